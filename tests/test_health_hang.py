"""A hung rank gets a diagnosis (issue 30): SIGSTOP one rank of a 2-rank launch after step 2; the
watchdog (train.hang_timeout_s=5) of the other writes its stack and last collective, the launcher
names the stopped rank in one line and ends the job."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.fault_hook import fault_env, unfreeze

REPO = Path(__file__).resolve().parent.parent
HANG_S = 5


def test_stopped_rank_is_named_and_every_rank_ends(tmp_path):
    run_dir = tmp_path / "r"
    env = fault_env(tmp_path, "stop:1:3")
    env["TMPDIR"] = str(tmp_path)
    args = [sys.executable, "launch.py", "recipe=tiny", "parallel.tp=1", "model.n_layers=2", "model.seq_len=32",
            "train.steps=8", f"run.dir={run_dir}", "logging.wandb.mode=disabled", f"train.hang_timeout_s={HANG_S}",
            "train.collective_timeout_s=60"]
    try:
        res = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    finally:
        unfreeze(tmp_path)
    stopped_at = float(re.search(r"SIGSTOP on rank 1 at step 3 at unix time (\d+\.\d+)", res.stderr).group(1))
    detected = time.time() - stopped_at
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("paralayer: hang:")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "rank 1 never entered the collective the others wait in (dp_cp" in lines[0], lines[0]
    assert detected < HANG_S + 30, detected  # every rank gone, the launcher returned
    report = (run_dir / "hang" / "rank-0.txt").read_text()
    assert '"step": 3' in report and "grad_reduce" in report, report[:2000]
    assert "Python stacks" in report and "in reduce_and_clip" in report, report
    assert not (run_dir / "hang" / "rank-1.txt").exists()
    assert (run_dir / "error.txt").read_text().strip() == lines[0]
    print(f"hang detected and the job ended {detected:.1f} s after the SIGSTOP (watchdog {HANG_S} s)")
