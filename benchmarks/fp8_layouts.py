"""Every FP8 layout of tests/test_fp8.py against one process, the errors printed (docs/context-parallel.md,
"The FP8 layout suite runs in fp64"). The test asserts 1e-5; this prints what each layout reads, at
any seed, so the table in the docs can be remade:

    PYTHONPATH=$PWD python benchmarks/fp8_layouts.py --seed 1

Each case runs as the test runs it (its layout, its model keys, its plant if any), the model in fp64;
``--fp32`` runs the same cases with the model in fp32, where a reordered sum's ulp meets FP8's
roundings. Prints one line per case: the worst relative error of loss and grad norm over its steps.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32", action="store_true", help="the model in fp32 instead of fp64")
    ap.add_argument("-k", default="", help="only the cases whose name holds this")
    a = ap.parse_args(argv)

    import torch

    import paralayer.runtime.train  # noqa: F401 - imported once, before the ranks fork
    from tests import test_fp8 as T
    from tests.dist import run_ranks, write_tokens

    tmp = tempfile.mkdtemp()
    paths = {s: write_tokens(f"{tmp}/tokens{s}.jsonl", 16, s, 64) for s in (32, 128)}
    cases = {n: c for n, c in T.CASES.items() if a.k in n}

    def base(mk) -> list:
        return T.BASE + list(mk) + [f"data.path={paths[128 if 'model.seq_len=128' in mk else 32]}",
                                    f"train.seed={a.seed}"]

    dtype = torch.float32 if a.fp32 else torch.float64
    keys = sorted({tuple(mk) for mk, _, _ in cases.values()})
    refs = dict(zip(keys, run_ranks(T._run_jobs, 1, [(base(k), None) for k in keys], dtype, timeout_s=900)[0]))
    for world in sorted({T._world(lay) for _, lay, _ in cases.values()}):
        names = [n for n, (_, lay, _) in cases.items() if T._world(lay) == world]
        got = run_ranks(T._run_jobs, world, [(base(cases[n][0]) + cases[n][1], cases[n][2]) for n in names],
                        dtype, timeout_s=900)[0]
        for n, g in zip(names, got):
            r = refs[tuple(cases[n][0])]
            k = min(len(g), len(r))
            el, en = T._errs(g[:k], r[:k])
            print(f"seed {a.seed} {n}: loss {el:.1e} grad norm {en:.1e} over {k} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
