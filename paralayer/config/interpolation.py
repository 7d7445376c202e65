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
