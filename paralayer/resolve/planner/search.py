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
peak, links, calibration, ``comm_seconds`` — is ``paralayer.resolve.cost.machine``, the table and the
CLI ``paralayer.resolve.planner.report``; the memory fast path ``planner.memory``, the communication
lines ``planner.comm``, the records ``planner.types`` and the listed rows ``planner.rows``):

    compute   = flops_per_step / (world · peak · efficiency)          (model FLOPs, 6N + 12·L·h·s)
    imbalance = FLOPs of the busiest pipeline rank / the mean (the output head sits on the last
                chunk's rank; the planner picks the layer split that minimises it)
    recompute = compute · imbalance · (selective: 4·L·h·s / flops_per_token, the attention core's
                forward; full: 1/3, one more forward; full with recompute_every=k: 1/3 of the
                layers i % k == 0 — weighed for a few k, the largest that fits, only where no
                mode at most as dear in FLOPs and traffic fits: ``_partial_full``)
    dispatch  = m · per-layer framework time of the busiest rank's layers (fitted on CPU, 0 on GPUs)
    comm[ax]  = count · latency(span) + wire bytes / bandwidth(span), volumes from ``cost.comm``
                (dp as the runtime moves it: FSDP per microbatch without pp, deferred under pp)
    tp        = comm[tp], or under parallel.tp_overlap what the GEMMs do not hide: per fused ring
                (tp − 1)·max(0, hop − overlap·GEMM/tp) (``machine.tp_overlap_seconds``)
    step      = (max over ranks of [its compute + recompute + tp, pp, cp, ep left exposed] + dispatch)
                · (1 + bubble) + dp exposed (``planner.rank_time``; dp: ``machine.dp_exposed_seconds``)

Its cost is bounded: per structure O(layers on four ranks); at most MAX_STRUCTURES structures and
MAX_CANDIDATES weighed layouts; with ``top`` structures go by a lower bound on their step, those that
cannot reach the best ``top`` skipped (exactly the exhaustive ranking's first ``top``), and a layout
whose step without its traffic exceeds the ``top``-th best so far is left untimed (``planner.bounds``).
A ZeRO stage reuses the activations another of the same precision mode weighed. ``fixed`` narrows.

"tp inside a node" falls out of the span bandwidths, "the rest is dp" out of dp being the axis whose
traffic hides behind compute, "pp only to fit" out of tp_overlap and the per-rank step (pp adds
bubble, imbalance, middle ranks' sends and a reduce-scatter: docs/planner.md, the 70B example)."""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from typing import Any, NamedTuple, Optional

from paralayer.config import Config
from paralayer.resolve import cost as cost_mod
from paralayer.resolve import memory as mem_mod
from paralayer.resolve.cost import optimizer_step
from paralayer.resolve.cost.machine import (  # noqa: F401 - LOCAL_CALIBRATION, wire_factor: the planner's public names
    LOCAL_CALIBRATION,
    Machine,
    comm_seconds,
    dp_exposed_max,
    dp_reduce_seconds,
    machine_for,
    wire_factor,
)
from paralayer.resolve.cost.split import balanced_split, best_split, layer_work, rank_work  # noqa: F401 - public here too
from paralayer.resolve.cost.step_time import compute_seconds, time_plan
from paralayer.resolve.memory import ACT_BYTES, BYTES_PER_PARAM
from paralayer.resolve.planner import precision as fp8_plan
from paralayer.resolve.planner import v_balance
from paralayer.resolve.planner.bounds import refined_bound, slower_than, structure_bound, structure_work
from paralayer.resolve.planner.comm import fsdp_key, recompute_key, tp_timer
from paralayer.resolve.planner.gc_pause import gc_paused
from paralayer.resolve.planner.lazy_lines import LazyLines
from paralayer.resolve.planner.memory import (
    RankInfo,
    act_tables,
    candidate_ranks,
    in_flight,
    peak_memory,
    peak_memory_every,
    shared_memos,
    state_table,
    table_bytes,
)
from paralayer.resolve.planner.rank_time import every_on_ranks, every_points, timed_on_ranks
from paralayer.resolve.planner.rows import config_for, materialise, override_prefix
from paralayer.resolve.planner.types import Candidate, Structure, Totals
from paralayer.resolve.planner.types import MemPick as MemPick  # noqa: F401 - a planner name too
from paralayer.resolve.rules import (
    V_SCHEDULES,
    Layout,
    divisors,
    resolve_device,
    resolve_precision,
    valid_tp,
)
from paralayer.resolve.rules import stage_layers as make_stage_layers

SCHEDULES_PP = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
RECOMPUTES = ("none", "swiglu", "core_attn", "selective", "full")  # planner.comm.RECOMPUTES (no norm_up)
MAX_VPP = 8


def schedule_options(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1)]
    # interleaving: vpp = 2 … MAX_VPP chunks per rank (an uneven split keeps the remainder off the
    # first and last chunk, as Meta's 405B split 7 + 14·8 + 7)
    out += [("interleaved", v) for v in range(2, MAX_VPP + 1) if pp * v <= n_layers]
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


# ------------------------------------------------------------------ records
#: The most layout structures (tp, cp, pp, ep, schedule/vpp) one plan evaluates: beyond it the
#: structures with the highest lower bound on step time are left out and counted in
#: ``stats["unexplored"]`` (the answer stays under a few seconds for any recipe the bounds allow).
MAX_STRUCTURES = 2000
#: ... and the most layouts whose memory it weighs before it stops taking more structures.
MAX_CANDIDATES = 150_000


# ------------------------------------------------------------------ the planner
def plan_layouts(cfg: Config, calibration: Optional[dict] = None, stats: Optional[dict] = None,
                 top: Optional[int] = None, fixed: Optional[dict] = None) -> list[dict]:
    """Every valid layout that fits, best (lowest predicted step time) first.

    Each is a dict: ``degrees``, ``schedule``, ``zero``, ``recompute``, ``micro_batch``,
    ``microbatches``, ``pp_layout``, predictions (``step_time_s``, ``tokens_per_s``, ``mfu``,
    ``bubble``, ``memory`` {params, grads, optimizer, activations, total, capacity, stage},
    ``comm_time_s`` per axis, ``spans``, the step's parts, and the time to train). ``top``: only
    the best ``top`` (structures whose lower bound cannot reach them are skipped). ``fixed``:
    {tp, pp, vpp, cp, ep, dp, schedule, zero, recompute, recompute_every, micro_batch: value} narrows
    the search (each layout also says its ``recompute_every``: k > 1 for full on every k-th layer).
    ``stats`` (a dict) receives ``considered``, ``dropped`` {reason: count}, ``machine``,
    ``listed`` (layouts that fit), ``untimed`` (of those, left untimed as
    they cannot reach the best ``top``), ``unexplored`` (structures left out) and ``seconds`` (CPU)."""
    with gc_paused():
        return _plan_layouts(cfg, calibration, stats, top, fixed)


def _plan_layouts(cfg: Config, calibration: Optional[dict], stats: Optional[dict], top: Optional[int],
                  fixed: Optional[dict]) -> list[dict]:
    """:func:`plan_layouts`, with the collector paused."""
    t0 = time.process_time()
    fixed = dict(fixed or {})
    mach = machine_for(cfg, calibration)
    tot = _totals(cfg, mach)
    dropped: dict[str, int] = {}

    def drop(reason: str, n: int = 1) -> None:
        dropped[reason] = dropped.get(reason, 0) + n

    structs = _structures(cfg, mach, tot, fixed, drop)
    structs.sort(key=lambda st: st.bound)
    unexplored = max(0, len(structs) - MAX_STRUCTURES)
    structs = structs[:MAX_STRUCTURES]
    extra: list[Structure] = []  # the variants weighed (v_balance), after structs in the rows' keys
    n_structs = len(structs)
    recs: list[Candidate] = []
    ctx = _Context(cfg, mach, tot, fixed, drop, {}, [0], {}, [0, 0])
    considered = 0
    capped = unexplored > 0
    best: list[float] = []  # max-heap (negated) of the best ``top`` step times so far
    for key, st in enumerate(structs):
        if top and len(best) >= top and st.bound > -best[0]:
            unexplored += len(structs) - key  # sorted by bound: none of the rest can reach the top
            break
        if ctx.weighed[0] > MAX_CANDIDATES:
            unexplored += len(structs) - key
            capped = True
            break
        refined = functools.partial(refined_bound, ctx.cfg, ctx.mach, ctx.tot)
        if top and len(best) >= top and v_balance.group_exceeds(refined, st, -best[0]):
            unexplored += 1
            continue
        considered += 1
        n0 = len(recs)
        v_balance.plan_group(_plan_structure, ctx, key, st, recs, -best[0] if top and len(best) >= top else math.inf,
                             extra, n_structs, refined)
        if top:
            for t in recs[n0:]:
                if len(best) < top:
                    heapq.heappush(best, -t.step)
                elif t.step < -best[0]:
                    heapq.heapreplace(best, -t.step)
    recs.sort(key=lambda t: (t.step, t.mem.total))  # (the unlisted slower ones: after all of these)
    shown = recs[:top] if top else recs
    out = [materialise(cfg, t, structs + extra, mach, tot, i + 1) for i, t in enumerate(shown)]
    if stats is not None:
        stats.update(considered=considered, dropped=dropped, machine=dataclasses.asdict(mach),
                     seconds=time.process_time() - t0, listed=ctx.fits[0], untimed=ctx.fits[1], unexplored=unexplored,
                     work_bound_hit=capped, fixed=fixed)
    return out


def _totals(cfg: Config, mach: Machine) -> Totals:
    m_ = cfg.model
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    wb, gbb, ob = BYTES_PER_PARAM[precision]
    gb, seq, h, L = cfg.train.global_batch, m_.seq_len, m_.d_model, m_.n_layers
    fpt = cost_mod.flops_per_token(cfg)
    compute = compute_seconds(fpt * gb * seq, gb * seq, cfg, mach)
    rc_frac = {mode: cost_mod.recompute_fraction(cfg, mode, 1, fpt) for mode in RECOMPUTES}
    avail = None if mach.capacity is None else mach.capacity - mach.reserve
    return Totals(wb, gbb, ob, ACT_BYTES[precision], gb, seq, h, compute, fpt * gb * seq, rc_frac, avail)


def _allowed(fixed: dict, name: str, values: list) -> list:
    """``values`` narrowed by ``fixed[name]``: one value, or a list/tuple/set of the allowed ones."""
    if name not in fixed:
        return list(values)
    want = fixed[name]
    ok = set(want) if isinstance(want, (list, tuple, set, frozenset)) else {want}
    return [v for v in values if v in ok]


def _structures(cfg: Config, mach: Machine, tot: Totals, fixed: dict, drop) -> list[Structure]:
    """Every (tp, cp, pp, dp, ep, schedule, vpp) that passes the divisibility rules, with its
    pipeline split and a lower bound on its step time (compute × imbalance × (1 + least bubble))."""
    m_ = cfg.model
    world, dpn, L = mach.world, mach.devices_per_node, m_.n_layers
    device = resolve_device(cfg)
    precision = resolve_precision(cfg, device)
    sp_setting = cfg.parallel.sequence_parallel
    work, head = layer_work(cfg)
    E = m_.moe.num_experts
    split_cache: dict = {}
    muon_cache: dict = {}  # optimizer_step.plan_seconds per distinct pipeline rank
    n_moe = sum(1 for i in range(L) if mem_mod.is_moe_layer(cfg, i))
    scale = fp8_plan.bound_scale(cfg, mach)  # FP8 shortens the GEMMs: the bf16 bound, scaled
    out: list[Structure] = []
    for tp in _allowed(fixed, "tp", [t for t in valid_tp(cfg, world) if world % t == 0]):
        sp = (tp > 1) if sp_setting is None else (bool(sp_setting) and tp > 1)
        padded = int(math.ceil(m_.vocab_size / tp) * tp)
        for cp in _allowed(fixed, "cp", divisors(world // tp)):
            if cp > 1 and (tot.seq % (2 * cp) or (m_.moe.num_experts and (m_.moe.capacity_factor is not None
                                                                         or m_.moe.seq_aux_loss_coef > 0))
                           or m_.mtp.depth):
                continue  # (capacity, the sequence-wise loss or MTP under cp: refused by rules.check_experts /
                # check_model_parts)
            if sp and tot.seq % (cp * tp):
                drop("sequence parallel: seq_len/cp not divisible by tp")
                continue
            no_pp = m_.mtp.depth and m_.tie_embeddings  # refused by rules.check_model_parts
            pps = [p for p in divisors(world // (tp * cp)) if p <= L and not (no_pp and p > 1)]
            for pp in _allowed(fixed, "pp", pps):
                dp = world // (tp * cp * pp)
                if "dp" in fixed and dp != fixed["dp"]:
                    continue
                if tot.gb % dp:
                    drop("global_batch not divisible by dp")
                    continue
                eps = [1] if E == 0 else [e for e in divisors(E) if (dp * cp) % e == 0]
                for ep in _allowed(fixed, "ep", eps):
                    for schedule, vpp in schedule_options(pp, L):
                        if not (_allowed(fixed, "schedule", [schedule]) and _allowed(fixed, "vpp", [vpp])):
                            continue
                        skey = (pp, vpp, schedule in V_SCHEDULES)
                        if skey not in split_cache:
                            split_cache[skey] = best_split(cfg, work, head, pp, vpp, schedule)
                        if split_cache[skey] is None:
                            drop("more pipeline chunks than layers")
                            continue
                        split, imbalance = split_cache[skey]
                        lay = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=dp, world=world, nodes=mach.nodes,
                                     devices_per_node=dpn, schedule=schedule, sequence_parallel=sp,
                                     padded_vocab=padded, device=device, precision=precision,
                                     stage_layers=make_stage_layers(L, split))
                        if why := fp8_plan.refusal(cfg, lay):
                            drop(why)
                            continue
                        least_bubble = cost_mod.bubble_fraction(schedule, pp, tot.gb // dp, vpp)
                        bound = structure_bound(cfg, mach, tot, lay, imbalance, least_bubble, n_moe) * scale
                        out.append(Structure(lay, split, imbalance, axis_spans(tp, pp, cp, dp, ep, dpn), dict(
                            tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=dp), override_prefix(
                            tp, pp, vpp, cp, ep, dp, schedule, split), bound, least_bubble=least_bubble,
                            work_head=(work, head)))
                        st = out[-1]

                        def muon_s(lay_v, st=st):  # Muon's step per ZeRO stage (cost/optimizer_step.py)
                            return optimizer_step.PerZero(lambda z: optimizer_step.plan_seconds(
                                cfg, lay_v, z, mach, st.spans, muon_cache)) \
                                if cfg.train.optimizer == "muon" else {}
                        st.optimizer_s = muon_s(lay)
                        v_balance.add_variants(st, split_cache, lambda lay_v, imb, lb=least_bubble: structure_bound(
                            cfg, mach, tot, lay_v, imb, lb, n_moe) * scale, muon_s)  # a V's lighter ends
    return out


class _Context(NamedTuple):
    cfg: Config
    mach: Machine
    tot: Totals
    fixed: dict
    drop: Any
    act_cache: dict  # (tp, sp, cp > 1, overlap, FSDP shards, ep > 1) -> act_elems_per_token table; shared_memos'
    weighed: list  # [layouts whose memory was weighed so far] (the work bound)
    layer_sums: dict  # peak_memory_every's per-rank layer sums, shared by the plan's structures
    fits: list  # [layouts that fit so far, of which untimed] (stats["listed"], stats["untimed"])


def _every_options(ctx: _Context, ranks: list[RankInfo], recomputes: list) -> list[int]:
    """recompute_every values k > 1 to weigh with recompute=full, largest (fewest layers recomputed)
    first: the divisors of the most layers a rank holds, and 2, 3, 4 (a handful per structure)."""
    if "full" not in recomputes:
        return []
    if "recompute_every" in ctx.fixed:  # given on the command line: that k (or those) only
        want = ctx.fixed["recompute_every"]
        return sorted({int(k) for k in (want if isinstance(want, (list, tuple, set)) else [want]) if k > 1})[::-1]
    n = max(len(rk.layers) for rk in ranks)
    ks = {k for k in divisors(n) if k > 1} | {k for k in (2, 3, 4) if k < n}
    return sorted(ks, reverse=True)


def _partial_full(ctx: _Context, st: Structure, key: int, ranks: list[RankInfo], states: list[tuple],
                  flight: list[tuple], act: dict, ks: list[int], fitted: set, lay_m: tuple,
                  tp_time: Any, layer_sums: Optional[dict] = None, bar_step: float = math.inf,
                  fp8_at: Any = None, memo_of: Any = None) -> Any:
    """recompute=full on every k-th layer (parallel.recompute_every=k): the largest k that fits, as
    it recomputes the fewest layers (least FLOPs and tp/cp/ep traffic of the k's). Skipped once a
    mode that already fits is no dearer in recompute and traffic: none and swiglu always, core_attn
    and selective without cp (their ring rerun is cp traffic full/k may save). Returns True (it fits,
    untimed) where it cannot beat ``bar_step``."""
    tot = ctx.tot
    zero, mb, mm, tokens, dp, bubble, work, ovh_per_m, overlap = lay_m
    cheap = {"none", "swiglu"} | ({"core_attn", "selective"} if st.lay.cp == 1 else set())
    bar = min((tot.rc_frac[m] for m in fitted & cheap), default=math.inf)
    for k in ks:
        rk = recompute_key("full", k)
        if rk not in tot.rc_frac:
            tot.rc_frac[rk] = cost_mod.recompute_fraction(ctx.cfg, "full", k)
        if tot.rc_frac[rk] >= bar:
            return None  # k descends, so the fraction only grows from here
        ctx.weighed[0] += 1
        mem = peak_memory_every(ranks, states, flight, act, k, tokens * tot.ab, layer_sums, ctx.layer_sums,
                                memo_of(k) if memo_of else None, tot.avail)
        if tot.avail is not None and mem.total > tot.avail:
            ctx.drop(f"memory: does not fit (recompute=full, recompute_every={k})")
            continue
        ch = fp8_at(mb, mm, "full", k) if fp8_at else None
        if slower_than(*fp8_plan.less(ch, work, tot.rc_frac[rk]), ovh_per_m * mm, bubble, bar_step):
            return True
        pts, fk = every_points(ctx.cfg, st, ctx.mach, tot.gb, k, zero)  # st.per_ax of full/k (rank 0's)
        line = tuple(sum(v[i] for v in st.per_ax[(overlap, rk, fk)].values()) for i in (0, 1, 2))
        t_tp = tp_time(mb, "full") if overlap else 0.0  # the resolver times tp_overlap as under full
        timed = functools.partial(_timed, st, key, zero, mb, mm, "full", mem, line, t_tp, dp(zero, mm), bubble, work,
                                  ovh_per_m, overlap, tot, ctx.mach, k, ch)
        return every_on_ranks(ctx.cfg, st, ctx.mach, pts, (mm, k, zero, fk),
                              (lambda kinds: tp_time(mb, "full", kinds)) if overlap else None, timed, bar_step)
    return None


def _microbatch_refusal(pp: int, mm: int, schedule: str) -> Optional[str]:
    """Why a schedule cannot run m microbatches on pp stages (None: it can)."""
    if pp == 1:
        return None
    need = 2 * pp if schedule == "dualpipev" else pp
    if mm < need and schedule != "gpipe":
        return f"microbatches m < {'2·pp' if schedule == 'dualpipev' else 'pp'} ({schedule})"
    if schedule == "interleaved" and mm % pp:
        return "interleaved: m not a multiple of pp"
    return None


def _plan_structure(ctx: _Context, key: int, st: Structure, recs: list, bar: float = math.inf) -> None:
    """Every (zero, micro-batch, tp_overlap, recompute) of one structure that fits, timed if it can beat ``bar``."""
    cfg, mach, tot, drop = ctx.cfg, ctx.mach, ctx.tot, ctx.drop
    lay, mtp = st.lay, (1 + cfg.model.mtp.depth, mem_mod.mtp_saved_elems(cfg))  # MTP's blocks, saved elements
    ranks = candidate_ranks(cfg, lay)
    overlaps, fp8_at = fp8_plan.setup(cfg, lay, mach, tot.seq)  # tp_overlap's options; FP8's change (None: bf16)
    if "tp_overlap" in ctx.fixed:
        overlaps = tuple(_allowed(ctx.fixed, "tp_overlap", list(overlaps))) or (False,)
    lines = LazyLines(cfg, st, mach, tot.gb)
    work = structure_work(cfg, mach, tot, lay, st.imbalance)
    ovh_per_m = max(mach.layer_overhead(rk.n_dense, rk.n_moe, lay.tp) for rk in ranks)
    acts = act_tables(cfg, ctx.act_cache, lay, overlaps)
    recomputes = _allowed(ctx.fixed, "recompute", list(RECOMPUTES))
    ks = _every_options(ctx, ranks, recomputes)
    if 1 not in _allowed(ctx.fixed, "recompute_every", [1]):  # full only on every k-th layer
        recomputes = [r for r in recomputes if r != "full"]
    mbs = _allowed(ctx.fixed, "micro_batch", divisors(tot.gb // lay.dp))
    n_var = len(overlaps) * len(recomputes)  # every drop below drops each of these variants
    tp_time = tp_timer(cfg, mach, tot, st, (ranks[0].n_dense, ranks[0].n_moe)) if True in overlaps else None
    copy_terms = mem_mod.autocast_copy_terms(cfg, lay) if lay.precision == "bf16" else None  # fp8 too: bf16 base
    every_sums: dict = {}  # (overlap, zero) -> peak_memory_every's per-layer sums by k
    flights, act_memo = shared_memos(ctx.act_cache, lay, ranks)  # (mb, mode) -> in_flight; (+ overlap, ...) -> acts
    for zero in _allowed(ctx.fixed, "zero", [0, 1, 2] if cfg.model.mtp.depth else [0, 1, 2, 3]):  # MTP: no ZeRO-3
        states = state_table(ranks, lay, zero, tot, copy_terms, fp8_plan.copy_saving_fn(cfg, lay, zero),
                             fp8_plan.fp8_copies_fn(cfg, lay) if copy_terms else None)
        mode = mem_mod.precision_mode(lay.precision, zero, lay.dp * lay.cp)
        rope = table_bytes(cfg, tot.seq / lay.cp, mode)
        fk = fsdp_key(lay, zero)
        if tot.avail is not None and min(s[3] for s in states) > tot.avail:
            drop("memory: model states alone exceed the device", len(mbs) * n_var)
            continue
        for i_mb, mb in enumerate(mbs):
            mm = tot.gb // (mb * lay.dp)
            if why := _microbatch_refusal(lay.pp, mm, lay.schedule):
                drop(why, n_var)
                continue
            n_before = ctx.fits[0]
            tokens = mb * tot.seq / lay.cp
            bubble = cost_mod.bubble_fraction(lay.schedule, lay.pp, mm, lay.vpp)
            flight = flights.get((mb, mode)) or flights.setdefault(  # the same for a precision mode's ZeRO stages
                (mb, mode), in_flight(lay, ranks, mm, tokens, tot.ab, tot.h, rope, mode, *mtp))
            for overlap in overlaps:
                ctx.weighed[0] += len(recomputes)
                fitted = set()
                for recompute in recomputes:
                    mem = peak_memory(ranks, states, flight, acts[(overlap, zero >= 2)], recompute, tokens * tot.ab,
                                      act_memo.setdefault((mb, mode, overlap, zero >= 2, recompute), {}), tot.avail)
                    if tot.avail is not None and mem.total > tot.avail:
                        drop(f"memory: does not fit (recompute={recompute})")
                        continue
                    fitted.add(recompute)
                    ctx.fits[0] += 1
                    ch = fp8_at(mb, mm, recompute) if fp8_at else None
                    if slower_than(*fp8_plan.less(ch, work, tot.rc_frac[recompute]), ovh_per_m * mm, bubble, bar):
                        ctx.fits[1] += 1
                        continue  # fits, but cannot be listed: its traffic is never needed
                    t_tp = tp_time(mb, recompute) if overlap else 0.0
                    line = lines.line(overlap, recompute, fk)
                    tp_of = (lambda kinds, mb=mb, rc=recompute: tp_time(mb, rc, kinds)) if overlap else None
                    timed = functools.partial(_timed, st, key, zero, mb, mm, recompute, mem, line, t_tp, lines.dp_at(
                        zero, mm), bubble, work, ovh_per_m, overlap, tot, mach, fp8=ch)
                    c = timed_on_ranks(cfg, st, mach, lines, (mm, recompute, zero, fk), tp_of, timed, bar)
                    ctx.fits[1] += c is None  # fits, but cannot be listed on rank 0's step alone
                    recs.extend(() if c is None else (c,))
                if ks:
                    c = _partial_full(ctx, st, key, ranks, states, flight, acts[(overlap, zero >= 2)], ks, fitted,
                                      (zero, mb, mm, tokens, lines.dp_at, bubble, work, ovh_per_m, overlap),
                                      tp_time, every_sums.setdefault((overlap, zero), {}), bar, fp8_at,
                                      lambda k, key=(mb, mode, overlap, zero >= 2): act_memo.setdefault(key + (k,), {}))
                    if c is not None:
                        ctx.fits[0] += 1
                        ctx.fits[1] += c is True
                        if c is not True:
                            recs.append(c)
            if ctx.fits[0] == n_before and tot.avail is not None and i_mb + 1 < len(mbs):
                # nothing fits at this micro-batch: a larger one holds at least as many activations
                drop("memory: does not fit (a smaller micro-batch did not)", (len(mbs) - i_mb - 1) * n_var)
                break


def _timed(st: Structure, key: int, zero: int, mb: int, mm: int, recompute: str, mem: MemPick,
           line: tuple, t_tp: float, dp: tuple, bubble: float, work: float, ovh_per_m: float, overlap: bool,
           tot: Totals, mach: Machine, every: int = 1, fp8: Any = None, inner_of: Any = None) -> Candidate:
    """The step time of one layout from its parts (the module docstring; ``inner_of``: rank_time's);
    ``fp8``: its FP8 change (fp8_time.Fp8Step), less work and recompute, the bf16 step beside it."""
    (fixed, per_m, per_inv), t_dp = line, 0.0  # dp: each timed rank's (dp, reduce) seconds; the max shows
    fixed += per_inv / mm  # DualPipeV's rerun traffic (planner.comm.comm_line), at this m
    recomp, ovh = work * tot.rc_frac[recompute_key(recompute, every)], ovh_per_m * mm

    def step_of(work: float, recomp: float) -> tuple[float, float, float]:
        inner = inner_of(work, recomp) + ovh
        dp_exposed, t_dp_ = dp_exposed_max(dp, zero, st.lay.pp, work + recomp, mm, mach)
        return inner * (1 + bubble) + dp_exposed + st.optimizer_s.get(zero, 0.0), inner, dp_exposed, t_dp_

    (step, inner, dp_exposed, t_dp), extra = step_of(work, recomp), None  # + Muon's step
    if fp8 is not None:
        extra = (step, work + recomp, fp8)
        step, inner, dp_exposed, _ = step_of(work - fp8.save_work, recomp - fp8.save_recompute)
    return Candidate(step, key, zero, mb, mm, recompute, mem, fixed + t_tp, per_m, t_dp,
                     dp_exposed, bubble, recomp, inner * bubble, tot.compute * (st.imbalance - 1), ovh, overlap, t_tp,
                     every, extra)


def predict(cfg: Config, calibration: Optional[dict] = None) -> dict:
    """The cost model's prediction for the config's own layout (for calibration): memory from
    ``resolve()`` (the same numbers the planner mirrors), time from the same terms as the ranking
    (``paralayer.resolve.cost.step_time``). Raises ValueError if the layout is not valid."""
    from paralayer.resolve.plan import resolve

    plan = resolve(cfg)
    if plan.errors:
        raise ValueError(f"invalid layout: {plan.errors}")
    return time_plan(cfg, plan, machine_for(cfg, calibration))


__all__ = ["plan_layouts", "predict", "config_for", "machine_for", "Machine", "LOCAL_CALIBRATION",
           "balanced_split", "comm_seconds", "wire_factor"]
