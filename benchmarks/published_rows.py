"""The published runs the GPU calibration fits (benchmarks/published_runs.csv), each read as a recipe
and predicted with our planner's layout (benchmarks/calibrate_gpu.py fits the constants over them).

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
"""
from __future__ import annotations

import csv
import dataclasses
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from paralayer.config import load_config  # noqa: E402
from paralayer.resolve import cost as cost_mod  # noqa: E402
from paralayer.resolve.cost.machine import machine_for  # noqa: E402
from paralayer.resolve.cost.step_time import RUNTIME, Framework, step_shape, time_plan  # noqa: E402
from paralayer.resolve.plan import resolve  # noqa: E402
from paralayer.resolve.planner import config_for, plan_layouts  # noqa: E402

TABLE = os.path.join(REPO, "benchmarks", "published_runs.csv")
PROFILE = {"a100": "a100-80gb-8x", "h100": "h100-80gb-8x", "h200": "h200-141gb-8x"}
#: torchtitan's H100s capped at 500 W run at this share of the 700 W peak (fitted with the rest;
#: a constant of those rows only, not of the planner)
FITTED_PEAK_500W = 0.749
#: layouts (the planner's best by our runtime's traffic) re-timed for a row whose framework moves
#: its traffic otherwise
RERANK = 8
#: what the planner may choose for a row when its source leaves the setting unstated
CHOOSABLE = ("micro_batch", "schedule", "vpp", "zero", "recompute")


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
