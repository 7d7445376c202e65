"""DeepSeek-V3 routing end to end through the runtime: group routing, routed scaling, the
sequence-wise balance loss, a shared expert and a dense first layer, under ep2, ep2·pp2, ep2·tp2
and dp2 against one rank. The loss matches within 1e-5; the routing statistics (tokens per expert,
drops, under capacity) and the router's selection bias after the aux-loss-free updates are EQUAL.
The grad norm matches within 1e-5 too: a planted halving of every expert gradient under ep2 moves
the losses by less than that (AdamW's update barely changes when a gradient is scaled) and fails it."""
from __future__ import annotations

import pytest

from tests.dist import TINY_SMALL, cfg_and_plan, max_rel_err, paired, plant_halved_expert_grads, run_ranks

DS = TINY_SMALL + ["model.n_layers=4", "train.steps=3", "model.moe.num_experts=8", "model.moe.top_k=2",
                   "model.moe.ffn_hidden=32", "model.moe.router=sigmoid", "model.moe.n_group=4",
                   "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5", "model.moe.first_k_dense=1",
                   "model.moe.shared_ffn_hidden=32", "model.moe.seq_aux_loss_coef=0.001",
                   "model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0.01",
                   "model.moe.capacity_factor=1.0", "train.precision=fp32", "train.threads=1"]


def _run(rank, world, overrides, plant_halved=False):
    """Train; return the records and {layer: expert_bias} of this rank's MoE layers."""
    from paralayer.runtime.train import as_plan, setup, train_step

    if plant_halved:
        plant_halved_expert_grads()
    cfg, plan = cfg_and_plan(DS + list(overrides))
    run = setup(cfg, as_plan(plan), None)
    recs = [train_step(run, s) for s in range(1, cfg.train.steps + 1)]
    bias = {key: layer.feed_forward.expert_bias.tolist() for c in run.built.chunks
            for key, layer in c.layers.items() if layer.is_moe}
    dense = sorted(int(key) for c in run.built.chunks for key, layer in c.layers.items() if not layer.is_moe)
    return recs, bias, dense


#: under tp the router's input is the row-parallel all-reduce's sum, equal to one rank's only to fp32
#: rounding; with capacity 1.0 hundreds of tokens compete for a slot by score, and a pair of them
#: closer than that rounding can swap (seen on one machine: one token at step 2, 301 vs 302 dropped,
#: the loss 1e-3 off by step 3, on this suite's old code too). So ep2·tp2 runs dropless, where the
#: exact claim holds (top-2 of the chosen groups per token); the ep layouts keep the capacity.
DROPLESS = ["model.moe.capacity_factor=null"]
LAYOUTS = {
    "dp2": (2, ["parallel.dp=2"]),
    "ep2": (2, ["parallel.dp=2", "parallel.ep=2"]),
    "ep2_pp2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2"]),
    "ep2_tp2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"] + DROPLESS),
}


@pytest.fixture(scope="module")
def references():
    """One rank's run, with the capacity and dropless, computed once each when first asked for."""
    cache: dict = {}

    def get(dropless: bool):
        if dropless not in cache:
            cache[dropless] = run_ranks(_run, 1, ["parallel.dp=1"] + (DROPLESS if dropless else []))[0]
        return cache[dropless]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_group_routing_parity_and_exact_stats(references, name):
    world, overrides = LAYOUTS[name]
    dropless = DROPLESS[0] in overrides
    out = run_ranks(_run, world, overrides)
    ref_recs, ref_bias, ref_dense = references(dropless)
    assert ref_dense == [0] and sorted(ref_bias) == ["1", "2", "3"]
    recs = out[0][0]
    assert max_rel_err([r["loss"] for r in recs], [r["loss"] for r in ref_recs]) <= 1e-5
    assert max_rel_err([r["grad_norm"] for r in recs], [r["grad_norm"] for r in ref_recs]) <= 1e-5
    for a, b in paired(recs, ref_recs):
        for key in ("tokens_per_expert_min", "tokens_per_expert_mean", "tokens_per_expert_max", "dropped_tokens"):
            assert a[key] == b[key], (name, key, a[key], b[key])
    if not dropless:
        assert any(r["dropped_tokens"] > 0 for r in ref_recs)  # capacity 1.0 drops: the figure is exercised
    bias = {}
    for _, b, _ in out:
        for key, v in b.items():
            assert bias.setdefault(key, v) == v  # every replica of a router holds the same bias
    assert bias == ref_bias
    assert any(x != 0 for v in ref_bias.values() for x in v)  # the updates happened


def test_planted_halved_expert_grads_fail_the_grad_norm(references):
    """ep2 with every expert gradient halved: the grad norm is off by far more than the 1e-5 the
    parity test holds it to (the losses alone let the plant pass: measured here too)."""
    world, overrides = LAYOUTS["ep2"]
    recs = run_ranks(_run, world, overrides, True)[0][0]
    ref_recs = references(False)[0]
    loss = max_rel_err([r["loss"] for r in recs], [r["loss"] for r in ref_recs])
    norm = max_rel_err([r["grad_norm"] for r in recs], [r["grad_norm"] for r in ref_recs])
    print(f"planted halved expert grads: loss {loss:.2e}, grad norm {norm:.2e} off")
    assert norm > 1e-4, (loss, norm)
