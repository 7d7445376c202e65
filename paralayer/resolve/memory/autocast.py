"""The bf16 weight copies autocast keeps for backward (bf16 under ZeRO 0/1: fp32 weights, bf16
compute), counted with the weights (2 B each) as the rehearsal measures them.

Why its own module: it is neither a model state (the copies are made per step) nor an activation
(one copy per weight, shared by every microbatch in flight), and the rules of which copies live
when (sequence parallel, full recompute, the head) are their own.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts
from paralayer.resolve.fp8 import fp8_layers
from paralayer.resolve.memory.activations import chunk_kind_counts, layer_kind
from paralayer.resolve.memory.states import (
    expert_params,
    layer_recompute,
    precision_mode,
    rank_chunks,
    rank_layers,
)
from paralayer.resolve.rules import V_SCHEDULES, Layout


def autocast_copy_terms(cfg: Config, lay: Layout) -> tuple[float, ...]:
    """(head, then each layer kind's: dense, MoE, and the two with a Gated DeltaNet layer in place
    of the attention, activations.layer_kind): weight elements on one device whose bf16 copy
    autocast keeps for backward (one copy per weight per step, shared by the microbatches in flight).

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
    that: not counted, as the rehearsal cannot see them). Measured by the rehearsal
    (``weight_copy_bytes``, rehearse/memory.py) and tests/test_precision.py. A Gated DeltaNet
    layer's GEMMs (in_proj_qkvz, in_proj_ba, out_proj) keep theirs as the attention's do, and on
    one tp rank its conv's weight too (under tp each rank casts its rows, an index_select the
    rehearsal counts with the activations; the conv is not sequence-parallel); Qwen3-Next's
    shared-expert gate keeps its d_model weight."""
    m = cfg.model
    h, t = m.d_model, lay.tp
    split_w, rep_w = model_parts.attn_weights(cfg)  # MLA's down-projections are not tp-split
    split = 0.0 if lay.sequence_parallel else split_w / t + rep_w
    li = m.linear
    conv = (2 * li.k_heads * li.head_k_dim + li.v_heads * li.head_v_dim) * li.conv_kernel if t == 1 else 0.0
    lin = (0.0 if lay.sequence_parallel else model_parts.linear_weights(cfg) / t) + conv
    ffn = 0.0 if lay.sequence_parallel else 3 * h * m.ffn_hidden / t
    moe_ffn = 0.0
    if m.moe.num_experts:
        moe_ffn = (h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden + model_parts.shared_gate_params(cfg)
                   + (m.moe.num_experts / lay.ep) * expert_params(cfg))
    # the head's term also holds each MTP depth's 2h -> h projection (replicated over tp; outside
    # its block, so not recomputed; deepseek-v3 rank 0 rehearsed 0.19 GiB of it)
    head = lay.padded_vocab * h / t + m.mtp.depth * 2 * h * h
    return (head, split + ffn, split + moe_ffn if m.moe.num_experts else 0.0,
            lin + ffn, lin + moe_ffn if m.moe.num_experts else 0.0)


def fp8_copy_terms(cfg: Config, lay: Layout) -> tuple[float, ...]:
    """:func:`autocast_copy_terms` of a block whose GEMMs run in FP8 (train.precision=fp8,
    resolve/fp8.py fp8_layers): its nn.Linear GEMMs (the attention projections, Gated DeltaNet's,
    the dense SwiGLU and the shared expert) become Float8Linear, which casts the fp32 weight to FP8
    itself and saves that fp32 weight for backward, so autocast makes no bf16 copy of them (measured:
    deepseek-v3-tiny on an H800 layout, params 0.862 of the plan before). Still copied: the router,
    the routed experts (their shared bf16 copy feeds the FP8 casts, model/moe.py), Gated DeltaNet's
    conv and Qwen3-Next's shared-expert gate."""
    m = cfg.model
    head, dense, moe, lin_dense, lin_moe = autocast_copy_terms(cfg, lay)
    h, t = m.d_model, lay.tp
    split_w, rep_w = model_parts.attn_weights(cfg)
    split = 0.0 if lay.sequence_parallel else split_w / t + rep_w
    lin = 0.0 if lay.sequence_parallel else model_parts.linear_weights(cfg) / t
    ffn = 0.0 if lay.sequence_parallel else 3 * h * m.ffn_hidden / t
    shared = 3 * h * m.moe.shared_ffn_hidden if m.moe.num_experts else 0.0
    return (head, dense - split - ffn, moe - split - shared if m.moe.num_experts else 0.0,
            lin_dense - lin - ffn, lin_moe - lin - shared if m.moe.num_experts else 0.0)


def norm_up_copies(cfg: Config, lay: Layout) -> float:
    """Weight elements of an MLA block's up-projections (q_b, kv_b after tp) whose autocast copies
    recompute=norm_up makes in backward only (model/latent_attention.py ``_up``, a rebuilt region);
    0 without MLA. Measured without pp: deepseek-v3-tiny norm_up bf16 params 0.960 of the plan before (7 Dec)."""
    a, m = cfg.model.mla, cfg.model
    if a.kv_lora_rank <= 0:
        return 0.0
    heads = m.n_heads / lay.tp
    q_b = a.q_lora_rank * heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) if a.q_lora_rank else 0.0
    return q_b + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)


def autocast_copy_params(cfg: Config, lay: Layout, r: int) -> float:
    """Weight elements of pipeline rank r whose bf16 copy autocast keeps (:func:`autocast_copy_terms`;
    0 unless bf16 runs under autocast, :func:`precision_mode`)."""
    if precision_mode(lay.precision, lay.zero, lay.dp * lay.cp) != "bf16-autocast":
        return 0.0
    head, *base_kinds = autocast_copy_terms(cfg, lay)
    fp8 = set(fp8_layers(cfg)) if cfg.train.precision == "fp8" else set()
    fp8_kinds = fp8_copy_terms(cfg, lay)[1:] if fp8 else base_kinds

    def kinds_of(i: int) -> list:
        return fp8_kinds if i in fp8 else base_kinds

    kinds = base_kinds  # a V chunk's transient sum below takes the base terms (an FP8 chunk's are fewer)
    chunks = rank_chunks(lay, r)
    if lay.pp > 1 and lay.schedule in V_SCHEDULES and lay.recompute == "full":
        # a split backward keeps a chunk's recomputed copies together, beside the head's copy
        # (activations.recompute_transient; deepseek-v3 rehearsed 2 layers' on pp rank 15)
        n = sum(kinds_of(i)[layer_kind(cfg, i)] for i in rank_layers(cfg, lay, r) if layer_recompute(lay, i) != "full")
        transient = max(sum(c * k for c, k in zip(counts, kinds)) for counts in chunk_kind_counts(cfg, lay, r))
        return n + ((head if (lay.chunks - 1) in chunks else 0.0) + transient)
    n, transient = 0.0, 0.0
    up = norm_up_copies(cfg, lay)
    for i in rank_layers(cfg, lay, r):  # the MTP blocks too, on the last chunk's rank
        if layer_recompute(lay, i) == "norm_up" and i not in fp8 and lay.pp == 1:
            # norm_up rebuilds q_b's and kv_b's outputs in backward: their copies live while that
            # layer's backward runs, as a fully recomputed layer's do (an FP8 block makes none).
            # Under pp the step is one autocast region, whose cache keeps some of them: counted held
            # there, as before (bf16 pp2 dualpipev rank 0 reads 0.988 so, 1.024 with none held)
            n += kinds_of(i)[layer_kind(cfg, i)] - up
            transient = max(transient, up)
        elif layer_recompute(lay, i) != "full":
            n += kinds_of(i)[layer_kind(cfg, i)]
        else:
            # a fully recomputed layer casts again in backward: its copies live while its
            # backward runs, after the same microbatch's head backward freed the head's copy
            transient = max(transient, kinds_of(i)[layer_kind(cfg, i)])
    return n + max(head if (lay.chunks - 1) in chunks else 0.0, transient)

