"""Measured pipeline bubble against the formula (p−1)/m (pp=2 on this machine's CPU, gloo).

    python benchmarks/bubble.py [--schedules 1f1b,gpipe] [--ms 2,4,8,16] [--steps 5] [--png docs/pipeline-timeline.png]

Each configuration starts pp gloo ranks (one thread each), runs 2 warm-up steps and ``--steps``
measured steps, and reports the median of ``PipelineRunner.bubble_measured`` (the definition is
in paralayer/parallel/pipeline/runner.py and docs/pipeline.md). The microbatch is fixed (so m grows
with the batch, as in the schedule papers). Prints a markdown table; writes a timeline PNG of
one measured step.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from paralayer.config import ModelConfig  # noqa: E402
from paralayer.model.transformer import Transformer, init_weights, lm_loss  # noqa: E402
from paralayer.parallel import pipeline as pl  # noqa: E402
from paralayer.parallel.pipeline import timeline as tl  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

CFG = dict(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=688, vocab_size=256, seq_len=128)
MB = 8


def predicted(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The plan's formula: (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved."""
    return (p - 1) / (v * m) if schedule == "interleaved" else (p - 1) / m


def simulate(events_by_stage):
    """Replay the recorded action order with the measured durations, zero communication time and
    no gaps: what the bubble would be from the schedule and the stage (im)balance alone."""
    rows = [sorted(r, key=lambda e: e["start"]) for r in events_by_stage]
    n_chunks = 1 + max(e["chunk"] for r in rows for e in r)
    end: dict = {}
    ptr = [0] * len(rows)
    free = [0.0] * len(rows)
    out = [[] for _ in rows]
    left = sum(len(r) for r in rows)
    while left:
        progressed = False
        for k, row in enumerate(rows):
            while ptr[k] < len(row):
                e = row[ptr[k]]
                a, i, c = e["action"], e["mb"], e["chunk"]
                dep = (("F", i, c - 1) if c > 0 else None) if a == "F" else \
                      (("B", i, c + 1) if c < n_chunks - 1 else ("F", i, c)) if a == "B" else ("B", i, c)
                if dep is not None and dep not in end:
                    break
                start = max(free[k], end[dep] if dep is not None else 0.0)
                stop = start + (e["end"] - e["start"])
                end[(a, i, c)] = stop
                free[k] = stop
                out[k].append(dict(e, start=start, end=stop))
                ptr[k] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("timeline has a dependency cycle")
    return out


def _worker(rank, world, schedule, m, steps, warmup, mb=MB):
    cfg = ModelConfig(**CFG)
    plan = {"degrees": {"pp": world, "vpp": pl.chunks_per_rank(schedule)}, "microbatches": m,
            "schedule": schedule, "stage_layers": pl.default_stage_layers(cfg.n_layers, world, 1, schedule)}
    with torch.device("meta"):
        model = Transformer(cfg)
    chunks = pl.split_model(model, plan, rank)
    for c in chunks:
        c.to_empty(device="cpu")
        init_weights(c, cfg, 0)
    runner = pl.PipelineRunner(chunks, dist.group.WORLD, plan, lambda lg, lb: lm_loss(lg, lb, cfg.vocab_size))
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (m * mb, cfg.seq_len + 1), generator=g)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    bubbles, times, timelines = [], [], []
    for i in range(warmup + steps):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        runner.step(tokens, labels)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            bubbles.append(runner.bubble_measured)
            timelines.append(runner.gather_timeline())
    med = statistics.median(bubbles)
    k = min(range(len(bubbles)), key=lambda j: abs(bubbles[j] - med))
    busy_f = [e["end"] - e["start"] for e in runner.last_timeline if e["action"] == "F"]
    busy_b = [e["end"] - e["start"] for e in runner.last_timeline if e["action"] == "B"]
    sims = [tl.bubble_from_timelines(simulate(t)) for t in timelines]
    busy = [sum(e["end"] - e["start"] for e in row) for row in timelines[k]]
    jit = statistics.median(period_jitter(t, world) for t in timelines)
    return {"bubbles": bubbles, "times": times, "timeline": timelines[k], "bubble_of_timeline": bubbles[k],
            "period_cv": jit,
            "simulated": statistics.median(sims), "imbalance": max(busy) / (sum(busy) / len(busy)) - 1,
            "f_ms": 1e3 * statistics.median(busy_f), "b_ms": 1e3 * statistics.median(busy_b)}


def period_jitter(events_by_stage, p: int) -> float:
    """Coefficient of variation of the steady-state period (one microbatch's F + B on a stage),
    pooled over stages: the first and last p microbatches (fill, drain) left out."""
    cvs = []
    for row in events_by_stage:
        per_mb: dict = {}
        for e in row:
            per_mb[e["mb"]] = per_mb.get(e["mb"], 0.0) + (e["end"] - e["start"])
        mbs = sorted(per_mb)[p:-p] if len(per_mb) > 2 * p + 1 else sorted(per_mb)
        v = [per_mb[i] for i in mbs]
        if len(v) > 1:
            cvs.append(statistics.pstdev(v) / statistics.mean(v))
    return statistics.mean(cvs) if cvs else 0.0


def lockstep_excess(cv: float) -> float:
    """Extra idle per unit of work that jitter alone adds to a 2-stage 1F1B steady state: each
    period both stages must finish before either goes on, so the faster one waits |T0 − T1|; with
    independent periods of relative spread cv that is E|T0 − T1| = 2·cv/√π of a period, for one of
    the two stages — cv/√π averaged over the stages."""
    return cv / math.sqrt(math.pi)


def solo_jitter(n: int = 30, mb: int = MB) -> float:
    """The machine's own jitter: one process, nothing else running, the same half-model's forward
    + backward repeated; the coefficient of variation of its duration."""
    cfg = ModelConfig(**dict(CFG, n_layers=CFG["n_layers"] // 2))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    init_weights(model, cfg, 0)
    x = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_len))
    ts = []
    for i in range(n + 3):
        t0 = time.perf_counter()
        model(x).float().sum().backward()
        if i >= 3:
            ts.append(time.perf_counter() - t0)
    return statistics.pstdev(ts) / statistics.mean(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--ms", default="2,4,8,16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mb", type=int, default=MB, help="sequences per microbatch")
    ap.add_argument("--png", default="docs/pipeline-timeline.png")
    ap.add_argument("--png-schedule", default="1f1b")
    ap.add_argument("--png-m", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with torch.device("meta"):  # warm torch's meta-op imports once, before the ranks fork
        Transformer(ModelConfig(**CFG))
    p = args.pp
    rows = []
    png_timeline = None
    print(f"pp={p}, model d={CFG['d_model']} L={CFG['n_layers']} s={CFG['seq_len']}, microbatch {args.mb} sequences, "
          f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank; median of {args.steps} steps after "
          f"{args.warmup} warm-up\n", flush=True)
    cv_solo = solo_jitter()
    print(f"machine jitter: one process alone, the same forward + backward 30 times: "
          f"coefficient of variation {cv_solo:.3f}\n", flush=True)
    print("| schedule | m | predicted (p−1)/m | measured (median) | measured / predicted | min–max | "
          "replayed, no comm. | stage imbalance | period cv | formula + jitter | measured / (formula + jitter) | "
          "F / B per microbatch (ms) | step (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for schedule in args.schedules.split(","):
        for m in (int(x) for x in args.ms.split(",")):
            out = run_ranks(_worker, p, schedule, m, args.steps, args.warmup, args.mb, timeout_s=900)
            r0 = out[0]
            b = statistics.median(r0["bubbles"])
            pred = predicted(schedule, p, m)
            if schedule == "1f1b" and p == 2:  # the lock-step model is 2-stage 1F1B's
                pj = pred + lockstep_excess(r0["period_cv"])
                jit_cols = f"{pj:.3f} | {b / pj:.2f}"
            else:
                jit_cols = "- | -"
            rows.append((schedule, m, pred, b))
            print(f"| {schedule} | {m} | {pred:.3f} | {b:.3f} | {b / pred:.2f} | "
                  f"{min(r0['bubbles']):.3f}–{max(r0['bubbles']):.3f} | {r0['simulated']:.3f} | "
                  f"{100 * r0['imbalance']:.0f}% | {r0['period_cv']:.3f} | {jit_cols} | "
                  f"{out[-1]['f_ms']:.1f} / {out[-1]['b_ms']:.1f} | {1e3 * statistics.median(r0['times']):.0f} |",
                  flush=True)
            if schedule == args.png_schedule and m == args.png_m:
                png_timeline = (r0["timeline"], r0["bubble_of_timeline"])
    if png_timeline is not None and args.png:
        os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
        events, b = png_timeline
        tl.plot_timeline(events, args.png, title=f"{args.png_schedule}, pp={p}, m={args.png_m}: measured bubble "
                         f"{b:.3f} (formula {predicted(args.png_schedule, p, args.png_m):.3f})")
        print(f"\ntimeline: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
