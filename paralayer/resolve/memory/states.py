"""Model states per device: parameter counts, which parameters each pipeline rank holds (after
tp and ep sharding), and the bytes of weights, grads and optimizer under ZeRO and each precision.

Why its own module: the resolver's memory, its cost (``cost``: FLOPs from the same counts) and the
planner's fast path all read these rules, and each states term has one place to be checked
(tests/test_memory.py, the rehearsal's ``params``/``grads``/``optimizer``).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.rules import V_SCHEDULES, Layout

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
    """Same rule as paralayer.model's block (model_parts.is_moe_layer: that module imports torch):
    past model.moe.first_k_dense, every k-th layer."""
    return parts.is_moe_layer(cfg, i)


def layer_recompute(lay: Layout, i: int) -> str:
    """The recompute mode of global layer i: recompute=full with recompute_every=k recomputes the
    layers with i % k == 0 and keeps the others' activations (paralayer.runtime.train.apply_recompute)."""
    if lay.recompute == "full" and i % max(lay.recompute_every, 1):
        return "none"
    return lay.recompute


def input_pass_reruns(schedule: str, p: int, m: int, chunk: int) -> int:
    """Microbatches of ``chunk`` whose fully recomputed layers rerun twice: once in the input pass
    and once in the weight pass of a split backward (parallel/split_backward.py drops the first
    rerun when its pass ends). Counted from torch's orders (tests/test_split_backward.py replays
    them, m ≥ 2p for DualPipeV): ZB-V splits every backward; DualPipeV splits p − ⌈c/2⌉ of chunk
    c < p and p − 1 − ⌊(2p−1−c)/2⌋ of chunk c ≥ p, whatever m; the rest are full backwards. The
    first chunk's input pass reruns nothing (its input needs no gradient)."""
    if p <= 1 or chunk == 0:
        return 0
    if schedule == "zbv":
        return m
    if schedule == "dualpipev":
        return p - (chunk + 1) // 2 if chunk < p else p - 1 - (2 * p - 1 - chunk) // 2
    return 0


def layer_reruns(lay: Layout, i: int) -> float:
    """Forward reruns of layer i per microbatch: 0 unless fully recomputed, then 1, or more under a
    split backward (:func:`input_pass_reruns` of its chunk; the MTP blocks sit on the last)."""
    if layer_recompute(lay, i) != "full":
        return 0.0
    return region_reruns(lay, i)


def region_reruns(lay: Layout, i: int) -> float:
    """Reruns per microbatch of a region recomputed in layer i (a whole block under ``full``, the
    norms and up-projections under ``norm_up``): 1, more under a split backward, whose input pass
    drops its rerun and whose weight pass reruns once more (model/recompute.py ``dropped_after``)."""
    if lay.pp <= 1 or lay.schedule not in V_SCHEDULES or lay.microbatches <= 0:
        return 1.0
    chunk = next((c for c, ls in enumerate(lay.stage_layers) if i in ls), lay.chunks - 1)
    return 1.0 + input_pass_reruns(lay.schedule, lay.pp, lay.microbatches, chunk) / lay.microbatches


def attn_params(cfg: Config) -> int:
    """The attention's matmul weights (model_parts: GQA q, k, v, o: h·hd·(2a + 2g); MLA's
    projections); its inner norms are :func:`model_parts.attn_norm_params`."""
    return parts.attn_matmul_params(cfg)


def expert_params(cfg: Config) -> int:
    """One expert's SwiGLU: 3·h·f_E."""
    m = cfg.model
    return 3 * m.d_model * (m.moe.ffn_hidden or m.ffn_hidden)


def layer_params(cfg: Config, i: int, active: bool = False) -> int:
    """Parameters of layer i: attention + its 2 (Gemma: 4) norms + (SwiGLU/GeGLU 3hf | router hE +
    experts + shared)."""
    m = cfg.model
    h = m.d_model
    n = int(parts.layer_attn_rank_params(cfg, i, 1)) + parts.layer_norm_params(cfg)  # whole at tp 1
    if is_moe_layer(cfg, i):
        e = m.moe.top_k if active else m.moe.num_experts
        n += h * m.moe.num_experts + e * expert_params(cfg) + 3 * h * m.moe.shared_ffn_hidden
        n += parts.router_bias_params(cfg) + e * parts.expert_bias_params(cfg)  # GPT-OSS
        n += parts.shared_gate_params(cfg)
    else:
        n += 3 * h * m.ffn_hidden
    return n


def parameter_counts(cfg: Config) -> dict:
    """Total and active (MoE: top_k of E experts) parameters, with the published (unpadded) vocab.
    ``total``/``active`` are the main model, as published counts are (DeepSeek-V3's 671B/37B);
    with MTP on, ``mtp``/``mtp_active`` are its D blocks with their norms and projections (they
    share the embedding and the head, so neither is counted again), held on the last stage."""
    m = cfg.model
    emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    total = sum(layer_params(cfg, i) for i in range(m.n_layers)) + emb + m.d_model
    active = sum(layer_params(cfg, i, True) for i in range(m.n_layers)) + emb + m.d_model
    out = {"total": total, "active": active}
    if m.mtp.depth:
        out["mtp"] = sum(layer_params(cfg, i) + parts.mtp_extra_params(cfg) for i in parts.mtp_layers(cfg))
        out["mtp_active"] = sum(layer_params(cfg, i, True) + parts.mtp_extra_params(cfg)
                                for i in parts.mtp_layers(cfg))
    return out


def matmul_params(cfg: Config) -> int:
    """Active parameters in a matmul per token (embedding lookup and norms excluded, output head in):
    the N of 6·N (same count as paralayer.model.transformer.count_matmul_params)."""
    m = cfg.model
    h = m.d_model
    n = 0
    for i in list(range(m.n_layers)) + parts.mtp_layers(cfg):
        n += parts.layer_attn_matmul_params(cfg, i)
        if is_moe_layer(cfg, i):
            n += m.moe.top_k * expert_params(cfg) + h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden
            n += parts.shared_gate_params(cfg)
        else:
            n += 3 * h * m.ffn_hidden
    # each MTP depth: its 2h → h projection and one more pass through the shared head
    return n + h * m.vocab_size + m.mtp.depth * (2 * h * h + h * m.vocab_size)


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
    attn = parts.attn_rank_params(cfg, t) + parts.layer_norm_params(cfg)
    linear = (parts.linear_rank_params(cfg, t) + parts.layer_norm_params(cfg)
              if m.linear.k_heads else attn)  # a Gated DeltaNet layer's
    moe_dense = (h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden + parts.router_bias_params(cfg)
                 + parts.shared_gate_params(cfg))
    moe_expert = ((m.moe.num_experts / lay.ep) * (expert_params(cfg) + parts.expert_bias_params(cfg))
                  if m.moe.num_experts else 0.0)
    mlp = 3 * h * m.ffn_hidden / t
    for i in layers:
        dense += linear if parts.is_linear_layer(cfg, i) else attn
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
        # under pp the MTP module keeps its own copy of the embedding on the last chunk, even when
        # the V schedules put chunk 0 on the same rank (parallel/pipeline.py split_model, model/mtp.py)
        if m.mtp.depth and lay.pp > 1:
            dense += vocab
        # the MTP blocks live on the last chunk (its own norms and projection, replicated over tp)
        for i in parts.mtp_layers(cfg):
            dense += attn + parts.mtp_extra_params(cfg)
            if is_moe_layer(cfg, i):
                dense += moe_dense
                expert += moe_expert
            else:
                dense += mlp
    return dense, expert, len(layers) + (cfg.model.mtp.depth if last else 0)


def chunk_blocks(cfg: Config, lay: Layout, r: int) -> list[list[int]]:
    """Global indices of the blocks of each chunk pipeline rank r runs, the MTP blocks with the
    last chunk (the per-chunk view of :func:`rank_layers`)."""
    mtp = parts.mtp_layers(cfg) if cfg.model.mtp.depth else []
    return [list(lay.stage_layers[c]) + (mtp if c == lay.chunks - 1 else []) for c in rank_chunks(lay, r)]


def rank_layers(cfg: Config, lay: Layout, r: int) -> list[int]:
    """Global indices of the blocks pipeline rank r runs: its chunks' layers, and on the last
    chunk's rank the MTP blocks (model_parts.mtp_layers) after them."""
    chunks = rank_chunks(lay, r)
    layers = [i for c in chunks for i in lay.stage_layers[c]]
    if cfg.model.mtp.depth and (lay.chunks - 1) in chunks:
        layers += parts.mtp_layers(cfg)
    return layers


def _shard(n: float, d: int, zero: int, stage: int) -> float:
    """ZeRO's rule: sharded over d from ``stage`` on."""
    return n / d if zero >= stage else n


def state_bytes(dense: float, expert: float, d_dense: int, d_exp: int, zero: int, pp: int,
                bytes_per_param: tuple | str, schedule: str = "1f1b") -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of a rank holding ``dense`` + ``expert`` parameters.

    ``bytes_per_param``: the precision ('fp32' | 'bf16'), counted as the runtime runs it
    (:func:`precision_mode`), or an explicit (weights, grads, optimizer) tuple. Under FSDP2's
    MixedPrecisionPolicy (bf16, ZeRO ≥ 2) the weights are fp32 shards (4 B / d) plus the bf16
    copies FSDP gathers for compute (2 B), in fp32 under ZeRO-2 the shards (4 B / d) plus the fp32
    gathered copies (4 B) (FSDP2's sharded and unsharded parameters are separate storages, even over
    one expert-data rank): all of them held from forward to backward under ZeRO-2
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
    elif mode == "fp32" and pz == 2 and d_dense > 1:
        # FSDP2 (runtime/build.py: ZeRO ≥ 2 over more than one dp·cp rank) keeps each shard beside
        # the gathered copy it holds from forward to backward, two storages (in fp32 as in bf16)
        params += wb * (dense / d_dense + expert / d_exp)
    grads = gb * (_shard(dense, d_dense, pz, 2) + _shard(expert, d_exp, pz, 2))
    opt = ob * (_shard(dense, d_dense, zero, 1) + (expert if zero == 1 else _shard(expert, d_exp, zero, 1)))
    return params, grads, opt

