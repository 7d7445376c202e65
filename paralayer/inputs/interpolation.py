"""Which ``${...}`` a recipe may hold: plain references to other recipe fields, nothing else.

Why: OmegaConf resolves ``${oc.env:VAR}`` (and any registered resolver) in every text field, so a
shared recipe or a pasted override could copy ``WANDB_API_KEY`` into ``run.name``, from where it
reaches the console, ``resolved.yaml``, W&B and the SLURM logs. Recipes and overrides may not read
the environment: the shell already expands ``$VAR`` on the command line for a user who wants it.
References inside the recipe (``${model.d_model}``, relative ``${..x}``) stay allowed.
"""
from __future__ import annotations

import re
from typing import Any

from paralayer.config.schema import ConfigError

#: ``${a.b.c}`` or a relative ``${.x}`` / ``${..x.y}``: a reference, no resolver, no nesting.
_REFERENCE = re.compile(r"\$\{\s*\.*[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+)*\s*\}")


def check_text(field: str, value: str) -> None:
    """Raise unless every ``${`` in ``value`` opens a plain reference to a recipe field."""
    if "${" not in value:
        return
    rest = _REFERENCE.sub("", value)
    if "${" in rest:
        bad = value[value.find("${"):][:40]
        what = "reads the environment" if "env:" in value else "is not a plain reference to a recipe field"
        raise ConfigError(field, f"'{_redact(bad)}' {what}; recipes and overrides may only reference other "
                          "recipe fields (${model.d_model}); resolvers such as oc.env are refused. Let the shell "
                          "expand $VAR on the command line instead")


def _redact(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def check_tree(node: Any, prefix: str = "") -> None:
    """Every text in a plain YAML tree (dicts, lists, scalars); keys too."""
    if isinstance(node, dict):
        for k, v in node.items():
            name = f"{prefix}{k}"
            if isinstance(k, str) and "${" in k:
                raise ConfigError(name, "keys may not hold interpolations")
            check_tree(v, name + ".")
    elif isinstance(node, (list, tuple)):
        for v in node:
            check_tree(v, prefix)
    elif isinstance(node, str):
        check_text(prefix.rstrip(".") or "recipe", node)


def references(node: Any, prefix: str = "") -> list[str]:
    """The dotted fields of a plain tree (or a list of trees) whose text holds a ``${...}``."""
    if isinstance(node, list) and prefix == "":
        return [f for n in node for f in references(n)]
    if isinstance(node, dict):
        return [f for k, v in node.items() for f in references(v, f"{prefix}{k}.")]
    if isinstance(node, (list, tuple)):
        return [f for v in node for f in references(v, prefix)]
    return [prefix.rstrip(".")] if isinstance(node, str) and "${" in node else []


# ------------------------------------------------------------------ how far references expand
#: characters one field may expand to through its references (``${a}${a}`` chains double per level)
MAX_EXPANDED_CHARS = 64 * 1024
#: references followed in all (each counted once per field that reaches it)
MAX_REFERENCES = 10_000
_REF_TARGET = re.compile(r"\$\{\s*(\.*)([A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+)*)\s*\}")


def flatten(node: Any, prefix: str = "", out: dict | None = None) -> dict:
    """A plain tree as {dotted key: leaf}; list items as ``key.0``, ``key.1``; sections kept as
    the set of their keys' prefixes (so ``${model}`` finds what is under it)."""
    out = {} if out is None else out
    stack = [(prefix, node)]
    while stack:  # iterative: the tree's depth was bounded by depth.py, but no recursion is needed
        pre, n = stack.pop()
        items = n.items() if isinstance(n, dict) else enumerate(n) if isinstance(n, (list, tuple)) else None
        if items is None:
            out[pre.rstrip(".")] = n
            continue
        for k, v in items:
            stack.append((f"{pre}{k}.", v))
    return out


def _target(key: str, dots: str, path: str) -> str:
    if not dots:
        return path
    parent = key.split(".")[:-1]
    up = len(dots) - 1
    base = parent[:len(parent) - up] if up else parent
    return ".".join(base + [path])


def check_expansion(flat: dict) -> None:
    """Raise, naming the field, when a text's references would expand past MAX_EXPANDED_CHARS (or
    loop), before OmegaConf resolves anything. ``flat`` is the merged recipe as ``flatten`` gives."""
    texts = {k: v for k, v in flat.items() if isinstance(v, str) and "${" in v}
    if not texts:
        return
    sizes: dict[str, int] = {}
    budget = [MAX_REFERENCES]
    for key in texts:
        _expanded(key, flat, texts, sizes, budget)


def _size_of(target: str, flat: dict, texts: dict, sizes: dict, budget: list, key: str, path: tuple) -> int:
    if target in texts:
        if target in path:
            raise ConfigError(key, f"its references loop back to {target}")
        return _expanded(target, flat, texts, sizes, budget, path)
    if target in flat:
        return len(str(flat[target]))
    under = [k for k in flat if k.startswith(target + ".")]  # a section: its leaves, as text
    return sum(_size_of(k, flat, texts, sizes, budget, key, path) + len(k) for k in under[:MAX_REFERENCES])


def _expanded(key: str, flat: dict, texts: dict, sizes: dict, budget: list, path: tuple = ()) -> int:
    """Characters ``key``'s text resolves to (memoised; the chain is at most MAX_REFERENCES long)."""
    if key in sizes:
        return sizes[key]
    if len(path) > 64:
        raise ConfigError(key, "references nest more than 64 levels deep (${a} -> ${b} -> ...); the limit is 64")
    text = texts[key]
    size = len(_REF_TARGET.sub("", text))
    for m in _REF_TARGET.finditer(text):
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(key, f"the recipe's references (${{...}}) number more than {MAX_REFERENCES:,} "
                              "when followed; the limit is " f"{MAX_REFERENCES:,}")
        size += _size_of(_target(key, m.group(1), m.group(2)), flat, texts, sizes, budget, key, path + (key,))
        if size > MAX_EXPANDED_CHARS:
            raise ConfigError(path[0] if path else key, f"its references (${{...}}) expand to more than "
                              f"{MAX_EXPANDED_CHARS:,} characters; the limit is {MAX_EXPANDED_CHARS:,}")
    sizes[key] = size
    return size
