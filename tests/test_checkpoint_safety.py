"""Checkpoints that never lose a run: retention around damaged checkpoints, resume falling back past
whatever torch raises, one clear error when nothing loads, per-rank digests, asynchronous save."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from paralayer.checkpoint.dcp import (
    Checkpointer,
    CheckpointError,
    load_checkpoint,
    resume_latest,
    save_checkpoint,
)
from paralayer.checkpoint.manifest import COMPLETE, digest_bytes, digest_file
from tests.dist import run_ranks


def _linear(fill: float):
    model = torch.nn.Linear(8, 16)
    with torch.no_grad():
        model.weight.fill_(fill)
    return model, torch.optim.AdamW(model.parameters())


def _save(root, step, keep=None):
    model, opt = _linear(step)
    return save_checkpoint(root, step, [model], [opt], {"step": step}, keep=keep)


def _shard(path):
    return os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0])


def _rewrite_manifest(path, name, data: bytes):
    """Replace a file and make the manifest agree with it (damage the digests cannot see)."""
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)
    with open(os.path.join(path, COMPLETE)) as f:
        man = json.load(f)
    entry = man["files"][name]
    entry["size"] = len(data)
    if "segments" in entry:
        entry["segments"] = [[0, len(data), digest_bytes(data)]]
    else:
        entry["digest"] = digest_bytes(data)
    with open(os.path.join(path, COMPLETE), "w") as f:
        json.dump(man, f)


def _messages(rec):
    return [str(w.message) for w in rec]


# ------------------------------------------------------------------ 1. retention
def test_retention_sets_damaged_aside_and_keeps_fresh(tmp_path):
    """The issue's case: every=1, keep=2, the directory already holds step-40 (truncated shard) and
    step-20 (garbage manifest), both COMPLETE. The fresh checkpoints survive; the damaged ones are
    renamed step-N.damaged with a warning naming the file and the reason."""
    root = str(tmp_path)
    p40, p20 = _save(root, 40), _save(root, 20)
    victim = _shard(p40)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with open(os.path.join(p20, COMPLETE), "w") as f:
        f.write("{garbage")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            _save(root, step, keep=2)
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003", "step-00000020.damaged",
                                        "step-00000040.damaged"]
    msgs = _messages(rec)
    assert any(victim in m and "truncated" in m and "step-00000040.damaged" in m for m in msgs), msgs
    assert any(os.path.join(p20, COMPLETE) in m and "corrupt manifest" in m for m in msgs), msgs
    model, opt = _linear(0)
    assert load_checkpoint(os.path.join(root, "step-00000003"), [model], [opt])["step"] == 3
    assert torch.all(model.weight == 3)


def test_retention_never_deletes_the_one_just_written(tmp_path):
    """Older steps written after newer verified ones (a run restarted with resume=none): the new
    checkpoint is kept even though two verified ones are newer; beyond that, keep=2 holds."""
    root = str(tmp_path)
    _save(root, 50)
    _save(root, 40)
    _save(root, 1, keep=2)
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000040", "step-00000050"]
    _save(root, 60, keep=2)
    assert sorted(os.listdir(root)) == ["step-00000050", "step-00000060"]


# ------------------------------------------------------------------ 2. resume past BaseException
def _resume_two_ranks(rank, world, root):
    model = torch.nn.Linear(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        path, extra = resume_latest(root, [model], [opt])
    return {"path": path, "step": extra["step"], "weight": float(model.weight[0, 0]), "warnings": _messages(rec)}


def _save_two_ranks(rank, world, root):
    for step in (1, 2, 3):
        model, opt = _linear(step)
        save_checkpoint(root, step, [model], [opt], {"step": step})


def _damage(root):
    """step-3's first shard: bytes the manifest agrees with that are not a tensor; step-2: garbage .metadata."""
    p3, p2 = os.path.join(root, "step-00000003"), os.path.join(root, "step-00000002")
    _rewrite_manifest(p3, os.path.basename(_shard(p3)), b"not a tensor" * 100)
    _rewrite_manifest(p2, ".metadata", b"\x80\x04garbage")
    return p3, p2


def _save_damage_resume(rank, world, root):
    """Save steps 1-3 on both ranks, rank 0 damages step-3 and step-2 (the ranks wait), then resume:
    one world for what two did."""
    _save_two_ranks(rank, world, root)
    dist.barrier()
    if rank == 0:
        _damage(root)
    dist.barrier()
    return _resume_two_ranks(rank, world, root)


def test_resume_falls_back_past_what_torch_raises(tmp_path):
    """step-3: a shard whose bytes match the manifest but are not a tensor (torch.load fails inside
    DCP: CheckpointException, a BaseException); step-2: a garbage .metadata the manifest agrees with.
    On 2 ranks resume=auto names both, loads step-1 and sets the two aside."""
    root = str(tmp_path)
    res = run_ranks(_save_damage_resume, 2, root)
    p3, p2 = os.path.join(root, "step-00000003"), os.path.join(root, "step-00000002")
    for r in res:
        assert r["path"].endswith("step-00000001") and r["step"] == 1 and r["weight"] == 1.0
    msgs = res[0]["warnings"]
    assert any(f"skipping checkpoint {p3}" in m for m in msgs), msgs
    assert any(f"skipping checkpoint {p2}" in m for m in msgs), msgs
    assert res[1]["warnings"] == [] or not any("skipping" in m for m in res[1]["warnings"])  # rank 0 reports
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002.damaged", "step-00000003.damaged"]


# ------------------------------------------------------------------ 3. nothing loads
def test_all_damaged_is_an_error_not_a_fresh_start(tmp_path):
    root = str(tmp_path / "ckpt")
    model, opt = _linear(0)
    assert resume_latest(root, [model], [opt]) is None  # no checkpoint at all: start fresh
    for step in (1, 2):
        _save(root, step)
    for step in (1, 2):
        victim = _shard(os.path.join(root, f"step-{step:08d}"))
        with open(victim, "r+b") as f:
            f.truncate(3)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as err:
            resume_latest(root, [model], [opt])
    msg = str(err.value)
    assert "\n" not in msg and root in msg and "none loads" in msg
    assert "step-00000002: " in msg and "step-00000001: " in msg and "truncated" in msg
    # nothing was renamed (nothing loaded, so no proof the model fits): a rerun fails the same way
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]
    os.rename(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000002.damaged"))
    os.rename(os.path.join(root, "step-00000001"), os.path.join(root, "step-00000001.damaged"))
    with pytest.raises(CheckpointError, match="set aside earlier as damaged: step-00000001.damaged"):
        resume_latest(root, [model], [opt])


# ------------------------------------------------------------------ per-rank digests
def _fsdp_model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # optimizer state exists (a load overwrites it)
    opt.zero_grad()
    return model, opt


def _save_fsdp(rank, world, root):
    model, opt = _fsdp_model(world)
    save_checkpoint(root, 1, [model], [opt], {"step": 1})


def _load_fsdp(rank, world, path):
    model, opt = _fsdp_model(world)
    try:
        load_checkpoint(path, [model], [opt])
    except CheckpointError as exc:
        return {"kind": type(exc).__name__, "msg": str(exc)}
    return {"kind": None}


def _save_load_fsdp(rank, world, root):
    """Save step 1, then (every rank past the save, the manifest written) load it back."""
    _save_fsdp(rank, world, root)
    dist.barrier()
    return _load_fsdp(rank, world, os.path.join(root, "step-00000001"))


def test_each_rank_digests_what_it_wrote_and_verifies_what_it_reads(tmp_path):
    root = str(tmp_path)
    loaded = run_ranks(_save_load_fsdp, 2, root)  # saved, then loaded intact, in one world
    path = os.path.join(root, "step-00000001")
    with open(os.path.join(path, COMPLETE)) as f:
        manifest = json.load(f)
    per_rank = []
    for r in (0, 1):
        with open(os.path.join(path, f"digests-rank{r:05d}.json")) as f:
            per_rank.append(json.load(f)["files"])
    assert set(per_rank[0]) == {".metadata", "__0_0.distcp", "extra-rank00000.pt"}
    assert set(per_rank[1]) == {"__1_0.distcp", "extra-rank00001.pt"}
    assert manifest["files"] == {**per_rank[0], **per_rank[1]}
    shard = os.path.join(path, "__1_0.distcp")
    segs = manifest["files"]["__1_0.distcp"]["segments"]
    assert len(segs) >= 4 and sum(ln for _o, ln, _d in segs) == os.path.getsize(shard)
    assert all(digest_file(shard, o, ln) == d for o, ln, d in segs)
    assert loaded == [{"kind": None}] * 2
    # flip one byte in the middle of a storage item of rank 1's file: same size, so only the
    # digest of the item rank 1 reads can tell; both ranks raise, naming that file
    off, ln, _ = segs[len(segs) // 2]
    with open(shard, "r+b") as f:
        f.seek(off + ln // 2)
        b = f.read(1)
        f.seek(off + ln // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    res = run_ranks(_load_fsdp, 2, path)
    for r in res:
        assert r["kind"] == "CheckpointDamaged" and shard in r["msg"] and "digest" in r["msg"], r


# ------------------------------------------------------------------ asynchronous save
def _async_loop(rank, world, root):
    from paralayer.checkpoint.group import checkpoint_group

    def steps(model, opt, ks, ck=None):
        out = []
        for k in ks:
            g = torch.Generator().manual_seed(k * 10 + rank)
            loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            val = loss.detach().clone()
            dist.all_reduce(val)
            out.append(val.item())
            if ck is not None:
                if k == 2:
                    ck.save(k, [model], [opt], {"step": k})
                else:
                    ck.poll()
        return out

    model, opt = _fsdp_model(world)
    straight = steps(model, opt, range(1, 6))
    model, opt = _fsdp_model(world)
    ck = Checkpointer(root, keep=2, group=checkpoint_group(60), async_save=True, timeout_s=60)
    steps(model, opt, range(1, 6), ck)
    ck.wait()
    model, opt = _fsdp_model(world)
    extra = load_checkpoint(os.path.join(root, "step-00000002"), [model], [opt])
    resumed = steps(model, opt, range(extra["step"] + 1, 6))
    return {"straight": straight, "resumed": resumed}


def test_async_save_then_resume_is_bitwise(tmp_path):
    """dcp.async_save copies the state, training goes on (steps 3-5 change every tensor), and the
    step-2 checkpoint resumed gives steps 3-5 bit for bit."""
    root = str(tmp_path)
    res = run_ranks(_async_loop, 2, root)
    for r in res:
        assert r["resumed"] == r["straight"][2:]
    assert sorted(os.listdir(root)) == ["step-00000002"]


def _train_run(rank, world, overrides, run_dir):
    from paralayer.runtime.train import train
    from tests.dist import cfg_and_plan

    cfg, plan = cfg_and_plan(overrides)
    return [{"step": r["step"]} for r in train(cfg, plan, run_dir)]


def test_launch_with_only_damaged_checkpoints_exits_2_with_one_line(tmp_path):
    """Through launch.py: a run leaves 2 checkpoints, both get truncated; resume=auto ends with exit
    2, no traceback, and one error line naming the directory and each checkpoint's reason."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
           "model.n_kv_heads=2", "model.ffn_hidden=64", "model.seq_len=32", "train.steps=2", "train.global_batch=2",
           "train.micro_batch=1", "checkpoint.every=1", f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled",
           "logging.progress=false", f"data.cache_dir={tmp_path / 'cache'}", "cluster.device=cpu",
           "cluster.peak_tflops=1.0"]

    def launch(*extra):
        return subprocess.run([sys.executable, os.path.join(repo, "launch.py"), *run, *extra], capture_output=True,
                              text=True, timeout=300, cwd=repo, env={**os.environ, "PYTHONPATH": repo})

    # the run that leaves the checkpoints: train() in a forked rank (what launch.py's rank runs; the
    # test is about the second launch, and a launch.py process costs ~3 CPU-s of imports)
    os.makedirs(tmp_path / "run")
    assert [r["step"] for r in run_ranks(_train_run, 1, run, str(tmp_path / "run"))[0]] == [1, 2]
    root = str(tmp_path / "run" / "checkpoints")
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]
    for step in (1, 2):
        victim = _shard(os.path.join(root, f"step-{step:08d}"))
        with open(victim, "r+b") as f:
            f.truncate(10)
    r = launch("train.resume=auto")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"checkpoint.dir {root} holds checkpoints but none loads" in errors[0], r.stderr
    assert "step-00000002: " in errors[0] and "step-00000001: " in errors[0] and "truncated" in errors[0]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl") or \
        [json.loads(x)["step"] for x in open(tmp_path / "run" / "metrics.jsonl")] == [1, 2]  # nothing retrained
