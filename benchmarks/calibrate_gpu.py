"""Fit the planner's GPU constants to published training runs and check them, leave-one-out.

    python benchmarks/calibrate_gpu.py [--table benchmarks/published_runs.csv] [--out docs/planner.md]
                                       [--loo] [--json FILE]

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

What a row gives and how it is read:

- The published figure is turned into tokens/s per GPU with the FLOP count its source used
  (``flops_counted``): ``megatron2021`` = 96·l·h²·(1 + s/6h + V/16lh) per sequence-token (Narayanan
  et al. 2021, eq. 3: full recompute counted), ``megatron`` = 72·l·h² + 12·l·h·s + 6·h·V (Megatron-Core's
  num_floating_point_operations for a GPT block: no recompute), ``model`` = ours
  (``cost.flops_per_token``: 6·N + 12·L·h·s), ``tokens`` = the figure is tokens/s per GPU. Errors are
  reported as TFLOP/s per GPU in OUR convention (the same ratio as tokens/s).
- A GPT block (``mlp = gelu4h``: a 4h GELU MLP) is represented by our SwiGLU block of width 8h/3
  (rounded to a multiple of 64): the same matmul parameters and FLOPs.
- The row's framework (``dp_sync``, ``pp_scatter_gather``; empty = as our runtime) says where it
  moves its traffic otherwise than our runtime (``step_time.Framework``): Megatron-Core's
  distributed optimizer overlaps its grad reduce-scatter and param all-gather (``distopt``);
  Megatron-LM 2021 all-reduces fp16 grads after the backward, nothing hidden
  (``allreduce-after-fp16``), and scatters/gathers pipeline hand-offs over the tp ranks.
- An empty cell is a setting the source does not state (micro-batch, schedule and vpp, recompute,
  ZeRO stage): the row is predicted with the fastest layout our planner finds with every stated
  setting fixed (``plan_layouts(fixed=...)``; its best RERANK re-timed as the row's framework runs
  them), memory not checked (the published frameworks hold less per parameter than our runtime's
  fp32 master weights, and our activation model is ours): what a tuned run of that framework would
  use. The layout is chosen with the constants being fitted (re-chosen after each round of the fit,
  and, for a held-out row, with the constants fitted without it).
- ``table``: the source table (same paper, same hardware); the order of its rows is checked.
- ``fit = no`` rows are never fitted on (none at present).

Outputs: the fitted constants (paste into ``machine.GPU_CALIBRATION``; the 500 W share into
FITTED_PEAK_500W), the per-row table, median and worst error, Spearman's rank correlation, the order
within each source table, and with ``--loo`` the leave-one-out errors (each row predicted from a fit
without it). ``--out`` rewrites the "GPU calibration" section of docs/planner.md and, with ``--loo``,
RECORD (benchmarks/published_runs_fit.json: the per-row fit and leave-one-out predictions that
tests/test_planner_gpu.py checks against the model as it is).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
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

from paralayer.config import load_config  # noqa: E402
from paralayer.resolve import cost as cost_mod  # noqa: E402
from paralayer.resolve.cost.machine import GPU_CALIBRATION, machine_for  # noqa: E402
from paralayer.resolve.cost.step_time import RUNTIME, Framework, step_shape, time_plan  # noqa: E402
from paralayer.resolve.plan import resolve  # noqa: E402
from paralayer.resolve.planner import config_for, plan_layouts  # noqa: E402

TABLE = os.path.join(REPO, "benchmarks", "published_runs.csv")
PROFILE = {"a100": "a100-80gb-8x", "h100": "h100-80gb-8x", "h200": "h200-141gb-8x"}
#: the fit's and leave-one-out's predictions per row, as docs/planner.md reports them
RECORD = os.path.join(REPO, "benchmarks", "published_runs_fit.json")
#: torchtitan's H100s capped at 500 W run at this share of the 700 W peak (fitted with the rest;
#: a constant of those rows only, not of the planner)
FITTED_PEAK_500W = 0.749
#: layouts (the planner's best by our runtime's traffic) re-timed for a row whose framework moves
#: its traffic otherwise
RERANK = 8
#: what the planner may choose for a row when its source leaves the setting unstated
CHOOSABLE = ("micro_batch", "schedule", "vpp", "zero", "recompute")


# ------------------------------------------------------------------ the table
def load_rows(path: str = TABLE) -> list[dict]:
    with open(path, newline="") as f:
        rows = [dict(r) for r in csv.DictReader(f)]
    for r in rows:
        if not r.get("source", "").strip():
            raise ValueError(f"{path}: row {r.get('id')} has no source")
    return rows


def _ffn(row: dict) -> int:
    if row["mlp"] == "gelu4h":  # a 4h GELU MLP = a SwiGLU of width 8h/3 (same matmul parameters)
        return int(round(8 * int(row["d_model"]) / 3 / 64)) * 64
    return int(row["ffn_hidden"])


def row_overrides(row: dict) -> list[str]:
    """The recipe overrides that describe a row (stated settings only)."""
    gpus, gpn = int(row["gpus"]), int(row["gpus_per_node"])
    tp, pp, cp = int(row["tp"]), int(row["pp"]), int(row["cp"] or 1)
    ov = [f"recipe=base", f"cluster={PROFILE[row['gpu']]}", f"cluster.nodes={gpus // gpn}",
          f"cluster.devices_per_node={gpn}", f"cluster.intra_node_gbps={row['intra_gbps']}",
          f"cluster.inter_node_gbps={row['inter_gbps']}",
          f"model.d_model={row['d_model']}", f"model.n_layers={row['n_layers']}", f"model.n_heads={row['n_heads']}",
          f"model.n_kv_heads={row['n_kv_heads']}", f"model.ffn_hidden={_ffn(row)}",
          f"model.vocab_size={row['vocab_size']}", f"model.seq_len={row['seq_len']}",
          f"train.global_batch={row['global_batch']}", "train.precision=bf16",
          f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.dp={gpus // (tp * pp * cp)}",
          f"parallel.sequence_parallel={row['sequence_parallel'] or 'null'}",
          f"parallel.tp_overlap={row['tp_overlap'] or 'false'}"]
    for key in CHOOSABLE:
        if row.get(key, "") and "|" not in row[key]:
            ov.append(f"{'train' if key == 'micro_batch' else 'parallel'}.{key}={row[key]}")
    return ov


def published_tokens_per_gpu(row: dict) -> float:
    """The row's figure as tokens/s per GPU, with its source's FLOP count."""
    v, conv = float(row["value"]), row["flops_counted"]
    if row["metric"] == "tokens_per_s_per_gpu":
        return v
    if row["metric"] == "mfu":
        v = v * (312.0 if row["gpu"] == "a100" else 989.0)
    l, h, s, V = (int(row[k]) for k in ("n_layers", "d_model", "seq_len", "vocab_size"))
    if conv == "megatron2021":
        fpt = 96.0 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    elif conv == "megatron":
        fpt = 72.0 * l * h * h + 12.0 * l * h * s + 6.0 * h * V
    elif conv == "model":
        fpt = float(cost_mod.flops_per_token(load_config(row_overrides(row))))
    else:
        raise ValueError(f"row {row['id']}: unknown flops_counted {conv!r}")
    return v * 1e12 / fpt


def row_framework(row: dict) -> Framework:
    """How the row's software moves what our cost model charges (``dp_sync``, ``pp_scatter_gather``
    columns; empty = as our runtime does)."""
    return Framework(dp_sync=row.get("dp_sync") or "runtime",
                     pp_scatter_gather=(row.get("pp_scatter_gather") or "").lower() == "true")


class Row:
    """One published run: its config, the measured figure, and (once chosen) its layout."""

    def __init__(self, row: dict):
        self.row = row
        self.id = row["id"]
        self.gpu = row["gpu"]
        self.cfg0 = load_config(row_overrides(row))
        self.fpt = cost_mod.flops_per_token(self.cfg0)
        self.measured_tok = published_tokens_per_gpu(row)
        self.measured = self.measured_tok * self.fpt / 1e12  # TFLOP/s per GPU, our convention
        # unstated (empty) or a choice among the software's options ("1f1b|interleaved")
        self.free = [k for k in CHOOSABLE if not row.get(k, "") or "|" in row[k]]
        self.options = {k: row[k].split("|") for k in CHOOSABLE if "|" in row.get(k, "")}
        self.framework = row_framework(row)
        self.cfg = self.cfg0
        self.plan = None
        self.shape = None

    def choose(self, cal: dict) -> None:
        """Fill the unstated settings with the planner's fastest layout (stated ones fixed)."""
        if self.free or self.plan is None:
            cfg = self.cfg0
            if self.free:
                p = cfg.parallel
                fixed = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.dp, "tp_overlap": p.tp_overlap}
                fixed.update({k: (cfg.train.micro_batch if k == "micro_batch" else getattr(p, k))
                              for k in CHOOSABLE if k not in self.free})
                fixed.update({k: [int(v) if v.isdigit() else v for v in opts] for k, opts in self.options.items()})
                if "recompute" not in self.free:  # a stated mode is the published one: every layer for "full"
                    fixed["recompute_every"] = p.recompute_every
                # memory unchecked: it is our runtime's (fp32 master weights, our activation
                # model), not the published framework's, and would push rows into recompute
                free_mem = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device_memory_gib=None))
                # the planner ranks by our runtime's traffic; the row's framework moves some of it
                # otherwise (Framework): its best few are re-timed as that framework runs them
                cands = plan_layouts(free_mem, calibration=cal, top=1 if self.framework == RUNTIME else RERANK,
                                     fixed=fixed)
                timed = []
                for d in cands:
                    c = config_for(cfg, d)
                    p = resolve(c)
                    if not p.errors:
                        sh = step_shape(c, p)
                        timed.append((time_plan(c, p, machine_for(c, cal), sh, self.framework)["step_time_s"],
                                      len(timed), c, p, sh))
                if not timed:
                    raise ValueError(f"row {self.id}: no valid layout")
                _, _, cfg, plan, shape = min(timed)
                self.cfg, self.plan, self.shape = cfg, plan, shape
                return
            plan = resolve(cfg)
            if plan.errors:
                raise ValueError(f"row {self.id}: {plan.errors}")
            self.cfg, self.plan, self.shape = cfg, plan, step_shape(cfg, plan)

    def predict(self, cal: dict) -> float:
        """Predicted TFLOP/s per GPU (our convention) with calibration ``cal``."""
        cfg = self.cfg
        if self.row.get("power_w") == "500":  # power-capped H100s: a fitted share of the 700 W peak
            cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(
                cfg.cluster, peak_tflops=cfg.cluster.peak_tflops * cal.get("peak_500w", FITTED_PEAK_500W)))
        mach = machine_for(cfg, cal)
        if self.row.get("hbm_tbps"):  # a GPU variant with other HBM (torchtitan's 96 GB HBM2e H100s)
            mach.hbm_bytes_per_s = float(self.row["hbm_tbps"]) * 1e12
        t = time_plan(cfg, self.plan, mach, self.shape, self.framework)
        return t["tokens_per_s"] / self.plan.world_size * self.fpt / 1e12

    def layout(self) -> str:
        p, t = self.cfg.parallel, self.cfg.train
        sch = p.schedule + (f" v{p.vpp}" if p.vpp > 1 else "") if p.pp > 1 else "-"
        return (f"tp{p.tp} pp{p.pp} cp{p.cp} dp{p.dp} {sch} z{p.zero} rc={p.recompute} mb{t.micro_batch}"
                + (" ovl" if p.tp_overlap else ""))


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


def write_section(path: str, text: str) -> None:
    head = "## GPU calibration (published runs)"
    old = open(path).read() if os.path.exists(path) else ""
    if head in old:
        i = old.index(head)
        j = old.find("\n## ", i + len(head))
        new = old[:i] + text + (old[j + 1:] if j >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


# ------------------------------------------------------------------ worked examples (docs/planner.md)
EXAMPLES = [
    ("recipe=llama3-70b cluster=h100-80gb-8x cluster.nodes=64 train.tokens=15e12", 8),
    ("recipe=llama3-405b cluster=h100-80gb-8x cluster.nodes=512 train.tokens=15.6e12", 8),
    ("recipe=llama3-405b cluster=h100-80gb-8x cluster.nodes=2048 train.tokens=15.6e12", 5),
]


def _example_table(ov: str, n: int) -> list[str]:
    from paralayer.resolve.plan import resolve
    from paralayer.resolve.planner import report as plan_report

    cfg = load_config(ov.split())
    stats: dict = {}
    t0 = time.process_time()
    plans = plan_layouts(cfg, top=n, stats=stats)
    secs = time.process_time() - t0
    plan_report.finish(plans, cfg)
    lines = [f"`python launch.py {ov} --plan --top {n}`: {stats['considered']:,} structures evaluated, "
             f"{stats['unexplored']:,} skipped by the bound, {secs:.2f} s CPU.", "",
             "| # | tp | ovl | pp | vpp | cp | dp | schedule | zero | recompute | mb | step s | MFU | bubble | "
             "mem GiB | days | GPU-hours | why |", "|" + "---|" * 18]
    for d in plans:
        g = d["degrees"]
        lines.append(f"| {d['rank']} | {g['tp']} | {'yes' if d['tp_overlap'] else '-'} | {g['pp']} | {g['vpp']} | "
                     f"{g['cp']} | {g['dp']} | {d['schedule']} | {d['zero']} | {d['recompute']} | {d['micro_batch']} | "
                     f"{d['step_time_s']:.2f} | {100 * d['mfu']:.1f}% | {d['bubble']:.3f} | "
                     f"{d['memory']['total'] / 2**30:.1f} | {d['train_days']:.1f} | {d['device_hours']:,.0f} | "
                     f"{d['why']} |")
    own = resolve(cfg)
    if own.ok:
        o = own.to_dict()
        p_ = cfg.parallel
        lines += ["", f"The recipe's own layout (tp={p_.tp} pp={p_.pp} {p_.schedule} zero={p_.zero} "
                  f"recompute={p_.recompute}), as `--dry-run` states it: step {o['step_time_s']:.2f} s, "
                  f"MFU {100 * o['mfu']:.1f}%, {o['train_days']:.1f} days, {o['device_hours']:,.0f} H100-hours "
                  f"for {o['train_tokens']:.3g} tokens."]
    return lines


def examples_md(cmd: str) -> str:
    lines = ["## Worked examples (GPU profiles, the fitted `GPU_CALIBRATION`)", "",
             f"Generated by `{cmd}` on {datetime.date.today().isoformat()}. Days and GPU-hours are ideal steps "
             "at the predicted step time: no failures, restarts, checkpoint stalls, evaluation or queueing "
             "(README, \"Time and cost to train\"). `ovl` = `parallel.tp_overlap`.", ""]
    for ov, n in EXAMPLES:
        lines += _example_table(ov, n) + [""]
    return "\n".join(lines)


def write_named_section(path: str, head_prefix: str, text: str) -> None:
    """Replace the section whose heading starts with ``head_prefix`` (or append it)."""
    old = open(path).read() if os.path.exists(path) else ""
    i = old.find(head_prefix)
    if i >= 0:
        j = old.find("\n## ", i + len(head_prefix))
        new = old[:i] + text.rstrip("\n") + "\n\n" + (old[j + 1:] if j >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default=TABLE)
    ap.add_argument("--loo", action="store_true", help="also the leave-one-out errors (a fit per row)")
    ap.add_argument("--out", default=None, help="rewrite the GPU calibration section of this markdown file")
    ap.add_argument("--json", default=None, help="write the fitted constants and predictions as JSON")
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
    cal = rounded(fit(rows))
    for r in rows:
        r.choose(cal)
    pred = {r.id: r.predict(cal) for r in rows}
    loo = leave_one_out(rows, cal) if args.loo else None
    secs = time.time() - t0
    cmd = ("python benchmarks/calibrate_gpu.py" + (" --loo" if args.loo else "")
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
