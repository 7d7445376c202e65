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

    cases = {n: c for n, c in T.CASES.items() if a.k in n}
    got = T.run_cases(cases, tempfile.mkdtemp(), (f"train.seed={a.seed}",),
                      torch.float32 if a.fp32 else torch.float64)
    for n, (g, r) in got.items():
        k = min(len(g), len(r))
        el, en = T._errs(g[:k], r[:k])
        print(f"seed {a.seed} {n}: loss {el:.1e} grad norm {en:.1e} over {k} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
