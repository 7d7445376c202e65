"""Fit the planner's FP8 constants (paralayer/resolve/cost/fp8_time.FP8_CALIBRATION) on published
measurements, and write the fit with its residuals.

    python benchmarks/calibrate_fp8.py [--out docs/planner.md]

Two stages, each on its own published data:

1. Per GEMM shape (benchmarks/fp8_microbench.csv): torchao's H100 microbenchmark, LayerNorm →
   Linear → Sigmoid forward + backward, FP8 speedup over bf16 by forward M, K, N. Rowwise: the
   216-shape table (M, K, N from 1,024 to 32,768) fits the bf16 and rowwise GEMM efficiencies and
   the casts' share of HBM speed (``fp8_time.microbench_speedup``, least squares on log speedup).
   Tensorwise: the two shapes torchao's README states (0.80× at 1024×2048×1024, 1.39× at
   4096×8192×16384) fit its GEMM efficiency and cast share of HBM speed (two numbers, two
   unknowns: no residual to report). The microbenchmark's H100 is Meta's (2.4 TB/s HBM2e,
   torchao's roofline_utils), dense peaks 989 / 1,979 TFLOP/s.
2. Per training step (benchmarks/fp8_pairs.csv): torchtitan's H100 bf16/FP8 pairs (same layout,
   same framework, vanilla TP). Each pair is planned at its layout with the GPU calibration and
   predicted with the step-1 constants; ``cast_share`` per recipe (the share of the casts a step
   pays once torch.compile fuses them into the kernels around them) is fitted on that recipe's
   two pairs. The residuals are the pairs' predicted over published gains.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from published_rows import FITTED_PEAK_500W, load_rows  # noqa: E402

from paralayer.config import load_config  # noqa: E402
from paralayer.resolve.cost import fp8_time  # noqa: E402
from paralayer.resolve.cost.machine import machine_for  # noqa: E402
from paralayer.resolve.cost.step_time import time_plan  # noqa: E402
from paralayer.resolve.plan import resolve  # noqa: E402

MICRO = os.path.join(REPO, "benchmarks", "fp8_microbench.csv")
PAIRS = os.path.join(REPO, "benchmarks", "fp8_pairs.csv")
#: the microbenchmark's H100 (torchao/testing/training/roofline_utils.py: Meta's variant)
MICRO_PEAKS, MICRO_HBM = (989e12, 1979e12), 2.4e12
#: torchtitan's Grand Teton H100s: 500 W (the GPU calibration's fitted share of the 700 W peak,
#: benchmarks/published_rows.FITTED_PEAK_500W, taken for both peaks) and 2.4 TB/s HBM2e
PAIR_HBM = 2.4e12


def _read(path: str) -> list[dict]:
    """The rows of a CSV, each with its source (published_rows.load_rows' check)."""
    return load_rows(path)


def _shape(r: dict) -> tuple[int, int, int]:
    return int(r["m"]), int(r["k"]), int(r["n"])


def micro_error(r: dict, cal: dict) -> float:
    """Predicted over published speedup, minus 1."""
    return fp8_time.microbench_speedup(*_shape(r), r["recipe"], *MICRO_PEAKS, MICRO_HBM, cal) / float(r["speedup"]) - 1


def fit_micro(rows: list[dict], cal: dict) -> dict:
    """Stage 1: GEMM efficiencies and cast HBM shares on torchao's tables."""
    cal = copy.deepcopy(cal)
    rw = [r for r in rows if r["recipe"] == "rowwise"]
    tw = [r for r in rows if r["recipe"] == "tensorwise"]

    def put(rec: str, eb: float, ef: float, ce: float) -> dict:
        c = copy.deepcopy(cal)
        c["gemm_efficiency"]["bf16"], c["gemm_efficiency"][rec], c["cast_efficiency"][rec] = eb, ef, ce
        return c

    def loss(x: list, rec: str, rs: list, eb=None) -> float:
        xs = ([eb] + list(x)) if eb is not None else list(x)
        if not all(0.01 < v <= 1.0 for v in xs):
            return 1e9
        c = put(rec, *xs)
        return sum(math.log1p(micro_error(r, c)) ** 2 for r in rs)

    from scipy.optimize import minimize  # here: the tests read this module's rows, not its fits

    res = minimize(loss, [0.5, 0.5, 0.5], args=("rowwise", rw), method="Nelder-Mead",
                   options={"maxiter": 8000, "xatol": 1e-7, "fatol": 1e-12})
    eb, er, cr = (round(float(v), 3) for v in res.x)
    cal = put("rowwise", eb, er, cr)
    res_t = minimize(loss, [0.5, 0.5], args=("tensorwise", tw, eb), method="Nelder-Mead",
                     options={"maxiter": 8000, "xatol": 1e-7, "fatol": 1e-14})
    et, ct = (round(float(v), 3) for v in res_t.x)
    cal = put("tensorwise", eb, et, ct)
    # blockwise: no published per-shape table here -- rowwise's GEMM and cast constants (stated)
    cal["gemm_efficiency"]["blockwise"] = er
    cal["cast_efficiency"]["blockwise"] = cr
    return cal


def pair_config(p: dict, fp8: bool):
    """The pair's layout as a config (bf16 or FP8 at the pair's recipe)."""
    gpus, tp, dp, mb = (int(p[k]) for k in ("gpus", "tp", "dp", "micro_batch"))
    ov = [f"recipe={p['recipe']}", "cluster=h100-80gb-8x", f"cluster.nodes={gpus // 8}", f"parallel.tp={tp}",
          "parallel.pp=1", "parallel.cp=1", f"parallel.dp={dp}", "parallel.zero=3",
          f"parallel.recompute={p['recompute']}", "parallel.sequence_parallel=true", "parallel.tp_overlap=false",
          f"train.micro_batch={mb}", f"train.global_batch={mb * dp}",
          f"train.precision={'fp8' if fp8 else 'bf16'}", f"train.fp8.recipe={p['fp8_recipe']}"]
    return load_config(ov)


def predicted_gain(p: dict, cal: dict, peak_share: float) -> float:
    """bf16 over FP8 step time of the pair's layout on torchtitan's H100s."""
    cfg = pair_config(p, fp8=True)
    c = cfg.cluster
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
        c, peak_tflops=c.peak_tflops * peak_share, peak_fp8_tflops=c.peak_fp8_tflops * peak_share))
    plan = resolve(cfg)
    if plan.errors:
        raise ValueError(f"pair {p['id']}: {plan.errors}")
    mach = machine_for(cfg)
    mach.hbm_bytes_per_s = PAIR_HBM
    cal, saved = copy.deepcopy(cal), copy.deepcopy(fp8_time.FP8_CALIBRATION)
    fp8_time.FP8_CALIBRATION.clear()
    fp8_time.FP8_CALIBRATION.update(cal)
    try:
        return time_plan(cfg, plan, mach)["fp8_gain"]
    finally:
        fp8_time.FP8_CALIBRATION.clear()
        fp8_time.FP8_CALIBRATION.update(saved)


def published_gain(p: dict) -> float:
    return float(p["fp8_tokens_per_s_per_gpu"]) / float(p["bf16_tokens_per_s_per_gpu"])


def fit_pairs(pairs: list[dict], cal: dict, peak_share: float) -> dict:
    """Stage 2: cast_share per recipe on its pairs (log error of the gain, least squares)."""
    from scipy.optimize import minimize_scalar

    cal = copy.deepcopy(cal)
    for rec in sorted({p["fp8_recipe"] for p in pairs}):
        ps = [p for p in pairs if p["fp8_recipe"] == rec]

        def loss(x: float, rec=rec, ps=ps) -> float:
            c = copy.deepcopy(cal)
            c["cast_share"][rec] = x
            return sum(math.log(predicted_gain(p, c, peak_share) / published_gain(p)) ** 2 for p in ps)

        cal["cast_share"][rec] = round(float(minimize_scalar(loss, bounds=(0.0, 3.0), method="bounded",
                                                             options={"xatol": 1e-4}).x), 3)
    cal["cast_share"]["blockwise"] = cal["cast_share"]["rowwise"]
    return cal


def report(micro: list[dict], pairs: list[dict], cal: dict, peak_share: float) -> str:
    rw = [r for r in micro if r["recipe"] == "rowwise"]
    errs = sorted(abs(micro_error(r, cal)) for r in rw)
    signed = [micro_error(r, cal) for r in rw]
    worst = max(rw, key=lambda r: abs(micro_error(r, cal)))
    lines = [
        "Generated by `python benchmarks/calibrate_fp8.py --out docs/planner.md`; the data are "
        "`benchmarks/fp8_microbench.csv` and `benchmarks/fp8_pairs.csv` (every row cites its source), "
        "the model `paralayer/resolve/cost/fp8_time.py`, the constants `fp8_time.FP8_CALIBRATION`.",
        "",
        f"- GEMM efficiency on the microbenchmark's H100: bf16 {cal['gemm_efficiency']['bf16']:.3f}, rowwise "
        f"{cal['gemm_efficiency']['rowwise']:.3f}, tensorwise {cal['gemm_efficiency']['tensorwise']:.3f} of the "
        f"dense peak; casts at {cal['cast_efficiency']['rowwise']:.3f} (rowwise) / "
        f"{cal['cast_efficiency']['tensorwise']:.3f} (tensorwise) of HBM speed; blockwise takes rowwise's (no table)",
        f"- rowwise table, {len(rw)} shapes: median |error| {100 * errs[len(errs) // 2]:.1f}%, "
        f"mean error {100 * sum(signed) / len(signed):+.1f}%, worst {100 * micro_error(worst, cal):+.1f}% "
        f"({worst['m']}×{worst['k']}×{worst['n']}: published {float(worst['speedup']):.2f}×)",
    ]
    for r in micro:
        if r["recipe"] == "tensorwise":
            lines.append(f"- tensorwise {r['m']}×{r['k']}×{r['n']}: published {float(r['speedup']):.2f}×, "
                         f"fit {float(r['speedup']) * (1 + micro_error(r, cal)):.2f}× (2 shapes, 2 constants)")
    lines += [f"- casts a step pays after torch.compile's fusion (`cast_share`): tensorwise "
              f"{cal['cast_share']['tensorwise']:.3f}, rowwise {cal['cast_share']['rowwise']:.3f} of the unfused bytes",
              f"- torchtitan's H100s at 500 W: {peak_share:.3f} of both peaks (the GPU calibration's share), "
              f"HBM {PAIR_HBM / 1e12:.1f} TB/s",
              "",
              "| pair | layout | published bf16 → FP8 tok/s/GPU | published gain | predicted gain | residual |",
              "|---|---|---:|---:|---:|---:|"]
    for p in pairs:
        g, pub = predicted_gain(p, cal, peak_share), published_gain(p)
        lay = (f"{p['recipe']} tp{p['tp']} dp{p['dp']} ZeRO-3 rc={p['recompute']} mb{p['micro_batch']} "
               f"({p['gpus']} H100)")
        b16, f8 = float(p["bf16_tokens_per_s_per_gpu"]), float(p["fp8_tokens_per_s_per_gpu"])
        err = 100 * (g / pub - 1)
        lines.append(f"| {p['id']} | {lay} | {b16:,.1f} → {f8:,.1f} | {pub:.3f}× | {g:.3f}× | {err:+.1f}% |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- fp8-calibration:begin -->", "<!-- fp8-calibration:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the report between the fp8-calibration markers of this file")
    args = ap.parse_args()
    micro, pairs = _read(MICRO), _read(PAIRS)
    cal = fit_micro(micro, fp8_time.FP8_CALIBRATION)
    cal = fit_pairs(pairs, cal, FITTED_PEAK_500W)
    text = report(micro, pairs, cal, FITTED_PEAK_500W)
    print("FP8_CALIBRATION =", cal)
    print(text)
    if args.out:
        with open(args.out) as f:
            doc = f.read()
        a, b = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        with open(args.out, "w") as f:
            f.write(doc[:a] + "\n" + text + doc[b:])


if __name__ == "__main__":
    main()
