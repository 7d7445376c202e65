"""Exit soak (issue 48): the same short run started N times per layout; how each one ended.

The layouts that start the most machinery: dp2 ZeRO-3, tp2·dp2, pp2, ep2 (tiny-moe), each with
the straggler watch (``logging.straggler_pct``), the hang watchdog (``train.hang_timeout_s``) and
asynchronous checkpoints (``checkpoint.async_save``, a save mid-run and at the last step) on, and
W&B offline (the default). For every run: the launcher's exit code, whether its output holds
``terminate called`` or ``Aborted`` (a native abort at exit), and whether the launcher said a rank
failed after finishing (the one line of paralayer/runtime/completion.py). Prints a markdown table
for docs/BENCHMARKS.md.

    python benchmarks/exit_soak.py --runs 100            # the issue's count (hours on 2 cores)
    python benchmarks/exit_soak.py --runs 10 --layouts dp2-zero3,pp2
    python benchmarks/exit_soak.py --runs 100 --budget-s 5400   # as many rounds as 90 minutes allow
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "model.seq_len=64", "model.vocab_size=256", "train.global_batch=8", "train.micro_batch=2"]
HEALTH = ["logging.straggler_pct=20", "train.hang_timeout_s=90", "checkpoint.async_save=true", "train.threads=1"]
LAYOUTS = {
    "dp2-zero3": ["recipe=tiny", "parallel.tp=1", "parallel.dp=2", "parallel.zero=3"],
    "tp2-dp2": ["recipe=tiny", "parallel.tp=2", "parallel.dp=2"],
    "pp2": ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", "parallel.pp=2"],
    "ep2": ["recipe=tiny-moe", "parallel.ep=2", "parallel.dp=2", "model.moe.ffn_hidden=64"],
}
ABORT = re.compile(r"terminate called|Aborted|SIGABRT")
AFTER_DONE = "after finishing every step"


def one_run(layout: str, steps: int, root: str, i: int) -> dict:
    run_dir = os.path.join(root, f"{layout}-{i}")
    args = [sys.executable, str(REPO / "launch.py"), *LAYOUTS[layout], *SMALL, *HEALTH, f"train.steps={steps}",
            f"checkpoint.every={max(1, steps // 2)}", f"run.dir={run_dir}"]
    t = time.time()
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    return {"rc": res.returncode, "abort": bool(ABORT.search(out)), "after_done": AFTER_DONE in out,
            "seconds": time.time() - t, "tail": out[-1500:] if res.returncode else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100, help="runs per layout (the issue asks 100)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no new round of runs after this many seconds (0: no limit)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    a = ap.parse_args()
    layouts = a.layouts.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="exit-soak-") as root:
        runs: dict[str, list[dict]] = {x: [] for x in layouts}
        t0 = time.time()
        for i in range(a.runs):  # round-robin: a run stopped by --budget-s has every layout at the same count
            if a.budget_s and time.time() - t0 > a.budget_s:
                print(f"budget of {a.budget_s:.0f} s spent after {i} runs per layout", file=sys.stderr)
                break
            for layout in layouts:
                r = one_run(layout, a.steps, root, i)
                runs[layout].append(r)
                print(f"{layout} run {i + 1}/{a.runs}: exit {r['rc']}, abort in log {r['abort']}, "
                      f"{r['seconds']:.0f} s", file=sys.stderr, flush=True)
                if r["rc"]:
                    print(r["tail"], file=sys.stderr, flush=True)
        for layout in layouts:
            done = runs[layout]
            if not done:
                continue
            codes = collections.Counter(r["rc"] for r in done)
            rows.append((layout, len(done), ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())),
                         sum(r["rc"] != 0 for r in done), sum(r["abort"] for r in done),
                         sum(r["after_done"] for r in done), sorted(r["seconds"] for r in done)[len(done) // 2]))
        if a.keep:
            print(f"run directories kept under {root}", file=sys.stderr)
            input("press enter to delete them")
    print("| layout | runs | launcher exit codes (code: runs) | non-zero exits | runs with an abort in the log "
          "| runs finished with a rank failing after its last step | median run s |")
    print("|---|---|---|---|---|---|---|")
    for layout, n, codes, bad, aborts, after, med in rows:
        print(f"| {layout} | {n} | {codes} | {bad} | {aborts} | {after} | {med:.0f} |")


if __name__ == "__main__":
    main()
