"""Data-parallel traffic per pipeline rank (issue 45 item 5): under pp the ranks hold different
parameters (the embedding, the head, an uneven ``parallel.pp_layout``), so they move different dp
bytes. The plan's ``comm.dp`` is the rank that moves the most (``pp_rank``, every rank's in
``rank_bytes_per_step``), and the step's exposed dp is the max over the ranks, charged once after the
pipeline's common end. A planted "rank 0 only" (every rank given rank 0's dp) fails each check."""
from __future__ import annotations

import pytest

from paralayer import rehearse as R
from paralayer.config import load_config
from paralayer.rehearse.comm import bytes_per_axis
from paralayer.resolve import resolve
from paralayer.resolve.cost import step_time, terms
from paralayer.resolve.cost.machine import machine_for

# Llama 3 8B on 4 H100 nodes, pp 4 with 14 of the 32 layers on pp rank 1 (a middle rank)
GPU = ["recipe=llama3-8b", "cluster=h100-80gb-8x", "cluster.nodes=4", "parallel.tp=1", "parallel.pp=4",
       "parallel.zero=1", "parallel.recompute=full", "parallel.pp_layout=[2,14,8,8]"]
# tiny-pp (1F1B) at pp 4, dp 2 with an uneven split: pp rank 1 holds 4 of the 8 layers
TINY = ["recipe=tiny-pp", "parallel.tp=1", "parallel.pp=4", "model.n_layers=8", "parallel.pp_layout=[1,4,2,1]",
        "train.micro_batch=2"]


def _rank0_only(monkeypatch) -> None:
    """The planted error: every pipeline rank's dp entry is rank 0's (the plan before item 5)."""
    real = terms.dp_comm
    monkeypatch.setattr(terms, "dp_comm", lambda cfg, lay, r=0: real(cfg, lay, 0))


def _layer_params(cfg) -> int:
    """One Llama block's parameters from its widths (q, k, v, o, the SwiGLU, two norms)."""
    m = cfg.model
    hd = m.d_model // m.n_heads
    return m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.ffn_hidden + 2 * m.d_model


def check_middle_rank_sets_dp(cfg, plan: dict, t: dict) -> None:
    """pp rank 1's dp (6 layers more than ranks 2, 3) is the plan's and the step's."""
    dp = plan["comm"]["dp"]
    b = dp["rank_bytes_per_step"]
    assert len(b) == 4 and dp["pp_rank"] == 1 and dp["bytes_per_step"] == b[1] == max(b), dp
    # bytes in proportion to parameters: rank 1 − rank 2 is 6 blocks, rank 3 − rank 2 the head and final norm
    head = plan["padded_vocab_size"] * cfg.model.d_model + cfg.model.d_model
    assert (b[1] - b[2]) / (b[3] - b[2]) == pytest.approx(6 * _layer_params(cfg) / head, rel=1e-9)
    x = t["rank_dp_exposed_s"]
    assert t["dp_rank"] == plan["dp_rank"] == 1 and t["dp_exposed_s"] == max(x) == x[1] > x[0], x
    assert plan["step_time_s"] == pytest.approx(max(plan["rank_step_time_s"]), rel=1e-12)


def test_a_middle_rank_of_an_uneven_split_sets_the_dp_term(monkeypatch):
    cfg = load_config(GPU)
    p = resolve(cfg)
    assert p.valid and p.fits, p.errors
    t = step_time.time_plan(cfg, p, machine_for(cfg))
    plan = p.to_dict()
    check_middle_rank_sets_dp(cfg, plan, t)
    # the planted "rank 0 only": the same plan with rank 0's dp everywhere fails, and is faster by
    # exactly the difference of the two ranks' exposed dp (the rest of the step does not move)
    _rank0_only(monkeypatch)
    p0 = resolve(load_config(GPU))
    t0 = step_time.time_plan(cfg, p0, machine_for(cfg))
    with pytest.raises(AssertionError):
        check_middle_rank_sets_dp(cfg, p0.to_dict(), t0)
    assert t["step_time_s"] - t0["step_time_s"] == pytest.approx(t["dp_exposed_s"] - t0["dp_exposed_s"], rel=1e-9)
    assert t["dp_exposed_s"] > t0["dp_exposed_s"]


def check_rehearsed_dp(plan: dict, out: dict, per_pp: int) -> None:
    """Each rehearsed rank's dp bytes (its collectives) are the plan's for its pipeline rank."""
    assert out["ok"], out.get("errors")
    for r in out["ranks"]:
        got = bytes_per_axis(r["collectives"], pairs=r.get("plan_comm_pairs", ()),
                             sends_only=r.get("plan_comm_sends_only", ("cp",)))["dp"]
        want = plan["comm"]["dp"]["rank_bytes_per_step"][r["rank"] // per_pp]
        assert abs(got / want - 1) < 1e-4, (r["rank"], got, want)


def test_rehearsal_agrees_with_the_plans_dp_bytes_per_rank(monkeypatch):
    """tiny-pp with an uneven split, pipeline rank 1 (the one moving the most) rehearsed: the plan's
    per-rank dp bytes are what the runtime's collectives move (measured 1.000001; ranks 0 and 3 by
    hand: 1.000005 each, docs/planner.md)."""
    cfg = load_config(TINY)
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    per_pp = plan["world_size"] // 4
    assert plan["comm"]["dp"]["pp_rank"] == 1
    out = R.rehearse(cfg, plan, [per_pp])
    check_rehearsed_dp(plan, out, per_pp)
    _rank0_only(monkeypatch)
    planted = resolve(load_config(TINY)).to_dict()
    with pytest.raises(AssertionError):
        check_rehearsed_dp(planted, out, per_pp)
