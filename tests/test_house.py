"""House rules that keep the package readable, checked with ast (nothing is imported or run).

- No function in paralayer/ over 80 lines (signature, docstring and body): a longer one does
  several things, and gets split into named steps.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "paralayer"
MAX_LINES = 80


def _long_functions(root: Path = PKG, max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name: N lines`` for every function (methods and nested ones too) over max_lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > max_lines:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_the_check_finds_an_81_line_method_and_passes_80(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES - 1))
    (pkg / "ok.py").write_text(f"class A:\n    def f(self):\n{body}\n")
    (pkg / "long.py").write_text(f"class A:\n    def g(self):\n{body}\n        return 1\n")
    assert _long_functions(pkg) == ["pkg/long.py:2 g: 81 lines"]


def test_no_function_over_80_lines():
    long = _long_functions()
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(long)


#: Where a training rank's code lives; none of it may read a PARALAYER_* variable (what a rank
#: does comes from resolved.yaml and plan.json; the launcher's variables are torch's and SLURM's).
#: The rehearsal (paralayer/rehearse/) runs in the front door's processes, not in a training rank.
RANK_PACKAGES = ("model", "parallel", "data", "checkpoint", "metrics", "runtime")


def _paralayer_vars(path: Path) -> list[str]:
    return sorted({n.value for n in ast.walk(ast.parse(path.read_text(), str(path)))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("PARALAYER_")})


def test_no_paralayer_variable_read_by_a_rank():
    bad = []
    for sub in RANK_PACKAGES:
        for path in sorted((PKG / sub).rglob("*.py")):
            if path.name.startswith("rehearse"):
                continue
            bad += [f"{path.relative_to(PKG.parent)}: {v}" for v in _paralayer_vars(path)]
    for path in (PKG / "compat.py", PKG / "clock.py"):
        if path.exists():
            bad += [f"{path.relative_to(PKG.parent)}: {v}" for v in _paralayer_vars(path)]
    assert not bad, "a rank reads PARALAYER_* variables (make them config fields):\n" + "\n".join(bad)
