"""The planner prices precision (issue #44 parts 2 and 3): FP8 GEMM time by local shape and recipe,
the casts, FSDP's FP8 all-gather, the ranking and its gain column, and the calibration on
torchtitan's published bf16/FP8 pairs (resolve/cost/fp8_time.py, resolve/planner/precision.py,
benchmarks/calibrate_fp8.py)."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from paralayer.config import load_config
from paralayer.resolve.cost import fp8_time, terms
from paralayer.resolve.cost.machine import machine_for
from paralayer.resolve.cost.step_time import time_plan
from paralayer.resolve.plan import resolve
from paralayer.resolve.planner import config_for, plan_layouts

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import calibrate_fp8  # noqa: E402
from published_rows import FITTED_PEAK_500W  # noqa: E402

L70 = ["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=32"]
FP8 = L70 + ["train.precision=fp8"]


@functools.lru_cache(maxsize=None)
def _plans(*overrides: str, top: int = 20) -> list:
    return plan_layouts(load_config(list(overrides)), top=top)


def _dry(*overrides: str) -> dict:
    return resolve(load_config(list(overrides))).to_dict()


# ------------------------------------------------------------------ peaks and the GEMM model
def test_profiles_carry_dense_fp8_peaks():
    for profile, bf16, fp8 in (("h100-80gb-8x", 989, 1979), ("h800-80gb-8x", 989, 1979),
                               ("h200-141gb-8x", 989, 1979), ("b200-180gb-8x", 2250, 4500)):
        mach = machine_for(load_config(["recipe=llama3-8b", f"cluster={profile}"]))
        assert (mach.peak_tflops, mach.peak_fp8_tflops) == (bf16, fp8), profile
    assert machine_for(load_config(["recipe=llama3-8b", "cluster=h100-80gb-8x", "cluster.peak_fp8_tflops=null",
                                    "cluster.peak_tflops=500"])).peak_fp8_tflops == 1000.0


def test_gemm_ratio_follows_the_shape():
    """Thin and small GEMMs lean on HBM: their FP8 GEMM gains less, and their casts (bytes ∝ M·K +
    K·N + M·N against M·K·N FLOPs) eat the rest — a 1024³ linear loses in FP8, 70B's MLP at tp 8 gains."""
    r = functools.partial(fp8_time.fp8_ratio, recipe="tensorwise", peak_bf16=989e12, peak_fp8=1979e12, hbm=3.35e12)
    big, thin, small = r(131072, 8192, 3584), r(131072, 8192, 128), r(1024, 1024, 1024)
    assert big < small and big < thin
    s = functools.partial(fp8_time.microbench_speedup, peak_bf16=989e12, peak_fp8=1979e12, hbm=3.35e12)
    for recipe in ("tensorwise", "rowwise"):
        assert s(131072, 8192, 3584, recipe) > 1.1 > 1.0 > s(1024, 1024, 1024, recipe) > s(1024, 1024, 128, recipe)


def test_microbench_fit_residuals():
    """The shipped constants against torchao's rowwise table: median error under 10%, and the two
    tensorwise shapes of its README within 2%."""
    rows = calibrate_fp8._read(calibrate_fp8.MICRO)
    rw = sorted(abs(calibrate_fp8.micro_error(r, fp8_time.FP8_CALIBRATION)) for r in rows if r["recipe"] == "rowwise")
    assert len(rw) == 216 and rw[len(rw) // 2] < 0.10
    for r in rows:
        if r["recipe"] == "tensorwise":
            assert abs(calibrate_fp8.micro_error(r, fp8_time.FP8_CALIBRATION)) < 0.02, r
        assert len(r["source"]) > 40


# ------------------------------------------------------------------ part 3: the published pairs
@pytest.mark.parametrize("pair", calibrate_fp8._read(calibrate_fp8.PAIRS), ids=lambda p: p["id"])
def test_fitting_pairs_within_ten_percent(pair):
    pub = calibrate_fp8.published_gain(pair)
    pred = calibrate_fp8.predicted_gain(pair, fp8_time.FP8_CALIBRATION, FITTED_PEAK_500W)
    assert abs(pred / pub - 1) < 0.10, (pair["id"], pred, pub)
    assert "torchtitan" in pair["source"] or pair["source"].startswith("same file")


def test_docs_state_the_fit_and_its_residuals():
    doc = (REPO / "docs" / "planner.md").read_text()
    section = doc[doc.index("<!-- fp8-calibration:begin -->"):doc.index("<!-- fp8-calibration:end -->")]
    for pair in calibrate_fp8._read(calibrate_fp8.PAIRS):
        assert f"| {pair['id']} |" in section
    assert "fp8_microbench.csv" in section and "residual" in section


# ------------------------------------------------------------------ the ranking at FP8
def test_plan_70b_fp8_shows_a_gain_per_row_that_is_not_one_constant():
    rows = _plans(*FP8)
    assert rows
    gains = [d["fp8_gain"] for d in rows]
    for d in rows:
        assert d["fp8_gain"] == pytest.approx(d["bf16_step_time_s"] / d["step_time_s"], rel=1e-12)
        assert not d["tp_overlap"] and d["degrees"]["ep"] == 1
    assert max(gains) - min(gains) > 0.01
    assert [d["step_time_s"] for d in rows] == sorted(d["step_time_s"] for d in rows)  # ranked by the FP8 step


def _effective_ratio(*overrides: str) -> float:
    split = _dry(*FP8, "parallel.pp=1", "parallel.zero=3", "parallel.recompute=full", *overrides)
    s = split["step_time_by_precision"]
    return (s["fp8_gemm_s"] + s["cast_s"]) / s["fp8_gemms_at_bf16_s"]


def check_gain_follows_shapes() -> None:
    """The FP8 GEMMs' time with their casts over their bf16 time grows as the local shapes shrink:
    more tp (thinner N, K), fewer tokens per microbatch (smaller M)."""
    r = {tp: _effective_ratio(f"parallel.tp={tp}", "train.micro_batch=1") for tp in (2, 8)}
    assert r[8] > r[2] * 1.01, r
    m = {mb: _effective_ratio("parallel.tp=8", f"train.micro_batch={mb}") for mb in (1, 8)}
    assert m[1] > m[8] * 1.005, m


def test_gain_follows_the_local_gemm_shapes():
    check_gain_follows_shapes()


def test_planted_constant_gain_fails(monkeypatch):
    """One factor for every GEMM, casts folded in (the model issue #44 rejects), is caught."""
    monkeypatch.setattr(fp8_time, "fp8_ratio", lambda *a, **k: 0.6)
    monkeypatch.setattr(fp8_time, "cast_bytes", lambda *a, **k: 0.0)
    with pytest.raises(AssertionError):
        check_gain_follows_shapes()


def test_fp8_may_pick_another_layout_than_bf16():
    bf16, fp8 = _plans(*L70)[0], _plans(*FP8)[0]
    assert (bf16["degrees"], bf16["tp_overlap"]) != (fp8["degrees"], fp8["tp_overlap"])
    assert bf16["tp_overlap"] and not fp8["tp_overlap"]


def test_planner_rows_equal_the_resolver_at_fp8():
    """A sample of listed FP8 layouts, resolved one by one: the same FP8 step and gain."""
    cfg = load_config(FP8)
    mach = machine_for(cfg)
    rows = _plans(*FP8)
    for d in rows[:: max(1, len(rows) // 5)]:
        c = config_for(cfg, d)
        plan = resolve(c)
        assert not plan.errors, plan.errors
        t = time_plan(c, plan, mach)
        assert t["step_time_s"] == pytest.approx(d["step_time_s"], rel=1e-6)
        assert t["fp8_gain"] == pytest.approx(d["fp8_gain"], rel=1e-6)
        assert plan.memory_per_device_bytes["total"] == d["memory"]["total"]


# ------------------------------------------------------------------ bf16 untouched, the dry run's split
def test_bf16_plans_have_no_fp8_fields_and_fp8_keeps_the_bf16_step():
    layout = ["parallel.tp=8", "parallel.pp=4", "parallel.zero=1"]
    bf16 = _dry(*L70, *layout)
    fp8 = _dry(*FP8, *layout)
    assert not {"fp8_gain", "bf16_step_time_s", "step_time_by_precision"} & set(bf16)
    # the same plan timed with its GEMMs in bf16: its traffic is the FP8 plan's, which under tp with
    # SP gathers FP8 rows (resolve/fp8_blocks.py), so the bf16 plan's own step is longer there ...
    assert fp8["comm"]["tp"]["bytes_per_step"] < bf16["comm"]["tp"]["bytes_per_step"]
    assert fp8["bf16_step_time_s"] < bf16["step_time_s"]
    # ... and equal to the bit where FP8 moves no traffic of its own
    same = ["parallel.tp=1", "parallel.pp=8", "parallel.zero=1"]
    assert _dry(*FP8, *same)["bf16_step_time_s"] == _dry(*L70, *same)["step_time_s"]
    assert all("fp8_gain" not in d for d in _plans(*L70))
    s = fp8["step_time_by_precision"]
    assert sum(s[k] for k in ("fp8_gemm_s", "bf16_gemm_s", "cast_s", "other_s")) == pytest.approx(fp8["step_time_s"])
    assert min(s.values()) > 0
    assert fp8["fp8_gain"] == pytest.approx(fp8["bf16_step_time_s"] / fp8["step_time_s"])


def test_cpu_fp8_is_timed_as_its_base_precision():
    """Emulated casts on CPU: no FP8 time change, no FP8 keys."""
    d = _dry("recipe=tiny", "train.precision=fp8")
    assert "fp8_gain" not in d and d["fp8"]["emulated"]


# ------------------------------------------------------------------ FSDP's FP8 all-gather
def _fp8_linear_params_per_rank(tp: int) -> int:
    """Llama 3 70B: one block's linear weights on a tp rank (q, k, v, o and the SwiGLU), from its widths."""
    h, kv, f = 8192, 8 * 128, 28672
    return (h * h + 2 * h * kv + h * h + 3 * h * f) // tp


def check_fp8_gather_bytes(recipe: str) -> None:
    layout = ["parallel.tp=8", "parallel.pp=1", "parallel.dp=32", "parallel.zero=3", "train.micro_batch=1"]
    bf16 = _dry(*L70, *layout)["comm"]["dp"]
    fp8 = _dry(*FP8, *layout, f"train.fp8.recipe={recipe}")["comm"]["dp"]
    gathers = 2 * 16  # ZeRO-3 without pp: twice per microbatch (16 microbatches of global batch 512 over dp 32)
    saved = gathers * 80 * _fp8_linear_params_per_rank(8) if recipe == "tensorwise" else 0
    assert bf16["bytes_per_step"] - fp8["bytes_per_step"] == saved, (recipe, bf16, fp8)


def test_fsdp_fp8_all_gather_carries_half_the_bytes():
    check_fp8_gather_bytes("tensorwise")
    check_fp8_gather_bytes("rowwise")  # rowwise gathers bf16 (torchao's FP8 all-gather is tensorwise)


def test_zero2_holds_the_fp8_gathered_weights_at_one_byte():
    layout = ["parallel.tp=8", "parallel.pp=1", "parallel.dp=32", "parallel.zero=2", "train.micro_batch=1"]
    bf16 = _dry(*L70, *layout)["memory_per_device_bytes"]["params"]
    assert bf16 - _dry(*FP8, *layout)["memory_per_device_bytes"]["params"] == 80 * _fp8_linear_params_per_rank(8)
    assert _dry(*FP8, *layout, "train.fp8.recipe=rowwise")["memory_per_device_bytes"]["params"] == bf16


def test_planted_doubled_fp8_gather_bytes_fails(monkeypatch):
    monkeypatch.setattr(terms, "fp8_gathered_params", lambda *a, **k: 0.0)  # FP8 weights gathered at 2 bytes
    with pytest.raises(AssertionError):
        check_fp8_gather_bytes("tensorwise")


# ------------------------------------------------------------------ the CLI
def test_cli_plan_table_has_the_gain_column_and_json_the_keys():
    out = subprocess.run([sys.executable, "launch.py", *FP8, "--plan", "--top", "3"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fp8 gain" in out.stdout
    js = subprocess.run([sys.executable, "launch.py", *FP8, "--dry-run", "--json"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    d = json.loads(js.stdout)
    assert {"fp8_gain", "bf16_step_time_s", "step_time_by_precision", "fp8"} <= set(d)
    text = subprocess.run([sys.executable, "launch.py", *FP8, "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert "step time by precision" in text.stdout and "FP8 GEMMs" in text.stdout


def test_fp8_top_n_is_the_exhaustive_ranking_cut():
    """The bounds, scaled for FP8 (planner.precision.bound_scale), still skip only what cannot reach the best N."""
    cfg = load_config(["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=8", "train.precision=fp8"])
    full = plan_layouts(cfg)
    top = plan_layouts(cfg, top=10)
    assert [d["step_time_s"] for d in top] == [d["step_time_s"] for d in full[:10]]
    assert [d["overrides"] for d in top] == [d["overrides"] for d in full[:10]]
