"""The planner's rows: a weighed layout as the dict ``plan_layouts`` lists (degrees, predictions,
memory, comm per axis, the overrides that select it), and a row back into a config (``config_for``).
"""
from __future__ import annotations

import dataclasses

from paralayer.config import Config
from paralayer.resolve.cost.machine import Machine
from paralayer.resolve.cost.step_time import time_to_train
from paralayer.resolve.planner.comm import at_m, fsdp_key, recompute_key
from paralayer.resolve.planner.types import Candidate, Totals


def materialise(cfg: Config, t: Candidate, structs: list, mach: Machine, tot: Totals, rank: int) -> dict:
    """The output dict of one listed layout (the keys plan_layouts documents)."""
    st = structs[t.key]
    lay = st.lay
    flops_step = tot.flops_step
    tokens = tot.gb * tot.seq
    ct = {"tp": t.t_tp, "pp": 0.0, "cp": 0.0, "ep": 0.0, "dp": t.t_dp}  # tp_overlap: the exposed share
    axes = st.per_ax[(t.overlap, recompute_key(t.recompute, t.every), fsdp_key(lay, t.zero))]
    for name, line in axes.items():
        ct[name] = at_m(line, t.mm)
    m = t.mem
    out = {
        "rank": rank,
        "degrees": dict(st.degrees),
        "schedule": lay.schedule,
        "zero": t.zero,
        "recompute": t.recompute,
        "recompute_every": t.every,
        "micro_batch": t.mb,
        "microbatches": t.mm,
        "sequence_parallel": lay.sequence_parallel,
        "tp_overlap": t.overlap,
        "pp_layout": st.pp_layout,
        "world_size": mach.world,
        "step_time_s": t.step,
        "tokens_per_s": tokens / t.step,
        "mfu": flops_step / (t.step * mach.world * mach.peak_tflops * 1e12),
        "bubble": t.bubble,
        "compute_s": tot.compute,
        "imbalance": st.imbalance,
        "imbalance_s": t.imb_s,
        "recompute_s": t.recomp,
        "overhead_s": t.ovh,
        "bubble_s": t.bubble_s,
        "comm_s": t.fixed + t.per_m * t.mm,  # tp + pp + cp + ep, on the critical path
        "dp_comm_s": t.t_dp,
        "dp_exposed_s": t.dp_exposed,
        "comm_time_s": ct,
        "spans": st.spans,
        "memory": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations,
                   "total": m.total, "capacity": mach.capacity, "stage": m.rank},
        "overrides": st.prefix + [f"parallel.zero={t.zero}", f"parallel.recompute={t.recompute}",
                                  f"train.micro_batch={t.mb}"] + (["parallel.tp_overlap=true"] if t.overlap else [])
        + ([f"parallel.recompute_every={t.every}"] if t.every > 1 else []),
    }
    out.update(time_to_train(cfg, t.step, tokens, mach.world))
    if t.fp8 is not None:  # train.precision=fp8: bf16_step_time_s, fp8_gain, step_time_by_precision
        from paralayer.resolve.planner.precision import row_fields

        out.update(row_fields(cfg, t.fp8, t.step, mach, tot))
    return out


def override_prefix(tp: int, pp: int, vpp: int, cp: int, ep: int, dp: int, schedule: str, split: list) -> list[str]:
    lo = "[" + ",".join(map(str, split)) + "]" if (pp > 1 and len(set(split)) > 1) else "null"
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.cp={cp}", f"parallel.ep={ep}",
            f"parallel.dp={dp}", f"parallel.schedule={schedule}", f"parallel.pp_layout={lo}"]


def config_for(cfg: Config, d: dict) -> Config:
    """The config with a planned layout applied (what ``resolve`` and the runtime take)."""
    deg = d["degrees"]
    par = dataclasses.replace(cfg.parallel, tp=deg["tp"], pp=deg["pp"], vpp=deg["vpp"], cp=deg["cp"], ep=deg["ep"],
                              dp=deg["dp"], schedule=d["schedule"], zero=d["zero"], recompute=d["recompute"],
                              recompute_every=int(d.get("recompute_every", 1)),
                              pp_layout=list(d["pp_layout"]) if d.get("pp_layout") else None,
                              tp_overlap=bool(d.get("tp_overlap", False)))
    tr = dataclasses.replace(cfg.train, micro_batch=d["micro_batch"])
    return dataclasses.replace(cfg, parallel=par, train=tr)

