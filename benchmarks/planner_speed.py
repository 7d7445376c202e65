"""The planner's speed guard: ``--plan`` for 405B on 4,096 and on 16,384 GPUs (issue #37: ≤ 1.0 s).

    python benchmarks/planner_speed.py [--repeats 7] [--trees BEFORE_DIR ...]

Each case is timed two ways, in fresh processes that import paralayer from a tree (this checkout by
default; ``--trees`` lists others, e.g. an unpacked ``git archive`` of the commit before a change,
and they are timed turn by turn in the same run so a loaded machine loads them alike):
- planning: the CPU seconds of ``planner.plan_layouts(cfg, top=15)`` in-process, imports warm
  (what ``--plan`` spends planning; the table shows the top 15);
- whole: the CPU seconds of the whole ``python launch.py ... --plan`` process (imports, planning,
  the rich table).
Medians over the repeats. Exit 1 when this checkout's planning median misses 1.0 s on a case.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {"405B on 4,096 GPUs": ["recipe=llama3-405b", "cluster.nodes=512"],
         "405B on 16,384 GPUs": ["recipe=llama3-405b", "cluster.nodes=2048"]}
BOUND_S = 1.0
PLANNING = """
import json, sys, time
from paralayer.config import load_config
from paralayer.resolve.planner import plan_layouts
cfg = load_config(json.loads(sys.argv[1]))
plan_layouts(cfg, top=15)  # warm: imports, first-call caches
t = time.process_time()
plan_layouts(load_config(json.loads(sys.argv[1])), top=15)
print(time.process_time() - t)
"""


def _env(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("PARALAYER_RECIPES", None)
    return env


def planning_s(tree: Path, overrides: list) -> float:
    out = subprocess.run([sys.executable, "-c", PLANNING, json.dumps(overrides)], capture_output=True, text=True,
                         env=_env(tree), cwd=str(tree), timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def whole_s(tree: Path, overrides: list) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, str(tree / "launch.py"), *overrides, "--plan"], capture_output=True,
                   env=_env(tree), cwd=str(tree), timeout=300, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--trees", nargs="*", default=[], help="other trees to time beside this checkout")
    a = ap.parse_args()
    trees = [REPO] + [Path(t).resolve() for t in a.trees]
    times = {(str(t), c, k): [] for t in trees for c in CASES for k in ("planning", "whole")}
    for _ in range(a.repeats):
        for case, ov in CASES.items():
            for t in trees:  # turn by turn: the same load for every tree
                times[(str(t), case, "planning")].append(planning_s(t, ov))
                times[(str(t), case, "whole")].append(whole_s(t, ov))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"CPU seconds, median of {a.repeats} (load average {os.getloadavg()[0]:.1f})")
    ok = True
    for case in CASES:
        for t in trees:
            p, w = med[(str(t), case, "planning")], med[(str(t), case, "whole")]
            name = "this checkout" if t == REPO else str(t)
            print(f"  {case:20s} {name}: planning {p:.3f} s (min {min(times[(str(t), case, 'planning')]):.3f}), "
                  f"whole --plan {w:.3f} s")
        if len(trees) > 1:
            for t in trees[1:]:
                print(f"  {case:20s} ratio {t.name} / this checkout: planning "
                      f"{med[(str(t), case, 'planning')] / med[(str(REPO), case, 'planning')]:.2f}x, whole "
                      f"{med[(str(t), case, 'whole')] / med[(str(REPO), case, 'whole')]:.2f}x")
        ok &= med[(str(REPO), case, "planning")] <= BOUND_S
    print("bound", BOUND_S, "s:", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
