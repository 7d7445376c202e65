"""Fit the planner's GPU constants to published training runs and check them, leave-one-out.

    python benchmarks/calibrate_gpu.py [--table benchmarks/published_runs.csv] [--out docs/planner.md]
                                       [--loo] [--json FILE] [--shipped]

Why published runs: no GPU has been lent to this project, but many runs at scale have been
published with their layout, hardware and measured throughput (benchmarks/published_runs.csv, the
source of every row in its ``source`` column). The planner's GPU time model
(``paralayer.resolve.cost.step_time`` / ``planner``) has a handful of physical constants
(``machine.GPU_CALIBRATION``): matmul and attention efficiency per GPU kind, the HBM bytes of the
non-matmul kernels, the share of the link bandwidth a ring reaches inside/across nodes, and the dp /
tp overlap factors. They are fitted here by least squares on the log of predicted vs published
tokens/s per GPU (a relative error, so a 1T row and a 1.7B row count alike), by a plain Nelder-Mead
over bounded transforms of the constants. Held, not fitted: the per-collective latency (NCCL's
launch latency, LAT_FIXED), the weights' HBM streams (machine.GPU_WEIGHT_PASSES at the datasheet
HBM speed); bounded by a published figure: the attention efficiency (ATTN_KERNEL_TFLOPS,
FlashAttention-2's rate).

What a row gives and how it is read: benchmarks/published_rows.py.

Outputs: the fitted constants (paste into ``machine.GPU_CALIBRATION``; the 500 W share into
FITTED_PEAK_500W), the per-row table, median and worst error, Spearman's rank correlation, the order
within each source table, and with ``--loo`` the leave-one-out errors (each row predicted from a fit
without it). ``--out`` rewrites the "GPU calibration" section of docs/planner.md and, with ``--loo``,
RECORD (benchmarks/published_runs_fit.json: the per-row fit and leave-one-out predictions that
tests/test_planner_gpu.py checks against the model as it is). ``--shipped`` keeps the shipped
constants instead of refitting them: after a model change, ``--shipped --loo --out docs/planner.md``
renews the record (its fit column, and the leave-one-out fits, which start from the shipped
constants) without moving any GPU figure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_sections import write_named_section, write_section  # noqa: E402
from planner_examples import examples_md  # noqa: E402
from published_rows import FITTED_PEAK_500W, TABLE, Row, load_rows, published_tokens_per_gpu  # noqa: E402,F401

from paralayer.resolve.cost.machine import GPU_CALIBRATION  # noqa: E402

#: the fit's and leave-one-out's predictions per row, as docs/planner.md reports them
RECORD = os.path.join(REPO, "benchmarks", "published_runs_fit.json")


# ------------------------------------------------------------------ the constants <-> a vector
def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


#: NCCL's launch latency per collective (a few µs in a node, ~10 µs across): held, not fitted — a
#: free latency is the fit's easiest knob for anything the model lacks (with one it charged 0.67 ms
#: per cross-node message to pay for the 128K row's attention).
LAT_FIXED = {"intra": 5e-6, "inter": 10e-6}
#: The fastest published attention kernel rate per GPU kind, TFLOP/s of the FLOPs it runs (causal:
#: half of 12·L·h·s): FlashAttention-2 (Dao 2023, arXiv:2307.08691) §4.1, "up to 335 TFLOPs/s" on
#: H100 and up to 73% of the 312 TFLOP/s peak on A100 (abstract: "50-73% of the theoretical maximum
#: FLOPs/s on A100"). The fitted attention efficiency (on 12·L·h·s FLOPs, no causal halving) is a
#: share of twice that: a run's attention does not beat the best published kernel. Only the
#: 128K-context row constrains it from above; without it the other rows would push it to any bound.
ATTN_KERNEL_TFLOPS = {"a100": 0.73 * 312.0, "h100": 335.0}
PEAK_TFLOPS = {"a100": 312.0, "h100": 989.0}
#: name, (to the constant from the unbounded x, back). ``att_*``: the attention efficiency as a share
#: of its cap 2 · ATTN_KERNEL_TFLOPS / peak.
PARAMS: list[tuple[str, Callable[[float], float], Callable[[float], float]]] = [
    ("eff_a100", _sig, _logit),
    ("eff_h100", _sig, _logit),
    ("att_a100", _sig, _logit),
    ("att_h100", _sig, _logit),
    ("peak_500w", _sig, _logit),
    ("elementwise_bytes", math.exp, math.log),
    ("bw_intra", _sig, _logit),
    ("bw_inter", _sig, _logit),
    ("dp_overlap", _sig, _logit),
    ("tp_overlap", _sig, _logit),
]


def _att_cap(kind: str) -> float:
    """The largest attention efficiency (on 12·L·h·s FLOPs) the best published kernel allows."""
    return 2.0 * ATTN_KERNEL_TFLOPS[kind] / PEAK_TFLOPS[kind]


def to_cal(c: dict) -> dict:
    return {"efficiency": {"a100": c["eff_a100"], "h100": c["eff_h100"]},
            "attention_efficiency": {k: _att_cap(k) * c[f"att_{k}"] for k in ("a100", "h100")},
            "peak_500w": c["peak_500w"],
            "elementwise_bytes": c["elementwise_bytes"],
            "latency_s": dict(LAT_FIXED),
            "bandwidth_eff": {"intra": c["bw_intra"], "inter": c["bw_inter"]},
            "dp_overlap": c["dp_overlap"], "tp_overlap": c["tp_overlap"]}


def from_cal(cal: dict) -> dict:
    eff = cal["efficiency"]
    att = {k: min(v, 0.999 * _att_cap(k)) for k, v in cal["attention_efficiency"].items()}
    return {"eff_a100": eff["a100"], "eff_h100": eff["h100"],
            "att_a100": att["a100"] / _att_cap("a100"), "att_h100": att["h100"] / _att_cap("h100"),
            "peak_500w": cal.get("peak_500w", FITTED_PEAK_500W),
            "elementwise_bytes": cal["elementwise_bytes"], "lat_intra": cal["latency_s"]["intra"],
            "lat_inter": cal["latency_s"]["inter"], "bw_intra": cal["bandwidth_eff"]["intra"],
            "bw_inter": cal["bandwidth_eff"]["inter"], "dp_overlap": cal["dp_overlap"],
            "tp_overlap": cal["tp_overlap"]}


def _vec_to_cal(x: list[float]) -> dict:
    return to_cal({name: fwd(v) for (name, fwd, _), v in zip(PARAMS, x)})


def _cal_to_vec(cal: dict) -> list[float]:
    c = from_cal(cal)
    return [back(c[name]) for name, _, back in PARAMS]


# ------------------------------------------------------------------ the fit
def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.5, iters: int = 1500,
                tol: float = 1e-10) -> list[float]:
    """Plain Nelder-Mead (reflection 1, expansion 2, contraction ½, shrink ½)."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        cen = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        refl = [c + (c - w) for c, w in zip(cen, pts[-1])]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c + 2 * (c - w) for c, w in zip(cen, pts[-1])]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(cen, pts[-1])]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [[b + 0.5 * (p - b) for b, p in zip(pts[0], q)] for q in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(n + 1), key=lambda i: vals[i])]


def rounded(cal: dict, digits: int = 3) -> dict:
    """The constants as they ship in machine.GPU_CALIBRATION (3 significant digits)."""
    if isinstance(cal, dict):
        return {k: rounded(v, digits) for k, v in cal.items()}
    return float(f"{cal:.{digits}g}")


def loss(rows: list[Row], cal: dict) -> float:
    """Mean squared log error of predicted vs published TFLOP/s per GPU."""
    err = [math.log(r.predict(cal) / r.measured) ** 2 for r in rows]
    return sum(err) / len(err)


def shipped() -> dict:
    """The constants as shipped: machine.GPU_CALIBRATION and FITTED_PEAK_500W (a deep copy)."""
    return dict(json.loads(json.dumps(GPU_CALIBRATION)), peak_500w=FITTED_PEAK_500W)


def fit(rows: list[Row], start: Optional[dict] = None, rounds: int = 2) -> dict:
    """Fit the constants; rows with unstated settings get their layout re-chosen each round."""
    cal = start or shipped()
    for _ in range(rounds):
        for r in rows:
            r.choose(cal)
        x = nelder_mead(lambda v: loss(rows, _vec_to_cal(v)), _cal_to_vec(cal))
        x = nelder_mead(lambda v: loss(rows, _vec_to_cal(v)), x, step=0.2)  # restart: NM stalls in 9-D
        cal = _vec_to_cal(x)
    for r in rows:
        r.choose(cal)
    return cal


# ------------------------------------------------------------------ reporting
def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else 0.0


def leave_one_out(rows: list[Row], cal: dict) -> dict[str, float]:
    """Each row predicted from a fit on the others (its layout chosen with those constants)."""
    out = {}
    for i, r in enumerate(rows):
        rest = rows[:i] + rows[i + 1:]
        c = fit(rest, start=json.loads(json.dumps(cal)), rounds=1)
        r.choose(c)
        out[r.id] = r.predict(c)
    for r in rows:  # back to the full fit's layouts
        r.choose(cal)
    return out


def summary(rows: list[Row], pred: dict[str, float]) -> dict:
    errs = [abs(pred[r.id] / r.measured - 1) for r in rows]
    worst = max(range(len(rows)), key=lambda i: errs[i])
    return {"median_abs_error": statistics.median(errs), "worst_abs_error": errs[worst], "worst_row": rows[worst].id,
            "spearman": spearman([r.measured for r in rows], [pred[r.id] for r in rows]),
            "within_25pct": sum(e <= 0.25 for e in errs), "rows": len(rows)}


#: measured figures closer than this (relative) are a tie: inside what repeated runs of one setup
#: differ by, and below the published figures' own rounding in Narayanan et al.'s table (137 vs 138)
ORDER_TIE = 0.02


def table_order(rows: list[Row], pred: dict[str, float]) -> dict[str, dict]:
    """Per source table (same paper, same hardware): does the prediction rank its rows as measured?
    Spearman over the table's rows, and the pairs whose measured figures differ by more than
    ORDER_TIE: how many the prediction orders the same way, and which it does not."""
    out: dict[str, dict] = {}
    for t in dict.fromkeys(r.row["table"] for r in rows):
        tr = [r for r in rows if r.row["table"] == t]
        if len(tr) < 2:
            continue
        pairs, kept, flipped = 0, 0, []
        for i, a in enumerate(tr):
            for b in tr[i + 1:]:
                if abs(a.measured / b.measured - 1) <= ORDER_TIE:
                    continue
                pairs += 1
                if (a.measured > b.measured) == (pred[a.id] > pred[b.id]):
                    kept += 1
                else:
                    flipped.append(f"{a.id}/{b.id}")
        out[t] = {"rows": len(tr), "spearman": spearman([r.measured for r in tr], [pred[r.id] for r in tr]),
                  "pairs": pairs, "kept": kept, "flipped": flipped}
    return out


def report_md(rows: list[Row], cal: dict, pred: dict, loo: Optional[dict], cmd: str, secs: float) -> str:
    s_fit = summary(rows, pred)
    lines = ["## GPU calibration (published runs)", "",
             f"Generated by `{cmd}` on {datetime.date.today().isoformat()} ({secs:.0f} s); the table is "
             "`benchmarks/published_runs.csv` (every row cites its source), the model "
             "`paralayer/resolve/cost/step_time.py`, the constants `machine.GPU_CALIBRATION`.", "",
             f"- rows: {len(rows)} ({sum(r.gpu == 'h100' for r in rows)} on H100, "
             f"{sum(r.gpu == 'a100' for r in rows)} on A100)",
             f"- fit on all rows: median error {100 * s_fit['median_abs_error']:.1f}%, worst "
             f"{100 * s_fit['worst_abs_error']:.1f}% ({s_fit['worst_row']}), Spearman {s_fit['spearman']:.3f}"]
    if loo:
        s_loo = summary(rows, loo)
        lines.append(f"- leave-one-out (each row predicted by a fit without it): median error "
                     f"{100 * s_loo['median_abs_error']:.1f}%, worst {100 * s_loo['worst_abs_error']:.1f}% "
                     f"({s_loo['worst_row']}), Spearman {s_loo['spearman']:.3f}, "
                     f"{s_loo['within_25pct']}/{len(rows)} within 25%")
    lines += ["", f"Order within each source table (same paper, same hardware): Spearman over its rows, and the "
              f"pairs whose published figures differ by more than {100 * ORDER_TIE:.0f}% (closer ones are ties) "
              "that the prediction ranks the same way:", "",
              "| table | rows | fit: Spearman | fit: pairs kept | leave-one-out: Spearman "
              "| leave-one-out: pairs kept |",
              "|---|---:|---:|---:|---:|---:|"]
    o_fit = table_order(rows, pred)
    o_loo = table_order(rows, loo) if loo else {}
    def cell(o: Optional[dict]) -> str:
        if not o:
            return "- | -"
        return (f"{o['spearman']:.2f} | {o['kept']}/{o['pairs']}"
                + (f" ({', '.join(o['flipped'])})" if o["flipped"] else ""))

    for t, o in o_fit.items():
        lines.append(f"| {t} | {o['rows']} | {cell(o)} | {cell(o_loo.get(t))} |")
    c = from_cal(cal)
    lines += ["", "Fitted constants:", "",
              f"- matmul efficiency: A100 {c['eff_a100']:.3f}, H100/H200 {c['eff_h100']:.3f} of the dense bf16 peak",
              f"- attention core (12·L·h·s FLOPs per token, causal half skipped by the kernels): A100 "
              f"{cal['attention_efficiency']['a100']:.3f}, H100/H200 {cal['attention_efficiency']['h100']:.3f} of the "
              f"peak (at most {_att_cap('a100'):.3f} / {_att_cap('h100'):.3f}: FlashAttention-2's published rate)",
              f"- H100 capped at 500 W (torchtitan's Grand Teton rows only; not a planner constant): "
              f"{c['peak_500w']:.3f} of the 700 W peak",
              f"- non-matmul kernels: {c['elementwise_bytes']:.1f} bytes per token·layer·hidden unit through HBM",
              f"- latency per collective: {1e6 * c['lat_intra']:.1f} µs in a node, {1e6 * c['lat_inter']:.1f} µs "
              "across (held at NCCL's launch latency, not fitted)",
              f"- share of the link bandwidth reached: {c['bw_intra']:.2f} in a node (NVLink), "
              f"{c['bw_inter']:.2f} across (IB/RoCE)",
              f"- overlap: dp {c['dp_overlap']:.2f} of the compute window, tp_overlap {c['tp_overlap']:.2f} "
              "of a chunk GEMM", "",
              "| row | GPU | GPUs | layout (planner-chosen where the source is silent) | published TFLOP/s/GPU | "
              "fit | err | leave-one-out | err |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lo = f"{loo[r.id]:.0f} | {100 * (loo[r.id] / r.measured - 1):+.1f}%" if loo else "- | -"
        lines.append(f"| {r.id} | {r.gpu} | {r.row['gpus']} | {r.layout()} | {r.measured:.0f} | {pred[r.id]:.0f} | "
                     f"{100 * (pred[r.id] / r.measured - 1):+.1f}% | {lo} |")
    lines += ["", "TFLOP/s per GPU are in our FLOP convention (6·N + 12·L·h·s, no recompute counted); a row "
              "published in another (Narayanan et al. count full recompute) is converted through its "
              "tokens/s, so its figure here is lower than the paper's."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default=TABLE)
    ap.add_argument("--loo", action="store_true", help="also the leave-one-out errors (a fit per row)")
    ap.add_argument("--out", default=None, help="rewrite the GPU calibration section of this markdown file")
    ap.add_argument("--json", default=None, help="write the fitted constants and predictions as JSON")
    ap.add_argument("--shipped", action="store_true",
                    help="keep machine.GPU_CALIBRATION (no refit): renew the record for the model as it is")
    ap.add_argument("--examples", default=None, metavar="MD",
                    help="only rewrite the worked examples section of this markdown file (no fit)")
    args = ap.parse_args(argv)
    if args.examples:
        md = examples_md(f"python benchmarks/calibrate_gpu.py --examples {args.examples}")
        print(md)
        write_named_section(args.examples, "## Worked examples", md)
        return 0
    t0 = time.time()
    rows = [Row(r) for r in load_rows(args.table) if r.get("fit", "yes") != "no"]
    cal = shipped() if args.shipped else rounded(fit(rows))
    for r in rows:
        r.choose(cal)
    pred = {r.id: r.predict(cal) for r in rows}
    loo = leave_one_out(rows, cal) if args.loo else None
    secs = time.time() - t0
    cmd = ("python benchmarks/calibrate_gpu.py" + (" --shipped" if args.shipped else "")
           + (" --loo" if args.loo else "")
           + (f" --out {args.out}" if args.out else ""))
    md = report_md(rows, cal, pred, loo, cmd, secs)
    print(md)
    print("GPU_CALIBRATION =", json.dumps({k: v for k, v in cal.items() if k != "peak_500w"}))
    print("FITTED_PEAK_500W =", cal["peak_500w"])
    if args.out:
        write_section(args.out, md)
        if loo:
            with open(RECORD, "w") as f:
                json.dump({"command": cmd, "calibration": cal,
                           "rows": {r.id: {"measured": r.measured, "fit": pred[r.id], "loo": loo[r.id],
                                           "layout": r.layout()} for r in rows}}, f, indent=1)
                f.write("\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calibration": cal, "fit": pred, "loo": loo, "measured": {r.id: r.measured for r in rows},
                       "layouts": {r.id: r.layout() for r in rows}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
