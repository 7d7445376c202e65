"""House rules that keep the package readable, checked with ast (nothing is imported or run).

- No function in paralayer/ over 80 lines (signature, docstring and body): a longer one does
  several things, and gets split into named steps.
- No module in paralayer/, benchmarks/ or tests/ over 500 lines unless its docstring says why
  ("Why this file is long:"; none does now).
- No folder of the package holds more than 15 modules: a job with several files gets its own
  sub-package (parallel/pipeline/, runtime/health/).
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


#: A file in paralayer/ over MAX_FILE_LINES lines holds more than one concept unless its module
#: docstring says why it does not, on a line that starts with LONG_MARKER.
MAX_FILE_LINES = 500
LONG_MARKER = "Why this file is long:"
#: Files over the bound that wait on work in flight, each with the reason (not a licence: the
#: entry goes when the file is split or its docstring carries the marker).
WAITING: dict[str, str] = {}  # modules allowed over the bound while a split is under way (none now)


def _long_files(root: Path = PKG, max_lines: int = MAX_FILE_LINES) -> list[str]:
    """``path: N lines`` for every module over max_lines whose docstring has no LONG_MARKER line."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        n = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if n <= max_lines:
            continue
        doc = ast.get_docstring(ast.parse(text, str(path))) or ""
        if any(line.strip().startswith(LONG_MARKER) for line in doc.splitlines()):
            continue
        out.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return out


def test_the_long_file_check_finds_a_501_line_file_and_passes_a_reason(tmp_path):
    (tmp_path / "ok.py").write_text("x = 1\n" * MAX_FILE_LINES)
    (tmp_path / "long.py").write_text('"""Two things."""\n' + "x = 1\n" * MAX_FILE_LINES)
    (tmp_path / "why.py").write_text(f'"""Two things.\n\n{LONG_MARKER} they change together.\n"""\n'
                                     + "x = 1\n" * MAX_FILE_LINES)
    assert _long_files(tmp_path) == [f"long.py: {MAX_FILE_LINES + 1} lines"]


def test_no_file_over_500_lines_without_its_reason():
    long = [f for root in (PKG, PKG.parent / "benchmarks", PKG.parent / "tests") for f in _long_files(root)
            if f.split(":")[0] not in WAITING]
    assert not long, (f"modules over {MAX_FILE_LINES} lines (split them by concept, or say at the top of the "
                      f"docstring, on a line starting '{LONG_MARKER}', why not):\n" + "\n".join(long))


#: The most modules (``__init__.py`` not counted) one folder of the package may hold.
MAX_FOLDER_MODULES = 15
#: Folders allowed over the bound while their split is under way, each with the reason.
WAITING_FOLDERS: dict[str, str] = {}


def _crowded_folders(root: Path = PKG, most: int = MAX_FOLDER_MODULES) -> list[str]:
    """``folder: N modules`` for every folder under root with more than ``most`` modules."""
    out = []
    for folder in sorted({p.parent for p in root.rglob("*.py")}):
        n = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        if n > most:
            out.append(f"{folder.relative_to(root).as_posix() or '.'}: {n} modules")
    return out


def test_the_folder_check_finds_16_modules_and_passes_15(tmp_path):
    for name, n in (("ok", MAX_FOLDER_MODULES), ("crowded", MAX_FOLDER_MODULES + 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        for i in range(n):
            (tmp_path / name / f"m{i}.py").write_text("")
    assert _crowded_folders(tmp_path) == [f"crowded: {MAX_FOLDER_MODULES + 1} modules"]


def test_no_folder_over_15_modules():
    crowded = [f for f in _crowded_folders() if f.split(":")[0] not in WAITING_FOLDERS]
    assert not crowded, (f"folders of the package over {MAX_FOLDER_MODULES} modules (group a job's files into "
                         f"a sub-package):\n" + "\n".join(crowded))
