"""The planner on GPU profiles: the published-runs table, the fitted constants against it, the time
and cost to train in the dry run, and --plan narrowed by overrides and --top (resolve/cost/step_time.py,
resolve/cost/machine.py GPU_CALIBRATION, benchmarks/calibrate_gpu.py)."""
from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from paralayer.config import load_config
from paralayer.resolve import planner
from paralayer.resolve.cost.machine import GPU_CALIBRATION, machine_for
from paralayer.resolve.cost.step_time import DP_SYNCS
from tests.cpu_budget import cpu_within

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import calibrate_gpu  # noqa: E402

L405_16K = ["recipe=llama3-405b", "cluster=h100-80gb-8x", "cluster.nodes=2048"]


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


# ------------------------------------------------------------------ the table and the fit
def test_published_table_has_sources_and_the_required_runs():
    rows = calibrate_gpu.load_rows()
    assert len(rows) >= 25
    assert sum(r["gpu"] in ("h100", "h200") for r in rows) >= 8
    for r in rows:
        assert len(r["source"]) > 40, r["id"]  # paper/table or repository/file, with the figure
        assert float(r["value"]) > 0
        assert r["table"], r["id"]  # the source table its order is checked within
        assert (r["dp_sync"] or "runtime") in DP_SYNCS, r["id"]
    text = " ".join(r["source"] for r in rows)
    for must in ("Narayanan et al. 2021", "NVIDIA/Megatron-LM README", "pytorch/torchtitan",
                 "Llama 3 Herd of Models"):
        assert must in text, must
    assert sum(r["id"].startswith("n21-") for r in rows) == 10  # Table 1: 1.7B … 1T
    # a published figure in Megatron 2021's convention converts to tokens/s through its own count:
    # 1T at 163 TFLOP/s per GPU (with recompute) on 3072 GPUs
    one_t = next(r for r in rows if r["id"] == "n21-1t")
    l, h, s, V = 128, 25600, 2048, 51200
    assert calibrate_gpu.published_tokens_per_gpu(one_t) == pytest.approx(
        163e12 / (96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))))


@functools.lru_cache(maxsize=1)
def _shipped_rows() -> tuple[list, dict]:
    """Every published row with its layout chosen under the shipped constants (read-only: shared)."""
    cal = calibrate_gpu.shipped()
    rows = [calibrate_gpu.Row(r) for r in calibrate_gpu.load_rows()]
    for r in rows:
        r.choose(cal)
    return rows, {r.id: r.predict(cal) for r in rows}


def test_shipped_constants_predict_the_published_runs():
    """GPU_CALIBRATION as shipped against the published runs (docs/planner.md has the per-row table):
    median error ≤ 3%, none off by more than 10%, Spearman ≥ 0.98 — the measured 2.0%, 8.5%, 0.988
    with a little room — and within each source table the rows ranked as measured: every pair whose
    published figures differ by more than 2% but the few listed (the model's known misses)."""
    rows, pred = _shipped_rows()
    errs = [abs(pred[r.id] / r.measured - 1) for r in rows]
    assert statistics.median(errs) <= 0.03, sorted(errs)
    assert max(errs) <= 0.10, max(zip(errs, [r.id for r in rows]))
    assert calibrate_gpu.spearman([r.measured for r in rows], [pred[r.id] for r in rows]) >= 0.98
    order = calibrate_gpu.table_order(rows, pred)
    # pairs the model orders the other way today: Megatron-LM 2021's 7.5B ran faster (142 TFLOP/s)
    # than its 1.7B, 3.6B and 39B (137–138); Megatron-Core's 32B (460) than its 177B (433);
    # torchtitan's 8B on 8 GPUs (5,762 tokens/s) than on 128 (5,605): predicted equal; and since 7 Dec
    # Megatron-LM 2021's 145B (135 TFLOP/s) above its 1.7B (137): the plan times our runtime, whose
    # tp all-reduces of the column GEMMs' input gradients without SP move autocast's fp32 stream
    # (rehearsed), where Megatron's moved fp16 (those tp-heavy rows read 1-4% slower than before)
    known = {"n21-1.7b/n21-7.5b", "n21-3.6b/n21-7.5b", "n21-7.5b/n21-39b", "mc-32b/mc-177b",
             "tt-8b-8/tt-8b-128", "n21-1.7b/n21-145b"}
    assert {f for o in order.values() for f in o["flipped"]} <= known, order
    assert order["narayanan2021-t1"]["kept"] >= 32 and order["megatron-core-weak"]["kept"] >= 30
    assert order["llama3-t4"]["kept"] == order["llama3-t4"]["pairs"] == 3
    # a layout the source leaves open is chosen by the planner among the stated software's options
    n21 = next(r for r in rows if r.id == "n21-1t")
    assert n21.cfg.parallel.schedule in ("1f1b", "interleaved") and n21.cfg.parallel.recompute == "full"


def test_leave_one_out_record_is_the_model_as_it_is():
    """benchmarks/published_runs_fit.json (written by ``calibrate_gpu.py --loo --out``) holds each
    row predicted by a fit without it: every row within 25%, median ≤ 4% (measured 2.5%, worst 18%),
    and its fit column is what the shipped constants predict now — a model change that moves any
    row by more than 0.5% makes the record stale (rerun the command)."""
    rec = json.loads((REPO / "benchmarks" / "published_runs_fit.json").read_text())
    rows, pred = _shipped_rows()
    assert set(rec["rows"]) == {r.id for r in rows}
    assert rec["calibration"]["efficiency"] == GPU_CALIBRATION["efficiency"]
    for r in rows:
        got = rec["rows"][r.id]
        assert got["measured"] == pytest.approx(r.measured, rel=1e-6), r.id
        assert got["fit"] == pytest.approx(pred[r.id], rel=0.005), (r.id, got["fit"], pred[r.id])
    loo = {k: v["loo"] for k, v in rec["rows"].items()}
    errs = [abs(loo[r.id] / r.measured - 1) for r in rows]
    assert max(errs) <= 0.25, max(zip(errs, [r.id for r in rows]))
    assert statistics.median(errs) <= 0.04
    assert calibrate_gpu.spearman([r.measured for r in rows], [loo[r.id] for r in rows]) >= 0.95


def test_hardest_row_held_out_stays_within_25_percent():
    """The 128K-context Llama 3 row is the only one where attention dominates (57% of its FLOPs): held
    out, the attention efficiency is bounded only by FlashAttention-2's published rate. A short fit
    without it (the shipped constants as the start, layouts kept) still predicts it within 25%."""
    rows = [calibrate_gpu.Row(r) for r in calibrate_gpu.load_rows()]
    cal = calibrate_gpu.shipped()
    for r in rows:
        r.choose(cal)
        r.free = []  # keep the layouts: only the constants are refitted (seconds, not minutes)
    held = next(r for r in rows if r.id == "l3-405b-128k")
    rest = [r for r in rows if r is not held]
    x = calibrate_gpu.nelder_mead(lambda v: calibrate_gpu.loss(rest, calibrate_gpu._vec_to_cal(v)),
                                  calibrate_gpu._cal_to_vec(cal), iters=400)
    c = calibrate_gpu._vec_to_cal(x)
    assert c["attention_efficiency"]["h100"] <= 2 * 335 / 989 + 1e-9
    assert abs(held.predict(c) / held.measured - 1) <= 0.25


def test_framework_terms_can_fail():
    """The published rows' frameworks are timed as they move their traffic: Megatron-Core's distributed
    optimizer hides most of the dp traffic our ZeRO-1 shows (its 16B row: runtime dp exposed ≥ 25% of
    the step, distopt ≤ 5%); Megatron-LM 2021's all-reduce after the backward shows whole."""
    from paralayer.resolve.cost.step_time import RUNTIME, Framework, time_plan

    cal = calibrate_gpu.shipped()
    rows = {x["id"]: calibrate_gpu.Row(x) for x in calibrate_gpu.load_rows() if x["id"] in ("mc-16b", "n21-1.7b")}
    for r in rows.values():
        r.choose(cal)
    mc = rows["mc-16b"]
    mach = machine_for(mc.cfg, cal)
    ours = time_plan(mc.cfg, mc.plan, mach, mc.shape, RUNTIME)
    theirs = time_plan(mc.cfg, mc.plan, mach, mc.shape, mc.framework)
    assert ours["dp_exposed_s"] >= 0.25 * ours["step_time_s"]
    assert theirs["dp_exposed_s"] <= 0.05 * theirs["step_time_s"]
    n21 = rows["n21-1.7b"]
    mach = machine_for(n21.cfg, cal)
    after = time_plan(n21.cfg, n21.plan, mach, n21.shape, Framework(dp_sync="allreduce-after-fp16"))
    params = n21.plan.comm["dp"]["message_bytes"] / 4
    wire = 2 * 31 / 32 * 2 * params / mach.bandwidth(n21.plan.spans["dp"])
    assert after["dp_exposed_s"] == pytest.approx(wire + mach.latency(n21.plan.spans["dp"]))
    with pytest.raises(ValueError):
        time_plan(n21.cfg, n21.plan, mach, n21.shape, Framework(dp_sync="nope"))


def test_fit_recovers_constants_from_its_own_predictions():
    """The fit can fail: predictions made with known constants (efficiency 0.6/0.7 instead of the
    shipped ones) are recovered to within 2% by fitting them back on a few rows."""
    rows = [calibrate_gpu.Row(r) for r in calibrate_gpu.load_rows() if r["id"] in
            ("n21-7.5b", "n21-145b", "mc-7.1b", "mc-177b", "tt-8b-a100", "l3-405b-8k")]
    truth = dict(calibrate_gpu.shipped(), peak_500w=0.7)
    truth["efficiency"] = {"a100": 0.6, "h100": 0.7}
    for r in rows:
        r.choose(truth)
        r.measured = r.predict(truth)
        r.free = []  # keep the layouts: only the constants are fitted
    x0 = calibrate_gpu._cal_to_vec(truth)
    x0[0] = x0[1] = calibrate_gpu._logit(0.45)  # the efficiencies start off: 0.45
    only_eff = [0, 1]  # fit the two efficiencies, the rest held at the truth

    def f(v):
        x = list(x0)
        for i, vi in zip(only_eff, v):
            x[i] = vi
        return calibrate_gpu.loss(rows, calibrate_gpu._vec_to_cal(x))

    best = calibrate_gpu.nelder_mead(f, [x0[i] for i in only_eff])
    got = calibrate_gpu._vec_to_cal([best[only_eff.index(i)] if i in only_eff else x0[i] for i in range(len(x0))])
    assert got["efficiency"]["a100"] == pytest.approx(0.6, rel=0.02)
    assert got["efficiency"]["h100"] == pytest.approx(0.7, rel=0.02)


def test_gpu_kind_and_hbm_follow_the_profile():
    a100 = machine_for(load_config(["recipe=llama3-70b", "cluster=a100-80gb-8x", "cluster.nodes=16"]))
    h200 = machine_for(load_config(["recipe=llama3-70b", "cluster=h200-141gb-8x", "cluster.nodes=16"]))
    assert (a100.gpu, a100.efficiency) == ("a100", GPU_CALIBRATION["efficiency"]["a100"])
    assert (h200.gpu, h200.efficiency) == ("h200", GPU_CALIBRATION["efficiency"]["h100"])
    assert h200.hbm_bytes_per_s == pytest.approx(4.8e12) and a100.hbm_bytes_per_s == pytest.approx(2.039e12)


# ------------------------------------------------------------------ time and cost to train
def test_dry_run_states_days_and_device_hours():
    out = _launch(*L405_16K, "train.tokens=15.6e12", "cluster.price_per_device_hour=2.5", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["world_size"] == 16384
    for k in ("step_time_s", "tokens_per_s", "mfu", "train_days", "device_hours", "train_cost"):
        assert d[k] > 0, k
    assert d["tokens_per_s"] == pytest.approx(d["tokens_per_step"] / d["step_time_s"])
    assert d["train_days"] == pytest.approx(15.6e12 / d["tokens_per_s"] / 86400)
    assert d["device_hours"] == pytest.approx(d["train_days"] * 24 * 16384)
    assert d["train_cost"] == pytest.approx(2.5 * d["device_hours"])
    assert d["mfu"] == pytest.approx(d["flops_per_step"] / (d["step_time_s"] * 16384 * 989e12))
    table = _launch(*L405_16K, "train.tokens=15.6e12", "--dry-run")
    assert table.returncode == 0, table.stderr
    assert "days" in table.stdout and "H100-hours" in table.stdout and "no failures" in table.stdout


def test_without_a_token_budget_the_steps_are_the_budget():
    from paralayer.resolve.plan import resolve

    cfg = load_config(L405_16K + ["train.steps=100"])
    d = resolve(cfg).to_dict()
    assert d["train_tokens_from"] == "train.steps"
    assert d["train_tokens"] == 100 * d["tokens_per_step"]
    assert d["train_days"] == pytest.approx(100 * d["step_time_s"] / 86400)
    cpu = resolve(load_config(["recipe=tiny"])).to_dict()
    assert "step_time_s" not in cpu  # the GPU time model only (CPU has the local calibration)


# ------------------------------------------------------------------ --plan: narrowing, --top
def test_plan_narrowed_by_overrides_and_top():
    out = _launch(*L405_16K, "parallel.tp=8", "parallel.pp=16", "--plan", "--json", "--top", "3")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)
    assert len(plans) == 3
    assert all(p["degrees"]["tp"] == 8 and p["degrees"]["pp"] == 16 for p in plans)
    assert [p["train_days"] for p in plans] == sorted(p["train_days"] for p in plans)
    table = _launch(*L405_16K, "parallel.tp=8", "parallel.pp=16", "--plan", "--top", "2",
                    "cluster.price_per_device_hour=2")
    assert table.returncode == 0, table.stderr
    assert "fixed on the command line: tp=8, pp=16" in table.stdout
    assert "Top 2 layouts, ranked by time to train" in table.stdout and "cost" in table.stdout
    bad = _launch(*L405_16K, "--plan", "--top", "0")
    assert bad.returncode == 2 and "--top" in bad.stderr and "Traceback" not in bad.stderr


def test_top_n_is_the_exhaustive_ranking_cut():
    """Branch and bound skips structures whose lower bound cannot reach the best N: the same N."""
    cfg = load_config(["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=8"])
    full = planner.plan_layouts(cfg)
    stats: dict = {}
    top = planner.plan_layouts(cfg, top=10, stats=stats)
    assert [d["step_time_s"] for d in top] == [d["step_time_s"] for d in full[:10]]
    assert [d["overrides"] for d in top] == [d["overrides"] for d in full[:10]]
    assert stats["listed"] <= len(full)
    narrowed = planner.plan_layouts(cfg, fixed={"tp": 4, "schedule": ["1f1b", "interleaved"]})
    assert narrowed and all(d["degrees"]["tp"] == 4 for d in narrowed)
    assert {d["schedule"] for d in narrowed} <= {"1f1b", "interleaved"}
    assert len(narrowed) == sum(1 for d in full if d["degrees"]["tp"] == 4 and d["schedule"] in ("1f1b", "interleaved"))


def _largest(kind: str) -> list[str]:
    from paralayer.inputs.bounds import INT_BOUNDS, MAX_WORLD

    if kind == "layers":  # the most layers the config allows, on 1,024 devices
        return ["recipe=tiny", "cluster=h100-80gb-8x", "cluster.nodes=128",
                f"model.n_layers={INT_BOUNDS['model.n_layers'][1]}", "train.global_batch=1024"]
    return ["recipe=llama3-405b", "cluster=h100-80gb-8x", f"cluster.nodes={MAX_WORLD // 8}",  # the most devices
            f"train.global_batch={MAX_WORLD}"]


@pytest.mark.parametrize("kind", ["layers", "devices"])
def test_plan_cost_is_bounded(kind):
    """The largest inputs the config bounds allow still plan (the table's top 15) in a few seconds
    of CPU: structures are ranked by a lower bound and the work is capped (MAX_STRUCTURES,
    MAX_CANDIDATES); nothing grows with the square of pp or of the layers."""
    cfg = load_config(_largest(kind))
    stats: dict = {}
    took, allowed, plans = cpu_within(lambda: planner.plan_layouts(cfg, top=15, stats=stats), 6.0)
    # 6 s since 6 Dec (was 4): the interleaved schedule's memory is exact per chunk (issue 46), which
    # costs these plans ~2.1x (layers 2.31 -> 4.98 s, devices 2.14 -> 4.29 s side by side at load ~2);
    # scaled to a slower or busier machine by tests/cpu_budget.py
    assert plans and took < allowed, (took, allowed, stats["considered"])
    assert stats["considered"] <= planner.MAX_STRUCTURES
