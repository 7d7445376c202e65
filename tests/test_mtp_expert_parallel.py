"""MTP with MoE depths under expert parallel (DeepSeek-V3's MTP block is an MoE block): ep2·dp2
against one rank, the step's ``loss`` and ``mtp_loss`` over 3 steps within 1e-5 (the MTP experts'
gradients move the next steps' losses). Planted: the MTP depths' MoE blocks left out of expert
parallel (each ep rank then holds all their experts and reduces their gradients over the expert
data-parallel group only, as runtime/build.py did before ``expert_blocks``) must fail it."""
from __future__ import annotations

import pytest

from tests.dist import TINY_SMALL, cfg_and_plan, max_rel_err, run_ranks

DS = TINY_SMALL + ["model.n_layers=2", "train.steps=3", "model.moe.num_experts=4", "model.moe.top_k=2",
                   "model.moe.ffn_hidden=32", "model.moe.router=sigmoid", "model.moe.first_k_dense=1",
                   "model.moe.shared_ffn_hidden=32", "model.moe.aux_loss_coef=0", "model.moe.capacity_factor=null",
                   "model.mtp.depth=1", "model.mtp.loss_weight=0.3", "model.init_std=0.2",
                   "train.grad_clip=1e9", "train.precision=fp32", "train.threads=1"]


def _run(rank, world, overrides, plant):
    from paralayer.runtime import build
    from paralayer.runtime.train import as_plan, setup, train_step

    if plant:
        build.expert_blocks = lambda chunk: [l.feed_forward for l in chunk.layers.values() if l.is_moe]
    cfg, plan = cfg_and_plan(DS + list(overrides))
    run = setup(cfg, as_plan(plan), None)
    return [train_step(run, s) for s in range(1, cfg.train.steps + 1)]


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_run, 1, ["parallel.dp=1"], False)[0]


def _err(recs, ref) -> float:
    return max(max_rel_err([r["loss"] for r in recs], [r["loss"] for r in ref]),
               max_rel_err([r["mtp_loss"] for r in recs], [r["mtp_loss"] for r in ref]))


def test_mtp_moe_depth_under_ep2_matches_one_rank(reference):
    assert all(r["mtp_loss"] > 0 for r in reference)
    out = run_ranks(_run, 2, ["parallel.dp=2", "parallel.ep=2"], False)
    assert _err(out[0], reference) <= 1e-5, (out[0], reference)


def test_planted_mtp_experts_outside_ep_fails(reference):
    out = run_ranks(_run, 2, ["parallel.dp=2", "parallel.ep=2"], True)
    assert _err(out[0], reference) > 1e-4
