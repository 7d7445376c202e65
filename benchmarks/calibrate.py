"""Calibrate the planner's cost model on this machine and check it: predicted vs measured step
time, activation and state bytes, and pipeline bubble over a matrix of small layouts.

    python benchmarks/calibrate.py [--steps 4] [--only N,M] [--out docs/planner.md]

Each layout runs ``train()`` for ``--steps`` steps on forked gloo ranks (tests/dist.py; one thread
per rank, as the local launcher gives ranks that outnumber the cores). Measured per layout:

- step time: the minimum over steps 2.. (step 1 pays for allocation and the first gloo connections;
  the machine is shared with other jobs, which only ever add time, so the least-interfered step
  is the estimate);
- activations: the peak live bytes of tensors saved for backward during a step
  (``paralayer.runtime.activation_memory.ActivationMemory``: saved-tensor hooks, unique storages, parameters
  excluded, released when autograd frees them), max over ranks;
- state: parameter bytes (the largest set held: after a chunk's forward — FSDP with
  ``reshard_after_forward=False`` still holds the gathered weights there — or after the step),
  gradient bytes and optimizer-state bytes after the optimizer step, local shards only, max over
  ranks;
- bubble: ``bubble_measured`` of the pipeline runner (pp > 1), median over steps 2..

The "device peak" is the measured one-thread fp32 GEMM peak (``metrics.measure_cpu_peak_tflops``);
the "links" are gloo over loopback. The time model is linear in (1/efficiency, latency,
1/bandwidth) with the dp overlap at 0 (our CPU runtime reduces gradients after the backward), so
the three are fitted by least squares on relative error (non-negative), and the planner's
``LOCAL_CALIBRATION`` holds the result. Spearman's rank correlation of predicted vs measured step
time is computed here (average ranks for ties).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from paralayer.compat import dtensor_local  # noqa: E402
from paralayer.config import load_config  # noqa: E402
from paralayer.resolve import planner  # noqa: E402
from paralayer.resolve.plan import resolve  # noqa: E402

BASE = ["recipe=tiny", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.ep=1",  # recipe layout off
        "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=688", "model.vocab_size=256", "model.seq_len=256", "train.global_batch=16",
        "parallel.dp=auto", "logging.wandb.mode=disabled", "cluster.device=cpu", "checkpoint.every=0"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=344"]

#: (name, overrides): tp (and tp_overlap), pp (four schedules), cp, ep, dp with ZeRO 0–3, recompute,
#: 1–4 ranks.
MATRIX = [
    ("single", ["train.micro_batch=4"]),
    ("single-selective", ["train.micro_batch=4", "parallel.recompute=selective"]),
    ("dp2-z0", ["parallel.dp=2", "train.micro_batch=4"]),
    ("dp2-z3", ["parallel.dp=2", "parallel.zero=3", "train.micro_batch=2"]),
    ("dp2-full", ["parallel.dp=2", "parallel.zero=1", "parallel.recompute=full", "train.micro_batch=4"]),
    ("tp2", ["parallel.tp=2", "train.micro_batch=4"]),
    ("tp2-mb1", ["parallel.tp=2", "train.micro_batch=1"]),
    ("dp2-z3-mb1", ["parallel.dp=2", "parallel.zero=3", "train.micro_batch=1"]),
    ("cp2", ["parallel.cp=2", "train.micro_batch=4"]),
    ("pp2-1f1b", ["parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=2"]),
    ("pp2-gpipe-m2", ["parallel.pp=2", "parallel.schedule=gpipe", "train.micro_batch=8"]),
    ("pp2-interleaved", ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "train.micro_batch=2"]),
    ("pp2-zbv", ["parallel.pp=2", "parallel.schedule=zbv", "train.micro_batch=2"]),
    ("pp2-dualpipev", ["parallel.pp=2", "parallel.schedule=dualpipev", "train.micro_batch=2"]),
    ("moe-ep2", MOE + ["parallel.dp=2", "parallel.ep=2", "train.micro_batch=4"]),
    ("moe-single", MOE + ["train.micro_batch=4"]),
    ("tp2-dp2-z1", ["parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "train.micro_batch=4"]),
    ("pp2-dp2-z2", ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2", "train.micro_batch=2"]),
    ("tp2-pp2", ["parallel.tp=2", "parallel.pp=2", "train.micro_batch=2"]),
    ("dp4-z2", ["parallel.dp=4", "parallel.zero=2", "train.micro_batch=2"]),
    ("tp2-ovl", ["parallel.tp=2", "parallel.tp_overlap=true", "train.micro_batch=4"]),
    ("tp2-pp2-ovl", ["parallel.tp=2", "parallel.pp=2", "parallel.tp_overlap=true", "train.micro_batch=2"]),
]


# ------------------------------------------------------------------ measurement (on the ranks)
def _local_bytes(t) -> int:
    if t is None:
        return 0
    base = dtensor_local(t)
    return int(base.numel() * base.element_size())


def _worker(rank: int, world: int, overrides: list, steps: int) -> Any:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from paralayer.runtime.activation_memory import ActivationMemory
    from paralayer.runtime.train import train

    class Acts(ActivationMemory):
        def _pack(self, t):  # parameters (FSDP's gathered ones included) and views of them are not activations
            try:
                for x in (t, getattr(t, "_base", None)):
                    if x is not None and (isinstance(x, torch.nn.Parameter) or (x.is_leaf and x.requires_grad)):
                        return t
                base = dtensor_local(t)
                base.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - no real storage (e.g. a DTensor wrapper's): not counted
                return t
            return super()._pack(t)

    cfg = load_config(overrides)
    cfg.data.cache_dir = os.path.join(tempfile.gettempdir(), "paralayer-calibrate-cache")
    plan = resolve(cfg).to_dict()
    per_step: list = []
    fwd_params: dict = {}

    chunks: dict = {}

    def fwd_hook(module, args, out):
        if type(module).__name__.endswith("Transformer"):  # the model chunk (FSDPTransformer under FSDP2)
            chunks[id(module)] = module
            fwd_params[id(module)] = max(fwd_params.get(id(module), 0),
                                         sum(_local_bytes(p) for p in module.parameters()))

    mem = Acts()

    def post_step(opt, args, kwargs):
        params = [p for g in opt.param_groups for p in g["params"]]
        pbytes = sum(_local_bytes(p) for p in params)
        # every gradient the model holds, not only the optimizer's: ZeRO-1 steps a share of the
        # parameters but the whole gradient is there at the step
        model_params = {id(p): p for c in chunks.values() for p in c.parameters()}
        model_params.update({id(p): p for p in params})
        gbytes = sum(_local_bytes(p.grad) for p in model_params.values())
        obytes = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        per_step.append({"acts": mem.peak_bytes, "params": max(pbytes, sum(fwd_params.values())),
                         "grads": gbytes, "optimizer": obytes})
        fwd_params.clear()
        mem.reset_peak()

    # Under pp, torch's stage runs FSDP without grad sync or resharding until its REDUCE_GRAD
    # action: the whole weights and grads of the stage exist just before it (the step's peak)
    from torch.distributed.pipelining import stage as pstage

    fsdp_peak: dict = {"params": 0, "grads": 0}
    orig_reduce = pstage._PipelineStageBase.perform_reduce_grad

    def reduce_grad(stage, *args, **kwargs):
        try:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(stage.submod, FSDPModule):
                pb = gb_ = 0
                for st in fully_shard.state(stage.submod)._state_ctx.all_states:
                    for group in st._fsdp_param_groups:
                        for fp in group.fsdp_params:
                            up = getattr(fp, "_unsharded_param", None)
                            ug = getattr(fp, "unsharded_accumulated_grad", None)
                            if up is not None:
                                pb += up.untyped_storage().nbytes()
                                gb_ += _local_bytes(up.grad)
                            gb_ += _local_bytes(ug)
                fsdp_peak["params"] += pb
                fsdp_peak["grads"] += gb_
        except Exception:  # noqa: BLE001 - FSDP internals moved: keep the post-step figures
            pass
        return orig_reduce(stage, *args, **kwargs)

    def post_step_peak(opt, args, kwargs):
        post_step(opt, args, kwargs)
        if fsdp_peak["params"] or fsdp_peak["grads"]:
            rec = per_step[-1]
            rec["params"] = max(rec["params"], fsdp_peak["params"])
            rec["grads"] = max(rec["grads"], fsdp_peak["grads"])
        fsdp_peak.update(params=0, grads=0)

    pstage._PipelineStageBase.perform_reduce_grad = reduce_grad
    h1 = register_optimizer_step_post_hook(post_step_peak)
    h2 = torch.nn.modules.module.register_module_forward_hook(fwd_hook)
    try:
        with mem:
            recs = train(cfg, plan)
    finally:
        h1.remove()
        h2.remove()
        pstage._PipelineStageBase.perform_reduce_grad = orig_reduce
    return {"records": [{k: r.get(k) for k in ("step_time_s", "loss", "bubble_measured")} for r in recs],
            "memory": per_step}


def measure(overrides: list, steps: int, timeout_s: float = 300) -> dict:
    from tests.dist import run_ranks

    cfg = load_config(overrides)
    plan = resolve(cfg)
    assert not plan.errors, plan.errors
    out = run_ranks(_worker, plan.world_size, overrides + [f"train.steps={steps}"], steps, timeout_s=timeout_s,
                    pg_timeout_s=120)
    recs = out[0]["records"]
    # the least-interfered step: other jobs on the machine only ever add time
    times = [r["step_time_s"] for r in recs[1:]] or [recs[0]["step_time_s"]]
    bub = [r["bubble_measured"] for r in recs[1:] if r.get("bubble_measured") is not None]
    # memory: the most loaded rank (by its total), steps 2.. (step 1 has no optimizer state yet
    # when the hook runs? it does — Adam creates it in step(); keep all steps, take the max)
    best = None
    for rank_out in out:
        for m in rank_out["memory"][1:] or rank_out["memory"]:
            tot = m["acts"] + m["params"] + m["grads"] + m["optimizer"]
            if best is None or tot > best["total"]:
                best = dict(m, total=tot)
    return {"step_time_s": min(times), "step_times": [r["step_time_s"] for r in recs],
            "bubble": statistics.median(bub) if bub else None, "memory": best,
            "losses": [r["loss"] for r in recs]}


# ------------------------------------------------------------------ the model side
#: the fitted constants, in the order of parts(): 1/efficiency, latency, 1/bandwidth, and the
#: dispatch overheads per layer per microbatch (every layer, tp layers, MoE layers)
TERMS = ("1/efficiency", "latency_s", "1/bandwidth_gbps", "overhead_layer_s", "overhead_tp_s", "overhead_moe_s")


def parts(cfg, peak: float, cores: float) -> tuple:
    """The step time's coefficient on each fitted constant (the time model is linear in them with the
    dp overlap at 0): predict() with that constant at 1 and the others off."""
    inf = 1e15
    off = {"efficiency": inf, "latency_s": 0.0, "bandwidth_gbps": inf, "overhead_layer_s": 0.0,
           "overhead_tp_s": 0.0, "overhead_moe_s": 0.0}
    base = dict(off, peak_tflops=peak, dp_overlap=0.0, cores=cores)
    one = [{"efficiency": 1.0}, {"latency_s": 1.0}, {"bandwidth_gbps": 1.0}, {"overhead_layer_s": 1.0},
           {"overhead_tp_s": 1.0}, {"overhead_moe_s": 1.0}]
    return tuple(planner.predict(cfg, dict(base, **o))["step_time_s"] for o in one)


def fit(rows: list) -> dict:
    """Non-negative least squares on relative error, min Σ((A·x − t)/t)² with x ≥ 0, by coordinate
    descent on the normal equations (a small convex problem: it converges to the NNLS optimum)."""
    import numpy as np

    A = np.array([list(r["parts"]) for r in rows], dtype=float)
    t = np.array([r["measured"]["step_time_s"] for r in rows], dtype=float)
    W = A / t[:, None]
    scale = np.where(W.max(axis=0) > 0, W.max(axis=0), 1.0)
    Ws = W / scale  # columns to a common scale, for the descent's conditioning
    H, g = Ws.T @ Ws, Ws.T @ np.ones_like(t)
    x = np.zeros(W.shape[1])
    for _ in range(20000):
        x_old = x.copy()
        for j in range(len(x)):
            if H[j, j] > 0:
                x[j] = max(0.0, x[j] + (g[j] - H[j] @ x) / H[j, j])
        if np.max(np.abs(x - x_old)) < 1e-12:
            break
    x = x / scale
    return {"efficiency": float(1.0 / x[0]) if x[0] > 0 else 1.0, "latency_s": float(x[1]),
            "bandwidth_gbps": float(1.0 / x[2]) if x[2] > 0 else 1e6, "overhead_layer_s": float(x[3]),
            "overhead_tp_s": float(x[4]), "overhead_moe_s": float(x[5])}


def predicted(parts_: tuple, cal: dict) -> float:
    x = (1.0 / cal["efficiency"], cal["latency_s"], 1.0 / cal["bandwidth_gbps"], cal["overhead_layer_s"],
         cal["overhead_tp_s"], cal["overhead_moe_s"])
    return sum(a * b for a, b in zip(parts_, x))


def spearman(a: list, b: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%" if meas else "-"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default=None, help="comma list of matrix names")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the matrix; step time = min over all")
    ap.add_argument("--save", default=None, help="write the measurements (JSON) here")
    ap.add_argument("--load", default=None, help="refit from saved measurements instead of running")
    a = ap.parse_args(argv)

    import torch

    import paralayer.runtime.train  # noqa: F401 - imported once, before forking the ranks
    from paralayer.metrics.peaks import measure_cpu_peak_tflops

    if a.load:
        with open(a.load) as f:
            saved = json.load(f)
        peak, cores, load = saved["peak"], saved["cores"], saved["load"]
    else:
        saved = None
        peak = statistics.median(measure_cpu_peak_tflops(torch.float32, threads=1, n=512) for _ in range(5))
        cores = os.cpu_count() or 1
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    matrix = [m for m in MATRIX if a.only is None or m[0] in a.only.split(",")]
    rows, failed = [], []
    t_all = time.time()
    by_name: dict = dict(saved["measured"]) if saved else {}
    if saved:
        failed = [tuple(f) for f in saved["failed"]]
    for rep in range(0 if saved else a.repeat):  # round-robin passes: interference differs between passes
        for name, ov in matrix:
            if any(f[0] == name for f in failed):
                continue
            overrides = BASE + ov
            t0 = time.time()
            try:
                meas = measure(overrides, a.steps, a.timeout)
            except AssertionError as exc:
                lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                failed.append((name, ov, f"{lines[0]} … {lines[-1]}"[:400] if lines else "error"))
                print(f"{name}: FAILED {failed[-1][2]}", flush=True)
                continue
            print(f"[pass {rep + 1}] {name}: {meas['step_time_s']:.3f} s/step (steps "
                  f"{[round(x, 3) for x in meas['step_times']]}), bubble {meas['bubble']}, {time.time() - t0:.0f} s",
                  flush=True)
            prev = by_name.get(name)
            if prev is None:
                by_name[name] = meas
            else:
                prev["step_times"] += meas["step_times"]
                prev["step_time_s"] = min(prev["step_time_s"], meas["step_time_s"])
                if meas["bubble"] is not None:
                    prev.setdefault("bubbles", [prev["bubble"]]).append(meas["bubble"])
                    prev["bubble"] = statistics.median(prev["bubbles"])
    if a.save and not saved:
        with open(a.save, "w") as f:
            json.dump({"peak": peak, "cores": cores, "load": load, "measured": by_name, "failed": failed}, f)
    for name, ov in matrix:
        if name in by_name:
            cfg = load_config(BASE + ov)
            rows.append({"name": name, "overrides": ov, "cfg": cfg, "plan": resolve(cfg), "measured": by_name[name]})
    if len(rows) < 3:
        print("too few layouts ran to fit", file=sys.stderr)
        return 1
    # effective cores: the ranks share this machine's cores with other jobs, so how many cores they
    # really get is fitted too (a grid; the rest is linear least squares for each value)
    best = None
    for eff_cores in [1.0 + 0.1 * i for i in range(int(round((cores - 1) / 0.1)) + 1)]:
        for r in rows:
            r["parts"] = parts(r["cfg"], peak, eff_cores)
        c_ = fit(rows)
        err = sum((predicted(r["parts"], c_) / r["measured"]["step_time_s"] - 1) ** 2 for r in rows)
        if best is None or err < best[0]:
            best = (err, eff_cores, c_)
    _, eff_cores, cal = best
    for r in rows:
        r["parts"] = parts(r["cfg"], peak, eff_cores)
    cal.update(peak_tflops=peak, dp_overlap=0.0, cores=eff_cores)
    for r in rows:
        r["predicted"] = predicted(r["parts"], cal)
    rho = spearman([r["predicted"] for r in rows], [r["measured"]["step_time_s"] for r in rows])
    # leave-one-out: the cores grid and the fit redone without the layout, then it is predicted
    parts_by_cores = {}
    for c_val in [1.0 + 0.1 * i for i in range(int(round((cores - 1) / 0.1)) + 1)]:
        parts_by_cores[c_val] = [parts(r["cfg"], peak, c_val) for r in rows]
    for k, r in enumerate(rows):
        best_k = None
        for ps in parts_by_cores.values():
            others = [dict(q, parts=ps[j]) for j, q in enumerate(rows) if j != k]
            c_ = fit(others)
            err = sum((predicted(q["parts"], c_) / q["measured"]["step_time_s"] - 1) ** 2 for q in others)
            if best_k is None or err < best_k[0]:
                best_k = (err, predicted(ps[k], c_))
        r["held_out"] = best_k[1]
    report = _report(rows, failed, cal, rho, a, peak, cores, load, time.time() - t_all)
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)
    return 0


def _report(rows, failed, cal, rho, a, peak, cores, load, seconds) -> str:
    L = []
    cmd = "python benchmarks/calibrate.py " + " ".join(f"--{k} {v}" for k, v in
                                                        (("steps", a.steps), ("repeat", a.repeat), ("only", a.only))
                                                        if v is not None)
    L.append(f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: `{cmd}` "
             f"({len(rows)} layouts ran, {len(failed)} failed; {seconds:.0f} s). Machine: {cores} CPU cores, "
             f"one-thread fp32 GEMM peak {peak * 1e3:.1f} GFLOP/s, load average {load:.1f} at the start "
             "(the cores are shared with other jobs).")
    L.append("")
    L.append(f"Model: {' '.join(o for o in BASE if o.startswith('model.') or o.startswith('train.global'))} "
             "(MoE rows add " + " ".join(MOE) + f"); {a.steps} steps per run, {a.repeat} runs per layout "
             f"(round-robin); step time = min over steps 2..{a.steps} of all runs, bubble = median.")
    L.append("")
    L.append("Fitted `local` calibration (paralayer/resolve/cost/machine.py `LOCAL_CALIBRATION`): "
             f"efficiency {cal['efficiency']:.3f} of the one-thread GEMM peak, effective cores {cal['cores']:.1f} "
             f"(of {cores}; shared with other jobs), per-collective latency "
             f"{cal['latency_s'] * 1e3:.3f} ms, gloo loopback bandwidth {cal['bandwidth_gbps']:.3f} GB/s, "
             f"dispatch per layer per microbatch {cal['overhead_layer_s'] * 1e3:.2f} ms "
             f"(+{cal['overhead_tp_s'] * 1e3:.2f} ms under tp, +{cal['overhead_moe_s'] * 1e3:.2f} ms per MoE layer).")
    L.append("")
    L.append("### Step time")
    L.append("")
    L.append("| layout | overrides | ranks | predicted s | (compute / latency / bytes / dispatch) | measured s | "
             "error | held out: predicted s | error | bubble pred | bubble meas |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["measured"]["step_time_s"]):
        m = r["measured"]
        bm = "-" if m["bubble"] is None else f"{m['bubble']:.3f}"
        bp = f"{r['plan'].bubble_fraction:.3f}" if r["plan"].degrees["pp"] > 1 else "-"
        tc, tl, tb, o1, o2, o3 = r["parts"]
        ovh = cal["overhead_layer_s"] * o1 + cal["overhead_tp_s"] * o2 + cal["overhead_moe_s"] * o3
        split = (f"{tc / cal['efficiency']:.2f} / {cal['latency_s'] * tl:.2f} / {tb / cal['bandwidth_gbps']:.2f}"
                 f" / {ovh:.2f}")
        L.append(f"| {r['name']} | `{' '.join(r['overrides'])}` | {r['plan'].world_size} | {r['predicted']:.3f} | "
                 f"{split} | {m['step_time_s']:.3f} | {_pct(r['predicted'], m['step_time_s'])} | "
                 f"{r['held_out']:.3f} | {_pct(r['held_out'], m['step_time_s'])} | {bp} | {bm} |")
    errs = [abs(r["predicted"] - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"] for r in rows]
    L.append("")
    herrs = [abs(r["held_out"] - r["measured"]["step_time_s"]) / r["measured"]["step_time_s"] for r in rows]
    rho_ho = spearman([r["held_out"] for r in rows], [r["measured"]["step_time_s"] for r in rows])
    L.append(f"Spearman rank correlation, predicted vs measured step time: **{rho:.3f}** over {len(rows)} layouts "
             f"(target ≥ 0.8). Median |error| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}% "
             "(the calibration is fitted on these same runs). Held out (leave-one-out: each layout predicted "
             f"from a calibration fitted on the other {len(rows) - 1}): Spearman **{rho_ho:.3f}**, median |error| "
             f"{100 * statistics.median(herrs):.1f}%, max {100 * max(herrs):.1f}%.")
    L.append("")
    L.append("### Memory per device (the most loaded rank), MiB")
    L.append("")
    L.append("| layout | activations pred | meas | error | state pred | meas | error | total pred | meas | error |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in rows:
        mp = r["plan"].memory_per_device_bytes
        mm = r["measured"]["memory"]
        ap_, am = mp["activations_saved"], mm["acts"]
        sp, sm = mp["params"] + mp["grads"] + mp["optimizer"], mm["params"] + mm["grads"] + mm["optimizer"]
        tp_, tm = ap_ + sp, am + sm
        worst = max(worst, abs(tp_ - tm) / tm)
        L.append(f"| {r['name']} | {_mib(ap_)} | {_mib(am)} | {_pct(ap_, am)} | {_mib(sp)} | {_mib(sm)} | "
                 f"{_pct(sp, sm)} | {_mib(tp_)} | {_mib(tm)} | {_pct(tp_, tm)} |")
    L.append("")
    L.append(f"Worst total-memory error: {100 * worst:.1f}% (target ≤ 10%). Predicted activations are the plan's "
             "`activations_saved` (what the forward leaves for backward, at the schedule's peak in flight); "
             "state is parameters + gradients + optimizer state.")
    if failed:
        L.append("")
        L.append("### Layouts that failed")
        L.append("")
        for name, ov, err in failed:
            L.append(f"- {name} (`{' '.join(ov)}`): {err}")
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
