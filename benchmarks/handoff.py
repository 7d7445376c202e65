"""Where the pipeline's hand-offs go: 1F1B at pp 2 with and without early receives, same process.

    python benchmarks/handoff.py [--m 16] [--steps 3]

Two runners over the same stages (torch's schedule alone, and with parallel/pipeline/early_recv.py) take
turns, step by step, so machine noise hits both alike. For each measured step: the bubble, the
replay of its recorded action durations with no time between actions (benchmarks/bubble.py's
``simulate``), their ratio, and the time between a rank's consecutive actions per unit of busy
time, split into what torch's schedule spent inside its P2P waits and the rest (bookkeeping; with
early receives the waits move into the action wrapper, so they count there).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bubble as B  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining import schedules as S  # noqa: E402

from paralayer.config import ModelConfig  # noqa: E402
from paralayer.model.transformer import Transformer, init_weights, lm_loss  # noqa: E402
from paralayer.parallel import pipeline as pl  # noqa: E402
from paralayer.parallel.pipeline import runner as plr  # noqa: E402 - where PipelineRunner looks EarlyRecv up
from paralayer.parallel.pipeline import timeline as tl  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


def _runner(chunks, plan, cfg, early: bool):
    real = plr.EarlyRecv
    if not early:
        plr.EarlyRecv = lambda stage, m: None  # torch's schedule alone
    try:
        return pl.PipelineRunner(chunks, dist.group.WORLD, plan, lambda lg, lb: lm_loss(lg, lb, cfg.vocab_size))
    finally:
        plr.EarlyRecv = real


def _worker(rank, world, m, steps):
    cfg = ModelConfig(**B.CFG)
    plan = {"degrees": {"pp": world, "vpp": 1}, "microbatches": m, "schedule": "1f1b",
            "stage_layers": pl.default_stage_layers(cfg.n_layers, world, 1, "1f1b")}
    with torch.device("meta"):
        model = Transformer(cfg)
    chunks = pl.split_model(model, plan, rank)
    for c in chunks:
        c.to_empty(device="cpu")
        init_weights(c, cfg, 0)
    runners = {False: _runner(chunks, plan, cfg, False), True: _runner(chunks, plan, cfg, True)}
    waits: list = []
    wait = S._wait_batch_p2p
    current = {}

    def timed_wait(work):  # torch's schedule waits on its P2P here
        t0 = time.perf_counter() - current["r"].clock._origin
        wait(work)
        waits.append((t0, time.perf_counter() - current["r"].clock._origin))

    S._wait_batch_p2p = timed_wait
    seq = torch.randint(0, cfg.vocab_size, (m * B.MB, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    out = []
    for i in range(2 * (2 + steps)):
        early = i % 2 == 1
        current["r"] = r = runners[early]
        waits.clear()
        for c in chunks:
            c.zero_grad(set_to_none=True)
        r.step(tokens, labels)
        if i >= 4:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, list(waits))
            out.append({"early": early, "bubble": r.bubble_measured, "timeline": r.gather_timeline(),
                        "waits": gathered})
    return out


def between_actions(timeline, waits) -> tuple[float, float]:
    """Time between consecutive actions of each rank, per unit of busy time: inside torch's P2P
    waits, and outside them."""
    inside = outside = 0.0
    for r, row in enumerate(timeline):
        row = sorted(row, key=lambda e: e["start"])
        for a, b in zip(row, row[1:]):
            w = sum(max(0.0, min(b["start"], e) - max(a["end"], s)) for s, e in waits[r])
            inside += w
            outside += (b["start"] - a["end"]) - w
    busy = sum(e["end"] - e["start"] for row in timeline for e in row)
    return inside / busy, outside / busy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with torch.device("meta"):
        Transformer(ModelConfig(**B.CFG))
    res = run_ranks(_worker, 2, args.m, args.steps, timeout_s=1800)[0]
    print(f"1F1B pp=2 m={args.m}, {os.cpu_count()} CPU cores, gloo; steps alternate between the two runners\n")
    print("| early receives | measured | replayed, no gaps | measured / replayed | excess | between actions: "
          "in torch's P2P waits | between actions: other |")
    print("|---|---|---|---|---|---|---|")
    summary: dict = {False: [], True: []}
    for st in res:
        rep = tl.bubble_from_timelines(B.simulate(st["timeline"]))
        inside, outside = between_actions(st["timeline"], st["waits"])
        summary[st["early"]].append((st["bubble"] / rep, st["bubble"] - rep))
        print(f"| {'on' if st['early'] else 'off'} | {st['bubble']:.4f} | {rep:.4f} | {st['bubble'] / rep:.3f} | "
              f"{st['bubble'] - rep:.4f} | {inside:.4f} | {outside:.4f} |")
    for early, rows in summary.items():
        print(f"\nearly receives {'on' if early else 'off'}: median measured / replayed "
              f"{statistics.median(r[0] for r in rows):.3f}, median excess {statistics.median(r[1] for r in rows):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
