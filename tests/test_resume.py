"""End-to-end resume through ``paralayer.runtime.train.train``: stop at k, resume=auto, steps k+1..2k equal
the straight run (bitwise on the same layout), and a tp=2 × pp=2 checkpoint resumed under dp=4: every
parameter's full tensor after the load equals the saved one bit for bit, and loss and grad norm
follow the straight run (init std 0.2: at 0.02 a stage left at its init moved the loss by 4e-6)."""
from __future__ import annotations

import os

import pytest

from paralayer.config import load_config
from paralayer.resolve.plan import resolve
from tests.dist import paired, run_ranks, write_tokens

SEQ = 16
#: 2 layers: one a pipeline stage under pp2 (a stage-to-global layer index slip still shows); 4 doubled
#: every step's passes and the saves' tensors for nothing the checks need
LAYERS = 2
BASE = ["model.d_model=32", f"model.n_layers={LAYERS}", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=48",
        "model.vocab_size=64", f"model.seq_len={SEQ}", "model.init_std=0.2", "train.global_batch=8",
        "train.micro_batch=2", "train.steps=4", "train.lr=3e-3", "train.warmup_steps=1", "train.precision=fp32",
        "train.threads=1", "data.format=tokens", "data.shuffle=false", "logging.wandb.mode=disabled",
        "logging.progress=false", "checkpoint.every=2", "checkpoint.keep=2"]


def _data(tmp):
    return write_tokens(os.path.join(tmp, "tokens.jsonl"), 64, SEQ, 64)


def _full_params(chunks) -> dict:
    """{name: bytes} of the full tensor of every parameter this rank's chunks hold (collective
    over the ranks that shard them: every rank calls it at the same point)."""
    from torch.distributed.tensor import DTensor

    from paralayer.model.transformer import _clean_name

    return {_clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().tobytes()
            for c in chunks for n, p in c.named_parameters()}


def _rank_train(rank, world, jobs):
    """For each (cfg, plan, run_dir) of ``jobs`` in turn, in this one world (a straight run, a stopped
    one and its resume share one fork): train(), the full parameters at its checkpoint save and right
    after its resume (the runtime's own _save and resume, wrapped in this forked rank only), and the
    checkpoint folder's listing once every rank's train() has returned."""
    import torch.distributed as dist

    from paralayer.runtime import rank_checkpoints as C
    from paralayer.runtime import train as T

    seen: dict = {}
    save, resume = C._save, C.resume

    def saving(run, step):
        seen["saved"] = _full_params(run.built.chunks)
        return save(run, step)

    def resuming(run):
        start = resume(run)
        seen["loaded"] = _full_params(run.built.chunks)
        return start

    C._save, C.resume = saving, resuming  # where train() and save_if_due look them up
    out = []
    for cfg, plan, run_dir in jobs:
        seen = {}
        recs = T.train(cfg, plan, run_dir)
        dist.barrier()
        ckpt = cfg.checkpoint.dir
        listing = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        recs = [{"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"], "lr": r["lr"]} for r in recs]
        out.append((recs, seen, listing))
    return out


def _runs(tmp, jobs: list) -> list:
    """[(rank 0's records, {"saved" | "loaded": {name: bytes}}, the checkpoint listing)] of each
    (name, layout, extra) of ``jobs``, in turn in one world (the jobs share one world size)."""
    args = []
    for name, layout, extra in jobs:
        run_dir = os.path.join(tmp, name)
        os.makedirs(run_dir, exist_ok=True)
        ckpt = os.path.join(tmp, "ckpt-" + name.split("-")[0])
        cfg = load_config(BASE + [f"data.path={_data(tmp)}", f"checkpoint.dir={ckpt}", f"run.dir={run_dir}"]
                          + layout + extra)
        plan = resolve(cfg).to_dict()
        assert not plan["errors"], plan["errors"]
        args.append((cfg, plan, run_dir))
    assert len({plan["world_size"] for _, plan, _ in args}) == 1, [plan["world_size"] for _, plan, _ in args]
    res = run_ranks(_rank_train, args[0][1]["world_size"], args, timeout_s=300)
    out = []
    for i in range(len(jobs)):
        params: dict = {}  # merged over the ranks (replicas must agree)
        for per_rank in res:
            for when, tensors in per_rank[i][1].items():
                for name, data in tensors.items():
                    assert params.setdefault(when, {}).setdefault(name, data) == data, (when, name)
        out.append((res[0][i][0], params, res[0][i][2]))
    return out


#: the 2-rank jobs of the same-layout and the async-save tests: ONE forked world runs the six in turn
#: (a world and its first train()'s warm-up less); (name, layout, extra) as _runs takes them
SAME, ASYNC = ["parallel.dp=2", "parallel.zero=1"], ["parallel.dp=2", "parallel.zero=0"]
DP2_JOBS = [("straight-a", SAME, ["checkpoint.every=0"]), ("same-1", SAME, ["train.stop_at_step=2"]),
            ("same-2", SAME, ["train.resume=auto"]), ("straight-c", ASYNC, ["checkpoint.every=0"]),
            ("async-1", ASYNC, ["train.stop_at_step=3", "checkpoint.every=1", "checkpoint.async_save=true"]),
            ("async-2", ASYNC, ["train.resume=auto", "checkpoint.async_save=true"])]


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory) -> dict:
    """{job name: _runs' (records, params, listing)} of :data:`DP2_JOBS`, one world for all."""
    return dict(zip([j[0] for j in DP2_JOBS], _runs(str(tmp_path_factory.mktemp("dp2")), DP2_JOBS)))


def test_exact_resume_same_layout(dp2_runs):
    straight, first, second = (dp2_runs[k][0] for k in ("straight-a", "same-1", "same-2"))
    assert [r["step"] for r in first] == [1, 2]
    assert [r["step"] for r in second] == [3, 4]
    assert first + second == straight  # bitwise: loss, grad norm, lr


def test_resume_tp2_pp2_as_dp4(tmp_path):
    tmp = str(tmp_path)
    mixed = ["parallel.dp=1", "parallel.tp=2", "parallel.pp=2"]
    (straight, _, _), (first, saved, _), (second, loaded, _) = _runs(tmp, [
        ("straight-b", mixed, ["checkpoint.every=0"]), ("mixed-1", mixed, ["train.stop_at_step=2"]),
        ("mixed-2", ["parallel.dp=4", "parallel.tp=1", "parallel.pp=1"], ["train.resume=auto"])])
    assert first == straight[:2]
    assert [r["step"] for r in second] == [3, 4]
    # bit for bit after the load: every parameter of both pipeline stages, tp shards joined
    assert sorted(saved["saved"]) == sorted(loaded["loaded"]) and len(loaded["loaded"]) == 2 + LAYERS * 9 + 1
    for name, data in saved["saved"].items():
        assert loaded["loaded"][name] == data, name
    print("tp2 pp2 -> dp4: max rel err loss %.1e, grad norm %.1e" % tuple(
        max(abs(a[k] - b[k]) / abs(b[k]) for a, b in paired(second, straight[2:])) for k in ("loss", "grad_norm")))
    for got, want in paired(second, straight[2:]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (second, straight)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * abs(want["grad_norm"]), (second, straight)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)


def test_exact_resume_async_save(dp2_runs):
    """checkpoint.async_save=true: saves at every step are written while the next steps run; the run
    stopped at 3 and resumed equals the straight run bit for bit."""
    straight, (first, _, names), second = dp2_runs["straight-c"][0], dp2_runs["async-1"], dp2_runs["async-2"][0]
    assert names == ["step-00000002", "step-00000003"], names  # keep=2, all complete after the run
    assert [r["step"] for r in second] == [4]
    assert first + second == straight


def _decay_after_resume(rank, world, tmp, run_dir):
    """Train 2 steps with weight decay 0.1 (a checkpoint at step 2), then set up the run again
    with 0.03 and resume: the optimizer's groups hold the recipe's 0.03, not the checkpoint's."""
    from paralayer.runtime import rank_checkpoints as C
    from paralayer.runtime import train as T

    def cfg_plan(wd):
        cfg = load_config(BASE + [f"data.path={_data(tmp)}", "parallel.dp=1", "parallel.tp=1", "train.resume=auto",
                                  f"train.weight_decay={wd}", f"checkpoint.dir={run_dir}/ck", "train.stop_at_step=2"])
        return cfg, resolve(cfg)

    T.train(*cfg_plan(0.1), run_dir=run_dir)
    cfg, plan = cfg_plan(0.03)
    run = T.setup(cfg, plan, run_dir)
    start = C.resume(run)
    return start, sorted({g["weight_decay"] for g in run.opt.param_groups})


def test_resume_keeps_the_recipes_weight_decay(tmp_path):
    """DCP restores each group's hyperparameters from the checkpoint; the recipe's value wins
    (a changed train.weight_decay, or the new weight_decay_1d default, takes effect on resume)."""
    start, decays = run_ranks(_decay_after_resume, 1, str(tmp_path), str(tmp_path / "run"))[0]
    assert start == 3
    assert decays == [0.0, 0.03], decays  # 1-D gains undecayed, matrices at the recipe's 0.03
