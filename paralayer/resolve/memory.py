"""Memory per device, for the most loaded pipeline rank (usually the first stage).

Why: a layout that does not fit should be rejected before minutes of start-up, and the planner
needs the number for thousands of layouts, so this is plain arithmetic on the config (no torch).

Sources: Megatron theoretical_memory_usage.py; Korthikanti et al. 2022 (activations); the
Ultra-Scale Playbook (bytes per parameter by ZeRO stage). The activation constants are OURS:
measured on ``paralayer/model/transformer.py`` (TransformerBlock with its lean RMSNorm, fp32, CPU) with
``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters and RoPE tables excluded)
and fitted exactly (max error < 0.1% over 6 shapes, GQA included). Per token per layer, elements:

    recompute=none        8h + 4f + a + 2     (replicated under TP: 3h + 2; sharded: 5h + a + 4f)
    recompute=swiglu      8h + 3f + a + 2     (silu(gate) not kept: sharded 5h + a + 3f)
    recompute=core_attn   6h + 2h·g/a + 4f + 2 (RoPE'd q/k/v, output, lse not kept: sharded
                                               3h + 2h·g/a + 4f)
    recompute=selective   6h + 2h·g/a + 3f + 2 (both: replicated 3h + 2; sharded 3h + 2h·g/a + 3f)
    recompute=full        h                    (the layer input; one layer's "none" set is live
                                               again while it is recomputed); with
                                               recompute_every=k only layers i % k == 0, the
                                               others keep their "none" set
    MoE feed-forward     3·k·h + 4·k·f_E + 4·f_S + E  (dropless, balanced routing; replaces the 4f;
                                               k → min(k, k·capacity_factor) with drops; f_S the
                                               shared expert; whole on every tp rank (experts are
                                               not tp-split) and kept under selective recompute)

(h d_model, a heads, g kv heads, f ffn width, k top_k, E experts, f_E expert width.) K/V are
counted at full width in "none" because ``sdpa_causal`` repeats GQA heads before SDPA; under
context parallel the ring attention saves them unexpanded (2h·g/a instead of 2h; its output shares
wo's input storage as SDPA's does; measured at cp=2 and 4 with g/a = 1/2 and 1/4).
Sequence parallel: the replicated part is split over tp, the column GEMMs' inputs included (they
save their sequence shard and re-gather it in backward, Megatron's §4.2.2: measured at tp 2 and 4 in
tests/test_tensor_memory.py); an MoE block's input is gathered by DTensor and saved whole (h). Context parallel divides the tokens. Predictions are lower bounds (allocator
fragmentation, temporary buffers and communication buffers are not counted; Megatron #525, #597).
"""
from __future__ import annotations

from dataclasses import dataclass

from paralayer.config import Config
from paralayer.resolve.rules import V_SCHEDULES, Layout

GIB = 1024 ** 3

#: Bytes per parameter (weights, grads, optimizer) before ZeRO sharding.
#: fp32 (CPU): weights 4 + grads 4 + Adam m, v 8.
#: bf16 mixed: weights 2 + grads 4 (accumulated and reduced in fp32) + fp32 master, m, v 12.
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16": (2, 4, 12)}
ACT_BYTES = {"fp32": 4, "bf16": 2}
#: Bytes per parameter HELD (weights, grads, optimizer) before ZeRO sharding, by how the runtime
#: runs the precision (:func:`precision_mode`; BYTES_PER_PARAM above stays the bytes on the wire).
#: bf16 under autocast: the fp32 weights 4; fp32 grads 4; fp32 Adam m, v 8. The bf16 copies
#: autocast keeps of SOME weights are counted apart (:func:`autocast_copy_params`, 2 B each); bf16
#: under FSDP2's MixedPrecisionPolicy is counted in :func:`state_bytes` (fp32 shards, bf16 gathered).
HELD_BYTES = {"fp32": (4, 4, 8), "bf16-autocast": (4, 4, 8), "bf16-fsdp": (4, 4, 8)}


def precision_mode(precision: str, zero: int, d_dense: int) -> str:
    """How the runtime runs ``precision`` (paralayer.runtime.train follows this, the memory model too):
    'fp32'; 'bf16-fsdp' when FSDP2 shards (ZeRO ≥ 2 over more than one dp·cp rank): bf16 params
    and compute, fp32 gradient reduction (MixedPrecisionPolicy); else 'bf16-autocast': fp32 weights,
    bf16 compute under ``torch.autocast``."""
    if precision != "bf16":
        return "fp32"
    return "bf16-fsdp" if zero >= 2 and d_dense > 1 else "bf16-autocast"


def is_moe_layer(cfg: Config, i: int) -> bool:
    """Same rule as paralayer.model.transformer.is_moe_layer (copied: that module imports torch)."""
    return cfg.model.moe.num_experts > 0 and (i + 1) % cfg.model.moe.every == 0


# ------------------------------------------------------------------ parameter counts
def attn_params(cfg: Config) -> int:
    """q, k, v, o of a GQA layer: h·hd·(2a + 2g) = 2h²(1 + g/a)."""
    m = cfg.model
    hd = m.d_model // m.n_heads
    return m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads)


def expert_params(cfg: Config) -> int:
    """One expert's SwiGLU: 3·h·f_E."""
    m = cfg.model
    return 3 * m.d_model * (m.moe.ffn_hidden or m.ffn_hidden)


def layer_params(cfg: Config, i: int, active: bool = False) -> int:
    """Parameters of layer i: attention + 2 norms + (SwiGLU 3hf | router hE + experts + shared)."""
    m = cfg.model
    h = m.d_model
    n = attn_params(cfg) + 2 * h
    if is_moe_layer(cfg, i):
        e = m.moe.top_k if active else m.moe.num_experts
        n += h * m.moe.num_experts + e * expert_params(cfg) + 3 * h * m.moe.shared_ffn_hidden
    else:
        n += 3 * h * m.ffn_hidden
    return n


def parameter_counts(cfg: Config) -> dict:
    """Total and active (MoE: top_k of E experts) parameters, with the published (unpadded) vocab."""
    m = cfg.model
    emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    total = sum(layer_params(cfg, i) for i in range(m.n_layers)) + emb + m.d_model
    active = sum(layer_params(cfg, i, True) for i in range(m.n_layers)) + emb + m.d_model
    return {"total": total, "active": active}


def matmul_params(cfg: Config) -> int:
    """Active parameters in a matmul per token (embedding lookup and norms excluded, output head in):
    the N of 6·N (same count as paralayer.model.transformer.count_matmul_params)."""
    m = cfg.model
    h = m.d_model
    n = 0
    for i in range(m.n_layers):
        n += attn_params(cfg)
        if is_moe_layer(cfg, i):
            n += m.moe.top_k * expert_params(cfg) + h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden
        else:
            n += 3 * h * m.ffn_hidden
    return n + h * m.vocab_size


# ------------------------------------------------------------------ per-rank split
def rank_chunks(lay: Layout, r: int) -> list[int]:
    """The chunks pipeline rank r holds, in order (the inverse of ``rules.chunk_rank``, without
    walking every chunk: the planner asks for it tens of thousands of times)."""
    if not 0 <= r < lay.pp:
        return []
    if lay.schedule in V_SCHEDULES:
        return [c for c in (r, 2 * lay.pp - 1 - r) if c < lay.chunks]
    return list(range(r, lay.chunks, lay.pp))


def rank_params(cfg: Config, lay: Layout, r: int) -> tuple[float, float, int]:
    """(dense params, expert params, layers) held by pipeline rank r, after tp/ep sharding.

    Norms and the router are replicated over tp; attention, MLPs, the vocab-parallel embedding and
    output head are split over tp; experts are split over ep (dim 0) only: the MoE block (router,
    experts, shared expert) is replicated over tp (ETP=1, see paralayer/parallel/tensor.py)."""
    m = cfg.model
    h, t = m.d_model, lay.tp
    chunks = rank_chunks(lay, r)
    layers = [i for c in chunks for i in lay.stage_layers[c]]
    dense = 0.0
    expert = 0.0
    # per-layer terms computed once (the planner calls this for thousands of layouts; same sums)
    attn = attn_params(cfg) / t + 2 * h
    moe_dense = h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden
    moe_expert = (m.moe.num_experts / lay.ep) * expert_params(cfg) if m.moe.num_experts else 0.0
    mlp = 3 * h * m.ffn_hidden / t
    for i in layers:
        dense += attn
        if is_moe_layer(cfg, i):
            dense += moe_dense
            expert += moe_expert
        else:
            dense += mlp
    first, last = 0 in chunks, (lay.chunks - 1) in chunks
    vocab = lay.padded_vocab * h / t
    if first:
        dense += vocab
    if last:
        # final norm and the head (tied embeddings keep a copy on the head's rank too, even when it
        # is the embedding's: paralayer/parallel/tied_embeddings.py)
        dense += h + vocab
    return dense, expert, len(layers)


def autocast_copy_terms(cfg: Config, lay: Layout) -> tuple[float, float, float]:
    """(head, dense layer, MoE layer): weight elements on one device whose bf16 copy autocast keeps
    for backward (one copy per weight per step, shared by the microbatches in flight).

    Under autocast (ZeRO 0/1) the weights are fp32 and every GEMM casts its weight to bf16; the
    copy lives as long as something holds it. ``nn.Linear`` GEMMs save their bf16 weight for
    backward, and autocast's own cache (one per weight while the autocast region is open: the whole
    step under pp, paralayer/parallel/pipeline.py) makes it one copy for all microbatches; the
    experts' GEMMs share one copy per step the same way (model/moe.py ``weight_cache``). Held: the
    output head; the MoE block's router, shared expert and local experts (never split by tp, not
    sequence-parallel GEMMs); the attention and SwiGLU GEMMs only without sequence parallel (SP's
    own GEMMs, parallel/sequence_parallel.py and tp_overlap.py, save the fp32 weight and cast again
    in backward). Not held: the embedding (a lookup) and the norms (fp32); a fully recomputed layer
    saves nothing in its forward: its copies are made again when backward recomputes it and live
    through that layer's backward, never beside the head's copy of the same microbatch (the larger
    counts; under pp, where the autocast region is the whole step, the caches also keep them after
    that: not counted, as the rehearsal cannot see them). Measured by the rehearsal (``weight_copy_bytes``, rehearse/memory.py)
    and tests/test_precision.py."""
    m = cfg.model
    h, t = m.d_model, lay.tp
    split = 0.0 if lay.sequence_parallel else attn_params(cfg) / t
    dense = split + (0.0 if lay.sequence_parallel else 3 * h * m.ffn_hidden / t)
    moe = 0.0
    if m.moe.num_experts:
        moe = (split + h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden
               + (m.moe.num_experts / lay.ep) * expert_params(cfg))
    return lay.padded_vocab * h / t, dense, moe


def autocast_copy_params(cfg: Config, lay: Layout, r: int) -> float:
    """Weight elements of pipeline rank r whose bf16 copy autocast keeps (:func:`autocast_copy_terms`;
    0 unless bf16 runs under autocast, :func:`precision_mode`)."""
    if precision_mode(lay.precision, lay.zero, lay.dp * lay.cp) != "bf16-autocast":
        return 0.0
    head, dense, moe = autocast_copy_terms(cfg, lay)
    chunks = rank_chunks(lay, r)
    n, transient = 0.0, 0.0
    for c in chunks:
        for i in lay.stage_layers[c]:
            if layer_recompute(lay, i) != "full":
                n += moe if is_moe_layer(cfg, i) else dense
            else:
                # a fully recomputed layer casts again in backward: its copies live while its
                # backward runs, after the same microbatch's head backward freed the head's copy
                transient = max(transient, moe if is_moe_layer(cfg, i) else dense)
    return n + max(head if (lay.chunks - 1) in chunks else 0.0, transient)


# ------------------------------------------------------------------ activations
def act_elems_per_token(cfg: Config, lay: Layout, moe: bool, recompute: str | None = None) -> float:
    """Saved elements per token for one layer on one device (see the module docstring), in units
    of ``ACT_BYTES[precision]``: under bf16 what is kept in fp32 counts twice (:func:`bf16_extra_elems`)."""
    mode = recompute or lay.recompute
    elems = _act_elems(cfg, lay, moe, mode)
    if lay.precision == "bf16":
        elems += bf16_extra_elems(cfg, lay, mode)
    return elems


def bf16_extra_elems(cfg: Config, lay: Layout, mode: str) -> float:
    """What a bf16 run keeps in fp32, as extra 2-byte elements per token per layer (measured on
    our block at tp 1 and 2, with bf16 weights as FSDP's MixedPrecisionPolicy runs it and under
    autocast, tests/test_tensor_memory.py):

    - RMSNorm keeps its 1/rms in fp32: 2 more (split over tp under SP);
    - SDPA's logsumexp is fp32: a more (heads split over tp; recomputed under core_attn/selective);
    - autocast only (ZeRO 0/1: fp32 weights, ``precision_mode``): the residual stream is fp32, so
      are the norms' saved inputs: 2h more (/t under SP). The column GEMMs' saved shard (SP) is
      fp32 too: 2·h/t more; without SP every linear saves its own bf16 cast of the input: q, k, v
      three and w1, w3 two where one was counted: 3h more.
      Under full recompute the block's input is all that is kept, in fp32: h (h/t under SP) more.
    """
    m = cfg.model
    h, a, t = m.d_model, m.n_heads, lay.tp
    sp = lay.sequence_parallel
    autocast = precision_mode(lay.precision, lay.zero, lay.dp * lay.cp) == "bf16-autocast"
    if mode == "full":
        return (h / t if sp else h) if autocast else 0.0
    extra = (2 + (2 * h if autocast else 0)) / (t if sp else 1)
    if mode not in ("core_attn", "selective"):
        extra += a / t
    if autocast:
        extra += 2 * h / t if sp else 3 * h
    return extra


def _act_elems(cfg: Config, lay: Layout, moe: bool, mode: str) -> float:
    m = cfg.model
    h, a, g, f, t = m.d_model, m.n_heads, m.n_kv_heads, m.ffn_hidden, lay.tp
    if mode == "full":
        return h / t if lay.sequence_parallel else h
    rep = 3 * h + 2  # the two norms' inputs and 1/rms (model.transformer.RMSNorm), the residual add
    if mode in ("core_attn", "selective"):  # RoPE'd q, k, v, the output and its lse recomputed
        shard = 3 * h + 2 * h * g / a
    else:
        shard = 5 * h + a
        if lay.cp > 1:
            # ring attention saves K/V with n_kv_heads (GQA heads are expanded per block only)
            shard -= 2 * h * (1 - g / a)
    # the SwiGLU product recomputed: gate and up are kept (its inputs), silu(gate) is not
    ffn_mult = 3 if mode in ("swiglu", "selective") else 4
    moe_whole = 0.0
    if moe:
        # Experts are not split by tp (ETP=1, paralayer/parallel/tensor.py): the MoE block runs
        # whole on every tp rank over the full sequence, and selective recompute leaves it alone.
        mo = m.moe
        fe = mo.ffn_hidden or f
        rows = routed_rows_per_token(cfg)
        moe_whole = 3 * rows * h + mo.num_experts + 4 * (rows * fe + mo.shared_ffn_hidden)
    else:
        shard += ffn_mult * f
    if lay.sequence_parallel:
        # the inputs of the column GEMMs (attention, FFN): only this rank's chunk is saved, the
        # backward gathers it again (parallel/sequence_parallel.py, tp_overlap.py); an MoE block's
        # input is gathered by DTensor and saved whole
        gathered = h / t + (h if moe else h / t)
        return gathered + (rep - 2 * h) / t + shard / t + moe_whole
    # Without SP, DTensor keeps one more full-width h per token (measured at tp=2 and 4).
    return rep + shard / t + (h - h / t) + moe_whole


def layer_recompute(lay: Layout, i: int) -> str:
    """The recompute mode of global layer i: recompute=full with recompute_every=k recomputes the
    layers with i % k == 0 and keeps the others' activations (paralayer.runtime.train.apply_recompute)."""
    if lay.recompute == "full" and i % max(lay.recompute_every, 1):
        return "none"
    return lay.recompute


def routed_rows_per_token(cfg: Config) -> float:
    """Expert rows per token: top_k (dropless), or fewer when capacity_factor·top_k < top_k."""
    mo = cfg.model.moe
    if mo.capacity_factor is None:
        return float(mo.top_k)
    return min(float(mo.top_k), mo.top_k * mo.capacity_factor)


def in_flight(lay: Layout, r: int) -> float:
    """Microbatches whose activations rank r holds at peak (times its own layers).

    GPipe: all m. 1F1B: p − r. Interleaved: torch's ScheduleInterleaved1F1B order (the one we
    run): rank r runs w = (v−1)·p + 2·(p−1−r) warm-up forwards (at most m·v), then holds w + 1
    chunk-microbatches, (w + 1)/v of its layers' sets: Megatron's p·(1 + (p−1)/(p·v)) on the first
    rank, ((v−1)·p + 1)/v on the last (not (p − r)·(1 + (p−1)/(p·v)): the last rank holds a
    whole round of its earlier chunks; gpt3-175b's last stage rehearsed 3.04× that).
    ZB-V: as 1F1B's first stage, p (sail-sg ZB table: "activation memory 1x"). DualPipeV: p + 1/2
    — the DualPipe README says PP+1, but torch's DualPipeV order (the one we run) peaks at 2p + 1
    chunk-microbatches on every rank, half a rank's layers each. Never more than m."""
    return in_flight_count(lay.pp, lay.microbatches, lay.schedule, lay.vpp, r)


def in_flight_count(p: int, mm: int, s: str, vpp: int, r: int) -> float:
    """:func:`in_flight` from the numbers alone (the planner calls it per candidate)."""
    if p == 1:
        return 1.0
    if s == "gpipe":
        return float(mm)
    if s == "1f1b":
        return float(min(mm, p - r))
    if s == "interleaved":
        total = mm * vpp
        return min(min((vpp - 1) * p + 2 * (p - 1 - r), total) + 1, total) / vpp
    if s == "zbv":
        return float(min(mm, p))
    if s == "dualpipev":
        return float(min(mm, p + 0.5))
    return float(min(mm, p))


@dataclass
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int
    capacity: int | None
    reserve: int
    stage: int
    activations_saved: int = 0  # what the forward leaves for backward (activations less the recompute peak)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity - self.reserve

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total, "capacity": self.capacity,
                "activations_saved": self.activations_saved}


def _shard(n: float, d: int, zero: int, stage: int) -> float:
    """ZeRO's rule: sharded over d from ``stage`` on."""
    return n / d if zero >= stage else n


def state_bytes(dense: float, expert: float, d_dense: int, d_exp: int, zero: int, pp: int,
                bytes_per_param: tuple | str, schedule: str = "1f1b") -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of a rank holding ``dense`` + ``expert`` parameters.

    ``bytes_per_param``: the precision ('fp32' | 'bf16'), counted as the runtime runs it
    (:func:`precision_mode`), or an explicit (weights, grads, optimizer) tuple. Under FSDP2's
    MixedPrecisionPolicy (bf16, ZeRO ≥ 2) the weights are fp32 shards (4 B / d) plus the bf16
    copies FSDP gathers for compute (2 B): all of them held from forward to backward under ZeRO-2
    (no reshard after forward) and under the V schedules, one block at a time under ZeRO-3 (not
    counted, like the fp32 gather buffers); grads reduce to fp32 shards.

    Under pp our stages reduce-scatter every microbatch's gradients into the 1/dp shard (ZeRO 2/3,
    parallel/pipeline.py ``reduce_each_microbatch``, the V schedules after each weight pass;
    ZeRO-3 also reshards the weights), so the peak holds sharded grads as without pp.
    ZeRO-1 keeps each rank's expert optimizer states whole (ZeroOneOptimizer local_params: the
    experts are dealt out over dp·cp, not over expert-dp); ZeRO 2/3 (FSDP) shard them over expert-dp."""
    mode = precision_mode(bytes_per_param, zero, d_dense) if isinstance(bytes_per_param, str) else None
    wb, gb, ob = HELD_BYTES[mode] if mode else bytes_per_param
    pz = zero  # ``schedule``: kept for callers; every schedule shards under pp (see above)
    params = wb * (_shard(dense, d_dense, pz, 3) + _shard(expert, d_exp, pz, 3))
    if mode == "bf16-fsdp":
        params = wb * (dense / d_dense + expert / d_exp) + (2 * (dense + expert) if pz < 3 else 0)
    grads = gb * (_shard(dense, d_dense, pz, 2) + _shard(expert, d_exp, pz, 2))
    opt = ob * (_shard(dense, d_dense, zero, 1) + (expert if zero == 1 else _shard(expert, d_exp, zero, 1)))
    return params, grads, opt


def rank_memory(cfg: Config, lay: Layout, r: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, activations) bytes on pipeline rank r.

    ZeRO shards over the ranks that hold the same weights: dp·cp for dense weights, the
    expert-data-parallel group dp·cp/ep for experts. Stage 1 shards the optimizer, 2 also the grads,
    3 also the weights. bf16 as the runtime runs it (:func:`precision_mode`): autocast (ZeRO 0/1)
    Z0 4+4+8, Z1 4+4+8/d, plus 2 B per weight whose bf16 copy it keeps (:func:`autocast_copy_params`); FSDP2 mixed precision Z2 2+4/d + (4+8)/d, Z3 (4+4+8)/d bytes per param."""
    dense, expert, _ = rank_params(cfg, lay, r)
    d_dense = lay.dp * lay.cp
    d_exp = max(d_dense // max(lay.ep, 1), 1)
    z = lay.zero

    params, grads, opt = state_bytes(dense, expert, d_dense, d_exp, z, lay.pp, lay.precision, lay.schedule)
    params = int(params) + int(2 * autocast_copy_params(cfg, lay, r))  # as the planner adds them

    acts, _ = rank_activations(cfg, lay, r)
    return int(params), int(grads), int(opt), acts


def rank_activations(cfg: Config, lay: Layout, r: int) -> tuple[int, int]:
    """(peak, saved) activation bytes on pipeline rank r: what the forward leaves for backward at
    the schedule's peak in flight, and the peak, which adds full recompute's transient.

    Per microbatch in flight: each layer's saved set, and each chunk's RoPE cos/sin
    (:func:`rope_bytes`). The last stage also holds, per microbatch whose backward has not begun,
    the fp32 logits 4·s·b·V/t (vocab-parallel) and what the final norm and head save; a
    microbatch's backward frees its own before any layer of it is recomputed, so the recomputed
    layer's set and that microbatch's head are never live together (the larger one counts)."""
    m = cfg.model
    ab = ACT_BYTES[lay.precision]
    tokens = lay.micro_batch * m.seq_len / lay.cp
    chunks = rank_chunks(lay, r)
    layers = [i for c in chunks for i in lay.stage_layers[c]]
    per_mb = sum(act_elems_per_token(cfg, lay, is_moe_layer(cfg, i), layer_recompute(lay, i))
                 for i in layers) * tokens * ab
    inf = in_flight(lay, r)
    # summed in the planner's order (plan_memory.in_flight, peak_memory: the same bytes to the unit)
    extra, head = inf * sum(1 for c in chunks if lay.stage_layers[c]) * rope_bytes(cfg, lay), 0.0
    if (lay.chunks - 1) in chunks:
        last_in_flight = lay.microbatches if (lay.schedule == "gpipe" and lay.pp > 1) else 1
        mode = precision_mode(lay.precision, lay.zero, lay.dp * lay.cp)
        head = 4 * tokens * lay.padded_vocab / lay.tp + head_saved_elems(lay, m.d_model, mode) * tokens * ab
        extra += head * last_in_flight
    saved = inf * per_mb + extra
    return int(saved + max(recompute_transient(cfg, lay, r) - head, 0.0)), int(saved)


def rope_bytes(cfg: Config, lay: Layout) -> float:
    """RoPE's cos and sin, (s/cp, head_dim) each: every chunk computes them per microbatch in the
    residual stream's dtype (fp32 but under FSDP's bf16) and its layers save them (RoPE's product,
    the checkpoints' inputs)."""
    m = cfg.model
    return rope_bytes_for(m.d_model // m.n_heads, m.seq_len / lay.cp,
                          precision_mode(lay.precision, lay.zero, lay.dp * lay.cp))


def rope_bytes_for(head_dim: int, positions: float, mode: str) -> float:
    """:func:`rope_bytes` from the numbers (the planner calls it per ZeRO stage)."""
    return 2.0 * head_dim * positions * (2 if mode == "bf16-fsdp" else 4)


def head_saved_elems(lay: Layout, h: int, mode: str = "fp32") -> float:
    """Per token, what the final norm and the head save: the norm's input and 1/rms
    (model.transformer.RMSNorm), and the head's input. Under SP the norm sees s/tp tokens and the
    head the gathered sequence: h + (h + 1)/tp; else 2h + 1 (measured at tp = 1, 2, 4 with and
    without SP). In units of ``ACT_BYTES``: under bf16 (``mode``, :func:`precision_mode`) 1/rms
    is fp32, and so is the norm's input under autocast (the residual stream), so they count twice
    (8b-512k bf16 rehearsed 1.012 without)."""
    norm = (h + 1) / lay.tp if lay.sequence_parallel else h + 1.0
    extra = norm if mode == "bf16-autocast" else (norm / (h + 1) if mode == "bf16-fsdp" else 0.0)
    return h + norm + extra


def recompute_transient(cfg: Config, lay: Layout, r: int) -> int:
    """Full recompute: the layer being recomputed in backward holds its whole "none" set once,
    less its input, which the forward saved already (the checkpoint's input is the first norm's).

    Not saved by the forward: torch.utils.checkpoint keeps it behind its own saved-tensor hooks
    (rehearse/memory.py counts it), but part of the peak. Selective recompute's regions
    (the attention core, the SwiGLU product) add nothing: the layer's backward first frees the
    input of the GEMM after the region (wo's, w2's), about what the region recomputes (rehearsed
    selective rows within 1% without it; counting it made 8b tp4 pp2 0.95). Zero-bubble
    schedules keep those inputs for the weight pass: 8b tp2 pp4 zbv rehearses 1.023.
    """
    if lay.recompute != "full":
        return 0
    layers = [i for c in rank_chunks(lay, r) for i in lay.stage_layers[c] if layer_recompute(lay, i) == "full"]
    if not layers:
        return 0
    tokens = lay.micro_batch * cfg.model.seq_len / lay.cp
    ab = ACT_BYTES[lay.precision]
    return int(max(act_elems_per_token(cfg, lay, is_moe_layer(cfg, i), "none")
                   - act_elems_per_token(cfg, lay, is_moe_layer(cfg, i), "full") for i in layers) * tokens * ab)


def memory(cfg: Config, lay: Layout) -> Memory:
    """The most loaded pipeline rank's memory (max over ranks; ties go to the first stage)."""
    best = None
    for r in range(lay.pp):
        parts = rank_memory(cfg, lay, r)
        if best is None or sum(parts) > sum(best[1]):
            best = (r, parts)
    assert best is not None
    r, (pa, gr, op, ac) = best
    cap = cfg.cluster.device_memory_gib
    capacity = int(cap * GIB) if cap is not None else None
    reserve = int(cfg.cluster.memory_reserve_gib * GIB)
    return Memory(pa, gr, op, ac, capacity, reserve, r, rank_activations(cfg, lay, r)[1])


def gib(n: float | None) -> str:
    return "unknown" if n is None else f"{n / GIB:.2f} GiB"


__all__ = ["Memory", "memory", "parameter_counts", "matmul_params", "rank_memory", "rank_activations", "in_flight",
           "autocast_copy_params", "autocast_copy_terms",
           "act_elems_per_token", "rank_chunks", "is_moe_layer", "layer_recompute"]
