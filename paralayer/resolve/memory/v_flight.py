"""Microbatches in flight at each backward pass of the V schedules (zbv, dualpipev), per chunk.

Why its own module: under the V schedules a rank holds two chunks, and the peak is not one count
times one saved set. A full backward recomputes one layer at a time, while a split pass (an input
or weight pass) keeps its whole chunk's recomputed sets (``activations.recompute_transient``),
and torch's orders run some split passes when fewer microbatches are in flight: DualPipeV's last
rank holds 2p + 1 chunk-microbatches around its full backwards but only p at its split passes.
The memory plan takes the largest of these moments (:func:`v_peak`, with each pass's transient:
``transients.split_transient`` for a split pass; activations re-exports it).

The orders are torch's own (``torch.distributed.pipelining.schedules``: ScheduleDualPipeV and
ScheduleZBVZeroBubble ``_calculate_single_rank_operations``), walked here as counts only, without
torch (the resolver imports none); tests/test_v_flight.py holds them equal to torch's for
p = 2..16 and several m.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple


class Moment(NamedTuple):
    """One backward pass of the rank's order: the chunk it runs (0: the rank's first chunk r,
    1: its second, 2p − 1 − r), whether it is a split pass, and the chunk-microbatches each of
    the two chunks holds then (those whose forward ran and whose full backward or weight pass
    has not)."""

    chunk: int
    split: bool
    held0: int
    held1: int


def v_order(schedule: str, p: int, m: int, r: int) -> list[tuple[str, int]]:
    """Rank r's actions as (kind, local chunk): F, B (a full backward), I (input pass), W (weight
    pass), in torch's order; overlapped F;B pairs are the F then the B."""
    if schedule == "dualpipev":
        return _dualpipev(p, m, r)
    if schedule == "zbv":
        return _zbv(p, m, r)
    raise ValueError(f"not a V schedule: {schedule}")


def _dualpipev(p: int, m: int, r: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    queue: list[int] = []  # chunks of the input passes whose weight pass is pending, oldest first

    def act(kind: str, c: int) -> None:
        out.append((kind, c))
        if kind == "I":
            queue.append(c)

    def weight() -> None:
        if queue:
            out.append(("W", queue.pop(0)))

    for _ in range((p - r - 1) * 2):
        act("F", 0)
    for _ in range(r + 1):
        act("F", 0)
        act("F", 1)
    for _ in range(p - r - 1):
        act("I", 1)
        weight()
        act("F", 1)
    for _ in range(m - 2 * p + r + 1):
        act("F", 0)
        act("B", 1)  # the last rank's first pair runs unoverlapped: the same two, in this order
        act("F", 1)
        act("B", 0)
    for _ in range(p - r - 1):
        act("B", 1)
        act("F", 1)
        act("B", 0)
    zb = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zb = True
        act("I" if zb else "B", 1)
        if i == steps // 2 and r % 2 == 0:
            zb = True
        act("I" if zb else "B", 0)
    for _ in range(p - r - 1):
        weight()
        act("I" if zb else "B", 0)
    for _ in range(r + 1):
        weight()
    return out


def _zbv(p: int, m: int, r: int) -> list[tuple[str, int]]:
    n = max(2 * p - 1, m)  # torch pads the order to 2p − 1 microbatches and drops the padding
    out: list[tuple[str, int]] = []

    def act(kind: str, c: int, index: int) -> None:
        if index < m:
            out.append((kind, c))

    f = [0, 0]
    b = [0, 0]

    def fwd(c: int) -> None:
        act("F", c, f[c])
        f[c] += 1

    def inp(c: int) -> None:
        act("I", c, b[c])

    for _ in range(2 * (p - r) - 1):
        fwd(0)
    for _ in range(r):
        fwd(1)
        fwd(0)
    for _ in range(p - r):
        fwd(1)
        inp(1)
        act("W", 1, b[1])
        b[1] += 1
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            fwd(0)
        inp(0)
        act("W", 0, b[0])
        b[0] += 1
        fwd(1)
        inp(1)
        act("W", 1, b[1])
        b[1] += 1
    w = list(b)
    for _ in range(r):
        inp(0)
        b[0] += 1
        inp(1)
        b[1] += 1
    for _ in range(p - r):
        inp(0)
        b[0] += 1
        act("W", 0, w[0])
        w[0] += 1
    while w[1] < b[1]:
        act("W", 1, w[1])
        w[1] += 1
    while w[0] < b[0]:
        act("W", 0, w[0])
        w[0] += 1
    return out


def moments(schedule: str, p: int, m: int, r: int) -> tuple[Moment, ...]:
    """The backward passes of rank r that can hold its peak: for each (chunk, split) the counts
    no other pass of the same kind holds at least as many of on both chunks. Past 2p + 2
    microbatches the orders only repeat their steady round (a forward and a backward per chunk,
    the counts back where they were), so m is capped there (tests/test_v_flight.py: equal for
    every m up to 8p): the planner asks for every rank of every candidate."""
    return _moments(schedule, p, min(m, 2 * p + 2), r)


@lru_cache(maxsize=8192)
def _moments(schedule: str, p: int, m: int, r: int) -> tuple[Moment, ...]:
    held = [0, 0]
    seen: dict[tuple[int, bool], set[tuple[int, int]]] = {}
    for kind, c in v_order(schedule, p, m, r):
        if kind == "F":
            held[c] += 1
            continue
        seen.setdefault((c, kind != "B"), set()).add((held[0], held[1]))
        if kind in ("B", "W"):
            held[c] -= 1
    out = []
    for (c, split), pairs in sorted(seen.items()):
        best1 = -1  # the Pareto front: by held0 descending, each pair holding more of chunk 1
        front = []
        for a, b in sorted(pairs, reverse=True):
            if b > best1:
                front.append(Moment(c, split, a, b))
                best1 = b
        out += sorted(front, key=lambda mo: (mo.held0, mo.held1))
    return tuple(out)


def v_peak(moments: tuple, saved: list, fixed: float, split_t: list, full_t: list) -> tuple[float, float, int]:
    """(peak, saved) bytes over a V-schedule rank's backward passes (``v_flight.moments``), and the
    index of the pass that holds the peak: the chunk-microbatches each chunk holds times its
    ``saved`` bytes, plus ``fixed``, plus the pass's transient (``split_t`` of its chunk for an
    input or weight pass, ``full_t`` for a full backward). The resolver and the planner
    (planner.memory) both sum through here."""
    peak, kept, at = 0.0, 0.0, 0
    for j, mo in enumerate(moments):
        held = mo.held0 * saved[0] + (mo.held1 * saved[1] if len(saved) > 1 else 0.0) + fixed
        t = split_t if mo.split else full_t
        v = held + (t[mo.chunk] if mo.chunk < len(t) else 0.0)
        if v > peak:
            peak, at = v, j
        if held > kept:
            kept = held
    return peak, kept, at
