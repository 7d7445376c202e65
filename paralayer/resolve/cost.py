"""Cost of a layout: pipeline bubble, FLOPs per token, communication per parallel axis.

Why: the dry run shows what a layout costs before it runs, and the planner ranks thousands of
layouts with these numbers, so everything is a pure, torch-free function of (config, layout).

Communication is per device per optimizer step: ``message_bytes`` is one collective's payload,
``count_per_step`` how many of them, ``bytes_per_step`` their product (payload, not the wire
bytes of a particular algorithm: a ring all-reduce moves 2(n−1)/n of the payload per device).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve.memory import (
    ACT_BYTES,
    BYTES_PER_PARAM,
    is_moe_layer,
    matmul_params,
    rank_chunks,
    rank_params,
    routed_rows_per_token,
)
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


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token: 6·N + 12·L·h·s (torchtitan / PaLM convention; attention not halved
    for the causal mask). N = active matmul parameters (MoE: top_k of E experts)."""
    m = cfg.model
    return int(6 * matmul_params(cfg) + 12 * m.n_layers * m.d_model * m.seq_len)


def _entry(collective: str, message: float, count: float, group: int) -> dict:
    message, count = int(message), int(count)
    return {"collective": collective, "message_bytes": message, "count_per_step": count,
            "bytes_per_step": message * count, "group_size": group}


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
    e = _entry("ring send/recv (fused in GEMMs)", chunk, rings * (t - 1) * mm + plain * mm, t)
    e["plain_bytes_per_step"] = int(plain * mm * act_msg * (t - 1) / t)
    e["bytes_per_step"] = int(rings * (t - 1) * mm * chunk) + e["plain_bytes_per_step"]
    e["wire_bytes_per_step"] = e["bytes_per_step"]
    return e


def tp_ring_flops(cfg: Config, tp: int, recompute: str) -> tuple[list[float], list[float]]:
    """GEMM FLOPs per token (of the gathered sequence, on one device) that each fused ring of a
    dense and of an MoE layer hides behind, in the order of TP_RINGS_*: forward (again under full
    recompute), then backward (input-grad and weight-grad GEMMs; a row GEMM's gather feeds both)."""
    m = cfg.model
    h, f = m.d_model, m.ffn_hidden
    qkv = 2.0 * h * (h + 2 * h * m.n_kv_heads / m.n_heads) / tp
    wo = 2.0 * h * h / tp
    w13 = 2.0 * h * 2 * f / tp
    w2 = 2.0 * f * h / tp
    again = 2 if recompute == "full" else 1
    dense = [qkv, wo, w13, w2] * again + [qkv, qkv, 2 * wo, w13, w13, 2 * w2]
    moe = [qkv, wo] * again + [qkv, qkv, 2 * wo]
    return dense, moe


def comm(cfg: Config, lay: Layout) -> dict:
    """Per-axis communication of the first pipeline rank (the one the memory figure is for).

    tp: all-reduce (or all-gather + reduce-scatter under SP, same volume) of s·b·h activations, 2 in
        forward + 2 in backward per layer per microbatch (+2 when full recompute reruns forward).
    pp: send/recv of s·b·h activations: per chunk per microbatch one forward send and one backward.
    cp: per attention layer per microbatch, K/V blocks of 2·(s/cp)·b·(h·g/a)/tp elements: cp−1 sends
        in forward, cp−1 more when recompute (selective or full) reruns the ring, cp−1 in backward,
        plus cp sends of the partial dK/dV (same shape, fp32) in backward. ``message_bytes`` is the
        K/V block; ``bytes_per_step`` counts the dK/dV sends at 4 bytes per element (counted
        against ``_Ring.exchange`` in tests/test_context_e2e.py).
    ep: all-to-all of routed token rows (tokens·top_k·h), dispatch + combine, forward and backward.
    dp: gradient sync over dp·cp, as our runtime does it: ZeRO 0 one all-reduce of the grads per
        step (in buckets); ZeRO 1 that all-reduce plus one broadcast of the updated weights per
        owner; ZeRO 2/3 (FSDP2) per microbatch and per unit (layer, chunk root) a weight all-gather
        (twice under ZeRO 3) and a grad reduce-scatter. ``wire_bytes_per_step``: what each device
        moves (ring); ``reduce_wire_bytes_per_step``: the grads' share of it.
    """
    m = cfg.model
    ab = ACT_BYTES[lay.precision]
    wb, gb, _ = BYTES_PER_PARAM[lay.precision]
    mm = lay.microbatches
    s_local = m.seq_len / lay.cp
    tokens = lay.micro_batch * s_local
    act_msg = tokens * m.d_model * ab
    dense, expert, n_layers = rank_params(cfg, lay, 0)
    n_moe = sum(1 for c in rank_chunks(lay, 0) for i in lay.stage_layers[c] if is_moe_layer(cfg, i))
    fwd_extra = 1 if lay.recompute == "full" else 0
    out: dict = {}

    if lay.tp > 1 and lay.tp_overlap:
        out["tp"] = tp_overlap_comm(lay, act_msg, n_layers - n_moe, n_moe, fwd_extra)
    elif lay.tp > 1:
        coll = "all-gather+reduce-scatter" if lay.sequence_parallel else "all-reduce"
        out["tp"] = _entry(coll, act_msg, (4 + 2 * fwd_extra) * n_layers * mm, lay.tp)
    else:
        out["tp"] = _entry("none", 0, 0, 1)

    if lay.pp > 1:
        chunks_here = lay.chunks // lay.pp
        out["pp"] = _entry("send/recv", act_msg / (lay.tp if lay.sequence_parallel else 1),
                           2 * chunks_here * mm, lay.pp)
    else:
        out["pp"] = _entry("none", 0, 0, 1)

    if lay.cp > 1:
        kv_elems = 2 * tokens * m.d_model * m.n_kv_heads / m.n_heads / lay.tp
        kv = kv_elems * ab
        # selective recompute reruns the attention core (the ring) as full recompute does
        reruns = 1 if lay.recompute in ("selective", "full") else 0
        kv_sends = (2 + reruns) * (lay.cp - 1)  # forward (+ recomputed forward) and backward K/V
        dkv_sends = lay.cp                      # partial dK/dV in fp32: cp hops home
        e = _entry("ring send/recv (K,V)", kv, (kv_sends + dkv_sends) * n_layers * mm, lay.cp)
        e["bytes_per_step"] = int((kv_sends * kv + dkv_sends * kv_elems * 4) * n_layers * mm)
        out["cp"] = e
    else:
        out["cp"] = _entry("none", 0, 0, 1)

    if lay.ep > 1 and m.moe.num_experts > 0:
        rows = tokens * routed_rows_per_token(cfg)  # top_k, fewer with a capacity factor < 1
        out["ep"] = _entry("all-to-all", rows * m.d_model * ab, (4 + 2 * fwd_extra) * n_moe * mm, lay.ep)
    else:
        out["ep"] = _entry("none", 0, 0, 1)

    d = lay.dp * lay.cp
    if d > 1:
        # expert grads are reduced over dp·cp/ep ranks only; count them with the rest (upper bound)
        n = dense + expert
        ring = (d - 1) / d
        if lay.zero == 0:
            e = _entry("all-reduce", n * gb, 1, d)
            e["wire_bytes_per_step"] = int(2 * ring * n * gb)
            e["reduce_wire_bytes_per_step"], e["reduce_count_per_step"] = e["wire_bytes_per_step"], 1
        elif lay.zero == 1:
            # our ZeRO-1: one all-reduce of the grads, then each owner broadcasts its updated share
            # (Megatron's distributed optimizer reduce-scatters instead: half the grad bytes)
            e = _entry("all-reduce+broadcast", n * gb, 1 + d, d)
            e["bytes_per_step"] = int(n * (gb + wb))
            e["wire_bytes_per_step"] = int(2 * ring * n * gb + ring * n * wb)
            e["reduce_wire_bytes_per_step"], e["reduce_count_per_step"] = int(2 * ring * n * gb), 1
        else:
            # FSDP2, per unit (a layer, and the chunk's root). Without pp, every microbatch gathers
            # the weights once (ZeRO-2, kept through backward) or twice (ZeRO-3, again for
            # backward) and reduce-scatters its grads (torchtitan's default). Under pp, torch's
            # stage defers the reduce-scatter to the step's end and keeps weights gathered after
            # backward: ZeRO-2 gathers once per step, ZeRO-3 still twice per microbatch.
            units = n_layers + lay.chunks // lay.pp
            gathers = (1 if lay.zero == 2 else 2) * (mm if (lay.pp == 1 or lay.zero == 3) else 1)
            reduces = mm if lay.pp == 1 else 1
            e = _entry("all-gather+reduce-scatter", n * wb / units, (gathers + reduces) * units, d)
            e["bytes_per_step"] = int(n * (gathers * wb + reduces * gb))
            e["wire_bytes_per_step"] = int(ring * e["bytes_per_step"])
            # the grads' share (under pp torch's REDUCE_GRAD waits for it: it cannot hide)
            e["reduce_wire_bytes_per_step"] = int(ring * n * reduces * gb)
            e["reduce_count_per_step"] = reduces * units
        out["dp"] = e
    else:
        out["dp"] = _entry("none", 0, 0, 1)
    return out
