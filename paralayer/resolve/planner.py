"""The layout planner: every valid layout for a model on a cluster, ranked by predicted step time.

    python launch.py recipe=llama3-70b cluster=h100-80gb-8x cluster.nodes=64 --plan [--json]

Why it is shaped like this: the planner must answer for llama3-405b on 4,096 devices in well under
2 s, torch-free, so it does not call :func:`paralayer.resolve.resolve` per candidate (~0.7 ms each,
and there are tens of thousands). It walks the layout space in nested loops, from the choices that
change the structure (tp, cp, pp, dp, ep, schedule/vpp — the pipeline split and the per-rank
parameter counts are computed once per structure, with the resolver's own functions) to the ones
that only scale a number (zero, micro_batch, recompute), and drops a branch as soon as it cannot
fit (model states alone over capacity). Memory is the resolver's arithmetic (``memory.rank_params``,
``act_elems_per_token``, the same in-flight and ZeRO rules) for the ranks that can be the most
loaded; communication is ``cost.comm`` itself, evaluated twice per structure (every axis's time is
affine in the number of microbatches). ``tests/test_planner.py`` checks a sample of listed layouts
against the full ``resolve()``: no errors, same memory total, bubble, spans and comm times.

The cost model (one step, one device; every term is reported per layout; the machine's side —
peak, links, calibration, ``comm_seconds`` — is ``paralayer.resolve.machine``, the table and the
CLI ``paralayer.resolve.plan_report``):

    compute   = flops_per_step / (world · peak · efficiency)          (model FLOPs, 6N + 12·L·h·s)
    imbalance = FLOPs of the busiest pipeline rank / the mean (the output head sits on the last
                chunk's rank; the planner picks the layer split that minimises it)
    recompute = compute · imbalance · (selective: 4·L·h·s / flops_per_token, the attention core's
                forward; full: 1/3, one more forward)
    dispatch  = m · per-layer framework time of the busiest rank's layers (fitted on CPU, 0 on GPUs)
    comm[ax]  = count · latency(span) + wire bytes / bandwidth(span), volumes from ``cost.comm``
                (dp as the runtime moves it: FSDP per microbatch without pp, deferred under pp)
    tp        = comm[tp], or under parallel.tp_overlap what the GEMMs do not hide: per fused ring
                (tp − 1)·max(0, hop − overlap·GEMM/tp) (``machine.tp_overlap_seconds``)
    step      = (compute · imbalance + recompute + dispatch + tp + comm[cp, ep, pp]) · (1 + bubble)
                + dp exposed (``machine.dp_exposed_seconds``: ZeRO 0–1 all of it, after the
                backward; ZeRO 2–3 what the step's compute does not hide, and under pp the grad
                reduce-scatter whole — torch's REDUCE_GRAD waits for it)

"tp inside a node" falls out of the span bandwidths, "the rest is dp" out of dp being the axis
whose traffic hides behind compute, and "pp only to fit" out of tp_overlap: once the tp traffic
hides behind the GEMMs pp only adds bubble, imbalance and an exposed reduce-scatter (without
tp_overlap, pp can win by the tp traffic it saves: docs/planner.md, the 70B example).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

from paralayer.config import Config
from paralayer.resolve import cost as cost_mod
from paralayer.resolve import memory as mem_mod
from paralayer.resolve.machine import (  # noqa: F401 - LOCAL_CALIBRATION, wire_factor: the planner's public names
    LOCAL_CALIBRATION,
    Machine,
    comm_seconds,
    dp_exposed_seconds,
    dp_reduce_seconds,
    machine_for,
    tp_overlap_seconds,
    wire_factor,
)
from paralayer.resolve.memory import ACT_BYTES, BYTES_PER_PARAM
from paralayer.resolve.rules import (
    V_SCHEDULES,
    Layout,
    chunk_rank,
    divisors,
    resolve_device,
    resolve_precision,
    valid_tp,
)
from paralayer.resolve.rules import stage_layers as make_stage_layers
from paralayer.resolve.split import balanced_split, best_split, layer_work, rank_work  # noqa: F401 - public here too

SCHEDULES_PP = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
RECOMPUTES = ("none", "selective", "full")
AXES = ("tp", "pp", "cp", "ep", "dp")
MAX_VPP = 8


def schedule_options(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1)]
    # interleaving: vpp = 2 (any split), and larger vpp where the layers divide evenly
    out += [("interleaved", v) for v in range(2, MAX_VPP + 1)
            if pp * v <= n_layers and (v == 2 or n_layers % (pp * v) == 0)]
    if 2 * pp <= n_layers:
        out += [("zbv", 2), ("dualpipev", 2)]
    return out


def axis_spans(tp: int, pp: int, cp: int, dp: int, ep: int, dpn: int) -> dict:
    """plan.spans in closed form: the group through rank 0 of an axis with stride s and size n
    stays in node 0 iff (n − 1)·s < devices_per_node (mesh order pp, dp, cp, tp; tp fastest)."""
    def where(last_rank: int) -> str:
        return "intra-node" if last_rank < dpn else "inter-node"

    ep_cp = min(ep, cp) if ep % max(min(ep, cp), 1) == 0 else cp
    ep_dp = max(ep // max(ep_cp, 1), 1)
    return {"tp": where(tp - 1), "pp": where((pp - 1) * tp * cp * dp), "cp": where((cp - 1) * tp),
            "ep": where((ep_cp - 1) * tp + (ep_dp - 1) * tp * cp), "dp": where((dp - 1) * tp * cp)}


# ------------------------------------------------------------------ the planner

def plan_layouts(cfg: Config, calibration: Optional[dict] = None, stats: Optional[dict] = None) -> list[dict]:
    """Every valid layout that fits, best (lowest predicted step time) first.

    Each is a dict: ``degrees``, ``schedule``, ``zero``, ``recompute``, ``micro_batch``,
    ``microbatches``, ``pp_layout``, predictions (``step_time_s``, ``tokens_per_s``, ``mfu``,
    ``bubble``, ``memory`` {params, grads, optimizer, activations, total, capacity, stage},
    ``comm_time_s`` per axis, ``spans``, and the step's parts). ``stats`` (a dict) receives
    ``considered``, ``dropped`` {reason: count}, ``machine``, ``listed`` and ``seconds`` (CPU)."""
    t0 = time.process_time()
    m_ = cfg.model
    mach = machine_for(cfg, calibration)
    world, dpn = mach.world, mach.devices_per_node
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    wb, gbb, ob = BYTES_PER_PARAM[precision]
    ab = ACT_BYTES[precision]
    gb = cfg.train.global_batch
    seq, h, L = m_.seq_len, m_.d_model, m_.n_layers
    E = m_.moe.num_experts
    fpt = cost_mod.flops_per_token(cfg)
    flops_step = fpt * gb * seq
    compute = flops_step / (world * mach.peak_tflops * 1e12 * mach.efficiency)
    rc_frac = {"none": 0.0, "selective": 4.0 * L * h * seq / fpt, "full": 1.0 / 3.0}
    avail = None if mach.capacity is None else mach.capacity - mach.reserve
    sp_setting = cfg.parallel.sequence_parallel
    work, head = layer_work(cfg)
    moe_flags = [mem_mod.is_moe_layer(cfg, i) for i in range(L)]
    dropped: dict[str, int] = {}
    considered = 0
    split_cache: dict = {}
    structs: list = []
    recs: list = []

    def drop(reason: str, n: int = 1) -> None:
        dropped[reason] = dropped.get(reason, 0) + n

    act_cache: dict = {}
    for tp in valid_tp(cfg, world):
        if world % tp:
            continue
        sp = (tp > 1) if sp_setting is None else (bool(sp_setting) and tp > 1)
        padded = int(math.ceil(m_.vocab_size / tp) * tp)
        for cp in divisors(world // tp):
            if cp > 1 and seq % (2 * cp):
                continue
            if sp and seq % (cp * tp):
                drop("sequence parallel: seq_len/cp not divisible by tp")
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > L:
                    continue
                dp = world // (tp * cp * pp)
                if gb % dp:
                    drop("global_batch not divisible by dp")
                    continue
                eps = [1] if E == 0 else [e for e in divisors(E) if (dp * cp) % e == 0]
                for ep in eps:
                    for schedule, vpp in schedule_options(pp, L):
                        skey = (pp, vpp, schedule in V_SCHEDULES)
                        if skey not in split_cache:
                            split_cache[skey] = best_split(cfg, work, head, pp, vpp, schedule)
                        sp_res = split_cache[skey]
                        if sp_res is None:
                            drop("more pipeline chunks than layers")
                            continue
                        split, imbalance = sp_res
                        lay = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=dp, world=world, nodes=mach.nodes,
                                     devices_per_node=dpn, schedule=schedule, sequence_parallel=sp,
                                     padded_vocab=padded, device=device, precision=precision,
                                     stage_layers=make_stage_layers(L, split))
                        key = len(structs)
                        structs.append((lay, split, imbalance, axis_spans(tp, pp, cp, dp, ep, dpn),
                                        {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "dp": dp},
                                        split if (pp > 1 and len(set(split)) > 1) else None, {},
                                        _override_prefix(tp, pp, vpp, cp, ep, dp, schedule, split)))
                        considered += 1
                        _plan_structure(cfg, key, structs[key], mach, recs, drop, act_cache, moe_flags, dict(
                            wb=wb, gbb=gbb, ob=ob, ab=ab, gb=gb, seq=seq, h=h, compute=compute,
                            rc_frac=rc_frac, avail=avail))
    recs.sort(key=lambda t: (t[0], t[6][0]))
    out = [_materialise(t, structs, mach, flops_step, gb * seq, i + 1) for i, t in enumerate(recs)]
    if stats is not None:
        stats.update(considered=considered, dropped=dropped, machine=dataclasses.asdict(mach),
                     seconds=time.process_time() - t0, listed=len(out))
    return out


def _plan_structure(cfg: Config, key: int, struct: tuple, mach: Machine, recs: list, drop, act_cache: dict,
                    moe_flags: list, k: dict) -> None:
    lay, split, imbalance, spans = struct[:4]
    tp, pp, cp, ep, dp, vpp, schedule = lay.tp, lay.pp, lay.cp, lay.ep, lay.dp, lay.vpp, lay.schedule
    wb, gbb, ob, ab, gb, seq, h = k["wb"], k["gbb"], k["ob"], k["ab"], k["gb"], k["seq"], k["h"]
    avail, compute, rc_frac = k["avail"], k["compute"], k["rc_frac"]
    d_dense = dp * cp
    d_exp = max(d_dense // max(ep, 1), 1)

    # the ranks that can be the most loaded: first, second, second to last, last
    ranks = []
    for r in sorted({0, 1, pp - 2, pp - 1} & set(range(pp))):
        dense, expert, _ = mem_mod.rank_params(cfg, lay, r)
        chunks = [c for c in range(lay.chunks) if chunk_rank(c, pp, schedule) == r]
        layers = [i for c in chunks for i in lay.stage_layers[c]]
        n_moe = sum(1 for i in layers if moe_flags[i])
        ranks.append((r, dense, expert, len(layers) - n_moe, n_moe, (lay.chunks - 1) in chunks))

    # Communication per step: the resolver's own cost.comm volumes, timed by comm_seconds. Every
    # term is affine in the number of microbatches m (bytes of tp/pp/cp/ep do not depend on the
    # micro-batch: tokens per microbatch × m is fixed; counts scale with m; ZeRO-3 gathers per
    # microbatch), so two evaluations (m1, m2) per recompute mode / zero stage give the line.
    # tp_overlap's exposed tp time is not affine in m (a ring step costs the longer of a chunk's
    # GEMM and its transfer): it is computed per micro-batch size, from cost.tp_ring_flops.
    m1 = gb // dp  # micro_batch 1
    mb2 = next((q for q in divisors(gb // dp) if q > 1), 1)
    m2 = gb // (dp * mb2)
    overlaps = (False, True) if (tp > 1 and lay.sequence_parallel and schedule not in V_SCHEDULES
                                 and mach.tp_overlap > 0) else (False,)
    per_ax: dict = {}  # (overlap, recompute) -> {axis: (fixed seconds, seconds per microbatch)}
    dp_line = {}  # zero -> (fixed, per microbatch) of all dp traffic, and of the grad reduce-scatter
    for recompute, zero_ in (("none", 0), ("selective", 1), ("full", 2), ("full", 3)):
        pts = []
        for mb_, mm_ in ((1, m1), (mb2, m2)):
            lay.micro_batch, lay.microbatches, lay.recompute, lay.zero = mb_, mm_, recompute, zero_
            c = cost_mod.comm(cfg, lay)
            t = {ax: comm_seconds(c[ax], spans[ax], mach, ax) for ax in AXES}
            t["dp_reduce"] = dp_reduce_seconds(c["dp"], spans["dp"], mach)
            pts.append((mm_, t))
        if (False, recompute) not in per_ax:
            per_ax[(False, recompute)] = {ax: _line(pts, ax) for ax in ("tp", "pp", "cp", "ep")}
            if True in overlaps:  # pp, cp, ep as without; tp per micro-batch size below
                per_ax[(True, recompute)] = {ax: per_ax[(False, recompute)][ax] for ax in ("pp", "cp", "ep")}
        dp_line[zero_] = (_line(pts, "dp"), _line(pts, "dp_reduce"))
    lay.micro_batch, lay.microbatches, lay.recompute, lay.zero = 1, m1, "none", 0
    lin = {k: (sum(v[0] for v in t.values()), sum(v[1] for v in t.values())) for k, t in per_ax.items()}
    struct[6].update(per_ax)
    work = compute * imbalance
    imb_s = compute * (imbalance - 1)
    ovh_per_m = max(mach.layer_overhead(rk[3], rk[4], tp) for rk in ranks)
    r0 = ranks[0]  # cost.comm's rank: the first pipeline rank
    full_ring_flops = {rc: cost_mod.tp_ring_flops(cfg, tp, rc) for rc in RECOMPUTES}
    tp_cache: dict = {}

    acts = {}  # overlap -> the act_elems_per_token table (saved gathered inputs differ)
    for overlap in overlaps:
        lay.tp_overlap = overlap
        akey = (tp, lay.sequence_parallel, cp > 1, overlap)  # the keys act_elems_per_token depends on
        if akey not in act_cache:
            act_cache[akey] = {mode: (mem_mod.act_elems_per_token(cfg, lay, False, mode),
                                      mem_mod.act_elems_per_token(cfg, lay, True, mode)) for mode in RECOMPUTES}
        acts[overlap] = act_cache[akey]
    lay.tp_overlap = False
    n_var = len(overlaps)  # every drop below drops each tp_overlap variant
    for zero in range(4):
        states = []
        for rk in ranks:
            dense, expert = rk[1], rk[2]
            pa, gr, op = (int(x) for x in
                          mem_mod.state_bytes(dense, expert, d_dense, d_exp, zero, pp, (wb, gbb, ob)))
            states.append((pa, gr, op, pa + gr + op))
        mbs = divisors(gb // dp)
        if avail is not None and min(s[3] for s in states) > avail:
            drop("memory: model states alone exceed the device", 3 * len(mbs) * n_var)
            continue
        for mb in mbs:
            mm = gb // (mb * dp)
            if pp > 1:
                need = 2 * pp if schedule == "dualpipev" else pp
                if mm < need and schedule != "gpipe":
                    drop(f"microbatches m < {'2·pp' if schedule == 'dualpipev' else 'pp'} ({schedule})", 3 * n_var)
                    continue
                if schedule == "interleaved" and mm % pp:
                    drop("interleaved: m not a multiple of pp", 3 * n_var)
                    continue
            tokens = mb * seq / cp
            tab = tokens * ab
            bubble = cost_mod.bubble_fraction(schedule, pp, mm, vpp)
            (dpf, dpm), (rdf, rdm) = dp_line[zero]
            t_dp, t_red = dpf + dpm * mm, rdf + rdm * mm
            # per candidate rank: (in flight, logits and final norm if last)
            fl = []
            for (r, _d, _e, _nd, _nm, last) in ranks:
                extra = 0.0
                if last:
                    lif = mm if (schedule == "gpipe" and pp > 1) else 1
                    extra = (4 * tokens * lay.padded_vocab / tp * lif
                             + mem_mod.head_saved_elems(lay, h) * tokens * ab)
                fl.append((mem_mod.in_flight_count(pp, mm, schedule, vpp, r), extra))
            for overlap in overlaps:
                act = acts[overlap]
                nd_none, nm_none = act["none"]
                for recompute in RECOMPUTES:
                    ed, em = act[recompute]
                    full = recompute == "full"
                    best = None
                    for (r, _d, _e, n_dense, n_moe, _last), st, (inf, extra) in zip(ranks, states, fl):
                        a = inf * (n_dense * ed + n_moe * em) * tab + extra
                        if full and (n_dense + n_moe):
                            a += max(nd_none if n_dense else 0, nm_none if n_moe else 0) * tab
                        a = int(a)
                        tot = st[3] + a
                        if best is None or tot > best[0]:
                            best = (tot, r, st[0], st[1], st[2], a)
                    if avail is not None and best[0] > avail:
                        drop(f"memory: does not fit (recompute={recompute})")
                        continue
                    fixed, per_m = lin[(overlap, recompute)]
                    t_tp = 0.0
                    if overlap:  # does not depend on zero: once per (micro-batch, recompute)
                        t_tp = tp_cache.get((mb, recompute))
                        if t_tp is None:
                            t_tp = tp_cache[(mb, recompute)] = tp_overlap_seconds(
                                full_ring_flops[recompute], r0[3], r0[4], tokens, mm, tp, h, ab, full, mach,
                                spans["tp"])
                    recomp = work * rc_frac[recompute]
                    ovh = ovh_per_m * mm
                    inner = work + recomp + fixed + per_m * mm + t_tp + ovh
                    dp_exposed = dp_exposed_seconds(t_dp, t_red, zero, pp, work + recomp, mm, mach)
                    recs.append((inner * (1 + bubble) + dp_exposed, key, zero, mb, mm, recompute, best,
                                 (fixed + t_tp, per_m, t_dp), dp_exposed, bubble, recomp, inner * bubble, imb_s, ovh,
                                 overlap, t_tp))


def _line(pts: list, ax: str) -> tuple[float, float]:
    """(fixed, per microbatch) seconds of an axis from its times at two microbatch counts."""
    (ma, ta), (mb, tb) = pts
    if ma == mb:
        return (ta[ax], 0.0)
    slope = (ta[ax] - tb[ax]) / (ma - mb)
    return (ta[ax] - slope * ma, slope)


def _materialise(t: tuple, structs: list, mach: Machine, flops_step: float, tokens: int, rank: int,
                 cfg: Optional[Config] = None) -> dict:
    (step, key, zero, mb, mm, recompute, best, (fixed, per_m, t_dp), dp_exposed, bubble, recomp, bubble_s, imb_s, ovh,
     overlap, t_tp) = t
    lay, split, imbalance, spans, degrees, pp_layout, per_ax, prefix = structs[key]
    tot, r, pa, gr, op, a = best
    ax = per_ax[(overlap, recompute)]
    ct = {"tp": t_tp, "pp": 0.0, "cp": 0.0, "ep": 0.0, "dp": t_dp}  # tp_overlap: the exposed share
    for name, (f_, p_) in ax.items():
        ct[name] = f_ + p_ * mm
    return {
        "rank": rank,
        "degrees": degrees,
        "schedule": lay.schedule,
        "zero": zero,
        "recompute": recompute,
        "micro_batch": mb,
        "microbatches": mm,
        "sequence_parallel": lay.sequence_parallel,
        "tp_overlap": overlap,
        "pp_layout": pp_layout,
        "world_size": mach.world,
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "mfu": flops_step / (step * mach.world * mach.peak_tflops * 1e12),
        "bubble": bubble,
        "compute_s": flops_step / (mach.world * mach.peak_tflops * 1e12 * mach.efficiency),
        "imbalance": imbalance,
        "imbalance_s": imb_s,
        "recompute_s": recomp,
        "overhead_s": ovh,
        "bubble_s": bubble_s,
        "comm_s": fixed + per_m * mm,  # tp + pp + cp + ep, on the critical path
        "dp_comm_s": t_dp,
        "dp_exposed_s": dp_exposed,
        "comm_time_s": ct,
        "spans": spans,
        "memory": {"params": pa, "grads": gr, "optimizer": op, "activations": a, "total": tot,
                   "capacity": mach.capacity, "stage": r},
        "overrides": prefix + [f"parallel.zero={zero}", f"parallel.recompute={recompute}", f"train.micro_batch={mb}"]
        + (["parallel.tp_overlap=true"] if overlap else []),
    }


def _override_prefix(tp: int, pp: int, vpp: int, cp: int, ep: int, dp: int, schedule: str, split: list) -> list[str]:
    lo = "[" + ",".join(map(str, split)) + "]" if (pp > 1 and len(set(split)) > 1) else "null"
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.cp={cp}", f"parallel.ep={ep}",
            f"parallel.dp={dp}", f"parallel.schedule={schedule}", f"parallel.pp_layout={lo}"]


# ------------------------------------------------------------------ configs for a layout
def config_for(cfg: Config, d: dict) -> Config:
    """The config with a planned layout applied (what ``resolve`` and the runtime take)."""
    deg = d["degrees"]
    par = dataclasses.replace(cfg.parallel, tp=deg["tp"], pp=deg["pp"], vpp=deg["vpp"], cp=deg["cp"], ep=deg["ep"],
                              dp=deg["dp"], schedule=d["schedule"], zero=d["zero"], recompute=d["recompute"],
                              pp_layout=list(d["pp_layout"]) if d.get("pp_layout") else None,
                              tp_overlap=bool(d.get("tp_overlap", False)))
    tr = dataclasses.replace(cfg.train, micro_batch=d["micro_batch"])
    return dataclasses.replace(cfg, parallel=par, train=tr)


def predict(cfg: Config, calibration: Optional[dict] = None) -> dict:
    """The cost model's prediction for the config's own layout (for calibration): memory from
    ``resolve()`` (the same numbers the planner mirrors), time from the same terms as the ranking.
    Raises ValueError if the layout is not valid."""
    from paralayer.resolve.plan import resolve

    plan = resolve(cfg)
    if plan.errors:
        raise ValueError(f"invalid layout: {plan.errors}")
    g = plan.degrees
    mach = machine_for(cfg, calibration)
    work, head = layer_work(cfg)
    split = [len(s) for s in plan.stage_layers]
    rw = rank_work(work, head, split, g["pp"], plan.schedule)
    imbalance = g["pp"] * max(rw) / (sum(work) + head)
    L, h, seq = cfg.model.n_layers, cfg.model.d_model, cfg.model.seq_len
    fpt = plan.flops_per_token
    compute = plan.flops_per_step / (mach.world * mach.peak_tflops * 1e12 * mach.efficiency)
    rc = {"none": 0.0, "selective": 4.0 * L * h * seq / fpt, "full": 1.0 / 3.0}[plan.recompute]
    t_ax = {ax: comm_seconds(plan.comm[ax], plan.spans[ax], mach, ax) for ax in AXES}
    work_s = compute * imbalance
    recomp = work_s * rc
    mm = plan.microbatches
    ovh = 0.0
    layer_kinds = []  # (dense, MoE) layers per pipeline rank
    for r in range(g["pp"]):
        layers = [i for c in range(len(plan.stage_layers)) if chunk_rank(c, g["pp"], plan.schedule) == r
                  for i in plan.stage_layers[c]]
        n_moe = sum(1 for i in layers if mem_mod.is_moe_layer(cfg, i))
        layer_kinds.append((len(layers) - n_moe, n_moe))
        ovh = max(ovh, mach.layer_overhead(len(layers) - n_moe, n_moe, g["tp"]) * mm)
    if plan.tp_overlap:
        t_ax["tp"] = tp_overlap_seconds(cost_mod.tp_ring_flops(cfg, g["tp"], plan.recompute), *layer_kinds[0],
                                        plan.micro_batch * seq / g["cp"], mm, g["tp"], h, ACT_BYTES[plan.precision],
                                        plan.recompute == "full", mach, plan.spans["tp"])
    inner = work_s + recomp + ovh + t_ax["tp"] + t_ax["pp"] + t_ax["cp"] + t_ax["ep"]
    dp_exposed = dp_exposed_seconds(t_ax["dp"], dp_reduce_seconds(plan.comm["dp"], plan.spans["dp"], mach),
                                    plan.zero, g["pp"], work_s + recomp, mm, mach)
    step = inner * (1 + plan.bubble_fraction) + dp_exposed
    return {"degrees": dict(g), "schedule": plan.schedule, "zero": plan.zero, "recompute": plan.recompute,
            "tp_overlap": plan.tp_overlap,
            "micro_batch": plan.micro_batch, "microbatches": mm, "step_time_s": step,
            "compute_s": compute, "imbalance": imbalance, "recompute_s": recomp, "overhead_s": ovh,
            "bubble": plan.bubble_fraction, "bubble_s": inner * plan.bubble_fraction, "comm_time_s": t_ax,
            "dp_exposed_s": dp_exposed, "memory": dict(plan.memory_per_device_bytes),
            "tokens_per_s": plan.tokens_per_step / step,
            "mfu": plan.flops_per_step / (step * mach.world * mach.peak_tflops * 1e12)}


__all__ = ["plan_layouts", "predict", "config_for", "machine_for", "Machine", "LOCAL_CALIBRATION",
           "balanced_split", "comm_seconds", "wire_factor"]
