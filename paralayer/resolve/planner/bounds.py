"""The planner's lower bounds on step time: what lets it skip work that cannot change its answer.

Why they are their own module: each must never exceed the step ``search._timed`` computes for
any layout it covers (or the top N would differ from the exhaustive ranking's), and that is
easier to check with the bounds side by side: per structure (``structure_bound``, then
``refined_bound`` with its least traffic) and per layout (``slower_than``: the step without its
terms that are ≥ 0, so a layout that fits is left untimed, its traffic never computed).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve.cost.machine import Machine
from paralayer.resolve.cost.split import rank_work
from paralayer.resolve.cost.step_time import replicated_elementwise_seconds
from paralayer.resolve.planner.comm import affine_line, comm_points, first_zero, rank_points, tp_overlap_options
from paralayer.resolve.planner.types import Structure, Totals
from paralayer.resolve.rules import Layout, overlap_refusal


def structure_work(cfg: Config, mach: Machine, tot: Totals, lay: Layout, imbalance: float) -> float:
    """The compute term of a structure: the step's compute with what tp without SP replicates
    (the non-SP elementwise kernels), times the busiest pipeline rank's imbalance."""
    return (tot.compute + replicated_elementwise_seconds(cfg, mach, lay.tp, lay.sequence_parallel)) * imbalance


def structure_bound(cfg: Config, mach: Machine, tot: Totals, lay: Layout, imbalance: float,
                     least_bubble: float, n_moe: int) -> float:
    """A lower bound on the step time of any layout of this structure: its compute (with what tp
    without SP replicates) × imbalance, plus the per-microbatch layer overhead (dispatch, weights
    streamed through HBM) at the fewest microbatches the schedule runs and an average rank's layers
    (the busiest holds at least as many), all × (1 + the least bubble). Each term is at its least
    over the structure's choices, so no layout of it is faster (``_timed``'s formula)."""
    work = structure_work(cfg, mach, tot, lay, imbalance)
    pp = lay.pp
    least_m = 1 if pp == 1 or lay.schedule == "gpipe" else (2 * pp if lay.schedule == "dualpipev" else pp)
    n_dense = cfg.model.n_layers - n_moe
    ovh = mach.layer_overhead(n_dense / pp, n_moe / pp, lay.tp) * least_m
    return (work + ovh) * (1 + least_bubble)


#: A layout is left untimed only when its lower bound exceeds the bar by more than float rounding.
SLACK = 1.0 - 1e-9


def slower_than(work: float, recomp: float, ovh: float, bubble: float, bar: float) -> bool:
    """Whether a layout cannot beat ``bar`` (the ``top``-th best step so far): ``_timed``'s step
    without its terms that are ≥ 0 (tp/pp/cp/ep seconds, exposed dp) already exceeds it."""
    return (work + recomp + ovh) * (1 + bubble) * SLACK > bar


def refined_bound(cfg: Config, mach: Machine, tot: Totals, st: Structure) -> float:
    """A tighter lower bound on the structure's step time: its compute and least bubble, plus the
    pp/cp/ep traffic (and tp's, where tp_overlap cannot hide it) at recompute=none — every other
    setting only adds to them — at the fewest microbatches, of the busiest pipeline rank. Keeps the
    comm points for reuse."""
    work, head = st.work_head
    rw = rank_work(work, head, st.split, st.lay.pp, st.lay.schedule)
    busiest = max(range(len(rw)), key=rw.__getitem__)
    if busiest == 0:
        pts = st.first_pts = comm_points(cfg, st, mach, tot.gb, "none", first_zero(st.lay), only_rank=0)
    else:  # its traffic alone: rank 0's cost.comm waits until the structure is planned
        pts = rank_points(cfg, st, mach, tot.gb, "none", first_zero(st.lay), busiest)
    hideable_tp = True in tp_overlap_options(st.lay, mach, cfg.model.mla.kv_lora_rank > 0)
    # the busiest rank's traffic (the step is at least that rank's; rank_groups: its group's share is
    # the imbalance); pp and ep not where parallel.pp_overlap may hide them
    lay = st.lay
    hideable_ep = cfg.parallel.pp_overlap is not False and overlap_refusal(cfg, lay.schedule, lay.ep, lay.tp,
                                                                           lay.cp, 0) is None
    comm = 0.0
    for ax in (() if hideable_ep else ("pp", "ep")) + ("cp",) + (() if hideable_tp else ("tp",)):
        fixed, per_m = affine_line(pts, (busiest, ax))
        comm += max(0.0, min(fixed + per_m, fixed + per_m * pts[0][0]))
    return st.bound + comm * (1.0 + st.least_bubble)
