"""An FP8 plan against a rehearsal that runs FP8 (issue 44): the rehearsal runs every FP8 plan in
FP8 (emulated) inside the plan's base precision (bf16 for a GPU plan: train.fp8.base_precision),
and the plan counts what that run holds and sends.

Before (deepseek-v3-tiny on an H800 layout, FP8 with cached activations) the rehearsal ran the
FP8 blocks in fp32 on this CPU and the plan counted autocast's bf16 copies of the FP8 GEMMs'
weights: params 0.68, ep bytes 2.0, activations 1.23 (rehearsed / plan). deepseek-v3-tiny cut to
one dense and one MoE block, no MTP, so that each rehearsal is one rank of 8 in a few seconds."""
from __future__ import annotations

import pytest

from paralayer import config as config_mod
from paralayer import rehearse as R
from paralayer.resolve import fp8 as fp8_mod
from paralayer.resolve import resolve
from paralayer.resolve.memory import autocast
from tests.plan_beside import misses, rehearse_cases, replanned

BASE = ["recipe=deepseek-v3-tiny", "cluster=h800-80gb-8x", "model.mla.qk_rope_head_dim=16", "parallel.dp=auto",
        "train.global_batch=32", "model.n_layers=2", "model.mtp.depth=0", "train.precision=fp8",
        "train.fp8.cache_activations=true"]
#: ZeRO-1: fp32 weights under autocast; the MoE block in FP8 (its Linear weights without a bf16
#: copy), the dense block kept bf16 under norm_up (its q_b and kv_b copies made in backward only);
#: ZeRO-2: FSDP gathers the Float8Linear weights in FP8 (1 byte) and the routed experts in bf16
CASES = {"zero1": ["parallel.zero=1", "parallel.recompute=norm_up", "train.fp8.bf16_first_blocks=1"],
         "zero2": ["parallel.zero=2", "parallel.recompute=swiglu"]}


def _misses(r: dict) -> list[str]:
    return misses(r, 0.05)


_replanned = replanned


@pytest.fixture(scope="module")
def rehearsed() -> dict:
    return rehearse_cases(BASE, CASES, lambda plan: plan["precision"] == "bf16")


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_plan_agrees_with_its_fp8_rehearsal(rehearsed, name):
    _, _, r = rehearsed[name]
    assert not _misses(r), (name, {k: r["ratios"][k] for k in R.MEM_KEYS}, r["ratios"]["comm"])
    assert r["ratios"]["comm"]["ep"] == pytest.approx(1, abs=0.01)  # the dispatch sends bf16 rows
    # the rehearsal ran FP8 in bf16: the plan's autocast copies are the router's and experts' only
    # (ZeRO-1), and the rank's gathered weights are fewer bytes than a bf16 plan's (ZeRO-2)
    bf16 = config_mod.load_config(BASE[:-2] + ["train.precision=bf16"] + [x for x in CASES[name] if "fp8" not in x])
    assert r["memory_bytes"]["params"] < resolve(bf16).to_dict()["memory_per_device_bytes"]["params"], name


def test_a_planted_copy_of_the_fp8_weights_fails(rehearsed, monkeypatch):
    """The old plan (autocast's bf16 copy of every GEMM's weight, FP8 ones too) disagrees by bytes."""
    case = rehearsed["zero1"]
    assert not _misses(_replanned(case))
    monkeypatch.setattr(autocast, "fp8_copy_terms", autocast.autocast_copy_terms)
    assert "params" in _misses(_replanned(case))


def test_a_planted_norm_up_copy_held_fails(rehearsed, monkeypatch):
    """norm_up's rebuilt up-projections (the bf16 block's q_b, kv_b) counted as held all step: a miss."""
    case = rehearsed["zero1"]
    monkeypatch.setattr(autocast, "norm_up_copies", lambda cfg, lay: 0.0)
    assert "params" in _misses(_replanned(case))


def test_a_planted_fp8_gather_of_the_experts_fails(rehearsed, monkeypatch):
    """The old FP8 all-gather count (the routed experts at 1 byte too) disagrees on params and dp."""
    case = rehearsed["zero2"]
    assert not _misses(_replanned(case))
    real = fp8_mod.layer_gemm_shapes
    monkeypatch.setattr(fp8_mod, "layer_gemm_shapes",
                        lambda *a: [("x" + s[0], *s[1:]) for s in real(*a)])  # no name starts "experts"
    got = _misses(_replanned(case))
    assert "params" in got and "dp" in got, got


def test_the_rehearsal_runs_an_fp8_plan_in_fp8_inside_its_base_precision():
    """A GPU plan: FP8 in bf16 (train.fp8.base_precision); a CPU plan: FP8 in fp32; bf16 stays bf16."""
    import torch

    from paralayer.rehearse.driver import rehearsal_config
    from paralayer.runtime import precision

    for extra, base in ((["cluster=h800-80gb-8x", "parallel.dp=auto", "train.global_batch=32"], "bf16"),
                        ([], "fp32")):
        cfg = config_mod.load_config(["recipe=deepseek-v3-tiny", "train.precision=fp8"] + extra)
        run_cfg = rehearsal_config(cfg, resolve(cfg).to_dict())[0]
        assert run_cfg.train.precision == "fp8" and run_cfg.train.fp8.base_precision == base, extra
        assert precision.run_precision(run_cfg, torch.device("cpu")) == base
    cfg = config_mod.load_config(["recipe=deepseek-v3-tiny", "train.precision=bf16"])
    assert rehearsal_config(cfg, resolve(cfg).to_dict())[0].train.precision == "bf16"


#: tensorwise on this CPU's fp32 plan: tp 2 (its one-number amax all-reduces over tp) beside dp 2 ZeRO-2
#: (FSDP's FP8 all-gather, which the runtime runs on CPU too) and full recompute (the rerun's casts)
TW = ["recipe=tiny", "model.n_layers=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero=2", "parallel.recompute=full",
      "train.precision=fp8", "train.fp8.recipe=tensorwise"]


@pytest.mark.timeout(300)
def test_tensorwise_amax_reduces_and_the_cpu_fp8_gather_are_the_plans_to_a_few_bytes(monkeypatch):
    """Counted since 7 Dec (resolve/fp8_blocks.tp_comm_delta, resolve/fp8.fp8_gathered_params): each cast
    of a tp-split tensor reduces one fp64 amax over tp (the weights' not under FSDP's FP8 all-gather,
    whose scales are precomputed), and FSDP gathers the FP8 blocks' weights at 1 byte on CPU as on GPUs,
    holding them at 1 byte where fp32 held 4. Before: tp 1.00009, dp 0.656, params 0.541 of the plan.
    What is left: the 4-byte scalars (the loss's, the grad norm's), a few bytes a step."""
    cfg = config_mod.load_config(TW)
    plan = resolve(cfg).to_dict()
    assert not plan["errors"] and plan["fp8"] and plan["precision"] == "fp32", plan["errors"]
    run = R.rehearse(cfg, plan, [0])
    assert run["ok"], run
    case = (cfg, plan, run["ranks"][0])
    r = _replanned(case)
    assert not _misses(r), (r["ratios"], r["memory_bytes"], r["plan_memory_bytes"])
    assert r["ratios"]["comm"]["tp"] == pytest.approx(1, abs=2e-6), r["ratios"]["comm"]
    assert r["ratios"]["comm"]["dp"] == pytest.approx(1, abs=2e-4), r["ratios"]["comm"]
    from paralayer.resolve import fp8_blocks

    real = fp8_blocks.tp_comm_delta
    monkeypatch.setattr(fp8_blocks, "tp_comm_delta", lambda *a: (*real(*a)[:2], 0.0, 0))  # amaxes left out
    assert _replanned(case)["ratios"]["comm"]["tp"] > 1 + 2e-5
    monkeypatch.setattr(fp8_blocks, "tp_comm_delta", real)
    monkeypatch.setattr(fp8_mod, "_GATHER_BYTES", {"bf16": 2, "fp32": 2})  # the held copies' saving at 1 byte
    assert "params" in _misses(_replanned(case))
