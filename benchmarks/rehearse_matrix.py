"""The rehearsal matrix: 32 layouts of the shipped models rehearsed at their full world size,
each figure against the plan (docs/BENCHMARKS.md, "Rehearsal matrix").

    python benchmarks/rehearse_matrix.py [--layers N] [--only SUBSTR] > table.md
    python benchmarks/rehearse_matrix.py --recipes [--only SUBSTR] > table.md

``--recipes``: every shipped recipe (recipes/*.yaml) at its own depth, layout and precision, rank 0
and the last rank (issue 46: a per-layer term a two-layer copy hides shows here), judged as the
issue asks: states exact, activations, FLOPs and each axis's comm within 2%.

Each row is ``launch.py ... --rehearse --json`` for the layout's first rank (pp rank 0, the most
loaded); ``--layers`` cuts the depth (widths, vocab, sequence and world stay the model's) so the
whole matrix runs in minutes on a laptop. Ratios are measured / planned; the agreement the issue
asks for: states exact, activations and comm within 5%, FLOPs within 2%.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# (label, overrides): models × axes (tp, pp + schedules, cp, ep, zero, recompute, tp_overlap, precision)
MATRIX: list[tuple[str, list[str]]] = [
    ("8b tp8 z1", ["recipe=llama3-8b", "cluster.nodes=8"]),
    ("8b tp8 z1 fp32", ["recipe=llama3-8b", "cluster.nodes=8", "train.precision=fp32"]),
    ("8b tp4 z0 none", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=4", "parallel.zero=0",
                        "parallel.recompute=none", "train.precision=fp32"]),
    ("8b tp2 z2 full", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=2", "parallel.zero=2",
                        "parallel.recompute=full", "train.precision=fp32"]),
    ("8b tp8 z3", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.zero=3", "train.precision=fp32"]),
    ("8b tp8 z3 bf16", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.zero=3"]),
    ("8b tp1 z3", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=1", "parallel.zero=3",
                   "train.precision=fp32"]),
    ("8b tp8 overlap", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp_overlap=true", "train.precision=fp32"]),
    ("8b tp8 no-sp", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.sequence_parallel=false",
                      "train.precision=fp32"]),
    ("8b tp4 pp2 1f1b", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=4", "parallel.pp=2",
                         "train.precision=fp32"]),
    ("8b tp4 pp2 gpipe", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=4", "parallel.pp=2",
                          "parallel.schedule=gpipe", "train.precision=fp32"]),
    ("8b tp2 pp4 interleaved", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=2", "parallel.pp=4",
                                "parallel.vpp=2", "parallel.schedule=interleaved", "train.precision=fp32"]),
    ("8b tp2 pp4 zbv", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=2", "parallel.pp=4",
                        "parallel.schedule=zbv", "train.precision=fp32"]),
    ("8b tp2 pp4 dualpipev", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=2", "parallel.pp=4",
                              "parallel.schedule=dualpipev", "train.precision=fp32"]),
    ("8b tp4 cp2", ["recipe=llama3-8b", "cluster.nodes=8", "parallel.tp=4", "parallel.cp=2",
                    "train.precision=fp32"]),
    ("8b-512k tp8 cp8", ["recipe=llama3-8b-512k"]),
    ("8b-512k tp8 cp8 fp32", ["recipe=llama3-8b-512k", "train.precision=fp32"]),
    ("8b-512k tp4 cp16", ["recipe=llama3-8b-512k", "parallel.tp=4", "parallel.cp=16"]),
    ("70b tp8 pp4", ["recipe=llama3-70b"]),
    ("70b tp8 pp4 fp32", ["recipe=llama3-70b", "train.precision=fp32"]),
    ("70b tp8 pp8 interleaved", ["recipe=llama3-70b", "parallel.pp=8", "parallel.vpp=2",
                                 "parallel.schedule=interleaved", "train.precision=fp32"]),
    ("70b tp8 pp4 z3", ["recipe=llama3-70b", "parallel.zero=3", "train.precision=fp32"]),
    ("405b tp8 pp16", ["recipe=llama3-405b"]),
    ("405b tp8 pp16 fp32", ["recipe=llama3-405b", "train.precision=fp32"]),
    ("gpt3-175b", ["recipe=gpt3-175b"]),
    ("gpt3-175b fp32", ["recipe=gpt3-175b", "train.precision=fp32"]),
    ("mixtral tp2 pp4 ep8", ["recipe=mixtral-8x7b"]),
    ("mixtral tp2 pp4 ep8 fp32", ["recipe=mixtral-8x7b", "train.precision=fp32"]),
    ("mixtral tp1 pp4 ep8 z0", ["recipe=mixtral-8x7b", "parallel.tp=1", "parallel.zero=0",
                                "train.precision=fp32"]),
    ("mixtral ep4 z3", ["recipe=mixtral-8x7b", "parallel.ep=4", "parallel.zero=3", "train.precision=fp32"]),
    ("deepseek-moe-16b", ["recipe=deepseek-moe-16b"]),
    ("deepseek-moe-16b fp32", ["recipe=deepseek-moe-16b", "train.precision=fp32"]),
    ("llama3.1-8b tp8", ["recipe=llama3.1-8b", "cluster.nodes=8", "train.precision=fp32"]),
    ("qwen3-8b tp8", ["recipe=qwen3-8b", "train.precision=fp32"]),
    ("qwen3-32b tp8 pp2", ["recipe=qwen3-32b", "train.precision=fp32"]),
    ("qwen3-32b window", ["recipe=qwen3-32b", "model.sliding_window=1024", "model.full_attention_every=4",
                          "train.precision=fp32"]),
    ("qwen3-30b-a3b ep8", ["recipe=qwen3-30b-a3b", "train.precision=fp32"]),
    ("qwen3-235b pp8 dualpipev ep8", ["recipe=qwen3-235b-a22b", "train.precision=fp32"]),
    ("dsv3 published pp16 dualpipev ep64", ["recipe=deepseek-v3", "train.precision=fp32"]),
    ("unshipped 3b gqa", ["recipe=llama3-8b", "cluster.nodes=4", "model.d_model=3072", "model.n_heads=24",
                          "model.n_kv_heads=8", "model.ffn_hidden=8192", "model.vocab_size=100000",
                          "parallel.tp=4", "parallel.pp=2", "train.precision=fp32"]),
]


def _layers(overrides: list[str], depth: int) -> list[str]:
    """A depth that every chunk of the layout can hold (the resolver names the valid pp choices)."""
    sys.path.insert(0, ".")
    from paralayer import config as config_mod
    from paralayer.resolve import resolve

    plan = resolve(config_mod.load_config(overrides)).to_dict()
    chunks = len(plan["stage_layers"])
    n = max(depth, chunks)
    n = -(-n // chunks) * chunks
    return overrides + [f"model.n_layers={n}", "parallel.pp_layout=null"]


def row(label: str, overrides: list[str], depth: int) -> dict:
    ovs = _layers(overrides, depth) if depth else overrides
    t0 = time.time()
    p = subprocess.run([sys.executable, "launch.py", *ovs, "--rehearse", "--ranks", "0", "--json"],
                       capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        return {"label": label, "ok": False, "error": (p.stderr.strip().splitlines() or ["?"])[-1], "wall": wall}
    if not out["ranks"]:
        return {"label": label, "ok": False, "error": "; ".join(out["errors"]) or "no rank", "wall": wall}
    r = out["ranks"][0]
    return {"label": label, "ok": out["ok"], "world": out["world_size"], "ratios": r["ratios"],
            "seconds": r["seconds"], "host_gib": r.get("host_peak_bytes", 0) / 2**30, "wall": wall,
            "agrees": r["agrees"], "m": f"{out['microbatches']}/{out['microbatches_full']}"}


#: The recipes' acceptance (issue 46): states exact, the rest within 2%.
RECIPE_TOL = {"activations": 0.02, "flops": 0.02, "comm": 0.02}
#: The recipes issue 46 names first; the others follow by name.
FIRST = ["qwen3-8b", "llama3.1-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"]


def shipped_recipes() -> list[str]:
    import os

    names = sorted(f[:-5] for f in os.listdir("recipes") if f.endswith(".yaml") and f != "base.yaml")
    return [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]


def recipe_rows(name: str) -> list[dict]:
    """``launch.py recipe=NAME --rehearse --ranks 0,LAST --json``: one row per rank, with the verdict."""
    sys.path.insert(0, ".")
    from paralayer import config as config_mod
    from paralayer.resolve import resolve

    plan = resolve(config_mod.load_config([f"recipe={name}"])).to_dict()
    world = int(plan["world_size"])
    d = plan["degrees"]
    lay = " ".join(f"{k}{d[k]}" for k in ("tp", "pp", "cp", "ep") if int(d.get(k, 1)) > 1) or "dp only"
    lay += f" dp{d['dp']} z{plan['zero']} {plan['schedule'] if int(d['pp']) > 1 else ''}".rstrip()
    lay += f" {config_mod.load_config([f'recipe={name}']).train.precision}"
    t0 = time.time()
    p = subprocess.run([sys.executable, "launch.py", f"recipe={name}", "--rehearse", "--ranks",
                        ",".join(str(r) for r in sorted({0, world - 1})), "--json"],
                       capture_output=True, text=True, timeout=7200)
    wall = time.time() - t0
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        return [{"name": name, "layout": lay, "error": (p.stderr.strip().splitlines() or ["?"])[-1], "wall": wall}]
    rows = [{"name": name, "layout": lay, "error": e, "wall": wall} for e in out["errors"]]
    for r in out["ranks"]:
        q = r["ratios"]
        exact = all(r["memory_bytes"][k] == r["plan_memory_bytes"][k] for k in ("params", "grads", "optimizer"))
        within = all(q[k] is not None and abs(q[k] - 1) <= RECIPE_TOL[k] for k in ("activations", "flops")) and \
            all(v is not None and abs(v - 1) <= RECIPE_TOL["comm"] for v in q["comm"].values())
        rows.append({"name": name, "layout": lay, "world": world, "rank": r["rank"], "ratios": q,
                     "m": f"{out['microbatches']}/{out['microbatches_full']}", "ok": exact and within,
                     "seconds": r["seconds"], "wall": wall})
    return rows


def recipes_table(only: str) -> None:
    print("| recipe | layout | world | m | rank | states exact, rest within 2% | params | grads | optimizer | "
          "activations | comm (per axis) | FLOPs | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.time()
    for name in shipped_recipes():
        if only and only not in name:
            continue
        for r in recipe_rows(name):
            if "error" in r:
                print(f"| {name} | {r['layout']} | | | | FAIL: {r['error'][:140]} | | | | | | | {r['wall']:.0f} |",
                      flush=True)
                continue
            print(f"| {name} | {r['layout']} | {r['world']} | {r['m']} | {r['rank']} | {'yes' if r['ok'] else 'NO'} | "
                  f"{ratio_cells(r['ratios'])} | {r['seconds']:.0f} |", flush=True)
    print(f"\nwall time {time.time() - t0:.0f} s", flush=True)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def ratio_cells(q: dict) -> str:
    """params | grads | optimizer | activations | comm per axis | FLOPs, as ratios."""
    comm = " ".join(f"{a} {fmt(v)}" for a, v in sorted(q["comm"].items()))
    return (f"{fmt(q['params'])} | {fmt(q['grads'])} | {fmt(q['optimizer'])} | {fmt(q['activations'])} | "
            f"{comm} | {fmt(q['flops'])}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=0, help="cut the depth to this many layers (0: the model's)")
    ap.add_argument("--only", default="", help="rows whose label contains this")
    ap.add_argument("--recipes", action="store_true", help="every shipped recipe at its own depth and layout")
    args = ap.parse_args()
    if args.recipes:
        recipes_table(args.only)
        return 0
    print("| layout | world | m | ok | params | grads | optimizer | activations | comm (per axis) | FLOPs | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, ovs in MATRIX:
        if args.only and args.only not in label:
            continue
        r = row(label, ovs, args.layers)
        if "error" in r:
            print(f"| {label} | | | FAIL | {r['error'][:120]} | | | | | | {r['wall']:.0f} |", flush=True)
            continue
        print(f"| {label} | {r['world']} | {r['m']} | {'yes' if r['ok'] else 'NO'} | {ratio_cells(r['ratios'])} | "
              f"{r['seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
