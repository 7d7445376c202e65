"""The package's import graph, read with ast (nothing is imported or run): no cycles, no import
from a lower layer up to a higher one, and no torch under resolve/ (the resolver answers in well
under a second because it never imports torch, not even through another module).

Every import counts, also those inside functions (a lazy import is still a dependency; it only
hides the cycle until the function runs); imports under ``if TYPE_CHECKING:`` do not run and do
not count.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "paralayer"

#: The layers, lowest first: a module may import its own layer and the ones below it.
#: compat (torch version guards) and clock (step timing) are tools every layer above config may use.
LAYERS: list[tuple[str, ...]] = [
    ("config", "families", "inputs"),  # families/ reads config.json into the schema (config/load.py asks it); inputs/ raises the schema's ConfigError
    ("compat", "clock"),
    ("resolve",),
    ("model",),
    ("parallel",),
    ("optim",),  # Muon and its owners: torch.distributed over the parallel layer's groups
    ("data", "checkpoint", "metrics"),
    ("runtime",),
    ("rehearse",),
    ("dispatch",),
    ("cli", "commands", "__main__"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``name`` imports: paralayer modules by full name, others by top-level name."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            if t.split(".")[0] != "paralayer":
                out.add(t.split(".")[0])
                continue
            while t not in modules and "." in t:  # an attribute of a module: the module
                t = t.rsplit(".", 1)[0]
            if t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: not in any layer of tests/test_imports.py LAYERS; add it")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_walker_sees_lazy_and_relative_imports():
    """The walker itself: function-level imports count, TYPE_CHECKING ones do not."""
    modules = {"paralayer.a": Path("a.py"), "paralayer.b": Path("b.py"), "paralayer.c": Path("c.py")}
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paralayer import c\n"
           "def f():\n    from paralayer import b\n    import torch.nn\n")
    tree = ast.parse(src)
    found = set()
    for node in _import_nodes(tree):
        found |= {a.name for a in node.names}
    assert found == {"TYPE_CHECKING", "b", "torch.nn"}
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports():
    bad = []
    for mod, deps in sorted(_graph().items()):
        lm = _layer(mod)
        for d in sorted(deps):
            if not d.startswith("paralayer.") or lm is None:
                continue
            ld = _layer(d)
            if ld is not None and ld > lm:
                bad.append(f"{mod} ({LAYERS[lm][0]}) imports {d} ({LAYERS[ld][0]})")
    assert not bad, "imports from a lower layer up to a higher one:\n" + "\n".join(bad)


def test_resolve_never_reaches_torch():
    graph = _graph()
    bad = []
    for start in sorted(m for m in graph if m.startswith("paralayer.resolve")):
        seen, todo, parent = {start}, [start], {start: None}
        while todo:
            m = todo.pop()
            for d in graph.get(m, ()):
                if d == "torch":
                    chain, x = [d], m
                    while x is not None:
                        chain.append(x)
                        x = parent[x]
                    bad.append(" <- ".join(chain))
                elif d in graph and d not in seen:
                    seen.add(d)
                    parent[d] = m
                    todo.append(d)
    assert not bad, "resolve/ imports torch:\n" + "\n".join(sorted(set(bad)))


def test_the_package_root_holds_only_what_stands_there():
    """No re-export modules at the root (issue #37): the old module paths python -m still runs
    (``paralayer.report``, ``paralayer.export``) are spellings of commands, found by
    paralayer/__init__.py, and their code is the command table's."""
    import importlib.util

    import paralayer

    root = {p.stem for p in PKG.glob("*.py")}
    assert root == {"__init__", "__main__", "cli", "clock", "commands", "compat"}, root
    for name, verb in paralayer.OLD_SPELLINGS.items():
        spec = importlib.util.find_spec(name)
        code = spec.loader.get_code(name)
        assert spec.loader is paralayer._CommandSpelling and name in code.co_consts, name
        assert "run_old_spelling" in code.co_names
        from paralayer.commands import COMMANDS
        assert verb in COMMANDS
