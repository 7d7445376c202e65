"""Issue 7's acceptance, end to end: ``python launch.py ... cluster=local-slurm`` against the real
one-node SLURM of cluster/local_slurm.sh (start it first; skipped, with the reason, when it is not
up). Real training runs of the tiny recipe, so each test costs tens of seconds on a loaded 2-core
machine; the whole file stays under ~4 min. Every wait has a deadline.

- one job with --wait, the default recipe (4 ranks) on the user's default path (the pre-flight
  rehearsal first): the printed hint (job id, logs, how to follow), exit status 0, every step; the
  other launches pass --no-rehearse (~8 CPU-s of fork server and rehearsal each, and not their subject)
- a sweep (-m parallel.dp=1,2) as one 2-element job array: ids N_0/N_1 in sacct, one run.dir and
  one W&B run each, both in one W&B group
- `scontrol requeue` of a running job: it resumes from its periodic checkpoint, every step logged once
- USR2 (the signal before the time limit): checkpoint() + requeue through submitit, then the same
- an invalid sweep element: exit 2, all invalid elements named, nothing submitted
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = str(REPO / "launch.py")
SMALL = ["recipe=tiny", "parallel.tp=1", "cluster=local-slurm", "logging.progress=true"]


@pytest.fixture(scope="module")
def slurm_env(local_slurm):
    import submitit  # noqa: F401 - a dependency (pyproject): missing is a failure, not a skip
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("PARALAYER_RESUME", "PARALAYER_FAULT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _launch(args, cwd, env, timeout):
    return subprocess.run([sys.executable, LAUNCH, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _steps(run_dir) -> list[int]:
    p = Path(run_dir, "metrics.jsonl")
    if not p.exists():
        return []
    return [json.loads(line)["step"] for line in p.read_text().splitlines() if line.strip()]


def _sacct(job: str, fields: str = "JobID,State", dup: bool = False) -> list[list[str]]:
    cmd = ["sacct", "-n", "-X", "-P", "-o", fields, "-j", job] + (["-D"] if dup else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def _sacct_until(job: str, ok, fields="JobID,State", dup=False, deadline_s=30.0):
    """Accounting reaches slurmdbd a moment after the job ends: poll with a deadline."""
    end = time.monotonic() + deadline_s
    while True:
        rows = _sacct(job, fields, dup)
        if ok(rows) or time.monotonic() > end:
            return rows
        time.sleep(0.5)


def _jobs_from(workdir: Path) -> list[str]:
    """Ids of every job (any state, since 2000) submitted from ``workdir``."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-a", "-S", "2000-01-01", "-o", "JobID,WorkDir"],
                         capture_output=True, text=True, timeout=30).stdout
    q = subprocess.run(["squeue", "-h", "-o", "%i|%Z"], capture_output=True, text=True, timeout=30).stdout
    rows = [line.split("|", 1) for line in (out + q).splitlines() if "|" in line]
    return [jid for jid, wd in rows if wd.strip().startswith(str(workdir))]


def _wandb_runs(run_dir) -> list[tuple[str, str, str]]:
    """(run_id, group, name) of each offline W&B run file under run_dir. The .wandb file is a
    LevelDB-style log (7-byte file header, 32 KiB blocks, records in FULL/FIRST/MIDDLE/LAST chunks)
    of wandb_internal_pb2.Record protobufs; the "run" record carries the group."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        data = Path(path).read_bytes()
        pos, block, buf = 7, 32768, b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if n == 0 and kind == 0:
                pos += left
                continue
            chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind == 1 or kind == 4:
                rec = pb.Record()
                rec.ParseFromString(buf + chunk if kind == 4 else chunk)
                buf = b""
                if rec.WhichOneof("record_type") == "run":
                    out.append((rec.run.run_id, rec.run.run_group, rec.run.display_name))
            elif kind == 2:
                buf = chunk
            elif kind == 3:
                buf += chunk
    return out


# ----------------------------------------------------------------------------- tests
def test_sweep_is_one_job_array(slurm_env, tmp_path):
    base = tmp_path / "sweep"
    t0 = time.monotonic()
    r = _launch([*SMALL, "-m", "parallel.dp=1,2", f"run.dir={base}", "train.steps=4",
                 "logging.wandb.mode=offline", "--wait"], tmp_path, slurm_env, timeout=200)
    took = time.monotonic() - t0
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    m = re.search(r"submitted job array (\d+) \(2 run\(s\)\)", r.stdout)
    assert m, r.stdout
    job = m.group(1)
    # runs named by what differs; the array index stays in each run's sweep.json
    assert f"{job}_0: {base / 'dp1'}" in r.stdout and f"{job}_1: {base / 'dp2'}" in r.stdout, r.stdout
    rows = _sacct_until(job, lambda rs: len(rs) == 2 and all(s == "COMPLETED" for _, s in rs))
    assert sorted(rows) == [[f"{job}_0", "COMPLETED"], [f"{job}_1", "COMPLETED"]], rows
    groups, ids = set(), set()
    for i, dp in enumerate((1, 2)):
        rd = base / f"dp{dp}"
        assert _steps(rd) == [1, 2, 3, 4], rd
        meta = json.loads((rd / "sweep.json").read_text())
        assert meta["index"] == i and meta["slurm"]["job_id"] == f"{job}_{i}" and meta["slurm"]["state"] == "COMPLETED"
        assert json.loads((rd / "plan.json").read_text())["degrees"]["dp"] == dp
        runs = _wandb_runs(str(rd))
        assert len(runs) == 1, runs
        ids.add(runs[0][0])
        groups.add(runs[0][1])
    assert len(ids) == 2 and len(groups) == 1 and groups.pop(), (ids, groups)
    # --wait saw the array complete, then the sweep report was printed and written
    assert "paralayer sweep report" in r.stdout, r.stdout[-3000:]
    with open(base / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(x["name"], x["state"], x["overrides"]) for x in rows] == [
        ("dp1", "completed", "parallel.dp=1"), ("dp2", "completed", "parallel.dp=2")], rows
    assert all(float(x["ratio_step_time_s"]) > 0 for x in rows) and (base / "report.png").stat().st_size > 10_000
    print(f"sweep of 2 as a job array: {took:.0f}s")


def _wait_for(cond, what, proc, log_path, deadline_s=120.0):
    end = time.monotonic() + deadline_s
    while not cond():
        assert proc.poll() is None, f"launch.py ended while waiting for {what}:\n" + log_path.read_text()[-3000:]
        assert time.monotonic() < end, f"no {what} within {deadline_s:.0f} s:\n" + log_path.read_text()[-3000:]
        time.sleep(0.2)


def test_requeue_and_usr2_resume_from_checkpoints(slurm_env, tmp_path):
    """One checkpointing run (checkpoint.every=3), interrupted twice while it trains:

    1. a bare `scontrol requeue`: SLURM sends SIGTERM (submitit ignores it), then SIGKILL, and re-runs
       the batch script from its start; the ranks save at the step's end on SIGTERM
       (paralayer/runtime/health/preempt.py), and the rerun comes back with resume=auto (SLURM_RESTART_COUNT > 0)
       and loads that checkpoint;
    2. USR2, what `--signal=USR2@90` sends before the time limit: the ranks finish the step, save a
       checkpoint there (paralayer/runtime/health/preempt.py), and hand the signal to submitit, which calls
       RankTask.checkpoint on rank 0 and requeues the job with resume=auto — so the rerun starts at
       the step after the signal, not at the last periodic checkpoint.
    Both times it resumes from a checkpoint, and in the end every step is logged exactly once."""
    steps = 24  # at the USR2 (step ~11) 13 steps are left: the job cannot end before the signal
    run, log_path = tmp_path / "run", tmp_path / "launch.out"
    out = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, LAUNCH, *SMALL, f"run.dir={run}", f"train.steps={steps}",
                             "checkpoint.every=3", "logging.wandb.mode=disabled", "--no-rehearse", "--wait"],
                            cwd=tmp_path, env=slurm_env, stdout=out, stderr=subprocess.STDOUT, text=True)
    job = None
    resumed_re = re.compile(r"resumed from \S+step-(\d+) at step (\d+)")
    try:
        _wait_for(lambda: len(_steps(run)) >= 5, "step 5", proc, log_path)  # past the checkpoint of step 3
        job = re.search(r"submitted job (\d+) ", log_path.read_text()).group(1)
        at1 = len(_steps(run))
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        # the rerun resumed; let it pass a checkpoint of its own (3 steps later at most)
        _wait_for(lambda: resumed_re.search(log_path.read_text()), "resume after scontrol requeue", proc, log_path)
        first = int(resumed_re.search(log_path.read_text()).group(2))
        _wait_for(lambda: len(_steps(run)) >= first + 4, f"step {first + 4}", proc, log_path)
        at2 = len(_steps(run))
        assert at2 < steps, "the job finished before it could be signalled"
        r = subprocess.run(["scancel", "--signal=USR2", job], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        rc = proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            if job:
                subprocess.run(["scancel", job], timeout=30)
        out.close()
    log = log_path.read_text()
    assert rc == 0, log[-4000:]
    assert log.count("resume=auto") == 2 and "Calling checkpoint method" in log and "Requeued job" in log, log[-4000:]
    resumes = [(int(a), int(b)) for a, b in resumed_re.findall(log)]
    assert len(resumes) == 2 and all(b == a + 1 for a, b in resumes), resumes
    assert resumes[0][0] >= 3 and resumes[1][0] >= first, (resumes, first)
    # each save at a signal is what the rerun loads: nothing is trained twice
    term_at = [int(x) for x in re.findall(r"SIGTERM after step (\d+): checkpoint saved", log)]
    usr2_at = [int(x) for x in re.findall(r"SIGUSR2 after step (\d+): checkpoint saved", log)]
    assert term_at == [resumes[0][0]] and usr2_at == [resumes[1][0]], (term_at, usr2_at, resumes)
    assert _steps(run) == list(range(1, steps + 1))  # each step once: no gap, no duplicate
    rows = _sacct_until(job, lambda rs: [s for _, s in rs] == ["REQUEUED", "REQUEUED", "COMPLETED"], dup=True)
    assert [s for _, s in rows] == ["REQUEUED", "REQUEUED", "COMPLETED"], rows
    print(f"requeue at step {at1} -> resumed at {resumes[0][1]}; USR2 at step {at2} -> resumed at "
          f"{resumes[1][1]}: {time.monotonic() - t0:.0f}s")


def test_finished_job_with_an_abort_at_exit_is_completed(slurm_env, tmp_path):
    """Issue 48 on the real SLURM: rank 1 of a dp2 run has a native abort registered for the
    interpreter's exit after its last step (tests/fault_hook.py ``abortexit``). The finished task
    ends with status 0 before that teardown (runtime/completion.py), so the job is COMPLETED, the
    launcher exits 0 and, with restarts allowed, submits nothing more."""
    from tests.fault_hook import fault_env

    run = tmp_path / "abort"
    env = fault_env(tmp_path / "fault", "abortexit:1:0", slurm_env)
    r = _launch([*SMALL, "parallel.dp=2", f"run.dir={run}", "train.steps=3", "logging.wandb.mode=disabled",
                 "cluster.slurm.max_restarts=2", "--no-rehearse", "--wait"], tmp_path, env, timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    job = re.search(r"submitted job (\d+) ", r.stdout).group(1)
    assert f"job {job}: COMPLETED" in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (run / "done").iterdir()) == ["rank-0.json", "rank-1.json"]
    assert _steps(run) == [1, 2, 3], _steps(run)
    attempts = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert [a["cause"] for a in attempts] == ["done"], attempts
    rows = _sacct_until(job, lambda rs: rs and rs[0][1] == "COMPLETED")
    assert rows and rows[0][1] == "COMPLETED", rows
    # after accounting has the job (slurmdbd records asynchronously: asked at once, sacct once had
    # no row yet and squeue had dropped the finished job), so a second submission would show too;
    # its WorkDir can trail the state row (8 Dec: the state COMPLETED read, the WorkDir query empty)
    ids, deadline = _jobs_from(tmp_path), time.monotonic() + 15
    while not ids and time.monotonic() < deadline:
        time.sleep(0.5)
        ids = _jobs_from(tmp_path)
    assert ids == [job]  # no second submission


def test_invalid_sweep_element_submits_nothing(slurm_env, tmp_path):
    base = [a for a in SMALL if not a.startswith("parallel.tp=")]  # the sweep sets tp itself
    r = _launch([*base, "-m", "parallel.tp=1,3", "parallel.pp=1,3", f"run.dir={tmp_path / 'bad'}", "--wait"],
                tmp_path, slurm_env, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for label in ("[parallel.tp=3 parallel.pp=1]", "[parallel.tp=1 parallel.pp=3]", "[parallel.tp=3 parallel.pp=3]"):
        assert label in r.stderr, r.stderr
    assert "[parallel.tp=1 parallel.pp=1]" not in r.stderr
    assert "3 of 4 sweep runs are invalid; nothing was started" in r.stderr
    assert "submitted" not in r.stdout
    assert not (tmp_path / "bad").exists()
    time.sleep(1.0)
    assert _jobs_from(tmp_path) == []


def test_launch_returns_the_wait_status(monkeypatch, tmp_path):
    """dispatch.launch returns SubmitResult.status (1: a job failed) after --wait, 0 when only submitted."""
    import types

    from paralayer import config as config_mod
    from paralayer import dispatch
    from paralayer.dispatch import slurm
    from paralayer.resolve import resolve

    seen = {}

    def fake_submit(run_dirs, cluster, folder=None, wait=False, **kw):
        seen.update(run_dirs=run_dirs, cluster=cluster, wait=wait)
        return slurm.SubmitResult(job_ids=["1"], run_dirs=list(run_dirs), folder=str(tmp_path), stdout=[[]],
                                  stderr=[[]], array=False, status=1 if wait else None)

    monkeypatch.setattr(slurm, "submit", fake_submit)
    for wait, want in ((True, 1), (False, 0)):
        cfg = config_mod.load_config(["recipe=tiny", "parallel.tp=1", "cluster=local-slurm",
                                      f"run.dir={tmp_path / str(wait)}"])
        assert dispatch.launch(cfg, resolve(cfg), types.SimpleNamespace(wait=wait)) == want
        assert seen["wait"] is wait and seen["cluster"]["devices_per_node"] == 2  # tiny: dp=2 -> 2 tasks
    # a sweep's array takes the largest element's shape
    cfgs = [config_mod.load_config(["recipe=tiny", "parallel.tp=1", "cluster=local-slurm", f"parallel.dp={dp}",
                                    "logging.wandb.group=g"]) for dp in (1, 2)]
    for c in cfgs:
        c.run.dir = ""
    cfgs[0].run.dir = str(tmp_path / "sw")
    assert dispatch.launch_sweep(cfgs, [resolve(c) for c in cfgs], types.SimpleNamespace(wait=True)) == 1
    assert seen["cluster"]["devices_per_node"] == 2 and len(seen["run_dirs"]) == 2


SECRET = "sk_PLANTED_5e1f0c9a7b"


def _files_holding(root: Path, needle: str) -> list[str]:
    hits = []
    for p in Path(root).rglob("*"):
        if p.is_file() and needle.encode() in p.read_bytes():
            hits.append(str(p))
    return hits


def test_default_recipe_four_ranks_and_no_secret_anywhere(slurm_env, tmp_path):
    """Issue 16: the README's `python launch.py cluster=local-slurm --wait` with the DEFAULT recipe
    (tiny: tp=2 × dp=2 = 4 ranks, more than this 2-core machine's cores) completes; with a planted
    WANDB_API_KEY (W&B offline) no file of the run (resolved.yaml, plan.json, metrics, W&B files),
    no SLURM log and nothing printed holds it. Issue 7's one job with --wait, on the same launch:
    the printed hint (job id, logs, how to follow), the states --wait followed, exit status 0, every
    step, sacct's COMPLETED."""
    run = tmp_path / "default"
    env = dict(slurm_env, WANDB_API_KEY=SECRET)
    t0 = time.monotonic()
    r = _launch(["cluster=local-slurm", f"run.dir={run}", "train.steps=3", "train.warmup_steps=1",
                 "logging.progress=true", "--wait"], tmp_path, env, timeout=400)
    took = time.monotonic() - t0
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    plan = json.loads((run / "plan.json").read_text())
    assert plan["world_size"] == 4 and plan["degrees"]["tp"] == 2 and plan["degrees"]["dp"] == 2
    assert _steps(run) == [1, 2, 3]
    assert list(run.glob("wandb/offline-run-*")), "W&B offline files were written"
    assert SECRET not in r.stdout + r.stderr
    assert _files_holding(tmp_path, SECRET) == []  # run dir and slurm-logs/ (submitit files, task logs)
    # the pre-flight rehearsal ran before the submission (the user's default path)
    assert "paralayer: pre-flight rehearsal of ranks [0] passed" in r.stderr, r.stderr[-3000:]
    m = re.search(r"submitted job (\d+) ", r.stdout)
    assert m, r.stdout
    job = m.group(1)
    # the hint: where the logs are and how to follow the job
    follow = re.search(r"follow with: tail -f (\S+_log\.out) (\S+_log\.err)", r.stdout)
    assert follow and Path(follow.group(1)).is_file(), r.stdout
    assert f"squeue -j {job}" in r.stdout and f"sacct -j {job}" in r.stdout
    assert str(run) in r.stdout and "metrics.jsonl" in r.stdout
    # --wait followed it: states and rank 0's log lines went by, then the end state
    assert "RUNNING" in r.stderr and f"job {job}: COMPLETED" in r.stderr, r.stderr[-3000:]
    assert "step 3/3" in r.stderr
    assert (run / "resolved.yaml").is_file()
    rows = _sacct_until(job, lambda rs: rs and rs[0][1] == "COMPLETED")
    assert rows and rows[0] == [job, "COMPLETED"], rows
    print(f"one job: {took:.0f}s")


@pytest.mark.parametrize("sweep", [False, True])
def test_submission_refused_is_one_line(slurm_env, tmp_path, sweep):
    """sbatch refusing the job (no such partition): one line, exit 2, for a job and a sweep alike."""
    args = [*SMALL, "cluster.slurm.partition=no-such-partition", f"run.dir={tmp_path / 'r'}", "--no-rehearse",
            "--wait"]
    if sweep:
        args += ["-m", "parallel.dp=1,2"]
    r = _launch(args, tmp_path, slurm_env, timeout=120)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]  # (progress lines aside)
    assert len(lines) == 1 and lines[0].startswith("error: cluster.slurm: submission failed:"), r.stderr
    assert "partition" in lines[0] and "Traceback" not in r.stderr and "sbatch: error" not in r.stderr.split(
        "submission failed:")[0]
