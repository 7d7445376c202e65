"""Runs that recover by themselves (issue 36), on the local launcher: a rank SIGKILLed at a random
step is named, its attempt ends within seconds, and the run restarts from the newest verified
checkpoint with losses equal to an uninterrupted run's bit for bit; each attempt is a line of
run.dir/attempts.jsonl; goodput.json's wall time is the launcher's wall clock (within 5%) and shows
the lost steps; bad input (exit 2) never restarts; a launcher killed with SIGKILL leaves no rank
behind; a rank frozen in step 1 or inside a save is named within the watchdog's time, and restarts
stop at the limit with one line.

Every launch is 2 ranks of a 2-layer d_model 32, seq 16 model, at most 6 steps, one thread each. The
SIGKILL and the hang share one run (attempt 1 killed, attempt 2 hung, attempt 3 done), and so do the
freeze in step 1, the freeze in a save and the restart limit (attempt 1 frozen in step 1, attempt 2
frozen in a save and the last): three launches less, and every check of each is still made."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paralayer.rehearse import fork_server
from tests.dist import cfg_and_plan, run_ranks
from tests.fault_hook import fault_env, unfreeze

REPO = Path(__file__).resolve().parent.parent
STEPS, EVERY, HUNG = 6, 2, 6  # the hung step: step 5 runs after the checkpoint of step 4, then again
TINY = ["recipe=tiny", "parallel.tp=1", "model.n_layers=2", "model.seq_len=16", "model.d_model=32",
        "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.init_std=0.2", "train.threads=1",
        "logging.wandb.mode=disabled",
        "train.collective_timeout_s=30"]


def _launch(tmp_path, name: str, spec: str | None, extra: list[str], timeout: float = 240):
    run_dir = tmp_path / name
    env = fault_env(tmp_path / f"fault-{name}", spec) if spec else dict(os.environ)
    env["TMPDIR"] = str(tmp_path)
    t = time.time()
    try:
        res = subprocess.run([sys.executable, "launch.py", *TINY, f"run.dir={run_dir}", *extra], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout)
    finally:
        unfreeze(tmp_path)
    return res, time.time() - t, run_dir


def _losses(run_dir) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(x["step"], x["loss"]) for x in lines if "event" not in x]


def _attempts(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]


def _train_plain(rank, world, overrides, run_dir):
    from paralayer.runtime.train import train

    cfg, plan = cfg_and_plan(overrides)
    train(cfg, plan, run_dir)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The reference: the same run, never interrupted (its losses, and its run.dir), on 2 forked ranks
    (tests/dist.py) rather than a launch: the same train() on the same config, ~6.5 CPU-s of a
    launcher's imports less; the launched runs must match its losses bit for bit."""
    run_dir = tmp_path_factory.mktemp("plain") / "plain"
    run_ranks(_train_plain, 2, TINY + [f"run.dir={run_dir}", f"train.steps={STEPS}", f"checkpoint.every={EVERY}"],
              str(run_dir))
    return _losses(run_dir), run_dir


@pytest.fixture(scope="module")
def uninterrupted(plain):
    return plain[0]


def test_restart_before_the_first_save_keeps_the_users_checkpoint(tmp_path, plain):
    """A run started from ``train.resume=PATH`` whose rank dies before the run's own first save:
    the restart loads PATH again (not step 1), and the losses are the uninterrupted run's."""
    losses, plain_dir = plain
    path = sorted((plain_dir / "checkpoints").glob("step-*"))[0]  # the oldest one retention kept
    at = int(path.name.split("-")[1])
    assert at < STEPS - 1, path
    res, _, run_dir = _launch(tmp_path, "p", f"kill1:1:{at + 2}",
                              [f"train.steps={STEPS}", f"checkpoint.every={STEPS}", "cluster.max_restarts=1",
                               f"train.resume={path}"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count(f"resumed from {path} at step {at + 1}") == 2, res.stdout[-3000:]
    assert _losses(run_dir) == losses[at:]
    assert [x["cause"] for x in _attempts(run_dir)] == ["rank_died", "done"]


def test_sigkilled_rank_restarts_and_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    """Attempt 1: rank 1 SIGKILLed at a random step. Attempt 2: rank 1 SIGSTOPped at step 6 until
    the watchdog (4 s) fires. Attempt 3 finishes; the losses are the uninterrupted run's."""
    step = random.Random().randint(2, HUNG - 1)  # a random step; printed for a rerun
    print(f"SIGKILL of rank 1 before the forward of step {step}, SIGSTOP before step {HUNG}")
    res, wall, run_dir = _launch(tmp_path, "r", f"kill1:1:{step},stop1:1:{HUNG}",
                                 [f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "cluster.max_restarts=2",
                                  "train.hang_timeout_s=4"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert _losses(run_dir) == uninterrupted  # bit for bit, every step once
    a = _attempts(run_dir)
    assert [x["attempt"] for x in a] == [1, 2, 3] and [x["cause"] for x in a] == ["rank_died", "hang", "done"]
    assert a[0]["ranks"] == [1] and a[0]["signal"] == "SIGKILL" and a[0]["exit_code"] is None and a[0]["restart"]
    assert a[1]["ranks"] == [1] and a[1]["restart"]
    assert a[0]["host"] and a[2]["exit_code"] == 0 and not a[2]["restart"]
    assert a[1]["start_unix"] == a[0]["end_unix"] and a[2]["start_unix"] == a[1]["end_unix"]
    # the launcher names the SIGKILLed rank and ends every rank of its attempt within seconds (what
    # test_runtime's killed-rank launch checked with no restarts: the same root_failure line, one launch less)
    named = [x for x in res.stderr.splitlines() if x.startswith("paralayer: rank ")]
    assert len(named) == 1 and named[0].startswith("paralayer: rank 1 failed"), res.stderr[-3000:]
    killed_at = float(re.search(r"injecting kill -9 on rank 1 at step \d+ at unix time (\d+\.\d+)",
                                res.stderr).group(1))
    assert a[0]["end_unix"] - killed_at < 30, (a[0], killed_at)
    ended = [x for x in res.stderr.splitlines() if x.startswith("paralayer: attempt ")]
    assert [x.split(" ended")[0] for x in ended if " ended" in x] == ["paralayer: attempt 1", "paralayer: attempt 2"]
    ckpt = (step - 1) // EVERY * EVERY  # the newest checkpoint before the kill
    assert f"resumed from {run_dir / 'checkpoints'}/step-{ckpt:08d} at step {ckpt + 1}" in res.stdout or ckpt == 0
    hung_ckpt = (HUNG - 1) // EVERY * EVERY
    assert f"resumed from {run_dir / 'checkpoints'}/step-{hung_ckpt:08d} at step {hung_ckpt + 1}" in res.stdout
    g = json.loads((run_dir / "goodput.json").read_text())
    t = g["totals"]
    assert t["goodput_attempts"] == 3 and abs(t["goodput_wall_s"] - wall) <= 0.05 * wall, (t, wall)
    lost = list(range(ckpt + 1, step))  # ran by attempt 1 after its last checkpoint, ran again by attempt 2
    hung_lost = list(range(hung_ckpt + 1, HUNG))  # step 5: ran by the hung attempt, again by attempt 3
    assert g["attempts"][0]["lost_steps"] == lost and g["attempts"][1]["lost_steps"] == hung_lost
    assert t["goodput_lost_steps"] == len(lost) + len(hung_lost)
    assert (g["attempts"][0]["lost_s"] > 0) == bool(lost) and g["attempts"][1]["lost_s"] > 0
    fail = [x["buckets_s"]["failure"] for x in g["attempts"]]
    assert fail[0] > 0 and fail[1] >= 4.0 and t["goodput_failure_s"] == pytest.approx(sum(fail))  # the watchdog's 4 s
    assert t["goodput_wall_s"] >= sum(x["wall_s"] for x in a) - 1e-6  # the hung attempt's whole wall time
    buckets = sum(v for k, v in t.items() if k.endswith("_s") and k != "goodput_wall_s")
    assert buckets == pytest.approx(t["goodput_wall_s"], rel=1e-6)
    print(f"wall {wall:.1f} s, goodput wall {t['goodput_wall_s']:.1f} s, lost steps {lost} + {hung_lost}")


def test_bad_input_mid_run_never_restarts(tmp_path):
    res, _, run_dir = _launch(tmp_path, "b", "exit2:1:3", ["train.steps=3", "cluster.max_restarts=3"])
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert errors == ["error: data.path: the batch of step 3 holds a token id past model.vocab_size "
                      "(injected on rank 1)"], res.stderr[-3000:]
    assert "restarting" not in res.stderr
    a = _attempts(run_dir)
    assert len(a) == 1 and a[0]["cause"] == "bad_input" and a[0]["exit_code"] == 2 and not a[0]["restart"]


def _rank_pids(tmp, ranks_only: bool = False) -> list[int]:
    """The processes a launcher started with TMPDIR=tmp (its rank server and the ranks forked from
    it, whose command line names paralayer.runtime.train): the ranks only with ``ranks_only``."""
    want = f"TMPDIR={tmp}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if fork_server.MARKER.encode() in cmd and want in env and (not ranks_only or fork_server.is_rank(int(pid))):
            out.append(int(pid))
    return out


def test_launcher_killed_with_sigkill_takes_its_ranks(tmp_path):
    run_dir = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "launch.py", *TINY, f"run.dir={run_dir}", "train.steps=100000"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.2)
        assert len(_rank_pids(tmp_path, ranks_only=True)) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=10)
        left = _rank_pids(tmp_path)
        while left and time.time() - killed < 10:
            time.sleep(0.1)
            left = _rank_pids(tmp_path)
        gone = time.time() - killed
        assert not left, f"ranks {left} still running {gone:.1f} s after the launcher's SIGKILL"
        print(f"every rank gone {gone:.1f} s after the launcher's SIGKILL")
    finally:
        for pid in _rank_pids(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_rank_frozen_in_step_1_then_in_a_save_is_named_until_the_limit(tmp_path):
    """Attempt 1: rank 1 frozen (SIGSTOP) before step 1's forward; attempt 2: frozen inside the save of
    step 2. Each hang is named within the watchdog's time with every rank of the attempt ended, and
    attempt 2 meets cluster.max_restarts=1: one limit line, exit 1, no rank left. (One launch for what
    were two launches of one freeze each and a third that reached the limit with two SIGKILLs: the
    limit is the same for a hang as for a dead rank, attempts.should_restart; a SIGKILLed rank's
    record is checked by test_sigkilled_rank_restarts_and_matches_the_uninterrupted_run.)"""
    hang = 4
    res, _, run_dir = _launch(tmp_path, "f", "stop1:1:1,stopsave:1:2",
                              ["train.steps=4", "checkpoint.every=2", f"train.hang_timeout_s={hang}",
                               "cluster.max_restarts=1"], timeout=240)
    returned = time.time()  # the launcher returned: every rank is gone
    assert res.returncode == 1, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("paralayer: hang:")]
    assert len(lines) == 2 and all("rank 1 never entered" in x for x in lines), res.stderr[-3000:]
    limit = [x for x in res.stderr.splitlines() if "restart limit" in x]
    assert limit == ["paralayer: attempt 2 failed and the restart limit is reached (cluster.max_restarts=1, "
                     "1 restart(s) made); not restarting"], res.stderr[-3000:]
    assert not _rank_pids(tmp_path, ranks_only=True)
    a = _attempts(run_dir)
    assert [(x["cause"], x["restart"], x["ranks"]) for x in a] == [("hang", True, [1]), ("hang", False, [1])], a
    for where, ended in (("at step 1", a[0]["end_unix"]), ("inside the save of step 2", returned)):
        stopped_at = float(re.search(rf"SIGSTOP on rank 1 {where} at unix time (\d+\.\d+)", res.stderr).group(1))
        detected = ended - stopped_at
        assert detected < hang + 30, (where, detected)
        print(f"rank 1 frozen {where}: named and every rank gone {detected:.1f} s after the SIGSTOP "
              f"(watchdog {hang} s)")
