"""Microbatches in flight per chunk (virtual stage) on a rank of the interleaved 1F1B schedule.

Why its own module: under the interleaved schedule a rank holds v chunks, and they do not hold
equal numbers of microbatches: rank r's last round of warm-up forwards runs its first chunks only,
so at the first backward the last rank holds p microbatches of each earlier chunk and one of its
last. Counting (w + 1)/v whole-rank sets (w the warm-up) is right only when the chunks weigh the
same; where they do not (a last chunk lightened for the head, dense layers first, MTP blocks
last) the rank's peak is Σ_c held_c · set_c at the worst backward (kimi-k2's last pp rank
rehearsed 1.169× the per-rank count). The order is torch's own
(``torch.distributed.pipelining.schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations``
with ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``), walked as counts only, without torch (the
resolver imports none); tests/test_interleaved_flight.py holds it equal to torch's order.
"""
from __future__ import annotations

from functools import lru_cache
from operator import ge


def interleaved_order(p: int, m: int, v: int, r: int) -> list[tuple[str, int]]:
    """Rank r's actions as (kind, local chunk): F (forward) and B (full backward), in torch's order
    (its padding no-ops dropped). Local chunk c is global stage c·p + r."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - r), m * v)
    total = m * v

    def fwd_chunk(step: int) -> int:
        return (step // per_round) % v

    def bwd_chunk(step: int) -> int:
        return v - 1 - ((step - warmup) // per_round) % v

    out: list[tuple[str, int]] = []
    for op in range(total + warmup):
        if op < warmup:
            out.append(("F", fwd_chunk(op)))
        elif op < total:
            out.append(("F", fwd_chunk(op)))
            out.append(("B", bwd_chunk(op)))
        else:
            out.append(("B", bwd_chunk(op)))
    return out


def moments(p: int, m: int, v: int, r: int) -> tuple[tuple[int, ...], ...]:
    """The chunk-microbatches each local chunk holds at rank r's backward passes (those whose
    forward ran and whose backward has not ended, the one running included), reduced to the ones
    no other backward holds at least as many of on every chunk: the peak of Σ_c held_c · set_c is
    at one of them, whatever the sets. Past v + 1 rounds of p microbatches the order only repeats
    its steady round (the counts back where they were), so m is capped there (equal for every m
    up to 3v + 7 rounds, p 2..16, v 2..6: tests/test_interleaved_flight.py): the planner asks for
    every rank of every candidate."""
    if m // max(1, m // p) == p and m // p > v + 1:  # whole rounds of p (every m past p² is)
        m = (v + 1) * p
    return _moments(p, m, v, r)


@lru_cache(maxsize=8192)
def _moments(p: int, m: int, v: int, r: int) -> tuple[tuple[int, ...], ...]:
    last, other, _ = _split(p, m, v, r)
    return tuple(sorted(hull(front(list(last) + list(other)))))


def split_moments(p: int, m: int, v: int, r: int) -> tuple[tuple, tuple, tuple]:
    """:func:`moments` apart by the chunk whose backward runs: (the rank's last chunk's, the
    others', and the others' one chunk at a time). On the last pipeline rank the last chunk's
    backward first frees its microbatch's logits and head; an earlier chunk's frees nothing; each
    chunk's recomputed layer has its own transient (:func:`peak`)."""
    if m // max(1, m // p) == p and m // p > v + 1:
        m = (v + 1) * p
    return _split(p, m, v, r)


@lru_cache(maxsize=8192)
def _split(p: int, m: int, v: int, r: int) -> tuple[tuple, tuple, tuple]:
    held = [0] * v
    seen: list[set] = [set() for _ in range(v)]
    for kind, c in interleaved_order(p, m, v, r):
        if kind == "F":
            held[c] += 1
        else:
            seen[c].add(tuple(held))
            held[c] -= 1
    other = set().union(*seen[:-1])
    return (tuple(sorted(hull(front(seen[-1])))), tuple(sorted(hull(front(other)))),
            tuple(tuple(sorted(hull(front(x)))) for x in seen[:-1]))


def peak(split: tuple, sets: list[float], head: float, transient: "float | list") -> tuple[float, float]:
    """(peak, saved) bytes of a rank: ``sets`` each chunk's bytes a microbatch (the last one's
    with the head's), at its backwards (:func:`split_moments`); a recomputed layer's ``transient``
    (one, or one per chunk: activations.chunk_transients) beside them at its chunk's backwards,
    less the head at the last chunk's backward (it frees its own first)."""
    ts = list(transient) if isinstance(transient, (list, tuple)) else [transient] * len(sets)
    last, other = peak_held(split[0], sets), peak_held(split[1], sets)
    if all(t == ts[0] for t in ts[:-1]):  # the earlier chunks' transients alike: their moments as one
        top = other + ts[0]
    else:
        top = max(peak_held(mo, sets) + t for mo, t in zip(split[2], ts))
    return max(top, last + max(ts[-1] - head, 0.0)), max(last, other)


def front(held: "set | list") -> list:
    """The count tuples no other one holds at least as many of on every chunk (the Pareto front)."""
    ts = sorted(set(held), key=sum, reverse=True)
    out: list = []
    for a in ts:
        if not any(all(map(ge, b, a)) for b in out):  # map(ge): the planner's deep splits, ~3x the generator
            out.append(a)
    return out


def hull(pts: list) -> list:
    """With two chunks, the front's points that a Σ held_c · set_c with sets ≥ 0 can peak at: the
    corners of its upper hull (a point at or below the segment of its neighbours never holds more
    than both). The max over them is the max over all: fewer moments for the planner to weigh.
    With more chunks the front stays whole."""
    if not pts or len(pts[0]) != 2:
        return list(pts)
    out: list = []
    for pt in sorted(pts, key=lambda q: (-q[0], q[1])):  # chunk 0 falling, chunk 1 rising
        while len(out) >= 2:
            (a0, a1), (b0, b1) = out[-2], out[-1]
            # drop the middle one when it lies on or below the segment from out[-2] to pt
            if (b0 - a0) * (pt[1] - a1) - (b1 - a1) * (pt[0] - a0) >= 0:
                out.pop()
            else:
                break
        out.append(pt)
    return out


def peak_held(moments_: "tuple | list", saved: list[float]) -> float:
    """The largest Σ_c held_c · saved_c over the moments: the bytes held at the rank's worst
    backward (the resolver and the planner both sum through here)."""
    return peak_held_at(moments_, saved)[0]


def peak_held_at(moments_: "tuple | list", saved: list[float]) -> tuple[float, int]:
    """:func:`peak_held` and the index of the moment that holds it. Chunks of equal sets are summed
    first (each moment's counts per distinct set, their front and hull, :func:`_grouped`): many
    chunks of one weight are few sums to weigh."""
    if len(saved) > 2 and len(moments_) > 2:
        pattern = tuple(saved.index(x) for x in saved)  # each chunk's first chunk of equal bytes
        if len(set(pattern)) < len(saved):
            key = (id(moments_), pattern)
            hit = _GROUPED.get(key)
            if hit is None or hit[0] is not moments_:  # the moments are the caches' own tuples
                if len(_GROUPED) > 4096:
                    _GROUPED.clear()
                hit = _GROUPED[key] = (moments_, *_grouped(tuple(moments_), pattern))
            _, kept, idx, groups = hit
            best, at = _scan(kept, [saved[g] for g in groups])
            return best, idx[at]
    return _scan(moments_, saved)


#: :func:`_grouped` by the identity of the moments (cached tuples) and the pattern: a bounded memo
#: of pure results (no state that changes an answer), kept beside lru_cache's to skip hashing the
#: moments on every call (the planner weighs ~10⁵ of them a plan)
_GROUPED: dict = {}


def _grouped(moments_: tuple, pattern: tuple) -> tuple[tuple, tuple, tuple]:
    """The moments' counts summed over chunks of equal sets (``pattern``: a chunk's first equal
    one), reduced to their front (and upper hull with two groups), each with the index of a moment
    it came from."""
    groups = tuple(sorted(set(pattern)))
    proj: dict = {}
    for j, held in enumerate(moments_):
        sums = [0] * len(groups)
        for h, g in zip(held, pattern):
            sums[groups.index(g)] += h
        proj.setdefault(tuple(sums), j)
    kept = tuple(hull(front(list(proj))))
    return kept, tuple(proj[t] for t in kept), groups


def _scan(moments_: "tuple | list", saved: list[float]) -> tuple[float, int]:
    best, at = 0.0, 0
    for j, held in enumerate(moments_):
        x = 0.0
        for n, b in zip(held, saved):
            x += n * b
        if x > best:
            best, at = x, j
    return best, at
