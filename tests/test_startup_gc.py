"""The cyclic garbage collector is off through a rank's start-up and on for training
(paralayer/runtime/startup_gc.py, issue #36: ~20% of the imports' CPU, benchmarks/rank_startup.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.dist import TINY_SMALL, cfg_and_plan, run_ranks

REPO = Path(__file__).resolve().parent.parent


def _seen(rank, world, run_dir):
    """What gc.isenabled() reads in setup() (the build) and before each forward, after the entry paused it."""
    import gc

    from paralayer.runtime import startup_gc
    from paralayer.runtime import train as T

    gc.unfreeze()  # tests/dist.py froze the inherited heap: here the start-up's freeze is what is measured
    startup_gc.pause()
    seen = {"forward": []}
    real_setup = T.setup

    def setup(*a, **k):
        seen["setup"] = gc.isenabled()
        return real_setup(*a, **k)

    class Hooks(T.StepHooks):
        def before_forward(self, rank, step):
            seen["forward"].append(gc.isenabled())
            seen["frozen"] = gc.get_freeze_count()  # the start-up's objects, out of the collector's passes

    T.setup = setup
    try:
        cfg, plan = cfg_and_plan(TINY_SMALL + ["parallel.dp=1", "train.steps=2"])
        T.train(cfg, plan, run_dir, hooks=Hooks())
    finally:
        T.setup = real_setup
    return seen


def test_collector_off_while_starting_and_on_for_the_steps(tmp_path):
    seen = run_ranks(_seen, 1, str(tmp_path / "r"))[0]
    assert seen["setup"] is False
    assert seen["forward"] and all(seen["forward"]), seen
    assert seen["frozen"] > 100_000, seen


def test_both_rank_entries_pause_it_before_importing_torch():
    """The local launcher's rank (python -m paralayer.runtime.train) pauses it before its first
    torch import, and SLURM's RankTask first thing in its call."""
    src = (REPO / "paralayer" / "runtime" / "train.py").read_text()
    assert src.index("startup_gc.pause()") < src.index("\nimport torch\n")
    task = (REPO / "paralayer" / "dispatch" / "slurm.py").read_text()
    call = task[task.index("    def __call__(self) -> Any:"):]
    assert call.index("startup_gc.pause()") < call.index("submitit.helpers.TorchDistributedEnvironment")
    # and the module stays torch-free, so pausing costs nothing
    out = subprocess.run([sys.executable, "-c", "import sys, paralayer.runtime.startup_gc as g; g.pause(); "
                          "import gc; print(gc.isenabled(), 'torch' in sys.modules)"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out
