"""One-rank ``train()`` against a plain PyTorch loop written here: the oracle of the reference every
parity test compares with.

The loop takes only the model (our class and init, at init std 0.2) from paralayer; the rest is
torch's own: ``torch.optim.AdamW`` over parameter groups chosen here (no decay on 1-D parameters
unless ``train.weight_decay_1d``), ``LambdaLR`` with a warmup + cosine written here, the whole
global batch in one forward, ``F.cross_entropy`` over its valid labels, ``clip_grad_norm_``, and
the batches read from the token file here (``data.format=tokens``, step k = lines (k-1)·B … k·B-1).
lr, loss and grad norm must agree over 5 steps; a planted error (warmup off by one, weight decay on
the norm gains, a cosine that ends at 0, microbatch losses summed instead of averaged) must not.
Plus a table test of ``lr_lambda``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist import cfg_and_plan, paired, run_ranks, write_tokens

SEQ, VOCAB, GB, STEPS, WARMUP = 32, 64, 8, 5, 2
LR, WD, MIN_RATIO = 1e-2, 0.5, 0.1  # a large decay, so decaying the gains or not shows in 5 steps
BASE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=48",
        f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", "model.init_std=0.2", "parallel.dp=1", "parallel.tp=1",
        f"train.global_batch={GB}", "train.micro_batch=2", f"train.steps={STEPS}", f"train.lr={LR}",
        f"train.warmup_steps={WARMUP}", f"train.min_lr_ratio={MIN_RATIO}", f"train.weight_decay={WD}",
        "train.grad_clip=0.5", "train.precision=fp32", "train.threads=1", "data.format=tokens",
        "data.shuffle=false", "logging.wandb.mode=disabled", "logging.progress=false",
        "cluster.device=cpu", "cluster.peak_tflops=1.0"]
LOSS_TOL, NORM_TOL = 2e-6, 2e-6  # relative: microbatches of 2 against one batch of 8, foreach against for-loop


def _token_file(tmp: str) -> str:
    return write_tokens(os.path.join(tmp, "tokens.jsonl"), GB * STEPS, SEQ, VOCAB)


def _loop_lr(i: int, steps: int = STEPS, warmup: int = WARMUP, min_ratio: float = MIN_RATIO) -> float:
    """The LR multiplier of optimizer step i+1 (LambdaLR's argument i = steps taken): warmup
    1/W, 2/W, …, 1 over steps 1..W, then half a cosine from 1 to ``min_ratio`` at the last step."""
    k = i + 1
    if k <= warmup:
        return k / warmup
    t = (k - warmup) / (steps - warmup)
    return min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * t)) / 2.0


def _plain_loop(cfg, token_path: str, decay_1d: bool) -> list[dict]:
    from paralayer.model.transformer import Transformer, init_weights

    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, cfg.model, cfg.train.seed)
    params = list(model.parameters())
    decayed = [p for p in params if p.ndim >= 2 or decay_1d]
    plain = [p for p in params if not (p.ndim >= 2 or decay_1d)]
    groups = [{"params": decayed, "weight_decay": WD}] + ([{"params": plain, "weight_decay": 0.0}] if plain else [])
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _loop_lr)
    with open(token_path) as f:
        lines = [json.loads(ln)["input_ids"] for ln in f]
    records = []
    for step in range(1, STEPS + 1):
        ids = torch.tensor(lines[(step - 1) * GB: step * GB])
        lr = sched.get_last_lr()[0]
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        records.append({"step": step, "lr": lr, "loss": loss.item(), "grad_norm": norm.item()})
    return records


def _planted(plant: str, build, optimizer, T):
    """Put one error into our code (in this forked rank only); return the undo."""
    from paralayer.parallel.grad_scaling import GradScaling

    good_lambda, good_decays, good_scaling = build.lr_lambda, optimizer.decays, T.grad_scaling
    if plant == "warmup_off_by_one":  # step k gets (k-1)/W: the first step at lr 0
        build.lr_lambda = lambda c: (lambda s: good_lambda(c)(s - 1) if s >= 1 else 0.0)
    elif plant == "cosine_to_zero":
        build.lr_lambda = lambda c: good_lambda(
            dataclasses.replace(c, train=dataclasses.replace(c.train, min_lr_ratio=0.0)))
    elif plant == "decay_norms":
        optimizer.decays = lambda p, decay_1d: True
    elif plant == "microbatch_sum":  # the microbatch losses summed, not averaged: grads 4x too large

        class Summed(GradScaling):
            loss_divisor = property(lambda self: 1)

        T.grad_scaling = lambda plan, meshes: Summed(**good_scaling(plan, meshes).__dict__)

    def undo():
        build.lr_lambda, optimizer.decays, T.grad_scaling = good_lambda, good_decays, good_scaling
    return undo


def _both(rank, world, overrides, plants):
    """The plain loop, and train() once per plant (None: our code as it is)."""
    from paralayer.runtime import build, optimizer
    from paralayer.runtime import train as T

    cfg, plan = cfg_and_plan(BASE + overrides)
    ours = []
    for plant in plants:
        undo = _planted(plant, build, optimizer, T)
        try:
            ours.append([{k: r[k] for k in ("step", "lr", "loss", "grad_norm")} for r in T.train(cfg, plan)])
        finally:
            undo()
    return ours, _plain_loop(cfg, overrides[0].split("=", 1)[1], cfg.train.weight_decay_1d)


def _max_errs(ours: list[dict], loop: list[dict]) -> dict:
    errs = {"lr": 0.0, "loss": 0.0, "grad_norm": 0.0}
    for a, b in paired(ours, loop):
        assert a["step"] == b["step"]
        for k in errs:
            errs[k] = max(errs[k], abs(a[k] - b[k]) / abs(b[k]))
    return errs


def _ok(errs: dict) -> bool:
    return errs["lr"] <= 1e-12 and errs["loss"] <= LOSS_TOL and errs["grad_norm"] <= NORM_TOL


@pytest.mark.parametrize("decay_1d", [False, True], ids=["no-decay-1d", "decay-all"])
def test_train_matches_plain_torch_loop(tmp_path, decay_1d):
    data = f"data.path={_token_file(str(tmp_path))}"
    (ours,), loop = run_ranks(_both, 1, [data, f"train.weight_decay_1d={str(decay_1d).lower()}"], [None])[0]
    errs = _max_errs(ours, loop)
    print(f"weight_decay_1d={decay_1d}: max rel err {errs}; loss {loop[0]['loss']:.4f} -> {loop[-1]['loss']:.4f}, "
          f"grad norm {loop[0]['grad_norm']:.3f} -> {loop[-1]['grad_norm']:.3f}")
    assert _ok(errs), (errs, ours, loop)
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    assert loop[0]["grad_norm"] > 1.0, "clipping (at 0.5) must be active for the oracle to check it"
    assert loop[0]["loss"] > 1.1 * math.log(VOCAB), "wide init: the loss starts far from ln V"


PLANTS = ["warmup_off_by_one", "cosine_to_zero", "decay_norms", "microbatch_sum"]


def test_planted_errors_fail_the_oracle(tmp_path):
    """Each planted error fails the comparison (one rank runs them one after the other, undoing each)."""
    data = f"data.path={_token_file(str(tmp_path))}"
    runs, loop = run_ranks(_both, 1, [data, "train.weight_decay_1d=false"], PLANTS)[0]
    for plant, ours in zip(PLANTS, runs):
        errs = _max_errs(ours, loop)
        print(f"planted {plant}: max rel err {errs}")
        assert not _ok(errs), (plant, errs)
        if plant == "decay_norms":  # the lr is right; the trajectory moves by far more than the tolerance
            assert errs["lr"] <= 1e-12 and max(errs["loss"], errs["grad_norm"]) > 20 * LOSS_TOL, errs
        if plant == "microbatch_sum":  # clipping and AdamW (m/sqrt(v)) hide it from the loss; the norm shows it
            assert errs["grad_norm"] > 1.0, errs


def test_weight_decay_groups():
    """No decay on 1-D parameters by default (norm gains), decay on matrices; the setting decays all;
    a DTensor's logical shape decides (a 1-D gain sharded by FSDP2 stays undecayed)."""
    from paralayer.config import load_config
    from paralayer.runtime.optimizer import adamw

    assert load_config([]).train.weight_decay_1d is False
    ps = [torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8, 4)),
          torch.nn.Parameter(torch.ones(2, 8, 4))]
    by_wd = lambda opt: sorted((g["weight_decay"], [tuple(p.shape) for p in g["params"]]) for g in opt.param_groups)  # noqa: E731
    assert by_wd(adamw(ps, 1e-3, (0.9, 0.95), 0.1, decay_1d=False)) == [(0.0, [(8,)]), (0.1, [(8, 4), (2, 8, 4)])]
    assert by_wd(adamw(ps, 1e-3, (0.9, 0.95), 0.1, decay_1d=True)) == [(0.1, [(8,), (8, 4), (2, 8, 4)])]


def _dtensor_groups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from paralayer.runtime.optimizer import param_groups

    mesh = init_device_mesh("cpu", (world,))
    gain = torch.nn.Parameter(distribute_tensor(torch.ones(8), mesh, [Shard(0)]))
    mat = torch.nn.Parameter(distribute_tensor(torch.ones(2, 8), mesh, [Shard(0)]))  # local (1, 8)
    groups = param_groups([gain, mat], 0.1, False)
    return [(g["weight_decay"], [tuple(p.to_local().shape) for p in g["params"]]) for g in groups]


def test_weight_decay_groups_use_the_logical_shape():
    assert run_ranks(_dtensor_groups, 2)[0] == [(0.1, [(1, 8)]), (0.0, [(4,)])]


# ------------------------------------------------------------------ lr_lambda, value by value
def _lam(steps, warmup, ratio=0.1):
    from paralayer.config import load_config
    from paralayer.runtime.build import lr_lambda

    return lr_lambda(load_config([f"train.steps={steps}", f"train.warmup_steps={warmup}",
                                  f"train.min_lr_ratio={ratio}"]))


@pytest.mark.parametrize("steps,warmup,ratio,want", [
    # (multiplier of optimizer steps 1, 2, ..., steps): warmup k/W, then cosine to ratio at the last step
    (6, 2, 0.1, [0.5, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55,
                 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1]),
    (3, 0, 0.1, [0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]),  # no warmup: step 1 is already 1/3 into the cosine
    (4, 4, 0.1, [0.25, 0.5, 0.75, 1.0]),  # steps == warmup: warmup only, never decays
    (5, 1, 0.0, [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0]),
])
def test_lr_lambda_table(steps, warmup, ratio, want):
    f = _lam(steps, warmup, ratio)
    got = [f(i) for i in range(steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (got, want)
    assert f(steps + 3) == pytest.approx(ratio)  # past the end: held at the floor
