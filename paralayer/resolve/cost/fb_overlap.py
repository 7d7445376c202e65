"""What DualPipe's overlapped forward-backward hides, per pipeline rank (``parallel.pp_overlap``).

Why its own file: the dry run (``step_time.time_plan``) and the planner's ranking must charge the
same exposed seconds, and the model is small enough to check by hand (tests/test_fb_overlap.py).

torch's ScheduleDualPipeV places the pairs (``OVERLAP_F_B``): on rank r with chunks c0 = r and
c1 = 2·pp − 1 − r, its steady state runs ``F(c0)+B(c1)`` and ``F(c1)+B(c0)`` pairs, one
microbatch's forward beside another's full backward (:func:`pair_counts`, read off torch's
``_calculate_single_rank_operations``); the warm-up and cool-down actions run alone, with no
partner to hide under. In a pair each half's expert all-to-alls (dispatch and combine; the
backward's rerun forward's under full recompute) and its pipeline send travel while the other half
computes (paralayer/parallel/pipeline/overlap.py). A pair with compute K and communication C:

    exposed = max(0, C − K)        hidden = C − exposed = min(C, K)

and while the communication runs, its kernels take ``f`` of the device (``cluster.comm_sm_fraction``:
DeepSeek-V3 gave 20 of the H800's 132 SMs to communication, arXiv 2412.19437 §3.2.1), so the
compute beside it runs at 1 − f: the pair takes max(C, K + f·C), and ``slowdown`` is what that adds
beyond K + exposed. The pair's hidden seconds are split over the axes (ep, pp) as their traffic is.
Torch-free.
"""
from __future__ import annotations

from typing import NamedTuple


def pair_counts(pp: int, m: int, r: int) -> tuple[int, int]:
    """(``F(c0)+B(c1)`` pairs, ``F(c1)+B(c0)`` pairs) that torch's ScheduleDualPipeV runs on pipeline
    rank r with m microbatches: step 4 holds m − 2·pp + r + 1 of each (the last rank runs its
    first ``F(c0)``, ``B(c1)`` apart, to shorten the bubble), step 5 pp − r − 1 more ``F(c1)+B(c0)``."""
    main = max(m - 2 * pp + r + 1, 0)
    first = main - (1 if r == pp - 1 and main else 0)
    return first, main + max(pp - r - 1, 0)


class Half(NamedTuple):
    """One chunk's half of a pair, per microbatch: its compute seconds and its traffic seconds by axis."""

    compute_s: float
    comm_s: dict


class Exposure(NamedTuple):
    """A rank's overlapped traffic per step: by axis, what its pairs carried (``paired_s``), hid and
    left exposed; ``slowdown_s``: the compute the communication kernels slowed beside it."""

    paired_s: dict
    hidden_s: dict
    exposed_s: dict
    slowdown_s: float


def pair(fwd: Half, bwd: Half, sm_fraction: float) -> tuple[dict, dict, float]:
    """One overlapped pair: (comm by axis, hidden by axis, slowdown seconds) — the module docstring."""
    axes = set(fwd.comm_s) | set(bwd.comm_s)
    comm = {ax: fwd.comm_s.get(ax, 0.0) + bwd.comm_s.get(ax, 0.0) for ax in axes}
    c = sum(comm.values())
    k = fwd.compute_s + bwd.compute_s
    exposed = max(0.0, c - k)
    hidden = c - exposed
    slowdown = max(c, k + sm_fraction * c) - k - exposed
    share = {ax: (hidden * v / c if c > 0 else 0.0) for ax, v in comm.items()}
    return comm, share, slowdown


def rank_exposure(counts: tuple[int, int], c0: tuple[Half, Half], c1: tuple[Half, Half],
                  sm_fraction: float) -> Exposure:
    """The rank's pairs: ``counts`` from :func:`pair_counts`; ``c0``, ``c1``: (forward, backward)
    halves of its two chunks. ``exposed_s`` here is the PAIRED traffic left exposed; the caller adds
    the traffic outside the pairs (warm-up, cool-down, receives), which stays whole."""
    n_a, n_b = counts
    paired: dict = {}
    hidden: dict = {}
    slow = 0.0
    for n, (f, b) in ((n_a, (c0[0], c1[1])), (n_b, (c1[0], c0[1]))):
        if n <= 0:
            continue
        comm, hid, s = pair(f, b, sm_fraction)
        for ax in comm:
            paired[ax] = paired.get(ax, 0.0) + n * comm[ax]
            hidden[ax] = hidden.get(ax, 0.0) + n * hid[ax]
        slow += n * s
    return Exposure(paired, hidden, {ax: paired[ax] - hidden[ax] for ax in paired}, slow)


__all__ = ["pair_counts", "Half", "Exposure", "pair", "rank_exposure"]
