"""Cost of a layout: pipeline bubble, FLOPs per token, communication per parallel axis.

Why: the dry run shows what a layout costs before it runs, and the planner ranks thousands of
layouts with these numbers, so everything is a pure, torch-free function of (config, layout).

Communication is per device per optimizer step: ``message_bytes`` is one collective's payload,
``count_per_step`` how many of them, ``bytes_per_step`` their product (payload, not the wire
bytes of a particular algorithm: a ring all-reduce moves 2(n−1)/n of the payload per device).
"""
from __future__ import annotations

import functools

from paralayer.config import Config
from paralayer.resolve import fp8_blocks
from paralayer.resolve import model_parts as parts
from paralayer.resolve.cost.comm_facts import (
    chunk_facts,
    linear_tp_delta,
    rank_facts,
    rank_layer_facts,
    recompute_facts,
    split_reruns,
    tp_small_reduces,
    with_embedding_sum,
)
from paralayer.resolve.cost.cp_ring import cp_comm
from paralayer.resolve.cost.entry import autocast, entry, with_reruns
from paralayer.resolve.cost.ep_bytes import (  # noqa: F401 - ep_node_split re-exported
    ep_node_split,
    group_routing_bound,
    node_dispatch_on,
    node_dispatch_split,
)
from paralayer.resolve.cost.linear_flops import linear_core_rank_flops
from paralayer.resolve.cost.norm_up_flops import norm_up_gemm_flops, norm_up_rerun_flops
from paralayer.resolve.fp8 import fp8_gather_bytes, fp8_gathered_params
from paralayer.resolve.memory import (
    ACT_BYTES,
    BYTES_PER_PARAM,
    expert_params,
    is_moe_layer,
    layer_recompute,
    matmul_params,
    rank_chunks,
    routed_rows_per_token,
)
from paralayer.resolve.memory.states import layer_reruns, rank_layers, region_reruns
from paralayer.resolve.rules import Layout


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step, relative to the ideal compute time.

    gpipe, 1f1b: (p−1)/m (Huang et al. 2019; Narayanan et al. 2021).
    interleaved: (p−1)/(v·m) (Narayanan et al. 2021, Megatron virtual pipeline).
    zbv, dualpipev: the orders torch.distributed.pipelining runs (ScheduleZBVZeroBubble,
        ScheduleDualPipeV: 2 chunks per rank, backward split into input and weight passes), replayed
        with T_F = T_I = T_W per chunk: (p − 1 + max(0, 3p − 2m − 1)) / (6m) idle per unit of work —
        (p−1)/(6m) once m ≥ 3p/2 (DualPipeV needs m ≥ 2p). Qi et al.'s ZB-V reaches 0 by moving
        W passes into the bubble; torch's order runs each W right after its I, so (p−1) single
        passes stay idle per step. The replay is benchmarks/bubble.py's ``simulate``
        (tests/test_resolver.py checks the figures against torch's own order generator).
    """
    if p <= 1 or m <= 0:
        return 0.0
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule in ("zbv", "dualpipev"):
        return (p - 1 + max(0, 3 * p - 2 * m - 1)) / (6 * m)
    return (p - 1) / m


def recompute_fraction(cfg: Config, mode: str, every: int = 1, flops_per_tok: float | None = None) -> float:
    """Recomputed FLOPs as a fraction of a step's model FLOPs (6N + 12·L·h·s per token), so the
    planner can weigh the recompute options against the memory they free:
    swiglu: silu(gate)·up again, ~5 element ops per f element per layer (memory-bound on GPUs,
    cheap); core_attn: the attention core's forward, 4·h·s per layer; selective: both;
    full: one more forward (1/3) of the recomputed layers (1 in ``every``); norm_up: the
    up-projections' GEMMs (:func:`norm_up_rerun_flops`), the norms and the MoE SwiGLU."""
    m = cfg.model
    fpt = float(flops_per_tok or flops_per_token(cfg))
    swiglu = 5.0 * m.n_layers * m.ffn_hidden / fpt
    core = attn_core_flops_per_token(cfg) / 3.0 / fpt
    if mode == "full":
        return (1.0 / 3.0) * len(range(0, m.n_layers, max(every, 1))) / m.n_layers
    if mode == "norm_up":
        return sum(norm_up_rerun_flops(cfg, i) for i in range(m.n_layers)) / fpt
    return {"none": 0.0, "swiglu": swiglu, "core_attn": core, "selective": core + swiglu}[mode]


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token: 6·N + the attention core, 12·L·h·s for plain full attention
    (torchtitan / PaLM convention; not halved for the causal mask). N = active matmul parameters
    (MoE: top_k of E experts; MTP: its blocks, projections and extra head passes). The core per
    layer is :func:`attn_core_flops_per_token`'s: head widths, MLA's qk/v widths, and a window's
    keys (model_parts.core_keys), so a windowed layer is never counted as full."""
    return int(6 * matmul_params(cfg) + attn_core_flops_per_token(cfg))


def layer_core_flops(cfg: Config, i: int) -> float:
    """Training FLOPs per token of layer i's attention core: 3 × forward, the forward
    2·n_heads·(d_qk + d_v) per key (4·h for a plain block) × the keys counted (model_parts.core_keys)."""
    return 3.0 * parts.layer_core_fwd_flops(cfg, i)  # a linear layer's: its delta rule (model_parts)


def attn_core_flops_per_token(cfg: Config) -> float:
    """The attention core's training FLOPs per token over every layer and MTP block."""
    m = cfg.model
    return sum(layer_core_flops(cfg, i) for i in list(range(m.n_layers)) + parts.mtp_layers(cfg))


#: Rings per layer and microbatch under tp_overlap (parallel/tp_overlap.py): forward, backward.
#: Forward: gather→(wq,wk,wv), wo→scatter, gather→(w1,w3), w2→scatter. Backward: each column
#: GEMM re-gathers its input (weight grads) and reduce-scatters its input grad; each row GEMM
#: gathers its output grad. An MoE layer fuses only its attention (2 forward, 3 backward); its
#: expert block keeps its plain all-gathers: the input in forward, the output's grad in backward
#: (its input grad is a local slice: the expert block runs replicated on every tp rank).
TP_RINGS_DENSE = (4, 6)
TP_RINGS_MOE = (2, 3)
TP_PLAIN_MOE = (1, 1)


def tp_plain_collectives(n_moe: int, full_recompute: bool) -> int:
    """Unfused all-gathers per microbatch under tp_overlap: the MoE blocks' (TP_PLAIN_MOE)."""
    return n_moe * (TP_PLAIN_MOE[0] * (2 if full_recompute else 1) + TP_PLAIN_MOE[1])


def tp_overlap_comm(lay: Layout, act_msg: float, n_dense: int, n_moe: int, fwd_extra: int) -> dict:
    """tp traffic under tp_overlap: every fused collective is a ring of tp − 1 chunk sends
    (``count_per_step`` counts the sends, ``message_bytes`` is one chunk); ``plain_bytes_per_step``
    is the MoE blocks' unfused share (it cannot hide behind a GEMM)."""
    t, mm = lay.tp, lay.microbatches
    rings = sum(n * (f * (1 + fwd_extra) + b) for n, (f, b) in ((n_dense, TP_RINGS_DENSE), (n_moe, TP_RINGS_MOE)))
    plain = tp_plain_collectives(n_moe, bool(fwd_extra))
    chunk = act_msg / t
    e = entry("ring send/recv (fused in GEMMs)", chunk, rings * (t - 1) * mm + plain * mm, t)
    e["plain_bytes_per_step"] = int(plain * mm * act_msg * (t - 1) / t)
    e["bytes_per_step"] = int(rings * (t - 1) * mm * chunk) + e["plain_bytes_per_step"]
    e["wire_bytes_per_step"] = e["bytes_per_step"]
    return e


def tp_ring_flops(cfg: Config, tp: int, recompute: str, split_backward: bool = False) -> tuple[list[float], list[float]]:
    """GEMM FLOPs per token (of the gathered sequence, on one device) that each fused ring of a
    dense and of an MoE layer hides behind, in the order of TP_RINGS_*: forward (again under full
    recompute), then backward (input-grad and weight-grad GEMMs; a row GEMM's gather feeds both,
    except under a split backward (zbv, dualpipev): there it feeds the input grad only, the weight
    grad waits for the weight pass)."""
    m = cfg.model
    h, f = m.d_model, m.ffn_hidden
    hd = parts.head_dim(cfg)
    qkv = 2.0 * h * hd * (m.n_heads + 2 * m.n_kv_heads) / tp
    wo = 2.0 * h * m.n_heads * hd / tp
    w13 = 2.0 * h * 2 * f / tp
    w2 = 2.0 * f * h / tp
    again = 2 if recompute == "full" else 1
    row = 1 if split_backward else 2
    dense = [qkv, wo, w13, w2] * again + [qkv, qkv, row * wo, w13, w13, row * w2]
    moe = [qkv, wo] * again + [qkv, qkv, row * wo]
    return dense, moe


def comm(cfg: Config, lay: Layout, r: int = 0, cp_rank: int | None = None, with_dp: bool = True) -> dict:
    """Per-axis communication of pipeline rank ``r`` (default the first: the one the memory figure
    is for; the rehearsal asks for each rank it steps). ``cp_rank``: the cp ring's figure for that
    cp rank (windowed layers move different chunks per rank); None, the busiest cp rank's.
    ``with_dp=False``: without the dp entry (the planner takes every rank's dp from :func:`dp_comm`).

    tp: all-reduce (or all-gather + reduce-scatter under SP, same volume) of s·b·h activations, 2 in
        forward + 2 in backward per layer per microbatch (+2 when full recompute reruns forward, and
        +2 again for each split backward's second rerun under the V schedules: ``split_reruns``,
        which every axis's rerun traffic below counts too); under SP the backward also re-gathers the
        column GEMMs' saved shards (+1 pair a layer; ½ a Gated DeltaNet's: comm_facts.linear_tp_delta).
    pp: send/recv of s·b·h activations: per microbatch, the activation and its grad across each
        boundary of rank r's chunks with a chunk on another rank (:func:`_pp_comm`).
    cp: per attention layer per microbatch, K/V blocks of 2·(s/cp)·b·(h·g/a)/tp elements: cp−1 sends
        in forward, cp−1 more when recompute (selective or full) reruns the ring, cp−1 in backward,
        plus cp sends of the partial dK/dV (same shape, fp32) in backward. ``message_bytes`` is the
        K/V block; ``bytes_per_step`` counts the dK/dV sends at 4 bytes per element (counted
        against ``_Ring.exchange`` in tests/test_context_e2e.py). A Gated DeltaNet layer runs no ring:
        its states and conv tails go to its zigzag neighbours instead (cost/cp_sends.py).
    ep: all-to-all of routed token rows (tokens·top_k·h), dispatch + combine, forward and backward.
    dp: gradient sync over dp·cp, as our runtime does it: ZeRO 0 one all-reduce of the grads per
        step (in buckets); ZeRO 1 that all-reduce plus one broadcast of the updated weights per
        owner; ZeRO 2/3 (FSDP2) per microbatch and per unit (layer, chunk root) a weight all-gather
        (twice under ZeRO 3) and a grad reduce-scatter. ``wire_bytes_per_step``: what each device
        moves (ring); ``reduce_wire_bytes_per_step``: the grads' share of it.
    """
    m, ab = cfg.model, ACT_BYTES[lay.precision]
    tokens = lay.micro_batch * m.seq_len / lay.cp
    act_msg = tokens * m.d_model * ab
    n_layers, layers, n_moe = rank_layer_facts(cfg, lay, r)
    n_full, n_full_moe = recompute_facts(cfg, lay, layers)  # full: every k-th layer
    again = split_reruns(cfg, lay, layers)  # the V schedules' second reruns, per step
    ends = _tp_ends(cfg, lay, r, n_layers, act_msg)
    moe = functools.partial(is_moe_layer, cfg)
    fp8_tp = linear_tp_delta(cfg, lay, layers, fp8_blocks.tp_comm_delta(cfg, lay, layers, moe, tokens))
    again_moe = sum(v for i, v in again.items() if moe(i))
    out = {"tp": _with_ends(_tp_comm(lay, act_msg, n_layers, n_moe, n_full, sum(again.values()), fp8_tp,
                                     n_full_moe, again_moe, parts.attention_kind(cfg) != "mla"), ends),
           "pp": with_embedding_sum(_pp_comm(lay, act_msg, r), cfg, lay, r),  # + the embedding copies' sum
           "cp": cp_comm(cfg, lay, tokens, ab, layers, n_full, cp_rank, again),
           "ep": _ep_comm(cfg, lay, tokens, ab, layers, n_moe, again)}
    if with_dp:
        out["dp"] = dp_comm(cfg, lay, r)
    return out


def dp_comm(cfg: Config, lay: Layout, r: int = 0) -> dict:
    """The dp entry of :func:`comm` for pipeline rank ``r`` alone: the ranks differ in it under pp (the
    embedding, the head and MTP on their chunks' ranks, uneven splits, MoE layers after first_k_dense,
    expert grads reduced over their own expert-dp group)."""
    dense, expert, n_layers, layers, _ = rank_facts(cfg, lay, r)
    return _dp_comm(lay, dense, expert, n_layers, fp8_gathered_params(cfg, lay, layers))


def plan_dp_entry(cfg: Config, lay: Layout) -> dict:
    """The plan's ``comm.dp``: the entry of the pipeline rank with the most dp bytes per step (the
    lowest such rank), plus ``pp_rank`` (which one) and ``rank_bytes_per_step`` (every pipeline
    rank's, indexed by pp rank). Before 7 Dec (issue 45 item 5) it was rank 0's whatever the others moved."""
    per = [dp_comm(cfg, lay, r) for r in range(lay.pp)]
    top = max(range(lay.pp), key=lambda r: (per[r]["bytes_per_step"], -r))
    return dict(per[top], pp_rank=top, rank_bytes_per_step=[int(e["bytes_per_step"]) for e in per])


def _tp_comm(lay: Layout, act_msg: float, n_layers: int, n_moe: int, n_full: int, again: int = 0,
             fp8: tuple = (0.0, 0.0, 0.0, 0), n_full_moe: int = 0, again_moe: int = 0,
             attn_gather: bool = True) -> dict:
    """tp of :func:`comm`: activations per layer per microbatch (docstring there); ``again``: the
    split backwards' second reruns per step (2 each); ``fp8``: (pairs, bytes in ``act_msg``s, amax
    bytes, amax count) per microbatch the FP8 blocks move beyond the SP rule
    (resolve/fp8_blocks.py tp_comm_delta); ``n_full_moe``, ``again_moe``: the MoE layers among those;
    ``attn_gather``: False for MLA (q_b, kv_b read the replicated latents: no shard to re-gather).
    A rerun moves a dense layer's two pairs (two all-reduces without SP), an MoE layer's attention
    pair and its block's input gather (``moe_pair``/2; the attention's all-reduce alone without SP):
    counted as a dense one's until 7 Dec, tiny-moe tp 2 with full recompute read tp 0.917."""
    mm = lay.microbatches
    if lay.tp > 1 and lay.tp_overlap:
        return tp_overlap_comm(lay, act_msg, n_layers - n_moe, n_moe, 1 if lay.recompute == "full" else 0)
    n_dense = n_layers - n_moe
    if lay.tp > 1 and lay.sequence_parallel:
        # + the backward re-gather of each column GEMM's saved shard (parallel/sequence_parallel.py):
        # two all-gathers (one pair's volume) per dense layer, one per MoE layer (attention; MLA's
        # none). An MoE block (replicated over tp) all-gathers its input and, in backward, its
        # output's grad (its input grad is a local slice): one pair's volume, not two (the block's
        # pair moves autocast's fp32 stream: twice the bytes under bf16 autocast)
        moe_pair = 2 if autocast(lay) else 1
        rerun = 1 + moe_pair / 2  # an MoE layer's rerun, in pairs
        mla = 0 if attn_gather else moe_pair - 1  # MLA gathers the norm's output as it is (fp32 in autocast)
        pairs = (4 * n_dense + (2 + moe_pair) * n_moe + 2 * (n_full - n_full_moe) + rerun * n_full_moe
                 + ((1 + attn_gather) * n_dense + attn_gather * n_moe) / 2 + mla * (n_layers + n_full / 2))
        twice = 2 * (again - again_moe) + rerun * again_moe + mla * again / 2
        e = entry("all-gather+reduce-scatter", act_msg, (pairs + fp8[0]) * mm + twice, lay.tp)
        # an odd count of MoE layers leaves half a pair per microbatch: the bytes keep it (the
        # truncated count would make them non-affine in m, which the planner's lines assume)
        e["bytes_per_step"] = int(act_msg * ((pairs + fp8[1]) * mm + twice))
        if fp8[3]:  # the amax all-reduces (rowwise, tensorwise)
            e["count_per_step"] += fp8[3] * mm
            e["bytes_per_step"] += int(fp8[2] * mm)
        return with_reruns(e, twice, act_msg * twice)
    if lay.tp > 1:
        # an MoE block without SP sees the replicated stream: only its attention all-reduces
        twice = 2 * (again - again_moe) + again_moe
        e = entry("all-reduce", act_msg,
                  (4 * n_dense + 2 * n_moe + 2 * (n_full - n_full_moe) + n_full_moe) * mm + twice, lay.tp)
        if fp8[1] or fp8[3]:  # the FP8 blocks' input gradients in the norms' dtype, the amax all-reduces
            e["bytes_per_step"] += int(act_msg * fp8[1] * mm + fp8[2] * mm)
            e["count_per_step"] += fp8[3] * mm
        if autocast(lay):  # the column GEMMs' input grads: the fp32 norm output's (tiny read 1.399, 7 Dec)
            e["bytes_per_step"] += int(act_msg * (2 * n_dense + n_moe) * mm)
        return with_reruns(e, twice, act_msg * twice)
    return entry("none", 0, 0, 1)


def _tp_ends(cfg: Config, lay: Layout, r: int, n_layers: int, act_msg: float) -> tuple[float, float, int]:
    """tp traffic outside the layers, per step: (pair-equivalents of s·b·h activations, small
    all-reduce bytes, their count). The vocab-parallel embedding's output and the head's input grad:
    an all-reduce each per microbatch without SP; under SP the embedding reduce-scatters (its grad
    all-gathered back), the head all-gathers its input (its grad reduce-scattered), plain under
    tp_overlap (each whole message); each MTP depth calls both again. In fp32 under autocast (the
    residual stream). Small ones: :func:`comm_facts.tp_small_reduces`. Counted by the rehearsal."""
    if lay.tp == 1:
        return 0.0, 0.0, 0
    if autocast(lay):
        act_msg *= 4 / ACT_BYTES[lay.precision]
    mm = lay.microbatches
    first, last, _ = chunk_facts(lay, r)
    calls = int(first) + int(last) * (1 + 2 * cfg.model.mtp.depth)
    ends = calls * mm * (2 if lay.tp_overlap and lay.sequence_parallel else 1)
    small, n_small = tp_small_reduces(cfg, lay, n_layers, last, lay.micro_batch * cfg.model.seq_len / lay.cp)
    return ends * act_msg, small * mm, ends + n_small * mm


def _with_ends(e: dict, ends: tuple[float, float, int]) -> dict:
    """The tp entry of :func:`comm` plus :func:`_tp_ends` (bytes and count; the wire bytes too)."""
    act, small, count = ends
    if not count:
        return e
    e = dict(e, collective=e["collective"] if e["group_size"] > 1 else "all-reduce")
    e["count_per_step"] += count
    e["bytes_per_step"] += int(act + small)
    if "wire_bytes_per_step" in e:
        e["wire_bytes_per_step"] += int(act + small)
    return e


def _pp_comm(lay: Layout, act_msg: float, r: int = 0) -> dict:
    """pp of :func:`comm`: per microbatch, across each boundary between one of rank r's chunks
    and a neighbour chunk on ANOTHER rank, the activation one way and its grad the other (a
    first or last stage has one such boundary per chunk, an interleaved middle chunk two; the V
    schedules' turn between chunks pp−1 and pp stays on one rank). Counted by the rehearsal."""
    if lay.pp == 1:
        return entry("none", 0, 0, 1)
    transfers = chunk_facts(lay, r)[2]
    return entry("send/recv", act_msg / (lay.tp if lay.sequence_parallel else 1),
                  transfers * lay.microbatches, lay.pp)


def _ep_comm(cfg: Config, lay: Layout, tokens: float, ab: float, layers: list, n_moe: int,
             again: dict | None = None) -> dict:
    """ep of :func:`comm`: the routed rows' all-to-alls (dispatch, combine; forward, backward, each
    rerun forward: ``again`` holds the split backwards' second ones)."""
    m = cfg.model
    if lay.ep == 1 or m.moe.num_experts == 0:
        return entry("none", 0, 0, 1)
    rows = tokens * routed_rows_per_token(cfg)  # top_k, fewer with a capacity factor < 1
    n_moe_full = recompute_facts(cfg, lay, layers)[1]
    twice = 2 * sum(n for i, n in (again or {}).items() if is_moe_layer(cfg, i))
    count = (4 * n_moe + 2 * n_moe_full) * lay.microbatches + twice
    if node_dispatch_on(cfg, lay):
        # two exchanges of rows where the flat path has one (parallel/expert_node.py, cost/ep_bytes.py);
        # a pipeline rank without MoE layers exchanges nothing
        split = node_dispatch_split(cfg, lay, tokens, ab, count)
        per = split["bytes_per_step"] / count if count else 0.0
        e = entry("all-to-all", per / 2, 2 * count, lay.ep)
        e = with_reruns(e, 2 * twice, per * twice)
        e.update(split)
    else:
        e = entry("all-to-all", rows * m.d_model * ab, count, lay.ep)
        e = with_reruns(e, twice, e["message_bytes"] * twice)
        e.update(ep_node_split(lay, e["bytes_per_step"]), dispatch="flat")
    e.update(group_routing_bound(cfg, lay, tokens, ab, count))
    return e


def _dp_comm(lay: Layout, dense: float, expert: float, n_layers: int, fp8_params: float = 0.0) -> dict:
    """dp of :func:`comm`: the gradient sync over dp·cp as the runtime does it, per ZeRO stage."""
    wb, gb, _ = BYTES_PER_PARAM[lay.precision]
    mm = lay.microbatches
    d = lay.dp * lay.cp
    if d == 1:
        return entry("none", 0, 0, 1)
    # expert grads are reduced over the dp·cp/ep expert-data ranks only: nothing when that is
    # one rank; ZeRO-1 broadcasts them only without ep: under ep each rank steps its own experts,
    # at ep 1 they are dealt out over dp·cp with the rest (parallel/data.py ZeroOneOptimizer: tiny-moe dp 2 broadcast
    # every weight, 7 Dec; the plan had counted the dense ones only, dp 1.75 of the rehearsal)
    d_exp = d // max(lay.ep, 1)
    n = dense + (expert if d_exp > 1 else 0)
    n_bcast = dense + (expert if lay.ep == 1 else 0)
    ring = (d - 1) / d
    if lay.zero == 0:
        e = entry("all-reduce", n * gb, 1, d)
        e["wire_bytes_per_step"] = int(2 * ring * n * gb)
        e["reduce_wire_bytes_per_step"], e["reduce_count_per_step"] = e["wire_bytes_per_step"], 1
    elif lay.zero == 1:
        # our ZeRO-1: one all-reduce of the grads, then each owner broadcasts its updated share (Megatron's
        # distributed optimizer reduce-scatters instead: half the grad bytes). Under bf16 autocast the weights
        # are the only copy and fp32: the broadcast moves fp32 (bf16 would leave the others' weights rounded)
        if autocast(lay):
            wb = 4
        e = entry("all-reduce+broadcast", n * gb, 1 + d, d)
        e["bytes_per_step"] = int(n * gb + n_bcast * wb)
        e["wire_bytes_per_step"] = int(2 * ring * n * gb + ring * n_bcast * wb)
        e["reduce_wire_bytes_per_step"], e["reduce_count_per_step"] = int(2 * ring * n * gb), 1
    else:
        # FSDP2, per unit (a layer, and the chunk's root). Without pp, every microbatch gathers the weights
        # once (ZeRO-2, kept through backward) or twice (ZeRO-3, again for backward) and reduce-scatters
        # its grads (torchtitan's default). Under pp our stages reduce-scatter every microbatch too (1/dp
        # of the grads at the peak; the V schedules after each weight pass); ZeRO-2 keeps the weights
        # gathered through the step (one gather per step), ZeRO-3 gathers twice per microbatch. FP8
        # blocks' weights gathered in FP8 (resolve/fp8.fp8_gathered_params) move at 1 byte.
        units = n_layers + lay.chunks // lay.pp
        gathers = (1 if lay.zero == 2 else 2) * (mm if (lay.pp == 1 or lay.zero == 3) else 1)
        reduces = mm
        e = entry("all-gather+reduce-scatter", n * wb / units, (gathers + reduces) * units, d)
        e["bytes_per_step"] = int(n * (gathers * wb + reduces * gb))
        if fp8_params:
            e.update(fp8_gather_bytes(n * wb - fp8_params * (wb - 1), units, gathers, n * reduces * gb))
        e["wire_bytes_per_step"] = int(ring * e["bytes_per_step"])
        # the grads' share (under pp torch's REDUCE_GRAD waits for it: it cannot hide)
        e["reduce_wire_bytes_per_step"] = int(ring * n * reduces * gb)
        e["reduce_count_per_step"] = reduces * units
    return e


def cp_core_fraction(cp: int) -> float:
    """Share of the S×S attention core a cp rank's ring computes (parallel/context.py's zigzag
    ``_step_blocks``): its 2 chunks of c = S/(2·cp) rows meet 3 c×c blocks of its own K/V and one
    2c×c block from each of the cp−1 others: (2·cp+1)·c² of the 4·cp·c² a full row-slice would be.
    A causal block counts whole (as ``FlopCounterMode`` and the attention kernels' launch do).
    1 without cp (one SDPA call over the whole S×S)."""
    return 1.0 if cp <= 1 else (2 * cp + 1) / (4 * cp)


@functools.lru_cache(maxsize=4096)
def window_core_fraction(seq: int, cp: int, window: int | None, cp_rank: int | None = None) -> float:
    """:func:`cp_core_fraction` for a windowed layer under cp: the c×c blocks (each counted whole)
    the busiest rank computes — its own 3 and the others' chunks it needs (config/cp_window.py,
    one block per needing query chunk) — over the 4·cp·c² of a full row-slice. Without cp the
    kernel runs the whole masked S×S (one SDPA call with the window's mask): 1."""
    if cp <= 1 or window is None or window >= seq:
        return cp_core_fraction(cp)
    c = seq // (2 * cp)
    best = 0
    for r in (range(cp) if cp_rank is None else (cp_rank,)):
        mine = (r, 2 * cp - 1 - r)
        blocks = 0
        for qi in mine:
            for kj in range(qi + 1):
                if kj == qi or (qi - kj - 1) * c + 1 < window:
                    blocks += 1
        best = max(best, blocks)
    return best / (4 * cp)


def _max_logit_per_token(cfg: Config, lay: Layout) -> float:
    """QK-clip's max-logit GEMM per query token of one softmax attention's forward
    (paralayer/model/max_logit.py): 2·(n_heads/tp)·d_qk per key, over the whole sequence's keys (the
    mask is applied after it, so no causal half or window is skipped; under cp the rank's s/cp
    queries meet every rank's keys); 0 when QK-clip is off."""
    if getattr(cfg.train.muon, "qk_clip_tau", None) is None:
        return 0.0
    return 2.0 * cfg.model.n_heads / lay.tp * parts.qk_head_dim(cfg) * cfg.model.seq_len


def rank_flops(cfg: Config, lay: Layout, r: int, cp_rank: int | None = None) -> float:
    """Hardware FLOPs of one device of pipeline rank ``r`` in one step, recompute included: what
    the rehearsal counts with ``FlopCounterMode`` (matmuls and attention; 2 FLOPs a multiply-add).

    Per token of the device's m·b·s/cp, per layer, forward: 2·(attention weights: split /tp,
    MLA's down-projections whole), + 2·(3·h·f)/tp for an MLP or, for an MoE block (whole on every
    tp rank), 2·(h·E + k·3·h·f_E + 3·h·f_S, + h for a gated shared expert); the attention core
    2·a·(d_qk + d_v)·s/tp (4·s·h/tp for a plain block; not halved for the mask). Backward: twice
    the matmuls, 2.5 times the core (the flash-attention backward recomputes the scores: 5 matmuls
    to the forward's 2). Recompute adds the core's forward (selective) or the layer's forward
    (full). The last chunk adds the head, 2·h·V_padded/tp per token, times 3, and per MTP depth its
    block (counted as a layer), its 2h → h projection (/tp under SP: the sequence shard) and one
    more head pass. Under cp the ring computes only the blocks the
    causal mask (and a window) leaves (:func:`cp_core_fraction`, :func:`window_core_fraction`:
    cp rank ``cp_rank``'s blocks, or the busiest's when None). A Gated DeltaNet layer counts its
    own projections and its delta rule instead (:func:`linear_core_rank_flops`);
    model FLOPs (:func:`flops_per_token`, MFU) keep the convention of :func:`layer_core_flops`."""
    m = cfg.model
    h, t = m.d_model, lay.tp
    tokens = lay.microbatches * lay.micro_batch * m.seq_len / lay.cp
    core_full = parts.core_fwd_flops_per_key(cfg) * m.seq_len / t
    split_w, rep_w = parts.attn_weights(cfg)
    attn_mat = 2.0 * (split_w / t + rep_w)
    total = 0.0
    # forward + the fused kernel's backward (2.5: it recomputes the scores); SDPA's CPU math path
    # (MLA with d_qk != d_v: memory.activations.attn_saved_elems) keeps them: 1 + 2
    unequal = (lay.device == "cpu" and parts.attention_kind(cfg) == "mla"
               and parts.qk_head_dim(cfg) != parts.v_head_dim(cfg))
    math_path = unequal and lay.cp == 1
    core_passes = 3.0 if math_path else 3.5
    if unequal and lay.cp > 1:  # the cp ring's CPU flash blocks pad V to q's width (parallel/context.py)
        dqk, dv = parts.qk_head_dim(cfg), parts.v_head_dim(cfg)
        core_full *= 2 * dqk / (dqk + dv)
    last = (lay.chunks - 1) in rank_chunks(lay, r)
    clip = _max_logit_per_token(cfg, lay)
    lin_fwd, lin_step = linear_core_rank_flops(cfg, lay)
    for i in rank_layers(cfg, lay, r):
        core = core_full * window_core_fraction(m.seq_len, lay.cp, parts.layer_window(cfg, i), cp_rank)
        mat = attn_mat
        linear = parts.is_linear_layer(cfg, i)
        if linear:  # Gated DeltaNet: its projections and its delta rule, not attention's
            mat, core = 2.0 * parts.linear_weights(cfg) / t, lin_fwd
        if is_moe_layer(cfg, i):
            mo = m.moe
            mat += 2.0 * (h * mo.num_experts + routed_rows_per_token(cfg) * expert_params(cfg)
                          + 3 * h * mo.shared_ffn_hidden + parts.shared_gate_params(cfg))
        else:
            mat += 2.0 * 3 * h * m.ffn_hidden / t
        mode = layer_recompute(lay, i)
        again = (mat + core) * layer_reruns(lay, i) if mode == "full" else (core if mode == "selective" else 0.0)
        if mode == "norm_up":
            again = norm_up_gemm_flops(cfg) * region_reruns(lay, i)
        if clip and not linear:  # QK-clip's q·kᵀ, again in each rerun of the core
            total += clip * (1 + (layer_reruns(lay, i) if mode == "full" else
                                  (mode in ("selective", "core_attn")
                                   or (mode == "norm_up" and parts.attention_kind(cfg) == "mla"))))
        if linear and mode == "selective":
            again = 0.0  # selective wraps attention's core; a linear layer has none (model/recompute.py)
        total += 3.0 * mat + (lin_step if linear else core_passes * core) + again
    if last:
        total += 3.0 * 2.0 * h * lay.padded_vocab / t * (1 + m.mtp.depth)
        total += 3.0 * 2.0 * 2 * h * h * m.mtp.depth / (t if lay.sequence_parallel else 1)  # M_k: SP's shard
    return total * tokens
