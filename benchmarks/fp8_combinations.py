"""The combination suite's layouts (tests/combos.py: every pair of layout features) trained in FP8
against one process, each recipe, the model in fp64 (docs/context-parallel.md, "The FP8 layout suite
runs in fp64"). Not a CI test: 44 layouts x 2 recipes x 4 steps took 33 minutes on the shared
2-core machine; CI runs tests/test_fp8.py's representative layouts. Prints one line per row and recipe: the worst
relative error of loss and grad norm over the steps, or the field the resolver refuses.

    PYTHONPATH=$PWD python benchmarks/fp8_combinations.py [--recipes tensorwise,rowwise] [--steps 4]

FP8's GEMMs need K and N multiples of 16 on a rank (resolve/fp8.py): the suite's FFN (48) and
key/value width (2 heads of 8) are widened to 64 and 4 heads here, Qwen3's head_dim (12) to 16 and
MLA's ranks and head widths to 16, in the row and its reference alike. tp_overlap, which the
resolver refuses with FP8 (its fused ring GEMMs have no FP8 cast), runs as plain sequence parallel.
Anything else the resolver refuses is printed with its field.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: the suite's model widened where FP8 needs multiples of 16 after tp 2 (before the row's own keys)
WIDE = ["model.ffn_hidden=64", "model.n_kv_heads=4"]
#: the families' widths FP8 can take (after the row's keys): Qwen3's head_dim 16 (still not
#: d_model / heads = 8), MLA's ranks and head widths 16 (V 16 against a q/k head of 32)
FAMILY_FP8 = {"qwen3": ["model.head_dim=16"],
              "mla": ["model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=16",
                      "model.mla.qk_rope_head_dim=16", "model.mla.v_head_dim=16"]}


def fp8_row(row: dict) -> tuple[dict, list]:
    """The row FP8 runs (tp_overlap, which has no FP8 cast, as plain sequence parallel) and the keys
    after its own (the family's FP8 widths)."""
    row = dict(row, tp="sp") if row["tp"] == "overlap" else row
    return row, FAMILY_FP8.get(row.get("family", "plain"), [])


def _jobs(rank, world, jobs):
    """Each (cfg, plan) of ``jobs`` trained in turn, the model in fp64: [(loss, grad norm) per step]."""
    import torch

    from paralayer.runtime.train import train

    torch.set_default_dtype(torch.float64)
    return [[(r["loss"], r["grad_norm"]) for r in train(cfg, plan)] for cfg, plan in jobs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="tensorwise,rowwise")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)

    import paralayer.runtime.train  # noqa: F401 - imported once, before the ranks fork
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve
    from tests import combos as C
    from tests.dist import max_rel_err, run_ranks, write_tokens

    data = write_tokens(str(Path(tempfile.mkdtemp()) / "tokens.jsonl"), 64, 16, 64)
    rows = C.suite_rows()
    worst, refused, ran = 0.0, defaultdict(int), 0
    for recipe in a.recipes.split(","):
        fp8 = ["train.precision=fp8", f"train.fp8.recipe={recipe}", f"train.steps={a.steps}", f"data.path={data}"]

        def resolved(ov: list):
            cfg = load_config(C.BASE + WIDE + ov + fp8)
            return cfg, resolve(cfg).to_dict()

        by_world, keys = defaultdict(list), {}
        for i, row in enumerate(rows):
            r, extra = fp8_row(row)
            cfg, plan = resolved(C.overrides(r) + extra)
            if plan["errors"]:
                e = plan["errors"][0]
                print(f"{recipe} row {i}: refused, {e['field']}: {e['message'][:110]}", flush=True)
                refused[e["field"]] += 1
                continue
            by_world[C.world_size(r)].append((i, r, (cfg, plan)))
            keys[C.reference_key(r) + tuple(extra)] = None
        ks = list(keys)
        refs = dict(zip(ks, run_ranks(_jobs, 1, [resolved(list(k) + ["parallel.tp=1", "parallel.dp=1"]) for k in ks],
                                      timeout_s=1800)[0]))
        for world, group in sorted(by_world.items()):
            out = run_ranks(_jobs, world, [job for _, _, job in group], timeout_s=1800)
            for j, (i, r, _) in enumerate(group):
                ref = refs[C.reference_key(r) + tuple(fp8_row(r)[1])]
                el = max(max_rel_err([x[0] for x in out[k][j]], [x[0] for x in ref]) for k in range(world))
                en = max(max_rel_err([x[1] for x in out[k][j]], [x[1] for x in ref]) for k in range(world))
                worst, ran = max(worst, el, en), ran + 1
                print(f"{recipe} row {i} ({world} ranks): loss {el:.1e} grad norm {en:.1e}  {' '.join(C.overrides(r))}",
                      flush=True)
    print(f"{ran} row-recipe runs, worst relative error {worst:.1e}; refused: {dict(refused)}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
