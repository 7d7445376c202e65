"""Activations per device: what the forward leaves for backward on a pipeline rank at the
schedule's peak in flight, and the peak itself (full recompute's transient).

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
    recompute=norm_up     none's (swiglu's in an MoE block) less the norms' and MLA's up-projections'
                                               outputs (resolve/memory/norm_up_acts.py)
    recompute=full        h                    (the layer input; one layer's "none" set is live
                                               again while it is recomputed); with
                                               recompute_every=k only layers i % k == 0, the
                                               others keep their "none" set
    MoE feed-forward     3·k·h + 4·k·f_E + 4·f_S + E  (dropless, balanced routing; replaces the 4f;
                                               k → min(k, k·capacity_factor) with drops; f_S the
                                               shared expert; whole on every tp rank (experts are
                                               not tp-split) and kept under selective recompute;
                                               recompute=swiglu: 3·k·f_E + 3·f_S)

(h d_model, a heads, g kv heads, f ffn width, k top_k, E experts, f_E expert width.) K/V are
counted at full width in "none" because ``sdpa_causal`` repeats GQA heads before SDPA; under
context parallel the ring attention saves them unexpanded (2h·g/a instead of 2h; its output shares
wo's input storage as SDPA's does; measured at cp=2 and 4 with g/a = 1/2 and 1/4).
Sequence parallel: the replicated part is split over tp, the column GEMMs' inputs included (they
save their sequence shard and re-gather it in backward, Megatron's §4.2.2: measured at tp 2 and 4 in
tests/test_tensor_memory.py); an MoE block's input is gathered by DTensor and saved whole (h).
Context parallel divides the tokens. Predictions are lower bounds (allocator
fragmentation, temporary buffers and communication buffers are not counted; Megatron #525, #597).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import fp8_blocks
from paralayer.resolve import model_parts as parts
from paralayer.resolve.fp8 import cached_bytes
from paralayer.resolve.memory import interleaved_flight, v_flight
from paralayer.resolve.memory.bf16_acts import bf16_extra_elems, routed_rows_per_token
from paralayer.resolve.memory.chunk_tables import chunk_tables, fixed_bytes, mask_bytes_for
from paralayer.resolve.memory.linear_acts import cp_rerun_elems, linear_norm_elems, linear_saved_elems
from paralayer.resolve.memory.norm_up_acts import norm_up_freed
from paralayer.resolve.memory.states import (
    ACT_BYTES,
    chunk_blocks,
    is_moe_layer,
    layer_recompute,
    precision_mode,
    rank_chunks,
    rank_layers,
)
from paralayer.resolve.memory.transients import live_transient, split_transient  # noqa: F401 - re-exported
from paralayer.resolve.memory.v_flight import v_peak  # noqa: F401 - re-exported
from paralayer.resolve.rules import V_SCHEDULES, Layout


def act_elems_per_token(cfg: Config, lay: Layout, moe: bool, recompute: str | None = None,
                        linear: bool = False) -> float:
    """Saved elements per token for one layer on one device (see the module docstring), in units
    of ``ACT_BYTES[precision]``: under bf16 what is kept in fp32 counts twice (:func:`bf16_extra_elems`).
    ``linear``: a Gated DeltaNet layer (resolve/memory/linear_acts.py) in place of the attention."""
    mode = recompute or lay.recompute
    if mode == "norm_up":  # none's set (swiglu's in an MoE block) less what the rebuild frees
        return act_elems_per_token(cfg, lay, moe, "swiglu" if moe else "none", linear) - norm_up_freed(cfg, lay)
    elems = _act_elems(cfg, lay, moe, mode, linear)
    if lay.precision == "bf16":
        elems += bf16_extra_elems(cfg, lay, mode, moe, linear)
    if cfg.train.precision == "fp8":  # an FP8 block's linears under tp or cp (resolve/fp8_blocks.py)
        elems += fp8_blocks.act_delta(cfg, lay, moe, mode, linear)
    return elems


def layer_kind(cfg: Config, i: int) -> int:
    """Layer i's kind for the activation tables: 1 if MoE, plus 2 if a Gated DeltaNet layer
    (:data:`KINDS`: dense, MoE, linear dense, linear MoE)."""
    return int(is_moe_layer(cfg, i)) + 2 * int(parts.is_linear_layer(cfg, i))


#: The (moe, linear) of each layer kind, by :func:`layer_kind`.
KINDS = ((False, False), (True, False), (False, True), (True, True))


def kind_elems(cfg: Config, lay: Layout, kind: int, recompute: str | None = None) -> float:
    """:func:`act_elems_per_token` of a layer kind (:func:`layer_kind`)."""
    moe, linear = KINDS[kind]
    return act_elems_per_token(cfg, lay, moe, recompute, linear)


def _act_elems(cfg: Config, lay: Layout, moe: bool, mode: str, linear: bool = False,
               parts: dict | None = None) -> float:
    """``parts``: filled with the same total by tensor (resolve/memory/saved_parts.py names them)."""
    m = cfg.model
    h, f, t = m.d_model, m.ffn_hidden, lay.tp
    if mode == "full":
        if parts is not None:
            parts["layer input (recompute=full)"] = h / t if lay.sequence_parallel else h
        return h / t if lay.sequence_parallel else h
    rep = 3 * h + 2  # the two norms' inputs and 1/rms (model.transformer.RMSNorm), the residual add
    if m.post_norms:  # Gemma 3's norms on wo's and w2's outputs: their inputs and 1/rms
        rep += 2 * h + 2
    if linear:  # a Gated DeltaNet layer: no recomputed core, nothing replicated over tp
        shard = linear_saved_elems(cfg, lay)
    else:
        shard = attn_saved_elems(cfg, lay, mode)
        rep += attn_replicated_elems(cfg, mode)
    # the SwiGLU product recomputed: gate and up are kept (its inputs), silu(gate) is not
    ffn_mult = 3 if mode in ("swiglu", "selective") else 4
    moe_whole = 0.0
    if moe:
        # Experts are not split by tp (ETP=1, paralayer/parallel/tensor.py): the MoE block runs
        # whole on every tp rank over the full sequence, and selective recompute leaves it alone.
        mo = m.moe
        fe = mo.ffn_hidden or f
        rows = routed_rows_per_token(cfg)
        # per expert row gate, up, silu(gate), the product; recompute=swiglu keeps no silu(gate)
        # (model/moe.py swiglu, the experts' and the shared expert's); selective leaves it
        # GPT-OSS's clamped SwiGLU keeps only gate and up whatever the mode (model/moe.py ClampedSwiGLU)
        moe_mult = 3 if mode == "swiglu" or mo.swiglu_limit is not None else 4
        moe_whole = 3 * rows * h + mo.num_experts + moe_mult * (rows * fe + mo.shared_ffn_hidden)
        swiglu = moe_mult * (rows * fe + mo.shared_ffn_hidden)
        if cfg.train.fp8.cache_activations and mode in ("swiglu", "norm_up"):
            # gate and up, the recomputed SwiGLU's inputs, kept in FP8 with a scale per tile
            # (train.fp8.cache_activations, model/float8.py Fp8Tiles) where 2 elements each were counted
            ab = ACT_BYTES[lay.precision]
            widths = ((rows * fe, fe), (mo.shared_ffn_hidden, mo.shared_ffn_hidden))
            moe_whole -= sum(2 * n * (1 - cached_bytes(w) / ab) for n, w in widths)
            swiglu -= sum(2 * n * (1 - cached_bytes(w) / ab) for n, w in widths)
        # the routing's bookkeeping: two int64 per row (the sort), the top-k's int64 indices and
        # fp32 weights, two fp32 per token, and each row's weight in the activations' dtype
        moe_whole += (16 * rows + 12 * mo.top_k + 8) / ACT_BYTES[lay.precision] + rows
        if mo.shared_gate and mo.shared_ffn_hidden:
            # Qwen3-Next's sigmoid gate on the shared expert: the sigmoid's output and the shared
            # expert's output it scales (model/moe.py)
            moe_whole += h + 1
    else:
        shard += ffn_mult * f
    if parts is not None:
        dense_ffn = 0 if moe else ffn_mult * f
        parts["Gated DeltaNet's saved set" if linear else "attention's saved set"] = (shard - dense_ffn) / t
        if not moe:
            parts["dense FFN's gate, up, silu(gate), product"] = dense_ffn / t
        else:
            parts["routed rows' d_model-wide copies (dispatched, experts' output, combined: 3·k·h)"] = 3 * rows * h
            parts["experts' SwiGLU (gate, up, silu(gate), product; routed and shared)"] = swiglu
            parts["router and routing bookkeeping"] = moe_whole - 3 * rows * h - swiglu
    if lay.sequence_parallel:
        # the inputs of the column GEMMs (attention, FFN): only this rank's chunk is saved, the
        # backward gathers it again (parallel/sequence_parallel.py, tp_overlap.py); an MoE block's
        # input is gathered by DTensor and saved whole, as a Gated DeltaNet layer's (its projections take
        # DTensor's gathered input, parallel/tensor/layout.py _linear_plan; tiny-qwen3.5 tp2 read 1.021)
        gathered = (h if linear else h / t) + (h if moe else h / t)
        if parts is not None:
            parts["GEMM inputs gathered over tp"] = gathered
            parts["norms' inputs and 1/rms, residual, replicated projections"] = (rep - 2 * h) / t
        return gathered + (rep - 2 * h) / t + shard / t + moe_whole
    # Without SP, DTensor keeps one more full-width h per token (measured at tp=2 and 4).
    if parts is not None:
        parts["norms' inputs and 1/rms, residual, replicated projections"] = rep + (h - h / t)
    return rep + shard / t + (h - h / t) + moe_whole


def attn_saved_elems(cfg: Config, lay: Layout, mode: str) -> float:
    """The attention's tp-split saved set per token (before /tp). GQA, measured with
    head_dim = h/a (module docstring) and written in the attention's own widths q = a·hd,
    kv = g·hd (rehearsed for head_dim ≠ h/a and qk_norm, tests/test_rehearse_models.py): none
    4q + h + a (q, the expanded k and v, wo's input, the lse, and one d_model-wide term: with
    head_dim = h/a the fit's 5q + a), ring attention under cp saving k/v unexpanded
    (−2(q − kv)); core_attn/selective 2q + h + 2kv; qk_norm adds each norm's
    input and 1/rms, q + kv + a + g, in every mode but full (the norms sit outside the
    recomputed core). MLA (measured on model/latent_attention.py, one block, fp32, varying
    every width and the sequence): none: q and k of a·d_qk, the output and wo's input a·d_v
    each, the lse a, kv_b's output a·(nope + d_v) (v is a view of it) — the fused kernel's set
    (CPU with d_v = d_qk, GPUs); on CPU with d_qk ≠ d_v SDPA runs its math path: 2a·d_qk +
    2a·d_v + a·s (the probabilities); core_attn/selective: q, kv_b's output and wo's input."""
    m = cfg.model
    a = m.n_heads
    if parts.attention_kind(cfg) == "mla":
        dqk, dv, nope = parts.qk_head_dim(cfg), parts.v_head_dim(cfg), cfg.model.mla.qk_nope_head_dim
        if mode in ("core_attn", "selective"):
            return a * dqk + a * (nope + dv) + a * dv
        if lay.cp > 1:
            # the ring (parallel/context.py) saves q, k, a contiguous v, its output (wo's input
            # is a view of it) and the lse; kv_b's output is not kept
            return 2 * a * dqk + 2 * a * dv + a
        if lay.device == "cpu" and dqk != dv:
            # CPU SDPA has no fused kernel for q/k wider than v: its math path keeps the a·s
            # probabilities, q, k, a contiguous v, and no lse nor kv_b's output
            return 2 * a * dqk + 2 * a * dv + a * cfg.model.seq_len
        if lay.device != "cpu":
            # a GPU kernel's output is laid out (b, s, a, d_v): wo's input is a view of it
            return 2 * a * dqk + a * dv + a + a * (nope + dv)
        return 2 * a * dqk + 2 * a * dv + a + a * (nope + dv)
    hd, g = parts.head_dim(cfg), m.n_kv_heads
    q, kv = a * hd, g * hd
    # qk_norm: each norm's input (wq's and wk's outputs) and its 1/rms per head; the norms run
    # before the recomputed core (model/attention.py), so they are kept in every mode but full
    norms = q + kv + a + g if m.qk_norm else 0
    # one term of the fit is d_model wide, not q (its constants were fitted with q = h): measured
    # with head_dim ≠ h/a (qwen3-32b, q = 8192 on h = 5120, tp8: none and selective, exact)
    h = m.d_model
    # model.attn_gate (Qwen3-Next's full layers): out · sigmoid(gate) before wo: the sigmoid's
    # output, the product (wo's input, no longer the core's output), the core's output as the
    # product's operand, and the q norm's input is half of wq's output 2q wide (measured at
    # tiny-qwen3-next's widths: 4q in "none", 3q where the core is recomputed)
    gated = q if m.attn_gate else 0
    if mode in ("core_attn", "selective"):  # RoPE'd q, k, v, the output and its lse recomputed
        return 2 * q + h + 2 * kv + norms + 3 * gated
    shard = 4 * q + h + a + 4 * gated
    if lay.cp > 1 or (m.attn_sinks and lay.device == "cpu"):
        # ring attention saves K/V with n_kv_heads (GQA heads are expanded per block only), and so
        # does one rank's sink core (model/sinks.py)
        shard -= 2 * (q - kv)
    if lay.cp > 1:  # the ring's output is laid out (b, s, h, d): the gate's operand is a view of it,
        shard -= gated  # not a copy (tiny-qwen3.5 cp2, all layers full: 0.958 of the plan with it, 0.999 without)
    return shard + norms


def attn_replicated_elems(cfg: Config, mode: str) -> float:
    """MLA's down-projections run replicated over tp: the latent q and c_kv, their norms' inputs
    and 1/rms, and the decoupled k_pe (measured with the rest of the block); nothing for GQA."""
    if parts.attention_kind(cfg) != "mla":
        return 0.0
    ml = cfg.model.mla
    ql = ml.q_lora_rank or 0
    # and the attention norm's output, which the down-projections read (GQA's fit has it in its
    # d_model-wide term): d_model more
    return 2 * ql + (1 if ql else 0) + 2 * ml.kv_lora_rank + 1 + ml.qk_rope_head_dim + cfg.model.d_model


def in_flight(lay: Layout, r: int) -> float:
    """Microbatches whose activations rank r holds at peak (times its own layers).

    GPipe: all m. 1F1B: p − r. Interleaved: torch's ScheduleInterleaved1F1B order (the one we
    run): rank r runs w = (v−1)·p + 2·(p−1−r) warm-up forwards (at most m·v), then holds w + 1
    chunk-microbatches, (w + 1)/v of its layers' sets where its chunks weigh the same: Megatron's
    p·(1 + (p−1)/(p·v)) on the first rank, ((v−1)·p + 1)/v on the last (not (p − r)·(1 +
    (p−1)/(p·v)): the last rank holds a whole round of its earlier chunks; gpt3-175b's last stage
    rehearsed 3.04× that). The memory plan weighs each chunk by its own count instead
    (:func:`rank_activations`, resolve/memory/interleaved_flight.py): the last rank holds p of each
    earlier chunk and one of its last, which is lighter where the head sits (kimi-k2 rehearsed 1.169×
    the per-rank count).
    ZB-V: as 1F1B's first stage, p (sail-sg ZB table: "activation memory 1x"). DualPipeV: p + 1/2
    — the DualPipe README says PP+1, but torch's DualPipeV order (the one we run) peaks at 2p + 1
    chunk-microbatches on every rank, half a rank's layers each. Never more than m. (The memory
    plan under the V schedules takes its peak per chunk over the order's backward passes instead:
    :func:`v_rank_activations`, resolve/memory/v_flight.py.)"""
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


def rank_activations(cfg: Config, lay: Layout, r: int) -> tuple[int, int]:
    """(peak, saved) activation bytes on pipeline rank r: what the forward leaves for backward at
    the schedule's peak in flight, and the peak, which adds full recompute's transient.

    Per microbatch in flight: each layer's saved set, and each chunk's RoPE tables and window
    masks (:func:`chunk_fixed_bytes`). The last stage also holds, per microbatch whose backward has not begun,
    the fp32 logits 4·s·b·V/t (vocab-parallel) and what the final norm and head save; a
    microbatch's backward frees its own before any layer of it is recomputed, so the recomputed
    layer's set and that microbatch's head are never live together (the larger one counts), except
    under the V schedules, whose last-chunk rank also recomputes the first chunk. Under the V
    schedules the peak is the largest backward pass of torch's order (:func:`v_peak`)."""
    m = cfg.model
    ab = ACT_BYTES[lay.precision]
    tokens = lay.micro_batch * m.seq_len / lay.cp
    chunks = rank_chunks(lay, r)
    layers = rank_layers(cfg, lay, r)
    head, one_pass = 0.0, 0.0
    if (lay.chunks - 1) in chunks:
        mode = precision_mode(lay.precision, lay.zero, lay.dp * lay.cp)
        head = 4 * tokens * lay.padded_vocab / lay.tp + head_saved_elems(lay, m.d_model, mode) * tokens * ab
        one_pass = head
        head *= 1 + m.mtp.depth  # each MTP depth's own pass through the shared head
        head += mtp_saved_elems(cfg) * tokens * ab  # and what each depth keeps beside its block
    if lay.pp > 1 and lay.schedule in V_SCHEDULES:
        return v_rank_activations(cfg, lay, r, head, tokens, ab)
    if lay.pp > 1 and lay.schedule == "interleaved":
        # per chunk its set times the chunk-microbatches it holds at the worst backward of torch's
        # order (interleaved_flight), and the head's bytes with each microbatch the last chunk
        # holds (its logits live from its forward to its backward; none while only earlier chunks
        # hold microbatches: tests/test_interleaved_flight.py) (planner.memory: the same bytes)
        sets = [chunk_saved_elems(cfg, lay, ids) * tokens * ab + chunk_fixed_bytes(cfg, lay, c)
                for c, ids in zip(chunks, chunk_blocks(cfg, lay, r))]
        sets[-1] += head
        # a recomputed layer's transient beside them, the head freed only at the last chunk's
        # backward (kimi-k2's last rank peaks at its first chunk's: 17 microbatches of it, none
        # of its last)
        top, saved = interleaved_flight.peak(interleaved_flight.split_moments(lay.pp, lay.microbatches, lay.vpp, r),
                                             sets, one_pass if m.mtp.depth else head, chunk_transients(cfg, lay, r))
        return int(top), int(saved)
    else:
        per_mb = sum(act_elems_per_token(cfg, lay, is_moe_layer(cfg, i), layer_recompute(lay, i),
                                         parts.is_linear_layer(cfg, i)) for i in layers) * tokens * ab
        inf = in_flight(lay, r)
        # summed in the planner's order (planner.memory.in_flight, peak_memory: the same bytes to the unit)
        extra = inf * sum(chunk_fixed_bytes(cfg, lay, c) for c in chunks)
        if head:
            extra += head * (lay.microbatches if (lay.schedule == "gpipe" and lay.pp > 1) else 1)
        saved = inf * per_mb + extra
    # with MTP depths, a depth's block is recomputed once its own head pass is freed, while the
    # main head's is not yet (deepseek-v3-tiny pp2 1F1B: 1.375 counting all freed, 0.873 none)
    freed = one_pass if m.mtp.depth else head
    return int(saved + max(recompute_transient(cfg, lay, r) - freed, 0.0)), int(saved)


def chunk_saved_elems(cfg: Config, lay: Layout, ids: list[int]) -> float:
    """A chunk's saved elements per token, summed by (kind, mode) in order as the planner's tables
    count them (planner.memory: the same bytes)."""
    kinds: dict = {}
    for i in ids:
        key = (layer_kind(cfg, i), layer_recompute(lay, i))
        kinds[key] = kinds.get(key, 0) + 1
    return sum(n * kind_elems(cfg, lay, kind, mode) for (kind, mode), n in sorted(kinds.items()))


def v_rank_activations(cfg: Config, lay: Layout, r: int, head: float, tokens: float, ab: int) -> tuple[int, int]:
    """:func:`rank_activations` under zbv and dualpipev (pp > 1): per chunk its saved set and RoPE
    tables per chunk-microbatch it holds, the head's bytes once (the last chunk's rank also runs
    the first chunk, whose backward recomputes while a later microbatch's head is live: nothing
    freed), and the transient of the pass: a full backward recomputes one layer at a time top-down,
    freeing the sets above it (:func:`live_transient` of the chunk), a split pass keeps its chunk's
    recomputed sets together and frees none (its graph is kept for the weight pass)."""
    tr = [_transient_elems(cfg, lay, k) for k in range(len(KINDS))]
    full = lay.recompute == "full"
    tables = _kind_tables(cfg, lay)
    saved, split_t, full_t = [], [], []
    for c, ids, counts in zip(rank_chunks(lay, r), chunk_blocks(cfg, lay, r), chunk_kind_counts(cfg, lay, r)):
        saved.append(chunk_saved_elems(cfg, lay, ids) * tokens * ab + chunk_fixed_bytes(cfg, lay, c))
        split_t.append(split_transient(counts, tr) * tokens * ab if full else 0.0)
        full_t.append(live_transient(_blocks(cfg, lay, ids), *tables) * tokens * ab if full else 0.0)
        if lay.cp > 1 and not full:  # a Gated DeltaNet layer's rerun, one at a time (rerun_extra)
            split_t[-1] = full_t[-1] = max((rerun_extra(cfg, lay, layer_kind(cfg, i), lay.recompute) for i in ids),
                                           default=0.0) * tokens * ab
    peak, kept, _ = v_peak(v_flight.moments(lay.schedule, lay.pp, lay.microbatches, r), saved, head, split_t, full_t)
    return int(peak), int(kept)


def _transient_elems(cfg: Config, lay: Layout, kind: int) -> float:
    """A fully recomputed layer's "none" set less its input (:func:`recompute_transient`), by kind
    (:func:`layer_kind`), and under cp its rule's rerun beyond what its backward freed (:func:`rerun_extra`)."""
    return kind_elems(cfg, lay, kind, "none") - kind_elems(cfg, lay, kind, "full") + rerun_extra(cfg, lay, kind, "full")


def rerun_extra(cfg: Config, lay: Layout, kind: int, mode: str) -> float:
    """Under cp a Gated DeltaNet layer's backward reruns its delta rule half a zigzag chunk at a time
    (parallel/context/linear_state.py ``_rule_grads``): that rerun's saved set
    (linear_acts.cp_rerun_elems) beyond what the block's backward freed before it (the FFN's set and
    the gated norm's), per token on one tp rank, 0 if less; 0 for other kinds and at cp = 1. A
    fully recomputed layer frees its recomputed "none" set's (``mode`` full)."""
    moe, linear = KINDS[kind]
    if lay.cp == 1 or not linear:
        return 0.0
    mode = {"full": "none", "norm_up": "swiglu" if moe else "none"}.get(mode, mode)
    named: dict = {}
    total = _act_elems(cfg, lay, moe, mode, True, parts=named)
    kept = sum(v for k, v in named.items() if k.startswith(("Gated DeltaNet", "norms' inputs", "GEMM inputs")))
    freed = total - kept + linear_norm_elems(cfg, lay) / lay.tp
    rerun = cp_rerun_elems(cfg, lay, precision_mode(lay.precision, lay.zero, lay.dp * lay.cp))
    return max(rerun - freed, 0.0)


def mtp_saved_elems(cfg: Config) -> float:
    """Per token, what the MTP depths keep besides their blocks (counted as layers): the two
    input norms' inputs (the embedding of t_{i+k}; h, the head's input already counted) and their
    1/rms, the 2h projection's input, the head norm's input and 1/rms: 4h + 3 per depth (measured
    on model/mtp.py's MTPLayer minus its block, fp32, one rank; tp and bf16 not measured)."""
    return cfg.model.mtp.depth * (4 * cfg.model.d_model + 3.0)


def rope_bytes(cfg: Config, lay: Layout) -> float:
    """RoPE's cos and sin, (s/cp, head_dim) each: every chunk computes them per microbatch in the
    residual stream's dtype (fp32 but under FSDP's bf16) and its layers save them (RoPE's product,
    the checkpoints' inputs)."""
    m = cfg.model
    return rope_bytes_for(parts.rope_dim(cfg), m.seq_len / lay.cp,
                          precision_mode(lay.precision, lay.zero, lay.dp * lay.cp))


def chunk_fixed_bytes(cfg: Config, lay: Layout, c: int) -> float:
    """Chunk c's RoPE tables and window masks per microbatch (memory/chunk_tables.py)."""
    mode = precision_mode(lay.precision, lay.zero, lay.dp * lay.cp)
    tables = chunk_tables(cfg, lay, lay.stage_layers[c], c == lay.chunks - 1)
    return fixed_bytes(tables, rope_bytes(cfg, lay), mask_bytes_for(cfg.model.seq_len / lay.cp, mode))


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
    less its input, which the forward saved already (the checkpoint's input is the first norm's);
    backward runs the rank's layers top-down and frees each one's saved set for that microbatch as
    it goes: the sets above it are gone by then (:func:`live_transient`; tiny tp2 with
    recompute_every=2, whose top layer is kept, rehearsed 0.777 of the largest transient alone).

    Not saved by the forward: paralayer.model.recompute keeps it behind its own saved-tensor hooks
    (rehearse/memory.py counts it), but part of the peak. Selective recompute's regions
    (the attention core, the SwiGLU product) add nothing: the layer's backward first frees the
    input of the GEMM after the region (wo's, w2's), about what the region recomputes (rehearsed
    selective rows within 1% without it; counting it made 8b tp4 pp2 0.95). Zero-bubble
    schedules keep those inputs for the weight pass: 8b tp2 pp4 zbv rehearses 1.023.

    Not for the V schedules (zbv, dualpipev at pp > 1): there a split backward keeps its whole graph
    (torch's input pass retains it for the weight pass), so a chunk's recomputed regions are live
    together, and :func:`v_rank_activations` takes each pass's transient (its chunk's sum, MTP
    blocks included: deepseek-v3-tiny pp2 dualpipev, activations 1.49 of a one-layer plan).

    Under cp, in every mode, a Gated DeltaNet layer's rule rerun (:func:`rerun_extra`), one layer's
    at a time: a fully recomputed one's in its t_i, the others' largest beside the live value (a
    split pass counts each fully recomputed one's: a bound).
    """
    tokens = lay.micro_batch * cfg.model.seq_len / lay.cp
    live = max(live_transient(_blocks(cfg, lay, rank_layers(cfg, lay, r)), *_kind_tables(cfg, lay))
               if lay.recompute == "full" else 0.0, _cp_reruns(cfg, lay, r))
    return int(live * tokens * ACT_BYTES[lay.precision])


def chunk_transients(cfg: Config, lay: Layout, r: int) -> list[int]:
    """:func:`recompute_transient` of each chunk of pipeline rank r (the interleaved schedule runs
    one chunk's backward at a time: the sets above the recomputed layer in its own chunk are freed;
    under cp the rank's largest rule rerun of a layer not fully recomputed beside each)."""
    tokens, ab, rerun = lay.micro_batch * cfg.model.seq_len / lay.cp, ACT_BYTES[lay.precision], _cp_reruns(cfg, lay, r)
    if lay.recompute != "full":
        return [int(rerun * tokens * ab)] * len(rank_chunks(lay, r))
    tables = _kind_tables(cfg, lay)
    return [int(max(live_transient(_blocks(cfg, lay, ids), *tables), rerun) * tokens * ab)
            for ids in chunk_blocks(cfg, lay, r)]


def _cp_reruns(cfg: Config, lay: Layout, r: int) -> float:
    """Under cp the largest Gated DeltaNet rule rerun (:func:`rerun_extra`) of rank r's layers not
    fully recomputed, per token (a fully recomputed one's is in its transient: :func:`_transient_elems`)."""
    if lay.cp == 1:
        return 0.0
    kinds = {(layer_kind(cfg, i), layer_recompute(lay, i)) for i in rank_layers(cfg, lay, r)}
    return max((rerun_extra(cfg, lay, k, m) for k, m in kinds if m != "full"), default=0.0)


def _blocks(cfg: Config, lay: Layout, ids: list[int]) -> list[tuple[int, bool]]:
    return [(layer_kind(cfg, i), layer_recompute(lay, i) == "full") for i in ids]


def _kind_tables(cfg: Config, lay: Layout) -> tuple[tuple, tuple, tuple]:
    """Elements per token by kind under "none" and "full", and under cp a fully recomputed Gated
    DeltaNet layer's rerun (:func:`rerun_extra`): the planner's act tables, the same values."""
    return tuple(kind_elems(cfg, lay, k, "none") for k in range(len(KINDS))), \
        tuple(kind_elems(cfg, lay, k, "full") for k in range(len(KINDS))), \
        tuple(rerun_extra(cfg, lay, k, "full") for k in range(len(KINDS)))


def chunk_kind_counts(cfg: Config, lay: Layout, r: int) -> list[tuple[int, ...]]:
    """Fully recomputed blocks of each chunk of pipeline rank r by kind (:func:`layer_kind`), the MTP
    blocks with the last chunk."""
    out = []
    for ids in chunk_blocks(cfg, lay, r):
        counts = [0] * len(KINDS)
        for i in ids:
            if layer_recompute(lay, i) == "full":
                counts[layer_kind(cfg, i)] += 1
        out.append(tuple(counts))
    return out or [(0,) * len(KINDS)]
