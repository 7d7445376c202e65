"""The planner's step before the bubble: the slowest pipeline rank's, as the dry run times it.

Why its own module: ``step_time.time_plan`` takes the max over the ranks of
``cost.rank_groups.timing_ranks`` of each rank's compute and its own traffic, less what
parallel.pp_overlap hides (``step_time.rank_inner``); the ranking does the same from the
structure's per-rank communication lines (``planner.comm``), so a listed row and ``predict()``
agree. Torch-free.
"""
from __future__ import annotations

import math
from typing import Callable

from paralayer.config import Config
from paralayer.resolve.cost.machine import Machine
from paralayer.resolve.cost.rank_groups import timing_ranks
from paralayer.resolve.cost.step_time import fb_overlap_facts, rank_inner
from paralayer.resolve.planner.bounds import SLACK
from paralayer.resolve.planner.comm import (
    RANK_AXES,
    at_m,
    comm_points,
    fsdp_key,
    rank_line_table,
    set_axes,
    with_ranks,
)
from paralayer.resolve.planner.types import Structure
from paralayer.resolve.rules import overlap_refusal


def pp_overlap_on(cfg: Config, st: Structure, zero: int) -> bool:
    """Whether the resolver turns parallel.pp_overlap on for this layout (rules.check_overlap)."""
    lay = st.lay
    return cfg.parallel.pp_overlap is not False and overlap_refusal(cfg, lay.schedule, lay.ep, lay.tp, lay.cp,
                                                                    zero) is None


def inner_of(cfg: Config, st: Structure, mach: Machine, rank_lines: tuple, mm: int, recompute: str, every: int,
             zero: int, tp_of: Callable | None) -> Callable[[float, float], float]:
    """(the busiest rank's work, its recompute) → the slowest rank's work + recompute + exposed traffic
    at m = ``mm``; ``tp_of(kinds)``: a rank's exposed tp seconds under tp_overlap (None: its line)."""
    reps, lines = rank_lines
    lay = st.lay
    overlap = st.inner_memo.get(("pp_overlap", zero))
    if overlap is None:
        overlap = st.inner_memo[("pp_overlap", zero)] = pp_overlap_on(cfg, st, zero)
    if overlap and any(q[0] not in st.fb_facts for q in reps):
        work, head = st.work_head
        total = sum(work) + head
        st.fb_facts.update({q[0]: fb_overlap_facts(cfg, lay, q[0], work, head, total) for q in reps
                            if q[0] not in st.fb_facts})
    full = recompute == "full"
    k = max(every, 1)
    # the ranks' seconds at m (not tp_overlap's, which depend on the micro-batch): once per lines and m
    hit = st.inner_memo.get((id(lines), mm, overlap)) if tp_of is None else None
    if hit is not None and hit[0] is lines:
        prepared = hit[1]
    else:
        prepared = []
        for r, share, _, kinds in reps:
            ln = lines[r]
            t = {ax: at_m(ln[ax], mm) for ax in RANK_AXES}
            if tp_of is not None:
                t["tp"] = tp_of(kinds)
            n_ep, n_pp = (at_m(ln[n], mm) for n in ("n_ep", "n_pp"))
            prepared.append((r, share, t, st.fb_facts.get(r) if overlap else None, n_ep, n_pp))
        if tp_of is None:
            st.inner_memo[(id(lines), mm, overlap)] = (lines, prepared)

    def inner(work: float, recomp: float) -> float:
        mean = work / st.imbalance
        return max(rank_inner(mean * share, recomp / st.imbalance * share, t, facts, r, lay.pp, mm, mean,
                              n_ep, n_pp, lambda i: full and i % k == 0, mach.comm_sm_fraction)[0]
                   for r, share, t, facts, n_ep, n_pp in prepared)

    return inner


def timed_on_ranks(cfg: Config, st: Structure, mach: Machine, lines, at: tuple, tp_of: Callable | None,
                   timed: Callable, bar: float):
    """``timed(inner_of=...)`` (search._timed's Candidate) over every timed rank, or None where the step
    on rank 0's work and traffic alone already exceeds ``bar``: the step is the max over the ranks, so
    it cannot be listed, and no other rank's traffic is computed for it (``lines``: planner.lazy_lines).
    ``at``: (microbatches, recompute, zero, FSDP key)."""
    mm, recompute, zero, fk = at
    first = lines.first_rank_lines(recompute, fk) if bar < math.inf else None
    if first is not None and timed(inner_of=inner_of(cfg, st, mach, first, mm, recompute, 1, zero,
                                                     tp_of)).step * SLACK > bar:
        return None
    return timed(inner_of=inner_of(cfg, st, mach, lines.rank_lines(recompute, fk), mm, recompute, 1, zero, tp_of))


def every_points(cfg: Config, st: Structure, mach: Machine, gb: int, k: int, zero: int) -> tuple[list, bool]:
    """(comm_points of recompute=full on every k-th layer, rank 0's alone; the FSDP key of ``zero``),
    once per structure, k and FSDP key (``st.per_ax`` set from them): :func:`every_on_ranks` adds the
    other ranks where needed."""
    fk = fsdp_key(st.lay, zero)
    key = ("every_pts", k, fk)
    if key not in st.inner_memo:
        st.inner_memo[key] = comm_points(cfg, st, mach, gb, "full", 2 if fk else 0, k, ranks=False)
        set_axes(st, (f"full/{k}", fk), st.inner_memo[key])
    return st.inner_memo[key], fk


def every_on_ranks(cfg: Config, st: Structure, mach: Machine, pts: list, at: tuple, tp_of: Callable | None,
                   timed: Callable, bar: float):
    """:func:`timed_on_ranks` for recompute=full on every k-th layer (search._partial_full), from
    :func:`every_points`' ``pts``: every other timed rank's ``cost.comm`` only where rank 0's step does
    not exceed ``bar``. Where it does, the Candidate returned is timed on rank 0's traffic alone: a
    lower bound of its step and over ``bar``, so it is never listed nor enters the best ``top`` (the
    bar only falls), and it is counted as the exhaustive one was (stats["listed"]).
    ``timed``: search._timed less its ``inner_of``; ``at``: (microbatches, k, zero, FSDP key)."""
    mm, k, zero, fk = at
    rk = f"full/{k}"
    if (rk, fk) not in st.rank_lines:
        reps = timing_ranks(cfg, st.lay, *st.work_head, prune=True)  # rank 0's entry: the same under any k
        if bar < math.inf and reps[0][0] == 0:
            c = timed(inner_of=inner_of(cfg, st, mach, ((reps[0],), rank_line_table(pts, reps[:1])), mm, "full",
                                        k, zero, tp_of))
            if c.step * SLACK > bar:
                return c
        set_axes(st, (rk, fk), with_ranks(cfg, st, mach, pts))
    return timed(inner_of=inner_of(cfg, st, mach, st.rank_lines[(rk, fk)], mm, "full", k, zero, tp_of))


__all__ = ["every_on_ranks", "every_points", "inner_of", "pp_overlap_on", "timed_on_ranks"]
