"""Runs that recover by themselves on the two-node SLURM (issue 36): a rank SIGKILLed at a random
step fails the job; the launcher (``--wait``, ``cluster.slurm.max_restarts``) submits it again with
``train.resume=auto`` and the losses equal an uninterrupted run's bit for bit (the same 4-rank
layout, dp2 x tp2: every reduction has two members, so its sum does not depend on the hosts).
A rank on n2 that dies in two attempts gets n2 excluded from the third (``--exclude=n2`` in its
sbatch script), which then runs on n1 alone (``cluster.slurm.min_nodes=1``, ``parallel.dp=auto``)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fault_hook import fault_env

REPO = Path(__file__).resolve().parents[1]
LAUNCH = str(REPO / "launch.py")
STEPS = 4
SMALL = ["recipe=tiny", "model.d_model=32", "model.seq_len=16", "model.n_heads=2", "model.n_kv_heads=2",
         "model.ffn_hidden=64", "model.n_layers=2", "model.init_std=0.2", "logging.wandb.mode=disabled",
         "train.collective_timeout_s=30", f"train.steps={STEPS}", "checkpoint.every=2"]


def _losses(run_dir) -> list:
    recs = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in recs if "event" not in r]


def _attempts(run_dir) -> list[dict]:
    return [json.loads(x) for x in Path(run_dir, "attempts.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_two_node_sigkilled_rank_restarts_bit_for_bit(env2, tmp_path):
    step = random.Random().randint(2, STEPS)
    print(f"SIGKILL of rank 2 (node n2) before the forward of step {step}")
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "r"
    ref = subprocess.Popen([sys.executable, LAUNCH, *SMALL, "train.threads=1", f"run.dir={ref_dir}"], cwd=tmp_path,
                           env=env2, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    env = fault_env(tmp_path / "fault", f"kill1:2:{step}", env2)
    t = time.time()
    res = subprocess.run([sys.executable, LAUNCH, *SMALL, "cluster=local-slurm-2node", "cluster.slurm.max_restarts=1",
                          f"run.dir={run_dir}", "--no-rehearse", "--wait"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=800)
    wall = time.time() - t
    assert ref.wait(timeout=300) == 0, ref.stderr.read()[-3000:]
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert _losses(run_dir) == _losses(ref_dir)  # bit for bit, every step once
    a = _attempts(run_dir)
    assert [(x["cause"], x["ranks"], x["hosts"]) for x in a] == [("rank_died", [2], ["n2"]), ("done", [], [])]
    assert a[0]["restart"] and a[0]["slurm_state"] == "FAILED" and a[0]["job_id"] != a[1]["job_id"]
    assert sum(1 for x in res.stderr.splitlines() if x.startswith("paralayer: attempt 1 ended (job ")) == 1
    g = json.loads((run_dir / "goodput.json").read_text())
    tot = g["totals"]
    assert tot["goodput_attempts"] == 2 and abs(tot["goodput_wall_s"] - wall) <= 0.05 * wall, (tot, wall)
    ckpt = (step - 1) // 2 * 2
    assert g["attempts"][0]["lost_steps"] == list(range(ckpt + 1, step))
    print(f"wall {wall:.1f} s, goodput wall {tot['goodput_wall_s']:.1f} s, attempts {[x['wall_s'] for x in a]}")


@pytest.mark.timeout(900)
def test_node_where_ranks_died_twice_is_excluded(env2, tmp_path):
    run_dir = tmp_path / "x"
    env = fault_env(tmp_path / "fault", "kill:2:1", env2)  # rank 2 (on n2) dies in every 4-rank attempt
    res = subprocess.run([sys.executable, LAUNCH, *SMALL, "train.steps=2", "checkpoint.every=0", "parallel.dp=auto",
                          "cluster=local-slurm-2node", "cluster.slurm.max_restarts=3", "cluster.slurm.min_nodes=1",
                          f"run.dir={run_dir}", "--no-rehearse", "--wait"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=800)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    lines = [x for x in res.stderr.splitlines() if "excluded from attempt" in x]
    assert lines == ["paralayer: node n2: ranks died there in two attempts; excluded from attempt 3 "
                     "(sbatch --exclude=n2)"], res.stderr[-3000:]
    a = _attempts(run_dir)
    assert [(x["cause"], x["hosts"], x["exclude"]) for x in a] == [
        ("rank_died", ["n2"], []), ("rank_died", ["n2"], []), ("done", [], ["n2"])]
    scripts = sorted(Path(p) for p in Path(tmp_path).rglob("attempt-3/*_submission.sh"))
    assert scripts and "#SBATCH --exclude=n2" in scripts[0].read_text()
    assert not any("--exclude" in p.read_text() for p in Path(tmp_path).rglob("attempt-2/*_submission.sh"))
