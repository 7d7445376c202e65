"""What run health costs: the per-rank timing gather and the profiler, as ratios of step time.

    python benchmarks/health_overhead.py [--steps 14] [--repeats 3]

The tiny recipe as plain data parallel on 2 gloo ranks (one thread each), train() on forked
ranks. A step's wall time is the time between consecutive ``before_forward`` hooks on rank 0
(so it includes everything the loop does between steps: the gather, logging, the watchdog's
beat); the first 2 and the last step are left out, the median is taken, and the variants run
interleaved (A, B, C, A, B, C, ...) so that the machine's load hits them alike:

- ``gather every step``: ``train.log_every=1`` (the default: every step is a logged step);
- ``gather once``: ``train.log_every=1000`` (the gather runs only at the last step);
- ``profiler on``: as the first, with ``logging.profile`` tracing every measured step on rank 0.

It also times the gather alone (200 calls of paralayer.metrics.rank_timing.gather on 2 ranks) and
the waited-for exchange alone (200 calls of paralayer.metrics.waited_for.owed on 2 ranks, each
with 16 collective arrivals and 8 point-to-point posts, as a dp2 step of this recipe records).
Prints a markdown table for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch._dynamo  # noqa: E402,F401 - imported once, before the ranks fork
import torch.profiler  # noqa: E402,F401

from tests.dist import cfg_and_plan, run_ranks  # noqa: E402

BASE = ["recipe=tiny", "parallel.tp=1", "parallel.dp=2", "logging.wandb.mode=disabled", "logging.progress=false"]


def _steps(rank, world, overrides):
    from paralayer.runtime import train as T

    marks: list[float] = []

    class Marks(T.StepHooks):
        def before_forward(self, r, step):
            marks.append(time.perf_counter())

    cfg, plan = cfg_and_plan(BASE + overrides)
    with tempfile.TemporaryDirectory() as d:
        T.train(cfg, plan, d, hooks=Marks())
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    return gaps[2:-1]


def _gather(rank, world, n):
    import torch

    from paralayer.metrics.rank_timing import gather

    dev = torch.device("cpu")
    for _ in range(10):
        gather([0.1, 0.2, 0.3, 0.4], dev)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        gather([0.1, 0.2, 0.3, 0.4], dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _exchange(rank, world, n):
    import torch
    import torch.distributed as dist

    from paralayer.metrics.waited_for import owed
    from paralayer.parallel.comm_trace import CommTrace

    trace = CommTrace(rank)
    trace.match({"dp_cp": dist.group.WORLD})
    dev = torch.device("cpu")
    out = []
    for i in range(n + 10):
        trace.new_step(i)
        for _ in range(16):
            trace.arrive(trace.axis_groups["dp_cp"])
        for k in range(8):
            trace.posted(1 - rank, 0, k % 2 == 0)[4] = time.monotonic()
        t = time.perf_counter()
        owed(trace, dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out[10:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    steps = [f"train.steps={a.steps}"]
    variants = {
        "gather every step": steps + ["train.log_every=1"],
        "gather once": steps + ["train.log_every=1000"],
        "profiler on (rank 0)": steps + ["train.log_every=1", "logging.profile.start=1",
                                          f"logging.profile.steps={a.steps}"],
    }
    gaps: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.repeats):
        for name, ov in variants.items():
            gaps[name] += run_ranks(_steps, 2, ov, timeout_s=600)[0]
    med = {k: statistics.median(v) for k, v in gaps.items()}
    g = run_ranks(_gather, 2, 200)[0]
    x = run_ranks(_exchange, 2, 200)[0]
    base = med["gather once"]
    print("| variant | median step wall (s) | ratio to gather once | steps |\n|---|---:|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.4f} | {v / base:.3f} | {len(gaps[k])} |")
    print(f"\nthe gather alone: median {g * 1e3:.3f} ms = {g / med['gather every step']:.4f} of a step")
    print(f"the waited-for exchange alone: median {x * 1e3:.3f} ms = {x / med['gather every step']:.4f} of a step")


if __name__ == "__main__":
    main()
