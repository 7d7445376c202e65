"""A blend's resume at position 2·10⁹: the stored schedule state against replaying from 0 (issue #37).

    python benchmarks/blend_resume.py [--position 2e9] [--repeats 5]

Replay: the draws per second of ``_Schedule`` from position 0 (measured over 10⁶ positions), and
what a replay to the position would cost at that rate. Resume: ``load_state_dict`` of the state a
checkpoint at that position holds, then one global batch (``assign``), median of the repeats.

The state at 2·10⁹ cannot be replayed here (hours), so it is built from the schedule's period:
with weights k_s / D (integers k_s), Tijdeman's bound |c_s − w_s·t| < 1 forces c_s = k_s·m exactly
at t = m·D, and the deficits and deadlines the rule compares repeat with period D. The script
checks that on the replay itself (at m·D for m up to 2·10⁴, and the batch after it against the
batch after the first period), then resumes at the largest multiple of D at or below the position
and draws on to it and one batch past it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paralayer.data.blend import _Schedule  # noqa: E402

WEIGHTS = [1, 1, 1, 21, 21]  # the vector that separates Tijdeman's rule from the plain one (D = 45)
BATCH = 2048  # sequences per step (Llama 3 405B's global batch)


def replay_rate(n: int = 1_000_000) -> float:
    """Seconds per position of a replay from 0."""
    t = time.perf_counter()
    _Schedule(WEIGHTS).counts_at(n)
    return (time.perf_counter() - t) / n


def period_state(m: int) -> dict:
    """The state at m·D (D = sum of the integer weights): counts k_s·m."""
    d = sum(WEIGHTS)
    s = _Schedule(WEIGHTS)
    return {"weights": s.w, "pos": m * d, "counts": [k * m for k in WEIGHTS]}


def check_period(max_m: int = 20_000) -> None:
    """The period holds on the replay: the counts at m·D, and the draws of the batch after it."""
    d = sum(WEIGHTS)
    s = _Schedule(WEIGHTS)
    first = _Schedule(WEIGHTS).assign(d, BATCH)[0].tolist()
    for m in (1, 2, 7, 100, 1000, max_m):
        assert s.counts_at(m * d) == period_state(m)["counts"], m
    again = s.assign(max_m * d, BATCH)[0].tolist()
    assert again == first, "the draws after m·D differ from those after D"


def resume_seconds(position: int, repeats: int) -> tuple[float, list]:
    d = sum(WEIGHTS)
    m = position // d
    times, src = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        s = _Schedule(WEIGHTS)
        assert s.load_state_dict(period_state(m))
        src, _ = s.assign(position, BATCH)  # draws from m·D to the position, then the batch
        times.append(time.perf_counter() - t)
    # the batch at the position is the batch at the same offset in the first periods
    ref = _Schedule(WEIGHTS).assign(d + position % d, BATCH)[0].tolist()
    assert src.tolist() == ref, "the resumed batch differs from the replayed one at the same phase"
    return statistics.median(times), times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--position", type=float, default=2e9)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    position = int(a.position)
    rate = replay_rate()
    check_period()
    med, times = resume_seconds(position, a.repeats)
    print(f"weights {WEIGHTS}, batch {BATCH}, position {position:,}")
    print(f"replay from 0: {rate * 1e6:.2f} µs a position -> {rate * position / 3600:.2f} h to reach the position")
    print(f"resume from the stored state: median {med * 1e3:.2f} ms over {a.repeats} "
          f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}); ratio {rate * position / med:,.0f}x")
    print("period check: counts at m·45 = k·m on the replay (m up to 20,000); resumed batch = replayed batch")
    return 0 if med < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
