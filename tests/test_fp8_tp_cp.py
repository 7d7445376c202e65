"""An FP8 plan under tp (with sequence parallel) and under cp against its FP8 rehearsal (issue 44):
what an FP8 block saves and sends there (resolve/fp8_blocks.py), and the rehearsal counting a
torchao float8 tensor at its FP8 bytes (rehearse/memory.py, rehearse/comm.py).

Before (tiny on an H100 layout, tensorwise; rehearsed / plan): tp 2 + SP activations 0.94, tp
bytes 1.17 (the rehearsal read the FP8 all-gathers at the wrapper's 4 or 2 bytes an element, the
plan counted the bf16 SP rule); cp 2 activations 0.83. Rowwise cp 2 before its cp terms:
activations 1.141, cp bytes 1.009; tp 2 · cp 2: 1.116, cp 1.012. One microbatch, rank 0 of 8."""
from __future__ import annotations

import pytest

from paralayer import config as config_mod
from paralayer.resolve import fp8_blocks
from paralayer.resolve.rules import check
from tests.plan_beside import misses, rehearse_cases, replanned

BASE = ["recipe=tiny", "cluster=h100-80gb-8x", "parallel.dp=auto", "train.global_batch=16", "train.precision=fp8",
        "train.fp8.recipe=tensorwise"]
CASES = {"tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
         "cp2": ["parallel.tp=1", "parallel.cp=2"],
         "cp2-rowwise": ["parallel.tp=1", "parallel.cp=2", "train.fp8.recipe=rowwise"],
         "tp2-cp2-rowwise": ["parallel.tp=2", "parallel.cp=2", "train.fp8.recipe=rowwise", "train.global_batch=8"],
         # tensorwise under tp and cp together (refused before 8 Dec): the float8 styles' terms and the
         # ring's fp32 q, k and output beside wo's FP8 copy (before that ring term: activations 1.117)
         "tp2-cp2": ["parallel.tp=2", "parallel.cp=2", "train.global_batch=8"],
         # blockwise under tp (since 7 Dec): split N and K of whole 128 tiles on a rank (4 x 64-wide heads
         # of q, k and v; ffn 256); its GEMMs save the norms' fp32 output once for q, k, v (the plan
         # counted autocast's three bf16 casts before: activations 0.938)
         "tp2-sp-blockwise": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.fp8.recipe=blockwise",
                              "model.head_dim=64", "model.n_kv_heads=4", "model.ffn_hidden=256"]}
#: MoE blocks under cp (issue 44: the experts' amaxes over cp at ep=1): their cp bytes, and rowwise's
#: ring set; one rehearsal of 2 blocks (tensorwise and ep2 · cp2 measured to the byte too, not run
#: here: docs/planner.md; an MoE block's tensorwise activations under cp keep the base rules)
MOE_CASES = {"cp2-moe-rowwise": CASES["cp2-rowwise"] + ["model.moe.num_experts=4", "model.moe.ffn_hidden=128",
                                                        "model.n_layers=2"]}
CP_CASES = [n for n in CASES if "cp2" in n] + list(MOE_CASES)
TOL = 0.02


def _misses(r: dict) -> list[str]:
    return misses(r, TOL)


_replanned = replanned


@pytest.fixture(scope="module")
def rehearsed() -> dict:
    return rehearse_cases(BASE, {**CASES, **MOE_CASES})


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_plan_agrees_under_tp_and_cp(rehearsed, name):
    r = _replanned(rehearsed[name])
    assert not _misses(r), (name, r["ratios"])
    axis = "tp" if name.startswith("tp") else "cp"
    assert r["ratios"]["comm"][axis] is not None


def test_the_float8_styles_gather_one_byte_rows(rehearsed):
    """The SP all-gathers of an FP8 block carry e4m3 / e5m2 rows: b·s·h bytes, where the base
    precision's gathers carry twice that (and the rehearsal read 4 or 2 bytes an element before)."""
    cfg, _, r = rehearsed["tp2-sp"]
    m = cfg.model
    rows = m.seq_len * m.d_model * cfg.train.micro_batch
    gathers = {c["message_bytes"]: c["count"] for c in r["collectives"]
               if c["axis"] == "tp" and c["kind"] == "all-gather"}
    assert gathers.get(rows, 0) == 4 * m.n_layers, gathers  # each block: attention and MLP, forward and backward


def test_a_planted_bf16_tp_rule_fails(rehearsed, monkeypatch):
    """The FP8 blocks' tp bytes counted by the bf16 SP rule (re-gather, 2 bytes): tp misses."""
    case = rehearsed["tp2-sp"]
    monkeypatch.setattr(fp8_blocks, "tp_comm_delta", lambda *a: (0.0, 0.0, 0.0, 0))
    assert "tp" in _misses(_replanned(case))


@pytest.mark.parametrize("name", [n for n in CASES if n != "tp2-cp2"])
def test_a_planted_bf16_activation_set_fails(rehearsed, monkeypatch, name):
    """The FP8 blocks' saved set counted as the base precision's (no FP8 copies): activations miss.
    Not at tensorwise tp 2 · cp 2, where the FP8 copies and the ring's fp32 set nearly cancel (the
    base rules alone fall inside the 2% tolerance there); its planted ring set is below."""
    case = rehearsed[name]
    monkeypatch.setattr(fp8_blocks, "act_delta", lambda *a, **k: 0.0)
    assert "activations" in _misses(_replanned(case))


def _cp_off(r: dict) -> float:
    """How far the plan's cp bytes are from the rehearsed ones (0: to the byte)."""
    return abs(r["ratios"]["comm"]["cp"] - 1)


@pytest.mark.parametrize("name", CP_CASES)
def test_cp_bytes_to_the_byte_with_the_amax_all_reduces(rehearsed, monkeypatch, name):
    """The cp bytes hold the ring and the FP8 scales' amax all-reduces over cp (rowwise: K + N
    values per weight gradient; tensorwise: one per input and output gradient): the plan counts
    them to the byte; left out (the planted error) it misses (tensorwise by 112 bytes, rowwise by
    0.9% and 1.2%, inside the 2% the other checks allow). MoE blocks: the experts' amaxes too at
    ep=1 (the routed rows' w1 and w3 inputs in fp32 under autocast), none at ep2."""
    case = rehearsed[name]
    cfg, _, r = case
    assert cfg.train.fp8.recipe == ("rowwise" if "rowwise" in name else "tensorwise")
    reduces = sum(c["count"] for c in r["collectives"] if c["axis"] == "cp" and c["kind"] == "all-reduce")
    # 2 MoE blocks, one microbatch: the attention's 4 GEMMs and the experts' 4 x 3, two amaxes each
    assert reduces == {"cp2-moe-rowwise": 64}.get(name, reduces) > 0
    assert _cp_off(_replanned(case)) < 1e-9
    monkeypatch.setattr(fp8_blocks, "cp_amax", lambda *a: (0.0, 0))
    assert _cp_off(_replanned(case)) > 1e-6


@pytest.mark.parametrize("name", [n for n in CP_CASES if "rowwise" in n or n == "tp2-cp2"])
def test_a_planted_rowwise_cp_activation_set_fails(rehearsed, monkeypatch, name):
    """Under cp and autocast without the ring's fp32 q, k and output (the bf16 plan's set):
    activations miss (rowwise 1.14 at cp 2, 1.12 at tp 2 · cp 2; tensorwise 1.117 at tp 2 · cp 2)."""
    monkeypatch.setattr(fp8_blocks, "_ring", lambda *a: 0.0)
    assert "activations" in _misses(_replanned(rehearsed[name]))


def test_bf16_plans_take_no_fp8_term():
    """The same layouts at bf16: no FP8 term applies (their plans are the base rules')."""
    for extra in CASES.values():
        cfg = config_mod.load_config(BASE[:-2] + ["train.precision=bf16"] + extra)
        lay = check(cfg)
        assert not lay.errors, lay.errors
        assert fp8_blocks.tp_styles(cfg, lay) is None
        assert fp8_blocks.act_delta(cfg, lay, False, "none") == 0.0
        layers = list(range(cfg.model.n_layers))
        assert fp8_blocks.tp_comm_delta(cfg, lay, layers, lambda i: False, 512.0) == (0.0, 0.0, 0.0, 0)
        assert fp8_blocks.cp_amax(cfg, lay, layers, lambda i: False) == (0.0, 0)
