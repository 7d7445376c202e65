"""Checkpoints: exact resume on a mini loop (FSDP2 on 2 gloo ranks), resharding to tensor parallel
and to one plain process, expert-parallel → ep=1, atomicity under kill -9, corruption → clear error
and fallback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist

from paralayer.checkpoint.dcp import (
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    resume_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from paralayer.config import ModelConfig
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from tests.dist import paired, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# init std 0.2: at 0.02 every layout's loss sits near ln V and a stage left unrestored barely shows
CFG = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=61, seq_len=16, init_std=0.2)
GB = 4  # global batch


def _mcfg(**kw) -> ModelConfig:
    return ModelConfig(**{**CFG, **kw})


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    toks = torch.randint(0, CFG["vocab_size"], (GB, CFG["seq_len"] + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def _optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def _build(layout: str, mesh=None, vocab_padded=None):
    """A tiny model under 'plain' | 'fsdp' (dp=2) | 'tp' (tp=2)."""
    cfg = _mcfg()
    with torch.device("meta"):
        model = Transformer(cfg, vocab_padded)
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for layer in model.layers.values():
            parallelize_module(layer, mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()})
    model.to_empty(device="cpu")
    init_weights(model, cfg, seed=7)
    return model


def _step(model, opt, sched, step, layout, rank, world):
    x, y = _batch(step)
    if layout == "fsdp":  # data parallel: each rank its rows
        n = GB // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    loss = lm_loss(model(x), y, CFG["vocab_size"])
    loss.backward()
    norm = _grad_norm(model)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    torch.rand(1)  # consume RNG so a missing RNG restore would show
    out = loss.detach().clone()
    if layout == "fsdp":
        dist.all_reduce(out)
        out /= world
    return out.item(), norm


def _grad_norm(model) -> float:
    """The global gradient norm from the full gradients (a collective under FSDP/TP): losses
    through AdamW cannot see a uniform gradient-scale error (m/sqrt(v) is scale-free), this can."""
    from torch.distributed.tensor import DTensor
    total = sum(float((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).double().pow(2).sum())
                for p in model.parameters())
    return total ** 0.5


def _bytes(params: dict) -> dict:
    return {n: t.detach().numpy().tobytes() for n, t in params.items()}


def _full_params(model):
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in model.named_parameters()}


def _extra(step, sched):
    return {"step": step, "scheduler": sched.state_dict(), "rng": rng_state(), "data": {"step": step}}


def _restore(extra, sched):
    sched.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
    return extra["step"]


# ------------------------------------------------------------------ mini loop on 2 ranks
def _fsdp_resume(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(123)
    # straight run: 4 steps
    model = _build("fsdp", mesh)
    opt, sched = _optim(model)
    straight = [_step(model, opt, sched, s, "fsdp", rank, world) for s in range(1, 5)]
    final_straight = _full_params(model)
    rand_straight = torch.rand(3)

    # stopped run: 2 steps, save, then a fresh process state loads and continues
    torch.manual_seed(123)
    model = _build("fsdp", mesh)
    opt, sched = _optim(model)
    first = [_step(model, opt, sched, s, "fsdp", rank, world) for s in range(1, 3)]
    saved = _bytes(_full_params(model))
    save_checkpoint(root, 2, [model], [opt], _extra(2, sched), keep=3)
    del model, opt, sched
    torch.manual_seed(999)  # a different RNG state that the checkpoint must restore
    model = _build("fsdp", mesh)
    opt, sched = _optim(model)
    path = find_latest(root)
    extra = load_checkpoint(path, [model], [opt])
    same_loaded = _bytes(_full_params(model)) == saved
    k = _restore(extra, sched)
    resumed = [_step(model, opt, sched, s, "fsdp", rank, world) for s in range(k + 1, 5)]
    final_resumed = _full_params(model)
    same_params = all(torch.equal(final_straight[n], final_resumed[n]) for n in final_straight)
    return {"straight": straight, "resumed": first + resumed, "same_params": same_params, "saved": saved,
            "same_loaded": same_loaded, "same_rng": torch.equal(rand_straight, torch.rand(3)), "path": path, "k": k}


def _tp_resume(rank, world, root):
    """Load the dp=2 (FSDP) checkpoint under tp=2 and continue."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(5)
    model = _build("tp", mesh)
    opt, sched = _optim(model)
    extra = load_checkpoint(find_latest(root), [model], [opt])
    loaded = _bytes(_full_params(model))
    k = _restore(extra, sched)
    losses = [_step(model, opt, sched, s, "tp", rank, world) for s in range(k + 1, 5)]
    return {"losses": losses, "lr": sched.get_last_lr(), "loaded": loaded}


def test_exact_resume_and_reshard(tmp_path):
    root = str(tmp_path / "ckpt")
    res = run_ranks(_fsdp_resume, 2, root)
    r0 = res[0]
    assert r0["path"].endswith("step-00000002") and r0["k"] == 2
    assert r0["resumed"] == r0["straight"], "exact resume (fp32, same layout) must be bitwise"
    assert all(r["same_params"] for r in res), "final parameters differ after resume"
    assert all(r["same_rng"] for r in res), "RNG state not restored"
    assert os.listdir(root) == ["step-00000002"]
    verify_checkpoint(os.path.join(root, "step-00000002"))

    saved = r0["saved"]
    assert all(r["same_loaded"] and r["saved"] == saved for r in res), "FSDP -> FSDP: a parameter differs"

    def same_run(got: list, layout: str) -> None:
        """Losses and grad norms of steps 3-4 against the straight FSDP run."""
        errs = [max(abs(a[i] - b[i]) / abs(b[i]) for a, b in paired(got, r0["straight"][2:])) for i in (0, 1)]
        print(f"FSDP -> {layout}: max rel err loss {errs[0]:.1e}, grad norm {errs[1]:.1e}")
        assert errs[0] <= 1e-5 and errs[1] <= 1e-5, (layout, errs, got, r0["straight"])

    tp = run_ranks(_tp_resume, 2, root)
    for r in tp:  # bit for bit after the load, every parameter (tp shards joined)
        assert sorted(r["loaded"]) == sorted(saved) and len(saved) == 3 + 9 * CFG["n_layers"]
        assert all(r["loaded"][n] == saved[n] for n in saved), [n for n in saved if r["loaded"][n] != saved[n]]
    same_run(tp[0]["losses"], "tp 2")

    # one plain process (no process group) loads the sharded checkpoint too
    torch.manual_seed(0)
    model = _build("plain")
    opt, sched = _optim(model)
    extra = load_checkpoint(os.path.join(root, "step-00000002"), [model], [opt])
    loaded = _bytes(_full_params(model))
    assert sorted(loaded) == sorted(saved) and all(loaded[n] == saved[n] for n in saved)
    k = _restore(extra, sched)
    same_run([_step(model, opt, sched, s, "plain", 0, 1) for s in range(k + 1, 5)], "one rank")


# ------------------------------------------------------------------ pipeline-style parts + experts
def _moe_cfg():
    from paralayer.config import MoEConfig
    return _mcfg(moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden=24, capacity_factor=None))


def _stage(cfg, first: bool, last: bool, layers: list[int]):
    """A pipeline chunk: the full model class with the other parts removed (same FQNs)."""
    with torch.device("meta"):
        m = Transformer(cfg)
    for i in list(m.layers.keys()):
        if int(i) not in layers:
            del m.layers[i]
    if not first:
        m.tok_embeddings = None
    if not last:
        m.norm, m.output = None, None
    return m


def _ep_save(rank, world, root):
    """ep=2 experts, model split in two 'pipeline' parts held by every rank (one optimizer each)."""
    from paralayer.parallel.expert import apply_expert_parallel
    cfg = _moe_cfg()
    parts = [_stage(cfg, True, False, [0]), _stage(cfg, False, True, [1])]
    for p in parts:
        apply_expert_parallel(p, dist.group.WORLD)
        p.to_empty(device="cpu")
        init_weights(p, cfg, seed=3)
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    for p, o in zip(parts, opts):
        for prm in p.parameters():
            prm.grad = torch.full_like(prm, 0.5 + rank)
        o.step()
    save_checkpoint(root, 1, parts, opts, {"step": 1})
    ff = parts[0].layers["0"].feed_forward
    # lists, not tensors: a tensor through the result queue needs the child alive to hand over its fd
    return {"w1": ff.w1.detach().tolist(), "exp_avg": opts[0].state[ff.w1]["exp_avg"].tolist()}


def test_expert_parallel_parts_to_plain(tmp_path):
    root = str(tmp_path / "ckpt")
    res = run_ranks(_ep_save, 2, root)
    cfg = _moe_cfg()
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    init_weights(model, cfg, seed=11)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = load_checkpoint(find_latest(root), [model], [opt])
    assert extra["step"] == 1
    ff = model.layers["0"].feed_forward
    assert torch.equal(ff.w1.detach(), torch.cat([torch.tensor(res[0]["w1"]), torch.tensor(res[1]["w1"])]))
    assert torch.equal(opt.state[ff.w1]["exp_avg"],
                       torch.cat([torch.tensor(res[0]["exp_avg"]), torch.tensor(res[1]["exp_avg"])]))


# ------------------------------------------------------------------ atomicity: kill -9 mid-save
_SAVER = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {repo!r})
    import paralayer.checkpoint.dcp as ck
    root, mode = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(512, 1024)
    opt = torch.optim.AdamW(model.parameters())
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model.weight.fill_(step)
        if mode == "hook" and step == 3:
            def stall(path, _orig=ck._fsync_dir):  # all files written, COMPLETE not yet renamed in
                print("stalled", step, flush=True)
                time.sleep(60)
            ck._fsync_dir = stall
        print("begin", step, flush=True)
        ck.save_checkpoint(root, step, [model], [opt], {{"step": step}}, keep=2)
        print("saved", step, flush=True)
""")


def _kill_during_save(tmp_path, mode):
    root = str(tmp_path / mode)
    script = tmp_path / "saver.py"
    script.write_text(_SAVER.format(repo=REPO))
    proc = subprocess.Popen([sys.executable, str(script), root, mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for = "stalled 3" if mode == "hook" else "begin 4"
    try:
        for line in proc.stdout:
            if line.strip() == wait_for:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return root


@pytest.mark.parametrize("mode", ["hook", "random"])
def test_kill_during_save_keeps_previous(tmp_path, mode):
    root = _kill_during_save(tmp_path, mode)
    names = sorted(os.listdir(root))
    if mode == "hook":
        assert "step-00000003.tmp" in names, names
        assert "step-00000003" not in names
    latest = find_latest(root)
    want = 2 if mode == "hook" else None
    assert latest is not None
    step = int(os.path.basename(latest)[5:])
    if want:
        assert step == want
    model = torch.nn.Linear(512, 1024)
    opt = torch.optim.AdamW(model.parameters())
    extra = load_checkpoint(latest, [model], [opt])
    assert extra["step"] == step and torch.all(model.weight == step)
    # the next save cleans the stale .tmp and keeps 2
    save_checkpoint(root, step + 1, [model], [opt], {"step": step + 1}, keep=2)
    names = sorted(os.listdir(root))
    assert not any(n.endswith(".tmp") for n in names) and len(names) == 2, names


# ------------------------------------------------------------------ corruption
def _two_checkpoints(root):
    model = torch.nn.Linear(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    for s in (1, 2):
        with torch.no_grad():
            model.weight.fill_(s)
        save_checkpoint(root, s, [model], [opt], {"step": s})
    return model, opt


def test_truncated_file_named_and_fallback(tmp_path):
    root = str(tmp_path)
    model, opt = _two_checkpoints(root)
    newest = list_checkpoints(root)[-1]
    victim = next(os.path.join(newest, f) for f in sorted(os.listdir(newest)) if f.endswith(".distcp"))
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_checkpoint(newest, [model], [opt])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        latest = find_latest(root)
    assert latest.endswith("step-00000001")
    assert any(victim in str(w.message) for w in rec), [str(w.message) for w in rec]
    path, extra = resume_latest(root, [model], [opt])
    assert path.endswith("step-00000001") and extra["step"] == 1 and torch.all(model.weight == 1)


def test_flipped_byte_and_missing_marker(tmp_path):
    root = str(tmp_path)
    model, opt = _two_checkpoints(root)
    newest = list_checkpoints(root)[-1]
    victim = os.path.join(newest, ".metadata")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="digest") as err:
        load_checkpoint(newest, [model], [opt])
    assert victim in str(err.value)
    with pytest.warns(UserWarning, match="digest"):
        path, extra = resume_latest(root, [model], [opt])
    assert extra["step"] == 1 and torch.all(model.weight == 1)
    assert os.path.isdir(newest + ".damaged") and not os.path.exists(newest)  # set aside, not deleted
    # a directory without its COMPLETE marker is never picked
    save_checkpoint(root, 2, [model], [opt], {"step": 2})
    os.remove(os.path.join(newest, "COMPLETE"))
    assert find_latest(root).endswith("step-00000001")
    with pytest.raises(CheckpointError, match="COMPLETE"):
        load_checkpoint(newest, [model], [opt])
    assert find_latest(str(tmp_path / "nothing")) is None


def test_extra_is_weights_only(tmp_path):
    """A pickle that would run code is refused by the extra-state loader."""
    root = str(tmp_path)
    model, opt = _two_checkpoints(root)
    newest = list_checkpoints(root)[-1]

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    fp = os.path.join(newest, "extra-rank00000.pt")
    torch.save({"x": Evil()}, fp)
    with pytest.raises(CheckpointError, match="extra-rank00000.pt"):
        load_checkpoint(newest, [model], [opt], verify=False)
