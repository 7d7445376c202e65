"""train.compile=true: the compiled blocks (and loss) train exactly as eager does.

CPU compile is slow (inductor generates and builds C++): one rank goes through inductor, the
tp 2 × dp 2 run through aot_eager, which traces the same forward and backward graphs (DTensor
included) and runs them without code generation. Wide init (std 0.2), so the loss moves and the
grad norms differ between steps; both loss and grad norm are compared at every step.
"""
from __future__ import annotations

import pytest

from tests.dist import TINY_SMALL, run_ranks, train_records

BASE = TINY_SMALL + ["train.steps=3", "model.init_std=0.2", "model.d_model=32", "model.n_heads=4",
                     "model.n_kv_heads=2", "model.ffn_hidden=64", "model.seq_len=32", "train.global_batch=4",
                     "train.micro_batch=2"]
TOL = 1e-5


def _compare(eager: list[dict], compiled: list[dict]) -> None:
    assert len(eager) == len(compiled) == 3, (len(eager), len(compiled))
    for a, b in zip(eager, compiled):
        assert abs(a["loss"] - b["loss"]) <= TOL, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * max(1.0, a["grad_norm"]), (a["step"], a["grad_norm"],
                                                                                     b["grad_norm"])
    assert eager[0]["loss"] - eager[-1]["loss"] > 1e-3, "the loss must move for the comparison to mean anything"


def _worker(rank, world, overrides, backend):
    from paralayer.compat import private

    counters = private("torch._dynamo.utils", "counters")
    eager = train_records(overrides)
    assert counters["stats"]["unique_graphs"] == 0
    compiled = train_records(overrides + ["train.compile=true", f"train.compile_backend={backend}"])
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    return [eager, compiled]


@pytest.mark.timeout(600)
def test_compile_one_rank_inductor_matches_eager():
    (eager, compiled), = run_ranks(_worker, 1, BASE + ["parallel.dp=1"], "inductor", timeout_s=540)
    _compare(eager, compiled)


@pytest.mark.timeout(600)
def test_compile_tp2_dp2_matches_eager():
    out = run_ranks(_worker, 4, BASE + ["parallel.tp=2", "parallel.dp=2"], "aot_eager", timeout_s=540)
    for eager, compiled in out:
        _compare(eager, compiled)
