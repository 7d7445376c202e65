"""Validation (paralayer/runtime/evaluate.py): ``val_loss`` every ``train.eval_every`` steps.

* One rank: the eval of K = 1 batch before any step is the training loss of that batch (same
  definition); metrics.jsonl holds ``val_loss`` with ``step`` on the eval steps only.
* Parity: under pp (1f1b, interleaved, zbv), tp, cp, ep, dp and ZeRO 1-3 the val_loss of
  every eval equals the one-rank run's within 1e-5 (relative), at a wide init (std 0.2); one
  4-rank world runs all the layouts, the one-rank references are computed once.
* The trajectory: losses and grad norms are bit-identical with and without eval.
* A planted error fails: the cp loss without its weighting misses the reference by far more
  than the tolerance.
* Config: eval_every > 0 without data.valid, a missing data.valid and a data.valid that is also a
  training file are plan errors naming the field.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch  # noqa: F401 - imported once here: the forked ranks inherit it

import paralayer.runtime.train  # noqa: F401 - likewise
from tests.dist import cfg_and_plan, max_rel_err, paired, run_ranks

VOCAB, SEQ = 128, 32
REL = 1e-5
STEPS = 2


def _write_tokens(path: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for row in rng.integers(0, VOCAB, size=(n, SEQ)):
            f.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_data")
    return {"train": _write_tokens(str(d / "train.jsonl"), 64, 1),
            "valid": _write_tokens(str(d / "valid.jsonl"), 24, 2), "cache": str(d / "cache")}


def _base(corpus) -> list[str]:
    return ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
            "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.n_layers=4",
            "model.init_std=0.2", "train.global_batch=8", "train.micro_batch=2", f"train.steps={STEPS}",
            "train.warmup_steps=1", "train.precision=fp32", "logging.wandb.mode=disabled", "cluster.peak_tflops=1.0", "cluster.device=cpu",
            "data.format=tokens", f"data.path={corpus['train']}", "data.shuffle=false",
            f"data.cache_dir={corpus['cache']}", f"data.valid={corpus['valid']}", "train.eval_every=1",
            "train.eval_batches=2"]


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=48", "model.moe.aux_loss_coef=0.01",
       "model.moe.capacity_factor=null", "model.moe.router=sigmoid"]

#: name -> (reference, layout overrides); all on 4 ranks
LAYOUTS = {
    "pp2_tp2_1f1b": ("dense", ["parallel.pp=2", "parallel.tp=2", "parallel.schedule=1f1b"]),
    "pp2_dp2_interleaved_zero1": ("dense", ["parallel.pp=2", "parallel.dp=2", "parallel.vpp=2",
                                            "parallel.schedule=interleaved", "parallel.zero=1"]),
    "pp2_dp2_zbv_zero2": ("dense", ["parallel.pp=2", "parallel.dp=2", "parallel.schedule=zbv", "parallel.zero=2"]),
    "cp2_dp2_zero2": ("dense", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=2"]),
    "moe_ep2_pp2_zero3": ("moe", ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=3"]),
}
#: also run without eval: the trajectory must not move (FSDP under a V schedule, FSDP ZeRO-2
#: outside the pipeline, MoE with the sigmoid router's load counter)
NO_EVAL = ("pp2_dp2_zbv_zero2", "cp2_dp2_zero2", "moe_ep2_pp2_zero3")


def _summary(recs: list[dict]) -> dict:
    return {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs],
            "val": {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}}


def _one_rank(rank, world, base, run_dir):
    """The references (dense and MoE), the eval-vs-training-loss identity, metrics.jsonl."""
    import torch

    from paralayer.runtime import evaluate
    from paralayer.runtime.train import as_plan, setup, train, train_step

    out = {}
    for name, extra in (("dense", []), ("moe", MOE)):
        cfg, plan = cfg_and_plan(base + extra)
        out[name] = _summary(train(cfg, plan, run_dir=run_dir if name == "dense" else None))
    # K = 1 batch of data.valid before any step vs the training loss of a run that trains on it
    cfg, plan = cfg_and_plan(base + [f"data.path={dict(x.split('=', 1) for x in base)['data.valid']}",
                                     "data.valid=null", "train.eval_every=0"])
    run = setup(cfg, as_plan(plan), None)
    rng = torch.get_rng_state()
    val1 = evaluate.validation_loss(run, run.dataset, 1)
    out["rng_kept"] = bool(torch.equal(rng, torch.get_rng_state()))
    b = cfg.train.global_batch  # eval batch 1 (0-based) reads sequences B ... 2B-1
    out["batch1_ok"] = bool(torch.equal(evaluate.eval_batch(run, run.dataset, 1)[0],
                                        run.dataset.sequences(range(b, 2 * b))))
    out["val1"], out["train1"] = val1, train_step(run, 1)["loss"]
    return out


def _layouts(rank, world, base, names, planted):
    out = {}
    for name in names:
        model, layout = LAYOUTS[name]
        extra = (MOE if model == "moe" else []) + layout
        from paralayer.runtime.train import train

        cfg, plan = cfg_and_plan(base + extra)
        out[name] = _summary(train(cfg, plan))
        if name in NO_EVAL:
            cfg, plan = cfg_and_plan(base + extra + ["train.eval_every=0"])
            out[name + "/no_eval"] = _summary(train(cfg, plan))
    out["planted"] = _planted_cp_error(base) if planted else None
    return out


def _planted_cp_error(base):
    """cp2 x dp2 at init, with the cp loss weight left out of the eval: the val_loss is wrong."""
    from paralayer.parallel.tensor import tp_loss
    from paralayer.runtime import evaluate
    from paralayer.runtime.train import as_plan, setup

    cfg, plan = cfg_and_plan(base + LAYOUTS["cp2_dp2_zero2"][1])
    run = setup(cfg, as_plan(plan), None)
    valid = evaluate.build_valid_dataset(cfg)
    good = evaluate.validation_loss(run, valid, 2)
    run.loss_fn = lambda logits, labels: tp_loss(logits, labels, cfg.model.vocab_size)  # no cp_loss_weight
    bad = evaluate.validation_loss(run, valid, 2)
    return good, bad


@pytest.fixture(scope="module")
def results(corpus, tmp_path_factory):
    base = _base(corpus)
    run_dir = str(tmp_path_factory.mktemp("eval_run"))
    ref = run_ranks(_one_rank, 1, base, run_dir, timeout_s=300)[0]
    got = run_ranks(_layouts, 4, base, list(LAYOUTS), True, timeout_s=600)
    return ref, got, run_dir


def test_eval_is_the_training_loss_on_one_rank(results):
    ref, _, run_dir = results
    assert ref["rng_kept"] and ref["batch1_ok"]
    assert abs(ref["val1"] - ref["train1"]) <= 1e-6 * abs(ref["train1"]), (ref["val1"], ref["train1"])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    assert [r["step"] for r in lines if "val_loss" in r] == list(range(1, STEPS + 1))
    assert [r["val_loss"] for r in lines] == [ref["dense"]["val"][s] for s in range(1, STEPS + 1)]
    vals = list(ref["dense"]["val"].values())
    assert min(abs(a - b) for a, b in zip(vals, vals[1:])) > 1e-3  # the eval sees the updated weights


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_val_loss_parity(results, name):
    ref, got, _ = results
    want = ref[LAYOUTS[name][0]]["val"]
    for r, per_rank in enumerate(got):
        val = per_rank[name]["val"]
        assert sorted(val) == sorted(want) == list(range(1, STEPS + 1)), (r, val, want)
        err = max_rel_err([val[s] for s in sorted(val)], [want[s] for s in sorted(want)])
        print(f"{name} rank {r}: val_loss max relative error {err:.2e}")
        assert err <= REL, (name, r, val, want)
        assert val == got[0][name]["val"]  # every rank holds the same val_loss


@pytest.mark.parametrize("name", NO_EVAL)
def test_eval_leaves_the_trajectory_alone(results, name):
    _, got, _ = results
    for per_rank in got:
        with_eval, without = per_rank[name], per_rank[name + "/no_eval"]
        assert without["val"] == {}
        for key in ("loss", "grad_norm"):
            for a, b in paired(with_eval[key], without[key]):
                assert a == b, (name, key, with_eval[key], without[key])


def test_planted_cp_weight_error_fails(results):
    ref, got, _ = results
    good, bad = got[0]["planted"]
    assert abs(bad - good) / abs(good) > 10 * REL, (good, bad)  # measured: 4.2e-4


def test_config_checks(corpus, tmp_path):
    from paralayer import cli
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    base = _base(corpus)

    def fields(overrides):
        cfg = load_config(base + overrides)
        plan = resolve(cfg)
        cli._check_data(cfg, plan)
        return [e["field"] if isinstance(e, dict) else e.field for e in plan.errors]

    assert fields([]) == []
    assert fields(["data.valid=null"]) == ["train.eval_every"]
    assert fields(["data.valid=null", "train.eval_every=0"]) == []
    assert fields([f"data.valid={tmp_path / 'missing.jsonl'}"]) == ["data.valid"]
    assert fields([f"data.valid={corpus['train']}"]) == ["data.valid"]
    from paralayer.config.schema import ConfigError

    for bad in ("train.eval_every=-1", "train.eval_batches=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            resolve(load_config(base + [bad]))
    # the runtime's own checks of the held-out corpus name data.valid (an id >= model.vocab_size)
    from paralayer.data.errors import DataError
    from paralayer.runtime import evaluate

    bad_ids = tmp_path / "bad.jsonl"
    bad_ids.write_text(json.dumps({"input_ids": [VOCAB + 1] * SEQ}) + "\n")
    with pytest.raises(DataError, match="^data.valid: "):
        evaluate.build_valid_dataset(load_config(base + [f"data.valid={bad_ids}",
                                                         f"data.cache_dir={tmp_path / 'cache'}"]))
    # the front door: --dry-run exits 2 with one line naming the field
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(repo, "launch.py"), "recipe=tiny", "train.eval_every=5",
                        "--dry-run"], capture_output=True, text=True, timeout=120, cwd=repo)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "train.eval_every" in p.stderr and "data.valid" in p.stderr and "Traceback" not in p.stderr
