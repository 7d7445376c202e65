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

The cost model (one step, one device; every term is reported per layout):

    compute   = flops_per_step / (world · peak · efficiency)          (model FLOPs, 6N + 12·L·h·s)
    imbalance = FLOPs of the busiest pipeline rank / the mean (the output head sits on the last
                chunk's rank; the planner picks the layer split that minimises it)
    recompute = compute · imbalance · (selective: 4·L·h·s / flops_per_token, the attention core's
                forward; full: 1/3, one more forward)
    comm[ax]  = count · latency(span) + bytes · wire(collective, n) / bandwidth(span)
                wire: all-reduce 2(n−1)/n (tp's AG+RS pairs too), all-gather / reduce-scatter /
                all-to-all (n−1)/n, send/recv 1; span from the mesh order (pp, dp, cp, tp), tp
                fastest: an axis whose group through rank 0 leaves a node uses inter_node_gbps.
    step      = (compute · imbalance + recompute + comm[tp, cp, ep, pp]) · (1 + bubble)
                + exposed(comm[dp])
    exposed(dp) = max(0, comm[dp] − overlap · window): gradient reduce-scatter runs under the
                last microbatch's backward and the weight all-gather under the first forward
                (window = one microbatch of compute); ZeRO-3's per-microbatch gathers are
                prefetched under the whole step's compute.

Nothing in the ranking is a rule of thumb: "tp inside a node" falls out of the span bandwidths,
"pp only to fit" out of the bubble and the stage imbalance (idle time no overlap hides) against
dp's overlapped gradient sync, and
"the rest is dp" out of dp being the one axis whose traffic hides behind compute.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Optional

from paralayer.config import Config
from paralayer.resolve import cost as cost_mod
from paralayer.resolve import memory as mem_mod
from paralayer.resolve.memory import ACT_BYTES, BYTES_PER_PARAM, GIB
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

# ------------------------------------------------------------------ named constants
#: Fraction of the device peak that the model's matmuls reach (compute only; communication,
#: bubble and recompute are charged separately). GPUs: Megatron-Core reaches 41–49% MFU end to end
#: on H100 (REFERENCE.md); with comm and bubble removed that is about 0.5 of peak for the GEMMs.
GPU_EFFICIENCY = 0.5
#: Per-collective launch latency on GPU profiles (NCCL: a few µs in a node, ~10–20 µs across).
GPU_LATENCY_S = {"intra": 10e-6, "inter": 20e-6}
#: How much of a window of compute can hide dp traffic on GPUs (async NCCL on its own stream).
GPU_DP_OVERLAP = 1.0

#: The ``local`` calibration (CPU ranks, gloo over loopback), fitted by benchmarks/calibrate.py on
#: this machine — see docs/planner.md for the run and the fit. ``peak_tflops`` is the measured
#: fp32 GEMM peak of one rank's thread (metrics.measure_cpu_peak_tflops); ranks get
#: min(1, cores / ranks) of it (one thread each, sharing ``cores``: the effective cores, fitted;
#: None = os.cpu_count()); the links are gloo over loopback: a per-collective latency and a
#: bandwidth, the same inside and "across" nodes. ``cluster.peak_tflops`` overrides the peak.
LOCAL_CALIBRATION = {
    "peak_tflops": 0.1442,  # one-thread fp32 GEMM, measured at the start of the run
    "efficiency": 0.604,
    "cores": 2.0,  # effective cores the ranks got (the machine's cores are shared with other jobs)
    "latency_s": 0.0,  # per collective: fitted to 0 once dispatch is counted (the fit put it there)
    "bandwidth_gbps": 0.141,  # gloo over loopback
    "dp_overlap": 0.0,  # our CPU runtime reduces gradients after the backward, not under it
    # eager dispatch per layer per microbatch (forward + backward) on one rank, on top of the
    # FLOPs: every layer; more under tp (DTensor redistributes); more per MoE layer (routing,
    # sort, the loop over experts). Fitted like the rest; GPUs: 0 (kernels launch ahead).
    "overhead_layer_s": 2.99e-3,
    "overhead_tp_s": 28.89e-3,
    "overhead_moe_s": 9.39e-3,
}

SCHEDULES_PP = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
RECOMPUTES = ("none", "selective", "full")
AXES = ("tp", "pp", "cp", "ep", "dp")
MAX_VPP = 8


# ------------------------------------------------------------------ the machine model
@dataclasses.dataclass
class Machine:
    """What the cost model needs of the cluster, with its calibration."""

    world: int
    devices_per_node: int
    nodes: int
    peak_tflops: float
    efficiency: float
    intra_gbps: float
    inter_gbps: float
    latency_s: dict
    dp_overlap: float
    capacity: Optional[int]
    reserve: int
    kind: str  # "gpu" | "local"
    #: seconds per layer per microbatch: {"layer", "tp", "moe"} (see LOCAL_CALIBRATION)
    overhead_s: dict = dataclasses.field(default_factory=dict)

    def layer_overhead(self, n_dense: int, n_moe: int, tp: int) -> float:
        """Dispatch seconds per microbatch of a rank holding these layers."""
        o = self.overhead_s
        per = o.get("layer", 0.0) + (o.get("tp", 0.0) if tp > 1 else 0.0)
        return (n_dense + n_moe) * per + n_moe * o.get("moe", 0.0)

    def bandwidth(self, span: str) -> float:
        return 1e9 * (self.intra_gbps if span == "intra-node" else self.inter_gbps)

    def latency(self, span: str) -> float:
        return self.latency_s["intra" if span == "intra-node" else "inter"]


def machine_for(cfg: Config, calibration: Optional[dict] = None) -> Machine:
    """The machine model for the config's cluster. CPU (``local``) uses LOCAL_CALIBRATION (or the
    given calibration); GPU profiles use the profile's peak and bandwidths with the GPU constants."""
    c = cfg.cluster
    device = resolve_device(cfg)
    if c.devices_per_node is None:
        p = cfg.parallel
        dpn = p.tp * p.pp * p.cp * (p.dp if isinstance(p.dp, int) else 1)
    else:
        dpn = c.devices_per_node
    cap = int(c.device_memory_gib * GIB) if c.device_memory_gib is not None else None
    reserve = int(c.memory_reserve_gib * GIB)
    if device == "cpu":
        cal = dict(LOCAL_CALIBRATION, **(calibration or {}))
        bw = cal["bandwidth_gbps"]
        # one thread per rank; ranks on one machine share its cores (2 ranks on 2 cores each get a
        # core, 4 ranks get half of one): the per-rank peak is the one-thread peak × min(1, cores/ranks)
        cores = cal.get("cores") or os.cpu_count() or 1
        share = min(1.0, cores / max(dpn, 1))
        peak = float(c.peak_tflops or cal["peak_tflops"] * share)
        # dispatch is CPU work too: ranks sharing a core share its time
        ovh = {k: cal.get(f"overhead_{k}_s", 0.0) / share for k in ("layer", "tp", "moe")}
        return Machine(c.nodes * dpn, dpn, c.nodes, peak, cal["efficiency"],
                       bw, bw, {"intra": cal["latency_s"], "inter": cal["latency_s"]}, cal["dp_overlap"],
                       cap, reserve, "local", ovh)
    cal = calibration or {}
    return Machine(c.nodes * dpn, dpn, c.nodes, float(c.peak_tflops or 989.0), cal.get("efficiency", GPU_EFFICIENCY),
                   float(c.intra_node_gbps), float(c.inter_node_gbps), dict(cal.get("latency_s", GPU_LATENCY_S)),
                   cal.get("dp_overlap", GPU_DP_OVERLAP), cap, reserve, "gpu")


def wire_factor(collective: str, n: int) -> float:
    """Bytes each device moves per payload byte, ring algorithms (see the module docstring)."""
    if n <= 1 or collective == "none":
        return 0.0
    if collective == "all-reduce":
        return 2.0 * (n - 1) / n
    if collective in ("send/recv", "ring send/recv (K,V)"):
        return 1.0
    return (n - 1) / n  # all-gather, reduce-scatter, all-to-all, and their pairs (bytes counted per half)


# ------------------------------------------------------------------ pipeline splits
def _fill(total: int, n: int) -> list[int]:
    """total layers over n chunks as evenly as possible; the extra layers go to the middle chunks
    first (not the first chunk, which also holds the embedding)."""
    base, rem = divmod(total, n)
    sizes = [base] * n
    order = list(range(1, n)) + [0]
    for i in order[:rem]:
        sizes[i] += 1
    return sizes


def balanced_split(n_layers: int, chunks: int) -> Optional[list[int]]:
    """Layers per chunk: even when it divides; else as even as possible with the remainder kept
    off the first and last chunk (they also hold the embedding and the output head — Meta's 405B
    split 7 + 14·8 + 7). None when there are more chunks than layers."""
    if chunks > n_layers or chunks < 1:
        return None
    base, rem = divmod(n_layers, chunks)
    if rem == 0:
        return [base] * chunks
    sizes = [base] * chunks
    order = list(range(1, chunks - 1)) + [0, chunks - 1] if chunks > 2 else list(range(chunks))
    for i in order[:rem]:
        sizes[i] += 1
    return sizes


def layer_work(cfg: Config) -> tuple[list[float], float]:
    """Training FLOPs per token of each layer and of the output head (the terms of
    cost.flops_per_token, split by where they run): a pipeline step is paced by its busiest rank."""
    m = cfg.model
    h = m.d_model
    attn = mem_mod.attn_params(cfg)
    out = []
    for i in range(m.n_layers):
        if mem_mod.is_moe_layer(cfg, i):
            n = (attn + m.moe.top_k * mem_mod.expert_params(cfg) + h * m.moe.num_experts
                 + 3 * h * m.moe.shared_ffn_hidden)
        else:
            n = attn + 3 * h * m.ffn_hidden
        out.append(6.0 * n + 12.0 * h * m.seq_len)
    return out, 6.0 * h * m.vocab_size


def rank_work(work: list[float], head: float, split: list[int], pp: int, schedule: str) -> list[float]:
    """FLOPs per token on each pipeline rank for a split (chunks mapped as the runtime maps them)."""
    ranks = [0.0] * pp
    start = 0
    n = len(split)
    for c, k in enumerate(split):
        r = chunk_rank(c, pp, schedule)
        ranks[r] += sum(work[start:start + k]) + (head if c == n - 1 else 0.0)
        start += k
    return ranks


def best_split(cfg: Config, work: list[float], head: float, pp: int, vpp: int,
               schedule: str) -> Optional[tuple[list[int], float]]:
    """The split of the layers into pp·vpp chunks that minimises the busiest rank's work (the
    output head counts on the last chunk's rank), and its imbalance = busiest / mean. Tries the
    even split and the ones that take 1–3 layers off the chunk holding the head."""
    L = len(work)
    chunks = pp * vpp
    even = balanced_split(L, chunks)
    if even is None:
        return None
    total = sum(work) + head
    if pp == 1:
        return even, 1.0
    cands = [even]
    base = L // chunks
    for k in range(max(1, base - 3), base + 1):
        rest = L - k
        if chunks - 1 <= rest:
            cands.append(_fill(rest, chunks - 1) + [k])
    best = None
    for s in cands:
        if min(s) < 1:
            continue
        mx = max(rank_work(work, head, s, pp, schedule))
        if best is None or mx < best[1] - 1e-9 * total:
            best = (s, mx)
    assert best is not None
    return best[0], pp * best[1] / total


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
def _in_flight(pp: int, m: int, schedule: str, vpp: int, r: int) -> float:
    """memory.in_flight, inlined for speed (same cases)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - r))
    if schedule == "interleaved":
        return min(m, pp - r) * (1 + (pp - 1) / (pp * vpp))
    if schedule == "zbv":
        return float(min(m, pp))
    return float(min(m, pp + 0.5))


# record tuple fields (materialised into dicts after sorting)
_F = ("step", "key", "zero", "mb", "mm", "recompute", "mem", "t_ax", "dp_exposed", "bubble", "recomp_s",
      "bubble_s", "imbalance_s", "overhead_s")


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

    akey = (tp, lay.sequence_parallel, cp > 1)  # the keys act_elems_per_token depends on
    if akey not in act_cache:
        act_cache[akey] = {mode: (mem_mod.act_elems_per_token(cfg, lay, False, mode),
                                  mem_mod.act_elems_per_token(cfg, lay, True, mode)) for mode in RECOMPUTES}
    act = act_cache[akey]

    # Communication per step: the resolver's own cost.comm volumes, timed by comm_seconds. Every
    # term is affine in the number of microbatches m (bytes of tp/pp/cp/ep do not depend on the
    # micro-batch: tokens per microbatch × m is fixed; counts scale with m; ZeRO-3 gathers per
    # microbatch), so two evaluations (m1, m2) per recompute mode / zero stage give the line.
    m1 = gb // dp  # micro_batch 1
    mb2 = next((q for q in divisors(gb // dp) if q > 1), 1)
    m2 = gb // (dp * mb2)
    per_ax = {}  # recompute -> {axis: (fixed seconds, seconds per microbatch)}
    dp_line = {}  # zero -> (fixed, per microbatch)
    for recompute, zero_ in (("none", 0), ("selective", 1), ("full", 2), ("full", 3)):
        pts = []
        for mb_, mm_ in ((1, m1), (mb2, m2)):
            lay.micro_batch, lay.microbatches, lay.recompute, lay.zero = mb_, mm_, recompute, zero_
            c = cost_mod.comm(cfg, lay)
            pts.append((mm_, {ax: comm_seconds(c[ax], spans[ax], mach, ax) for ax in AXES}))
        if recompute not in per_ax:
            per_ax[recompute] = {ax: _line(pts, ax) for ax in ("tp", "pp", "cp", "ep")}
        dp_line[zero_] = _line(pts, "dp")
    lay.micro_batch, lay.microbatches, lay.recompute, lay.zero = 1, m1, "none", 0
    lin = {r: (sum(v[0] for v in t.values()), sum(v[1] for v in t.values())) for r, t in per_ax.items()}
    struct[6].update(per_ax)
    nd_none, nm_none = act["none"]
    work = compute * imbalance
    imb_s = compute * (imbalance - 1)
    dp_overlap = mach.dp_overlap
    ovh_per_m = max(mach.layer_overhead(rk[3], rk[4], tp) for rk in ranks)

    for zero in range(4):
        states = []
        for rk in ranks:
            dense, expert = rk[1], rk[2]
            pz = zero if pp == 1 else min(zero, 1)  # memory.rank_memory: FSDP under pp keeps whole weights/grads
            pa = int(wb * (_shard(dense, d_dense, pz, 3) + _shard(expert, d_exp, pz, 3)))
            gr = int(gbb * (_shard(dense, d_dense, pz, 2) + _shard(expert, d_exp, pz, 2)))
            # memory.rank_memory: ZeRO-1 keeps the expert optimizer states whole on each rank
            op = int(ob * (_shard(dense, d_dense, zero, 1) + (expert if zero == 1 else _shard(expert, d_exp, zero, 1))))
            states.append((pa, gr, op, pa + gr + op))
        mbs = divisors(gb // dp)
        if avail is not None and min(s[3] for s in states) > avail:
            drop("memory: model states alone exceed the device", 3 * len(mbs))
            continue
        for mb in mbs:
            mm = gb // (mb * dp)
            if pp > 1:
                need = 2 * pp if schedule == "dualpipev" else pp
                if mm < need and schedule != "gpipe":
                    drop(f"microbatches m < {'2·pp' if schedule == 'dualpipev' else 'pp'} ({schedule})", 3)
                    continue
                if schedule == "interleaved" and mm % pp:
                    drop("interleaved: m not a multiple of pp", 3)
                    continue
            tokens = mb * seq / cp
            tab = tokens * ab
            bubble = cost_mod.bubble_fraction(schedule, pp, mm, vpp)
            t_dp = dp_line[zero][0] + dp_line[zero][1] * mm
            # per candidate rank: (in flight, logits and final norm if last)
            fl = []
            for (r, _d, _e, _nd, _nm, last) in ranks:
                extra = 0.0
                if last:
                    lif = mm if (schedule == "gpipe" and pp > 1) else 1
                    extra = 4 * tokens * lay.padded_vocab / tp * lif + 3 * tokens * h * ab
                fl.append((_in_flight(pp, mm, schedule, vpp, r), extra))
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
                fixed, per_m = lin[recompute]
                recomp = work * rc_frac[recompute]
                ovh = ovh_per_m * mm
                inner = work + recomp + fixed + per_m * mm + ovh
                window = (work + recomp) if zero >= 2 else (work + recomp) / mm
                dp_exposed = t_dp - dp_overlap * window
                if dp_exposed < 0.0:
                    dp_exposed = 0.0
                recs.append((inner * (1 + bubble) + dp_exposed, key, zero, mb, mm, recompute, best,
                             (fixed, per_m, t_dp), dp_exposed, bubble, recomp, inner * bubble, imb_s, ovh))


def _shard(n: float, d: int, zero: int, stage: int) -> float:
    """memory.rank_memory's ZeRO rule: sharded over d from ``stage`` on."""
    return n / d if zero >= stage else n


def _line(pts: list, ax: str) -> tuple[float, float]:
    """(fixed, per microbatch) seconds of an axis from its times at two microbatch counts."""
    (ma, ta), (mb, tb) = pts
    if ma == mb:
        return (ta[ax], 0.0)
    slope = (ta[ax] - tb[ax]) / (ma - mb)
    return (ta[ax] - slope * ma, slope)


def comm_seconds(entry: dict, span: str, mach: Machine, axis: str = "") -> float:
    """Time of one axis's traffic per step from a resolver comm entry (``plan.comm[axis]``):
    count · latency + bytes · wire / bandwidth. The planner computes the same in closed form.

    tp under sequence parallel counts one all-gather + reduce-scatter PAIR per all-reduce it
    replaces (same volume), so its wire factor is the all-reduce's whatever the collective's name."""
    if entry["collective"] == "none" or entry["group_size"] <= 1:
        return 0.0
    n = entry["group_size"]
    count = entry["count_per_step"]
    if "wire_bytes_per_step" in entry:
        return count * mach.latency(span) + entry["wire_bytes_per_step"] / mach.bandwidth(span)
    wf = wire_factor("all-reduce" if axis == "tp" else entry["collective"], n)
    return count * mach.latency(span) + entry["bytes_per_step"] * wf / mach.bandwidth(span)


def _materialise(t: tuple, structs: list, mach: Machine, flops_step: float, tokens: int, rank: int,
                 cfg: Optional[Config] = None) -> dict:
    step, key, zero, mb, mm, recompute, best, (fixed, per_m, t_dp), dp_exposed, bubble, recomp, bubble_s, imb_s, ovh = t
    lay, split, imbalance, spans, degrees, pp_layout, per_ax, prefix = structs[key]
    tot, r, pa, gr, op, a = best
    ax = per_ax[recompute]
    ct = {"tp": 0.0, "pp": 0.0, "cp": 0.0, "ep": 0.0, "dp": t_dp}
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
        "overrides": prefix + [f"parallel.zero={zero}", f"parallel.recompute={recompute}", f"train.micro_batch={mb}"],
    }


def finish(plans: list[dict], cfg: Config, mach: Optional[Machine] = None, upto: Optional[int] = None) -> None:
    """Fill in ``why`` (how each layout loses to the first) for the first ``upto`` layouts (all by
    default)."""
    if not plans:
        return
    mach = mach or machine_for(cfg)
    best = plans[0]
    for d in plans[:upto]:
        d["why"] = "fastest" if d is best else why_slower(d, best, mach)


def _override_prefix(tp: int, pp: int, vpp: int, cp: int, ep: int, dp: int, schedule: str, split: list) -> list[str]:
    lo = "[" + ",".join(map(str, split)) + "]" if (pp > 1 and len(set(split)) > 1) else "null"
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.cp={cp}", f"parallel.ep={ep}",
            f"parallel.dp={dp}", f"parallel.schedule={schedule}", f"parallel.pp_layout={lo}"]


# ------------------------------------------------------------------ explaining the ranking
def why_slower(d: dict, best: dict, mach: Machine) -> str:
    """One line: how much slower than the first, and the term that accounts for most of it."""
    pct = 100.0 * (d["step_time_s"] / best["step_time_s"] - 1)
    head = f"+{pct:.1f}% step time" if pct >= 0.05 else "ties on step time"
    if d["spans"]["tp"] == "inter-node" and d["degrees"]["tp"] > 1:
        ratio = mach.intra_gbps / mach.inter_gbps if mach.inter_gbps else float("inf")
        return f"{head}: tp spans nodes: tp comm {ratio:.1f}× slower ({d['comm_time_s']['tp']:.3g} s)"
    if pct < 0.05:
        diffs = [k for k in ("zero", "micro_batch", "recompute", "schedule") if d[k] != best[k]]
        return head + (f" (differs in {', '.join(diffs)}; more memory)" if diffs and
                       d["memory"]["total"] > best["memory"]["total"] else "")
    terms = {
        "bubble": (d["bubble_s"] - best["bubble_s"], f"pp bubble {d['bubble']:.3f}"),
        "imbalance": (d["imbalance_s"] - best["imbalance_s"],
                      f"pp stage imbalance {d['imbalance']:.3f} (busiest stage / mean)"),
        "recompute": (d["recompute_s"] - best["recompute_s"], f"recompute={d['recompute']}"),
        "dp": (d["dp_exposed_s"] - best["dp_exposed_s"], f"dp sync exposed {d['dp_exposed_s']:.3g} s"),
    }
    for ax in ("tp", "pp", "cp", "ep"):
        inter = d["spans"][ax] == "inter-node" and d["degrees"][ax] > 1
        terms[ax] = (d["comm_time_s"][ax] - best["comm_time_s"][ax],
                     f"{ax} comm {d['comm_time_s'][ax]:.3g} s" + (" (spans nodes)" if inter else ""))
    _, (delta, text) = max(terms.items(), key=lambda kv: kv[1][0])
    if delta <= 0:
        return head
    return f"{head}: {text} (+{delta:.3g} s)"


# ------------------------------------------------------------------ configs for a layout
def config_for(cfg: Config, d: dict) -> Config:
    """The config with a planned layout applied (what ``resolve`` and the runtime take)."""
    deg = d["degrees"]
    par = dataclasses.replace(cfg.parallel, tp=deg["tp"], pp=deg["pp"], vpp=deg["vpp"], cp=deg["cp"], ep=deg["ep"],
                              dp=deg["dp"], schedule=d["schedule"], zero=d["zero"], recompute=d["recompute"],
                              pp_layout=list(d["pp_layout"]) if d.get("pp_layout") else None)
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
    for r in range(g["pp"]):
        layers = [i for c in range(len(plan.stage_layers)) if chunk_rank(c, g["pp"], plan.schedule) == r
                  for i in plan.stage_layers[c]]
        n_moe = sum(1 for i in layers if mem_mod.is_moe_layer(cfg, i))
        ovh = max(ovh, mach.layer_overhead(len(layers) - n_moe, n_moe, g["tp"]) * mm)
    inner = work_s + recomp + ovh + t_ax["tp"] + t_ax["pp"] + t_ax["cp"] + t_ax["ep"]
    window = (work_s + recomp) if plan.zero >= 2 else (work_s + recomp) / mm
    dp_exposed = max(0.0, t_ax["dp"] - mach.dp_overlap * window)
    step = inner * (1 + plan.bubble_fraction) + dp_exposed
    return {"degrees": dict(g), "schedule": plan.schedule, "zero": plan.zero, "recompute": plan.recompute,
            "micro_batch": plan.micro_batch, "microbatches": mm, "step_time_s": step,
            "compute_s": compute, "imbalance": imbalance, "recompute_s": recomp, "overhead_s": ovh,
            "bubble": plan.bubble_fraction, "bubble_s": inner * plan.bubble_fraction, "comm_time_s": t_ax,
            "dp_exposed_s": dp_exposed, "memory": dict(plan.memory_per_device_bytes),
            "tokens_per_s": plan.tokens_per_step / step,
            "mfu": plan.flops_per_step / (step * mach.world * mach.peak_tflops * 1e12)}


# ------------------------------------------------------------------ CLI
def run(cfg: Config, args: Any) -> int:  # noqa: D401
    """``launch.py --plan [--json]``: the ranked layouts; exit 0 if any layout fits, else 2."""
    stats: dict = {}
    plans = plan_layouts(cfg, stats=stats)
    as_json = getattr(args, "json", False)
    finish(plans, cfg, upto=None if as_json else 15)
    if as_json:
        print(json.dumps(plans))
        return 0 if plans else 2
    print_plans(cfg, plans, stats)
    return 0 if plans else 2


def print_plans(cfg: Config, plans: list[dict], stats: dict, top: int = 15, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console(file=sys.stdout, width=max(160, Console().width))
    mach = stats["machine"]
    con.print(f"[bold]{cfg.recipe}[/bold] on {cfg.cluster.name}: {mach['nodes']} node(s) × "
              f"{mach['devices_per_node']} = {mach['world']} devices; peak {mach['peak_tflops']:g} TFLOP/s × "
              f"efficiency {mach['efficiency']:g}; links {mach['intra_gbps']:g} GB/s in a node, "
              f"{mach['inter_gbps']:g} GB/s across")
    con.print(f"{stats['considered']:,} layout structures considered, {stats['listed']:,} layouts fit and are "
              f"listed, planned in {stats['seconds']:.2f} s CPU")
    t = Table(title=f"Top {min(top, len(plans))} layouts (best first)")
    for c in ("#", "tp", "pp", "vpp", "cp", "ep", "dp", "schedule", "zero", "recompute", "mb", "step s",
              "tok/s", "MFU", "bubble", "mem GiB", "why it loses to #1"):
        t.add_column(c, justify="left" if c in ("schedule", "recompute", "why it loses to #1") else "right")
    for d in plans[:top]:
        g = d["degrees"]
        t.add_row(str(d["rank"]), *(str(g[a]) for a in ("tp", "pp", "vpp", "cp", "ep", "dp")), d["schedule"],
                  str(d["zero"]), d["recompute"], str(d["micro_batch"]), f"{d['step_time_s']:.3g}",
                  f"{d['tokens_per_s']:,.0f}", f"{100 * d['mfu']:.1f}%", f"{d['bubble']:.3f}",
                  f"{d['memory']['total'] / GIB:.1f}", d["why"])
    con.print(t)
    if stats["dropped"]:
        t = Table(title="Dropped layouts, by reason")
        t.add_column("reason")
        t.add_column("count", justify="right")
        for reason, n in sorted(stats["dropped"].items(), key=lambda kv: -kv[1]):
            t.add_row(reason, f"{n:,}")
        con.print(t)
    if plans:
        con.print("run the first: python launch.py recipe=" + cfg.recipe + " " + " ".join(plans[0]["overrides"]))
    else:
        con.print("[red]no layout fits[/red]")


__all__ = ["plan_layouts", "finish", "run", "predict", "config_for", "machine_for", "Machine", "LOCAL_CALIBRATION",
           "GPU_EFFICIENCY", "balanced_split", "why_slower"]
