"""The tiny recipe trained in FP8 (emulated on CPU) against a higher-precision run over the same steps.

Each precision is one ``python launch.py`` run on one rank (tp=1, dp=1, the same data and seed);
the script reads their metrics.jsonl and prints the final loss (mean of the last 10 steps, the
single last step too), the relative gap and the wall time. The FP8 run's precision around its FP8
GEMMs is the reference's (``train.fp8.base_precision``): ``--against bf16`` compares FP8 inside bf16
with bf16, as on a GPU. bf16 on a CPU without bf16 instructions is ~40x slower than fp32 (the default
comparison, fp32, is for those); with AVX-512 BF16 it is faster than fp32 (8 Dec: 11.3 s against
16.5 s for 10 steps of the tiny recipe).

    python benchmarks/fp8_tiny.py [--steps 200] [--recipe tensorwise] [--against fp32] [--seed 0] [--together]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(precision: str, steps: int, recipe: str, out: str, base: str = "auto",
          seed: int = 0) -> tuple[subprocess.Popen, float]:
    """One rank of the tiny recipe, started; its process and start time. ``base``: the FP8 run's
    precision around its FP8 GEMMs (train.fp8.base_precision; auto is fp32 on CPU)."""
    args = [sys.executable, "launch.py", "recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"train.steps={steps}",
            f"train.precision={precision}", f"train.fp8.recipe={recipe}", f"train.fp8.base_precision={base}",
            f"train.seed={seed}",
            "logging.wandb.mode=disabled",
            "logging.progress=false", "checkpoint.every=0", f"run.dir={out}",
            "train.hang_timeout_s=0"]  # one rank, no collective to hang on: a slow step on a loaded machine is no hang
    return subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)), time.perf_counter()


def finish(proc: subprocess.Popen, t0: float, out: str) -> tuple[list[dict], float]:
    """Wait for a run; its metrics records and wall seconds."""
    if proc.wait():
        raise SystemExit(f"{' '.join(proc.args)} exited {proc.returncode}")
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--recipe", default="tensorwise")
    ap.add_argument("--against", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--seed", type=int, default=0, help="train.seed of both runs (weights and data order)")
    ap.add_argument("--together", action="store_true",
                    help="run both precisions at once (a loaded machine: the wall times then include each other)")
    ap.add_argument("--dir", default=None, help="keep the two runs here (default: a temporary directory)")
    a = ap.parse_args()
    rows = {}
    with (contextlib.nullcontext(a.dir) if a.dir else tempfile.TemporaryDirectory()) as tmp:
        outs = {prec: os.path.join(tmp, prec) for prec in ("fp8", a.against)}
        started = {}
        for prec, out in outs.items():
            started[prec] = start(prec, a.steps, a.recipe, out, a.against if prec == "fp8" else "auto", a.seed)
            if not a.together:
                started[prec] = finish(*started[prec], out)
        for prec, out in outs.items():
            recs, wall = finish(*started[prec], out) if a.together else started[prec]
            last = [r["loss"] for r in recs[-10:]]
            rows[prec] = (sum(last) / len(last), recs[-1]["loss"], recs[0]["loss"], wall)
    f8, ref = rows["fp8"], rows[a.against]
    print(f"tiny recipe, {a.steps} steps, one rank each; fp8 recipe {a.recipe} (emulated on CPU)"
          + ("; both runs at once" if a.together else ""))
    print("| precision | first loss | last loss | mean of last 10 | wall s |")
    print("|---|---|---|---|---|")
    for name, (mean10, last, first, wall) in rows.items():
        print(f"| {name} | {first:.4f} | {last:.4f} | {mean10:.4f} | {wall:.0f} |")
    gap = (f8[0] - ref[0]) / ref[0]
    print(f"final loss (mean of the last 10 steps): fp8 {f8[0]:.4f} vs {a.against} {ref[0]:.4f}: {100 * gap:+.2f}% "
          f"({'within' if abs(gap) <= 0.02 else 'OUTSIDE'} 2%)")


if __name__ == "__main__":
    main()
