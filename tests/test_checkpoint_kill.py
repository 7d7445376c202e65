"""Kill during save: SIGKILL the training rank at random moments inside checkpoint saves, 20+ times
over one run; each restart with train.resume=auto continues from the newest complete checkpoint,
loses at most checkpoint.every steps, and at the end metrics.jsonl holds every step exactly once,
with the losses of a run that was never killed (bit for bit).

Cheap enough for CI: the rank is a process forked from this already-imported test process (no
torch import per trial), the model is tiny, and the moment of death is drawn among the save's own
file operations (each fsync, rename and removal of DCP's writer, the digests, the manifest, the
atomic rename and retention), so every phase of a save is hit without timing luck.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import time

import pytest
import torch

from paralayer.checkpoint.dcp import list_checkpoints, verify_checkpoint
from tests.dist import warm, write_tokens

STEPS, EVERY, TRIALS = 50, 2, 20
SEQ = 16
BASE = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64",
        "model.vocab_size=64", f"model.seq_len={SEQ}", "train.global_batch=2", "train.micro_batch=1",
        f"train.steps={STEPS}", "train.lr=3e-3", "train.warmup_steps=1", "train.precision=fp32",
        "train.threads=1", "data.format=tokens", "data.shuffle=true", "logging.wandb.mode=disabled",
        "logging.progress=false", f"checkpoint.every={EVERY}", "checkpoint.keep=2", "parallel.tp=1",
        "cluster.device=cpu", "cluster.peak_tflops=1.0"]


def _data(tmp: str) -> str:
    return write_tokens(os.path.join(tmp, "tokens.jsonl"), 64, SEQ, 64)


def _rank(overrides: list[str], run_dir: str, kill_at: int, log: str, rank: int, world: int, store: str) -> None:
    """One rank in a forked child; SIGKILLs itself at the ``kill_at``-th file operation of a save."""
    import torch.distributed as dist

    import paralayer.checkpoint.dcp as ckpt
    from paralayer.runtime.train import train
    from tests.dist import cfg_and_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    state = {"ops": 0, "saving": None}

    def note(**kw):
        with open(log, "a") as f:
            f.write(json.dumps(kw) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def counted(fn):
        def wrapper(*a, **k):
            if state["saving"] is not None:
                state["ops"] += 1
                if state["ops"] == kill_at:
                    note(killed_in_save_of=state["saving"], op=fn.__name__)
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapper

    os.fsync, os.replace, shutil.rmtree = counted(os.fsync), counted(os.replace), counted(shutil.rmtree)
    save, resume = ckpt.Checkpointer.save, ckpt.resume_latest

    def saving(self, step, *a, **k):
        state["saving"] = step
        try:
            return save(self, step, *a, **k)
        finally:
            state["saving"] = None

    def resuming(*a, **k):
        found = resume(*a, **k)
        if rank == 0:
            note(resumed_from=found[0] if found else None)
        return found

    ckpt.Checkpointer.save, ckpt.resume_latest = saving, resuming
    cfg, plan = cfg_and_plan(overrides)
    train(cfg, plan, run_dir)
    if rank == 0:
        note(finished=True)
    os._exit(0)


def _fork(overrides, run_dir, kill_at, log, world: int = 1, killer: int = 0) -> int:
    """``world`` forked ranks; rank ``killer`` dies at its ``kill_at``-th save operation and the
    others are SIGKILLed at once (as a node failure or scancel would). Returns the killer's exit code."""
    warm()  # the runtime imported here once: each trial's ranks fork with it (~1 CPU-s a rank otherwise)
    ctx = mp.get_context("fork")
    store = os.path.join(run_dir, f"store-{os.getpid()}-{random.getrandbits(32)}")
    procs = [ctx.Process(target=_rank, args=(overrides, run_dir, kill_at if r == killer else 0, log, r, world, store))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"trial did not end within 120 s (kill_at={kill_at})")
        time.sleep(0.01)
    for p in procs:
        p.join()
    return procs[killer].exitcode


def _events(log):
    with open(log) as f:
        return [json.loads(line) for line in f]


def _newest_complete(root):
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path, full=True)
            return path
        except Exception:  # noqa: BLE001
            continue
    return None


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("world,trials", [(1, TRIALS), (2, 4)])
def test_sigkill_during_saves_never_loses_more_than_every(tmp_path, world, trials):
    """20 kills of a one-rank run; 4 of a two-rank (dp=2) run, where a random rank dies mid-save
    and the other is killed with it."""
    tmp = str(tmp_path)
    data = _data(tmp)
    straight_dir = os.path.join(tmp, "straight")
    os.makedirs(straight_dir)
    common = BASE + [f"data.path={data}", f"data.cache_dir={os.path.join(tmp, 'cache')}", f"parallel.dp={world}"]
    assert _fork(common + [f"run.dir={straight_dir}", "checkpoint.every=0"], straight_dir, 0,
                 os.path.join(tmp, "straight.log"), world) == 0
    straight = {r["step"]: r["loss"] for r in _metrics(straight_dir)}
    assert sorted(straight) == list(range(1, STEPS + 1))

    run_dir, root = os.path.join(tmp, "run"), os.path.join(tmp, "run", "ckpt")
    os.makedirs(run_dir)
    overrides = common + [f"run.dir={run_dir}", f"checkpoint.dir={root}", "train.resume=auto"]
    rng = random.Random(15)
    kills, ops_seen, trial = 0, set(), 0
    while kills < trials:
        trial += 1
        assert trial <= 3 * trials, "the run finished before enough kills"
        log = os.path.join(tmp, f"trial{trial}.log")
        newest_before = _newest_complete(root)
        code = _fork(overrides, run_dir, rng.randint(1, 30), log, world, rng.randrange(world))
        ev = _events(log)
        # resume=auto took the newest complete checkpoint (or started fresh when there was none)
        assert ev[0]["resumed_from"] == newest_before, (trial, ev, newest_before)
        if code == 0:
            assert ev[-1] == {"finished": True}
            break
        assert code == -signal.SIGKILL, (trial, code)
        kills += 1
        killed = ev[-1]
        ops_seen.add(killed["op"])
        newest = _newest_complete(root)
        step_now = int(os.path.basename(newest)[5:]) if newest else 0
        # the save of step S was under way: at most `every` steps are lost
        assert killed["killed_in_save_of"] - step_now <= EVERY, (trial, killed, newest)
        assert not [n for n in os.listdir(root) if n.endswith(".damaged")]  # a kill never damages
    assert kills >= trials
    if trials >= 20:  # DCP's writes, the manifest and the rename were all hit
        assert ops_seen >= {"fsync", "replace"}, ops_seen
    if code != 0:  # finish the run
        assert _fork(overrides, run_dir, 0, os.path.join(tmp, "last.log"), world) == 0
    metrics = _metrics(run_dir)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))  # every step exactly once
    assert {r["step"]: r["loss"] for r in metrics} == straight  # and bit for bit the straight run's
