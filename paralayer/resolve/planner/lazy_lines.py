"""The planner's communication lines, computed only when a layout needs them (issue #37 item 6).

Why: ``planner.comm.comm_lines`` evaluated ``cost.comm`` for every traffic class and ZeRO stage of a
structure up front (~a third of ``--plan`` for 405B), yet with ``top`` most layouts that fit are
already slower, before any traffic, than the best ``top`` found so far: their compute, recompute,
dispatch and bubble alone exceed it (every omitted term, comm and exposed dp, is ≥ 0). Their
lines are never needed. This gives the same lines as ``comm_lines`` — the same ``comm_points``
call for each (class, zero), the same zero's dp line from the same class — on first use.
"""
from __future__ import annotations

from typing import Optional

from paralayer.config import Config
from paralayer.resolve.cost.machine import Machine
from paralayer.resolve.cost.rank_groups import timing_ranks
from paralayer.resolve.planner.comm import (
    COMM_CLASS,
    comm_points,
    dp_rank_lines,
    first_zero,
    fsdp_able,
    rank_line_table,
    set_axes,
    with_ranks,
)
from paralayer.resolve.planner.types import Structure

CLASSES = ("none", "core_attn", "full")


class LazyLines:
    """``comm_lines``'s dp lines and ``st.per_ax`` entries, each filled on first use."""

    def __init__(self, cfg: Config, st: Structure, mach: Machine, gb: int) -> None:
        self.cfg, self.st, self.mach, self.gb = cfg, st, mach, gb
        self.pts: dict = {}  # (class, zero) -> comm_points
        self.dp: dict = {}  # zero -> (dp line, grad reduce-scatter line)
        self.lin: dict = {}
        self.first: dict = {}  # (recompute, fk) -> first_rank_lines
        self.dp_cache: dict = {}  # (zero, m) -> (dp seconds, grad reduce-scatter seconds)  # (overlap, recompute, fk) -> (fixed, per m), summed over the axes
        fks = (False, True) if fsdp_able(st.lay) else (False,)
        self.zero_of: dict = {}  # (fk, class) -> the zero comm_lines evaluated that class at
        self.dp_from: dict = {}  # zero -> (class, zero) whose points give its dp line (comm_lines' order)
        for fk in fks:
            zs = ([2, 3] if fk else [0, 1]) if len(fks) == 2 else [0, 1, 2, 3]
            for i, cls in enumerate(CLASSES):
                zero_ = zs[min(i, len(zs) - 1)]
                self.zero_of[(fk, cls)] = zero_
                self.dp_from.setdefault(zero_, (cls, zero_))
        for zero_ in range(4):
            self.dp_from.setdefault(zero_, ("none", zero_))

    def points(self, cls: str, zero: int, ranks: bool = True) -> list:
        """comm_points of (class, zero), the refined bound's where they are those; ``ranks``: with
        every timed rank's traffic (the dp lines need rank 0's alone)."""
        key = (cls, zero)
        if key not in self.pts:
            st = self.st
            if cls == "none" and zero == first_zero(st.lay) and st.first_pts is not None:
                self.pts[key] = st.first_pts
            else:
                self.pts[key] = comm_points(self.cfg, st, self.mach, self.gb, cls, zero, ranks=False)
        return with_ranks(self.cfg, self.st, self.mach, self.pts[key]) if ranks else self.pts[key]

    def dp_line(self, zero: int) -> tuple:
        """((dp line, grad reduce-scatter line), ...): rank 0's and every other timed rank's (dp_rank_lines)."""
        if zero not in self.dp:
            pts = self.points(*self.dp_from[zero], ranks=False)
            self.dp[zero] = dp_rank_lines(self.cfg, self.st, self.mach, pts)
        return self.dp[zero]

    def dp_at(self, zero: int, mm: int) -> tuple:
        """((dp seconds, grad reduce-scatter seconds), ...) per timed rank at m microbatches, once per (zero, m)."""
        if (zero, mm) not in self.dp_cache:
            self.dp_cache[(zero, mm)] = tuple((dpf + dpm * mm, rdf + rdm * mm)
                                              for (dpf, dpm), (rdf, rdm) in self.dp_line(zero))
        return self.dp_cache[(zero, mm)]

    def line(self, overlap: bool, recompute: str, fk: bool) -> tuple:
        """(fixed, per m, per 1/m) of tp+pp+cp+ep (pp+cp+ep under tp_overlap) for a plain recompute mode."""
        key = (overlap, recompute, fk)
        if key not in self.lin:
            if (overlap, recompute, fk) not in self.st.per_ax:
                cls = COMM_CLASS[recompute]
                set_axes(self.st, (recompute, fk), self.points(cls, self.zero_of[(fk, cls)], ranks=False))
            t = self.st.per_ax[key]
            self.lin[key] = tuple(sum(v[i] for v in t.values()) for i in (0, 1, 2))
        return self.lin[key]

    def rank_lines(self, recompute: str, fk: bool) -> tuple:
        """``st.rank_lines`` of a plain recompute mode: every timed rank's lines (``planner.comm``)."""
        if (recompute, fk) not in self.st.rank_lines:
            cls = COMM_CLASS[recompute]
            set_axes(self.st, (recompute, fk), self.points(cls, self.zero_of[(fk, cls)]))
        return self.st.rank_lines[(recompute, fk)]

    def first_rank_lines(self, recompute: str, fk: bool) -> Optional[tuple]:
        """Rank 0's lines alone, as ``rank_lines`` would hold them (its rank group's entry first), from
        the points rank 0's ``cost.comm`` already gave: its step is a lower bound on the slowest
        rank's, so a layout that cannot beat the bar on it needs no other rank's traffic. None: rank
        0 is not the first timed rank."""
        if (recompute, fk) not in self.first:
            cls = COMM_CLASS[recompute]
            pts = self.points(cls, self.zero_of[(fk, cls)], ranks=False)
            reps = timing_ranks(self.cfg, self.st.lay, *self.st.work_head, prune=True)  # every 1: no k in its key
            self.first[(recompute, fk)] = ((reps[0],), rank_line_table(pts, reps[:1])) if reps[0][0] == 0 else None
        return self.first[(recompute, fk)]
