"""dualpipev's overlapped forward-backward with a delay injected into every expert all-to-all.

Four gloo ranks (pp2 × dp2, the experts over ep2; tiny-moe widened so a layer's halves compute for a
few milliseconds) run the same steps with ``parallel.pp_overlap`` false and true, each with no delay
and with ``--delay`` seconds added to the completion of every all-to-all: the issue returns at
once and its ``wait()`` returns no earlier than issue + delay (a slow network, not a slow caller).
Without the overlap every rank waits on each all-to-all as soon as it is issued, so the step grows
by the whole injected delay (all-to-alls per rank per step × delay); with it, the other half
computes while the delay runs.

The four configurations alternate step by step (one set-up each, kept), so the load of a shared
machine falls on them alike; the step is timed from a barrier to a barrier (the slowest rank sets
it). Printed: the median step of each, the growth with the delay, the hidden share
1 − growth(overlap) / growth(serial), and each rank's time blocked in all-to-all waits (which CPU
contention on a shared machine does not blur as it blurs the step).

    python benchmarks/ep_overlap.py [--delay 0.01] [--steps 12] [--warmup 2] [--m 8]
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["recipe=tiny-moe", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.tp=1",
         "parallel.schedule=dualpipev", "model.n_layers=4", "model.d_model=256", "model.n_heads=4",
         "model.n_kv_heads=4", "model.moe.ffn_hidden=256", "model.seq_len=256", "train.micro_batch=2",
         "train.precision=fp32", "train.threads=1", "logging.wandb.mode=disabled"]
CONFIGS = [(ov, d) for ov in (False, True) for d in (False, True)]  # (overlap, delayed)


class _Delay:
    """Every expert all-to-all through ``expert.start_all_to_all`` completes ``seconds`` after its
    issue at the earliest; since the last reset, ``count`` all-to-alls were issued and the rank
    spent ``blocked`` seconds in their ``wait()``."""

    def __init__(self):
        from paralayer.parallel import expert

        self.seconds, self.count, self.blocked, real = 0.0, 0, 0.0, expert.start_all_to_all
        delay = self

        class Delayed:
            def __init__(self, inner, due: float):
                self.inner, self.due = inner, due

            def wait(self, timeout=None) -> bool:
                t = time.perf_counter()
                self.inner.wait()
                left = self.due - time.perf_counter()
                if left > 0:
                    time.sleep(left)
                delay.blocked += time.perf_counter() - t
                return True

        def start(*args, **kwargs):
            delay.count += 1
            return Delayed(real(*args, **kwargs), time.perf_counter() + delay.seconds)

        expert.start_all_to_all = start


def _rank(rank: int, world: int, store_path: str, a, queue) -> None:
    import torch
    import torch.distributed as dist

    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve
    from paralayer.runtime.build import as_plan
    from paralayer.runtime.train import forward_backward, setup, step_batch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    delay = _Delay()
    runs = {}
    for ov in (False, True):
        cfg = load_config(MODEL + [f"parallel.pp_overlap={str(ov).lower()}", f"train.global_batch={4 * a.m}"])
        plan = resolve(cfg).to_dict()
        assert not plan["errors"], plan["errors"]
        runs[ov] = setup(cfg, as_plan(plan), None)
    times: dict = {c: [] for c in CONFIGS}
    counts: dict = {c: [] for c in CONFIGS}
    blocked: dict = {c: [] for c in CONFIGS}
    for step in range(1, a.warmup + a.steps + 1):
        for ov, delayed in CONFIGS:
            run = runs[ov]
            tokens, labels = step_batch(run, step)
            delay.seconds, delay.count, delay.blocked = (a.delay if delayed else 0.0), 0, 0.0
            dist.barrier()
            t0 = time.perf_counter()
            forward_backward(run, tokens, labels)
            dist.barrier()
            if step > a.warmup:
                times[ov, delayed].append(time.perf_counter() - t0)
                counts[ov, delayed].append(delay.count)
                blocked[ov, delayed].append(delay.blocked)
            for chunk in run.built.chunks:
                chunk.zero_grad(set_to_none=True)
    queue.put((rank, times, counts, blocked))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay", type=float, default=0.01, help="seconds added to each all-to-all's completion")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--m", type=int, default=8, help="microbatches per step (micro-batch 2, dp 2)")
    a = ap.parse_args()
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, 4, os.path.join(tmp, "store"), a, queue)) for r in range(4)]
        for p in procs:
            p.start()
        res = sorted(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    times = res[0][1]  # every rank times the same barrier-to-barrier window
    per_rank = [max(statistics.median(c) for c in r[2].values()) for r in res]
    med = {c: statistics.median(v) for c, v in times.items()}
    injected = max(per_rank) * a.delay
    grow = {ov: med[ov, True] - med[ov, False] for ov in (False, True)}
    print(f"dualpipev pp2 × ep2 (4 gloo ranks, tiny-moe d_model 256, seq 256, m = {a.m}), delay {1e3 * a.delay:.1f} ms "
          f"per all-to-all, {a.steps} steps after {a.warmup} (wall {time.perf_counter() - t0:.0f} s)")
    print(f"all-to-alls per rank per step: {per_rank}; injected on the busiest rank: {1e3 * injected:.0f} ms")
    print("| pp_overlap | step, no delay (ms) | step, delayed (ms) | growth (ms) | growth / injected |")
    print("|---|---:|---:|---:|---:|")
    for ov in (False, True):
        print(f"| {str(ov).lower()} | {1e3 * med[ov, False]:.0f} | {1e3 * med[ov, True]:.0f} | "
              f"{1e3 * grow[ov]:.0f} | {grow[ov] / injected:.2f} |")
    print("time in all-to-all waits per step, median per rank (ms): "
          + "; ".join(f"pp_overlap={str(ov).lower()}{' delayed' if d else ''} "
                      + ", ".join(f"{1e3 * statistics.median(r[3][ov, d]):.0f}" for r in res) for ov, d in CONFIGS))
    print(f"hidden share of the delay: 1 − {1e3 * grow[True]:.0f} / {1e3 * grow[False]:.0f} = "
          f"{1 - grow[True] / grow[False]:.2f}; step with the delay, overlap / serial: "
          f"{med[True, True] / med[False, True]:.2f}")


if __name__ == "__main__":
    main()
