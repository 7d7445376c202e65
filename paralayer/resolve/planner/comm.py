"""The planner's communication lines: every axis's seconds per step as an affine function of the
microbatch count m, from the resolver's own ``cost.comm`` evaluated at two values of m.

Why it is its own module: the search (``planner``) needs each axis's time for thousands of
(zero, micro-batch, recompute) choices of one structure; two calls of ``cost.comm`` per traffic
class give all of them (bytes of tp/pp/cp/ep are fixed by the step's tokens, counts scale with m).
"""
from __future__ import annotations

from typing import Callable, Optional

from paralayer.config import Config
from paralayer.config.schema import RECOMPUTE
from paralayer.resolve import cost as cost_mod
from paralayer.resolve import memory as mem_mod
from paralayer.resolve.cost.entry import exchanges
from paralayer.resolve.cost.machine import Machine, comm_seconds, dp_reduce_seconds, rerun_seconds, tp_overlap_seconds
from paralayer.resolve.cost.rank_groups import timing_ranks
from paralayer.resolve.cost.split import layer_work
from paralayer.resolve.planner.types import Structure
from paralayer.resolve.rules import V_SCHEDULES, Layout, divisors

#: the modes the planner weighs: all but norm_up, which is refused under tp and cp (axes the search
#: spans; config/validate.py) and planned where given (--dry-run, --rehearse)
RECOMPUTES = tuple(m for m in RECOMPUTE if m != "norm_up")
# recompute modes with the same traffic in cost.comm: swiglu reruns no collective, selective's reruns
# are core_attn's (the cp ring), full reruns the whole layer's
COMM_CLASS = {"none": "none", "swiglu": "none", "core_attn": "core_attn", "selective": "core_attn", "full": "full"}
AXES = ("tp", "pp", "cp", "ep", "dp")
RANK_AXES = ("tp", "pp", "cp", "ep")


def recompute_key(recompute: str, every: int) -> str:
    """The key of a recompute choice in ``rc_frac`` and ``per_ax``: the mode, or full/k."""
    return recompute if every == 1 else f"{recompute}/{every}"


def tp_overlap_options(lay: Layout, mach: Machine, mla: bool = False) -> tuple:
    """tp_overlap variants to list: both where the runtime can fuse (tp > 1 with SP, not V: the
    runtime runs each ring once under V too, parallel/backward_pass.py, but listing the pair moves
    picks, e.g. 70B at tp_overlap ≤ 0.5 to zbv tp 4 × pp 4, and waits on the planner's memory
    agreeing with the resolver's for the layouts it would then list)."""
    ok = lay.tp > 1 and lay.sequence_parallel and lay.schedule not in V_SCHEDULES and mach.tp_overlap > 0 \
        and not mla  # not built for MLA (rules.check_sequence_parallel)
    return (False, True) if ok else (False,)


def tp_timer(cfg: Config, mach: Machine, tot, st: Structure, first: tuple) -> Callable:
    """tp_overlap's exposed tp seconds (``machine.tp_overlap_seconds``) of a rank of ``kinds`` (dense,
    MoE) blocks (``first``: rank 0's), any zero: once per (micro-batch, recompute, kinds)."""
    lay = st.lay
    split = lay.schedule in V_SCHEDULES and lay.pp > 1
    ring_flops = {rc: cost_mod.tp_ring_flops(cfg, lay.tp, rc, split) for rc in RECOMPUTES}
    cache: dict = {}

    def tp_time(mb: int, recompute: str, kinds: tuple = ()) -> float:
        key = (mb, recompute, kinds or first)
        if key not in cache:
            cache[key] = tp_overlap_seconds(ring_flops[recompute], *key[2], mb * tot.seq / lay.cp,
                                            tot.gb // (mb * lay.dp), lay.tp, tot.h, tot.ab, recompute == "full", mach,
                                            st.spans["tp"])
        return cache[key]

    return tp_time


def comm_lines(cfg: Config, st: Structure, mach: Machine, gb: int, overlaps: tuple) -> dict:
    """Communication per step as lines in the microbatch count m, from the resolver's own
    ``cost.comm`` at two values of m per (recompute, zero): every axis's time is affine in m (bytes
    of tp/pp/cp/ep are fixed by the step's tokens, counts scale with m, ZeRO-3 gathers per
    microbatch). Fills ``st.per_ax``; returns {zero: (dp line, grad reduce-scatter line)}.
    tp_overlap's exposed tp time is not affine in m: it is computed per micro-batch size later."""
    dp_line = {}
    fks = (False, True) if fsdp_able(st.lay) else (False,)
    for fk in fks:
        # the zeros with this precision mode, spread over the traffic classes so each zero's dp line comes once
        zs = ([2, 3] if fk else [0, 1]) if len(fks) == 2 else [0, 1, 2, 3]
        for i, cls in enumerate(("none", "core_attn", "full")):
            zero_ = zs[min(i, len(zs) - 1)]
            if cls == "none" and zero_ == first_zero(st.lay) and st.first_pts is not None:
                pts = with_ranks(cfg, st, mach, st.first_pts)
            else:
                pts = comm_points(cfg, st, mach, gb, cls, zero_)
            for recompute in RECOMPUTES:
                if COMM_CLASS[recompute] == cls:
                    set_axes(st, (recompute, fk), pts)
            dp_line.setdefault(zero_, (affine_line(pts, "dp"), affine_line(pts, "dp_reduce")))
    for zero_ in range(4):
        if zero_ not in dp_line:
            pts = comm_points(cfg, st, mach, gb, "none", zero_, ranks=False)
            dp_line[zero_] = (affine_line(pts, "dp"), affine_line(pts, "dp_reduce"))
    return dp_line


def fsdp_able(lay: Layout) -> bool:
    """Whether ZeRO 2/3 runs bf16 as FSDP2's mixed precision here (bf16 stream) where ZeRO 0/1
    autocasts (fp32 stream): then tp, pp and cp traffic depend on the ZeRO stage."""
    return mem_mod.precision_mode(lay.precision, 2, lay.dp * lay.cp) == "bf16-fsdp"


def fsdp_key(lay: Layout, zero: int) -> bool:
    return zero >= 2 and fsdp_able(lay)


def first_zero(lay: Layout) -> int:
    """The ZeRO stage whose tp/pp/cp/ep traffic is least (bf16 under FSDP moves half autocast's)."""
    return 2 if fsdp_able(lay) else 0


def set_axes(st: Structure, key: tuple, pts: list) -> None:
    """st.per_ax for (recompute key, FSDP key), without and with tp_overlap (pp, cp, ep the same;
    tp under tp_overlap is timed per micro-batch size)."""
    rk, fk = key
    if (False, rk, fk) not in st.per_ax:
        st.per_ax[(False, rk, fk)] = {ax: comm_line(pts, ax) for ax in ("tp", "pp", "cp", "ep")}
        st.per_ax[(True, rk, fk)] = {ax: st.per_ax[(False, rk, fk)][ax] for ax in ("pp", "cp", "ep")}
    if key not in st.rank_lines and not pts[0][1]["partial"]:  # every timed rank's, once they are in pts
        st.rank_lines[key] = (pts[0][1]["ranks"], rank_line_table(pts, pts[0][1]["ranks"]))


def rank_line_table(pts: list, reps: tuple) -> dict:
    """{rank: {axis or n_ep/n_pp: (fixed, per m, per 1/m)}} of ``reps`` from ``pts``."""
    return {q[0]: {ax: comm_line(pts, (q[0], ax)) for ax in RANK_AXES + ("n_ep", "n_pp")} for q in reps}


def comm_points(cfg: Config, st: Structure, mach: Machine, gb: int, recompute: str, zero: int,
                 every: int = 1, only_rank: Optional[int] = None, ranks: bool = True) -> list:
    """Every axis's seconds per step at micro-batch 1 and the next micro-batch size: [(m, {axis: s})],
    rank 0's, and each timed rank's under (rank, axis) (``only_rank``: that rank's alone, for a
    bound; ``t["partial"]`` says so; ``ranks=False``: rank 0's alone, for the dp lines).
    :func:`with_ranks` adds the other timed ranks later, so one ``cost.comm`` of rank 0 serves all."""
    lay = st.lay
    m1 = gb // lay.dp
    mb2 = next((q for q in divisors(gb // lay.dp) if q > 1), 1)
    pts = []
    if not st.work_head:
        st.work_head = layer_work(cfg)
    for mb_, mm_ in ((1, m1), (mb2, gb // (lay.dp * mb2))):
        _set(lay, mb_, mm_, recompute, zero, every)
        c = cost_mod.comm(cfg, lay)
        t = {ax: comm_seconds(c[ax], st.spans[ax], mach, ax) for ax in AXES}
        _reruns(t, c, st, mach)
        t["dp_reduce"] = dp_reduce_seconds(c["dp"], st.spans["dp"], mach)
        # rank 0's own lines are its axes' (the same call); its all-to-alls and sends for pp_overlap
        t.update({(0, ax): t[ax] for ax in RANK_AXES})
        t.update({("1/m", (0, ax)): t[("1/m", ax)] for ax in RANK_AXES if ("1/m", ax) in t})
        t[(0, "n_ep")], t[(0, "n_pp")] = exchanges(c["ep"]), c["pp"]["count_per_step"]
        t["args"], t["partial"], t["ranks"] = (mb_, recompute, zero, every), True, ((0,),)
        pts.append((mm_, t))
    _set(lay, 1, m1, "none", 0, 1)
    if only_rank is not None:
        _add_ranks(cfg, st, mach, pts, ((only_rank,),))
    elif ranks:
        with_ranks(cfg, st, mach, pts)
    return pts


def dp_rank_lines(cfg: Config, st: Structure, mach: Machine, pts: list) -> tuple:
    """((dp line, grad reduce-scatter line), ...): rank 0's from ``pts`` (:func:`comm_points`), then each
    other timed rank's (``cost.dp_comm`` at the same two points): the ranks differ in dp bytes under pp
    and the step's dp term is the max over them (cost/step_time.py, the same ranks' max)."""
    lay, span = st.lay, st.spans["dp"]
    out = [(affine_line(pts, "dp"), affine_line(pts, "dp_reduce"))]
    others = [q[0] for q in timing_ranks(cfg, lay, *st.work_head, prune=True) if q[0]] if lay.pp > 1 else []
    for r in others:
        vals = []
        for mm_, t in pts:
            mb_, recompute, zero, every = t["args"]
            _set(lay, mb_, mm_, recompute, zero, every)
            e = cost_mod.dp_comm(cfg, lay, r)
            vals.append((mm_, {"dp": comm_seconds(e, span, mach, "dp"), "dp_reduce": dp_reduce_seconds(e, span, mach)}))
        _set(lay, 1, pts[0][0], "none", 0, 1)
        out.append((affine_line(vals, "dp"), affine_line(vals, "dp_reduce")))
    return tuple(out)


def rank_points(cfg: Config, st: Structure, mach: Machine, gb: int, recompute: str, zero: int, rank: int) -> list:
    """One pipeline rank's (rank, axis) seconds at :func:`comm_points`' two micro-batch sizes, without
    rank 0's ``cost.comm`` (the refined bound's busiest rank; memoised, so the same floats later)."""
    lay = st.lay
    m1 = gb // lay.dp
    mb2 = next((q for q in divisors(gb // lay.dp) if q > 1), 1)
    pts = [(mm_, {"args": (mb_, recompute, zero, 1)}) for mb_, mm_ in ((1, m1), (mb2, gb // (lay.dp * mb2)))]
    _add_ranks(cfg, st, mach, pts, ((rank,),))
    return pts


def with_ranks(cfg: Config, st: Structure, mach: Machine, pts: list) -> list:
    """``pts`` (of :func:`comm_points`) with every timed rank's traffic (cost/rank_groups.py: the step
    is the slowest rank's), and its all-to-alls and sends (what parallel.pp_overlap's pairs hide is
    per collective); added in place, once."""
    if not pts[0][1]["partial"]:
        return pts
    lay = st.lay
    _, recompute, zero, every = pts[0][1]["args"]
    _set(lay, 1, pts[0][0], recompute, zero, every)
    reps = timing_ranks(cfg, lay, *st.work_head, prune=True)
    _set(lay, 1, pts[0][0], "none", 0, 1)
    _add_ranks(cfg, st, mach, pts, reps)
    for _, t in pts:
        t["partial"], t["ranks"] = False, reps
    return pts


def _add_ranks(cfg: Config, st: Structure, mach: Machine, pts: list, reps: tuple) -> None:
    """Each of ``reps``' (rank, axis) seconds at both points. A rank's tp/pp/cp/ep traffic depends on the
    recompute class only through reruns (cp's ring under core_attn, every axis under full) and on ZeRO
    only through FSDP's bf16 stream: memoised by those, across classes and ZeRO stages."""
    lay = st.lay
    m1 = pts[0][0]
    for mm_, t in pts:
        mb_, recompute, zero, every = t["args"]
        key = None
        for q in reps:
            if (q[0], "tp") in t:
                continue
            if key is None:
                _set(lay, mb_, mm_, recompute, zero, every)
                key = (mb_, mm_, recompute if (recompute == "full" or lay.cp > 1) else "none", every,
                       fsdp_key(lay, zero))
            got = st.rank_memo.get((q[0],) + key)
            if got is None:
                cr = cost_mod.comm(cfg, lay, q[0], with_dp=False)
                got = {ax: comm_seconds(cr[ax], st.spans[ax], mach, ax) for ax in RANK_AXES}
                _reruns(got, cr, st, mach)
                got["n_ep"], got["n_pp"] = exchanges(cr["ep"]), cr["pp"]["count_per_step"]
                st.rank_memo[(q[0],) + key] = got
            for ax, v in got.items():
                t[("1/m", (q[0], ax[1])) if isinstance(ax, tuple) else (q[0], ax)] = v
    _set(lay, 1, m1, "none", 0, 1)


def _set(lay: Layout, mb: int, mm: int, recompute: str, zero: int, every: int) -> None:
    lay.micro_batch, lay.microbatches, lay.recompute, lay.zero, lay.recompute_every = mb, mm, recompute, zero, every


def _reruns(t: dict, c: dict, st: Structure, mach: Machine) -> None:
    """Under DualPipeV, each axis's seconds of the split backwards' second reruns at this point, under
    ("1/m", axis): their count is the chunks', so their bytes go as the micro-batch, 1/m at a fixed
    batch (cost.terms._with_reruns); ZB-V's go as m, affine like the rest."""
    if st.lay.schedule != "dualpipev":
        return
    for ax in RANK_AXES:
        s = rerun_seconds(c[ax], st.spans[ax], mach, ax)
        if s:
            t[("1/m", ax)] = s


def comm_line(pts: list, ax) -> tuple[float, float, float]:
    """(fixed, per microbatch, per 1/m) seconds of an axis from its times at two microbatch counts:
    affine, plus the DualPipeV reruns' share (:func:`_reruns`), a + b/m through its two values."""
    (ma, ta), (mb, tb) = pts
    ra, rb = ta.get(("1/m", ax), 0.0), tb.get(("1/m", ax), 0.0)
    if (not ra and not rb) or ma == mb:
        return affine_line(pts, ax) + (0.0,)
    inv = (ra - rb) / (1 / ma - 1 / mb)
    slope = ((ta[ax] - ra) - (tb[ax] - rb)) / (ma - mb)
    return (ta[ax] - slope * ma - inv / ma, slope, inv)


def at_m(line: tuple, m: float) -> float:
    """A :func:`comm_line` (or an affine pair) at m microbatches."""
    return line[0] + line[1] * m + (line[2] / m if len(line) > 2 and line[2] else 0.0)


def affine_line(pts: list, ax: str) -> tuple[float, float]:
    """(fixed, per microbatch) seconds of an axis from its times at two microbatch counts."""
    (ma, ta), (mb, tb) = pts
    if ma == mb:
        return (ta[ax], 0.0)
    slope = (ta[ax] - tb[ax]) / (ma - mb)
    return (ta[ax] - slope * ma, slope)

