"""Mixture-of-experts end to end through ``train``: expert-parallel parity with ep=1 (alone and
composed with dp, tp, pp, ZeRO-3), a forced router (imbalance and exact drops in the metrics), and
the resolver's MoE numbers against what runs (saved activations, all-to-all bytes)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.dist import run_ranks

# Tiny MoE: 2 layers, both MoE, 4 experts top-2, dropless, no aux loss in the objective.
MOE = ["recipe=tiny", "train.steps=5", "train.global_batch=8", "train.micro_batch=2",
       "model.n_layers=2", "model.seq_len=64", "logging.wandb.mode=disabled",
       "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=96",
       "model.moe.aux_loss_coef=0", "model.moe.capacity_factor=null", "train.precision=fp32"]


def _cfg_plan(overrides):
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    cfg = load_config(MOE + list(overrides))
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    return cfg, plan


def _train(rank, world, overrides):
    from paralayer.train import train

    cfg, plan = _cfg_plan(overrides)
    recs = train(cfg, plan)
    return recs


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_train, 1, ["parallel.dp=1"])[0]


def _rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


LAYOUTS = {
    "dp2_ep1": (2, ["parallel.dp=2"]),  # MoE without expert parallel: experts are plain dp weights
    "ep2": (2, ["parallel.dp=2", "parallel.ep=2"]),
    "ep4": (4, ["parallel.dp=4", "parallel.ep=4"]),
    "ep2_tp2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"]),
    "ep2_pp2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2"]),
    "ep2_zero3": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3"]),
    "ep2_zero1": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_parity(reference, name):
    world, overrides = LAYOUTS[name]
    recs = run_ranks(_train, world, overrides)
    ref = reference
    losses = [r["loss"] for r in recs[0]]
    ref_losses = [r["loss"] for r in ref]
    assert len(losses) == 5
    err = _rel_err(losses, ref_losses)
    print(f"{name}: max relative loss error {err:.2e}")
    assert err <= 1e-5, (name, losses, ref_losses)
    # every rank logs the same record; the routing statistics are global, so they match ep=1
    for r in recs[1:]:
        assert [x["loss"] for x in r] == losses
    for a, b in zip(recs[0], ref):
        assert a["tokens_per_expert_mean"] == b["tokens_per_expert_mean"]
        assert a["dropped_tokens"] == b["dropped_tokens"] == 0
    # grad norms agree too (expert grads reduced over expert-dp, norms summed over ep)
    gerr = _rel_err([r["grad_norm"] for r in recs[0]], [r["grad_norm"] for r in ref])
    assert gerr <= 1e-4, (name, gerr)
