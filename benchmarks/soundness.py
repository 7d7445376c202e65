"""Soundness: random small layouts that the resolver accepts each train 2 steps here exactly as one
process does.

    python benchmarks/soundness.py [--n 30] [--seed 0] [--worlds 2,4,8] [--steps 2] [--out FILE.md]

Each sample picks a world size and a model (dense or MoE, tiny shapes), asks the planner for every
valid layout on that many local CPU ranks (cluster.devices_per_node=WORLD; on CPU the device
memory is unknown, so every valid layout "fits"), and picks one at random, preferring layouts that
cover an axis value the sweep has not run yet (tp, pp, cp, ep > 1, each schedule, zero stage and
recompute mode). The layout runs ``train()`` for ``--steps`` steps on forked gloo ranks
(tests/dist.py) at a wide init (std 0.2) and is compared with ONE process training the same model
on the same batches (computed once per model and micro-batch size): it passes when every rank's
loss and grad norm match the reference's every step, to 1e-5 and 3e-5 relative (a finite loss is
not enough: a ZeRO-3 × ZB-V layout once "passed" with wrong gradients, issue #25). MoE runs
without the aux loss in the objective (its balance statistics are per microbatch and rank). A
summary table is printed (markdown), failures with the first line of the failing rank's error.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from paralayer.config import load_config  # noqa: E402
from paralayer.resolve import planner  # noqa: E402
from paralayer.resolve.plan import resolve  # noqa: E402

DENSE = ["recipe=tiny", "model.d_model=64", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=128", "model.vocab_size=256", "model.seq_len=32", "train.global_batch=8",
         "logging.wandb.mode=disabled", "cluster.device=cpu", "cluster.peak_tflops=0.05", "checkpoint.every=0",
         "model.init_std=0.2", "train.precision=fp32", "train.threads=1"]
MOE = DENSE + ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=64", "model.moe.aux_loss_coef=0"]
LOSS_TOL, NORM_TOL = 1e-5, 3e-5


def features(d: dict) -> set:
    g = d["degrees"]
    f = {f"{ax}>1" for ax in ("tp", "pp", "cp", "ep", "dp") if g[ax] > 1}
    if g["pp"] > 1:
        f.add(f"schedule={d['schedule']}")
    f.add(f"zero={d['zero']}")
    f.add(f"recompute={d['recompute']}")
    if d.get("tp_overlap"):
        f.add("tp_overlap")
    return f


def with_overlap(d: dict) -> dict:
    """The layout with parallel.tp_overlap on (the planner offers it only where the machine hides
    it — GPUs — but the runtime must run it here too): tp > 1 with SP, not under the V schedules."""
    return dict(d, tp_overlap=True, overrides=list(d["overrides"]) + ["parallel.tp_overlap=true"])


def overlap_ok(d: dict) -> bool:
    return d["degrees"]["tp"] > 1 and d["sequence_parallel"] and d["schedule"] not in ("zbv", "dualpipev")


def sample_layouts(n: int, seed: int = 0, worlds=(2, 4, 8), steps: int = 2) -> list[dict]:
    """n (overrides, layout) samples, each valid for the resolver, covering the axes greedily."""
    rng = random.Random(seed)
    seen: set = set()
    out = []
    cache: dict = {}
    for i in range(n):
        world = worlds[i % len(worlds)] if i < len(worlds) else rng.choice(worlds)
        kind = "moe" if i % 3 == 2 else "dense"
        base = (MOE if kind == "moe" else DENSE) + [f"cluster.devices_per_node={world}", f"train.steps={steps}"]
        key = (world, kind)
        if key not in cache:
            cfg = load_config(base)
            cache[key] = (cfg, planner.plan_layouts(cfg))
        cfg, plans = cache[key]
        pool = rng.sample(plans, min(60, len(plans)))
        pool += [with_overlap(d) for d in pool if overlap_ok(d) and rng.random() < 0.5]
        best = max(pool, key=lambda d: (len(features(d) - seen), rng.random()))
        seen |= features(best)
        c = planner.config_for(cfg, best)
        p = resolve(c)
        assert not p.errors and p.ok, (best["overrides"], p.errors)
        out.append({"kind": kind, "world": world, "steps": steps, "base": base, "layout": best,
                    "overrides": best["overrides"]})
    return out


def _worker(rank: int, world: int, overrides: list) -> Any:
    from paralayer.runtime.train import train

    cfg = load_config(overrides)
    cfg.data.cache_dir = os.path.join(tempfile.gettempdir(), "paralayer-soundness-cache")
    plan = resolve(cfg).to_dict()
    recs = train(cfg, plan)
    return [(r["loss"], r["grad_norm"], r["step_time_s"]) for r in recs]


def reference_overrides(sample: dict) -> list:
    """One process, the same model, global batch and micro-batch (capacity drops and the MoE
    statistics are per microbatch)."""
    return sample["base"] + [f"train.micro_batch={sample['layout']['micro_batch']}", "parallel.tp=1", "parallel.dp=1",
                              "cluster.devices_per_node=1"]


_REFERENCES: dict = {}


def reference(sample: dict, timeout_s: float = 120) -> list:
    """The one-rank run's [(loss, grad_norm, s)] per step, computed once per model and micro-batch."""
    from tests.dist import run_ranks

    key = tuple(reference_overrides(sample))
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(_worker, 1, list(key), timeout_s=timeout_s)[0]
    return _REFERENCES[key]


def _max_rel(got: list, want: list) -> float:
    if len(got) != len(want) or not got:
        return math.inf
    return max(abs(a - b) / abs(b) if b else abs(a) for a, b in zip(got, want))


def run_one(sample: dict, timeout_s: float = 120) -> dict:
    from tests.dist import run_ranks

    t0 = time.time()
    res = dict(sample, ok=False, error=None, losses=None, loss_err=None, norm_err=None)
    try:
        ref = reference(sample, timeout_s)
        out = run_ranks(_worker, sample["world"], sample["base"] + sample["overrides"], timeout_s=timeout_s,
                        pg_timeout_s=min(60, timeout_s))
        losses = [x[0] for x in out[0]]
        res["losses"] = losses
        res["loss_err"] = max(_max_rel([x[0] for x in o], [x[0] for x in ref]) for o in out)
        res["norm_err"] = max(_max_rel([x[1] for x in o], [x[1] for x in ref]) for o in out)
        res["ok"] = len(losses) == sample["steps"] and all(math.isfinite(v) for v in losses) \
            and res["loss_err"] <= LOSS_TOL and res["norm_err"] <= NORM_TOL
        if not res["ok"]:
            res["error"] = (f"vs one rank: loss {res['loss_err']:.1e}, grad norm {res['norm_err']:.1e} "
                            f"(losses {losses}, reference {[x[0] for x in ref]})")
    except AssertionError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        head = lines[0] if lines else "error"
        last = lines[-1] if lines else ""
        res["error"] = f"{head} … {last}"[:300]
    res["seconds"] = time.time() - t0
    return res


def sweep(n: int, seed: int = 0, worlds=(2, 4, 8), steps: int = 2, timeout_s: float = 120,
          log=None) -> list[dict]:
    """Sample n layouts and run each; returns one result per layout."""
    import torch  # noqa: F401 - imported once before forking the ranks

    import paralayer.runtime.train  # noqa: F401

    results = []
    for s in sample_layouts(n, seed, worlds, steps):
        r = run_one(s, timeout_s)
        results.append(r)
        if log:
            log(_row(len(results), r))
    return results


def _row(i: int, r: dict) -> str:
    d = r["layout"]
    g = d["degrees"]
    status = "ok" if r["ok"] else "FAIL"
    loss = f"{r['losses'][-1]:.3f}" if r.get("losses") else "-"
    errs = f"{r['loss_err']:.0e} / {r['norm_err']:.0e}" if r.get("loss_err") is not None else "-"
    tp = f"{g['tp']} ovl" if d.get("tp_overlap") else str(g["tp"])
    return (f"| {i} | {r['kind']} | {r['world']} | {tp} | {g['pp']} | {g['vpp']} | {g['cp']} | {g['ep']} | "
            f"{g['dp']} | {d['schedule'] if g['pp'] > 1 else '-'} | {d['zero']} | {d['recompute']} | "
            f"{d['micro_batch']} | {status} | {loss} | {errs} | {r['seconds']:.0f} | {r['error'] or ''} |")


HEADER = ("| # | model | world | tp | pp | vpp | cp | ep | dp | schedule | zero | recompute | mb | result | "
          "last loss | err loss / grad norm vs 1 rank | s | error |\n|" + "---|" * 18)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args(argv)
    worlds = tuple(int(w) for w in a.worlds.split(","))
    print(HEADER, flush=True)
    t0 = time.time()
    results = sweep(a.n, a.seed, worlds, a.steps, a.timeout, log=lambda s: print(s, flush=True))
    ok = sum(r["ok"] for r in results)
    cover: set = set()
    for r in results:
        cover |= features(r["layout"])
    summary = (f"\n{ok}/{len(results)} layouts matched one rank for {a.steps} steps (loss {LOSS_TOL:g}, "
               f"grad norm {NORM_TOL:g}; worst {max((r['loss_err'] or 0) for r in results):.1e} / "
               f"{max((r['norm_err'] or 0) for r in results):.1e}) "
               f"({time.time() - t0:.0f} s). Covered: {', '.join(sorted(cover))}.")
    print(summary)
    if a.out:
        with open(a.out, "w") as f:
            f.write("```\npython benchmarks/soundness.py " + " ".join(argv if argv is not None else sys.argv[1:]) +
                    "\n```\n\n" + HEADER + "\n")
            for i, r in enumerate(results):
                f.write(_row(i + 1, r) + "\n")
            f.write(summary + "\n")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
