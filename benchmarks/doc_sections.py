"""Rewriting one section of a markdown file in place (docs/planner.md, docs/BENCHMARKS.md): what the
benchmarks that publish their tables share."""
from __future__ import annotations

import os


def write_section(path: str, text: str) -> None:
    head = "## GPU calibration (published runs)"
    old = open(path).read() if os.path.exists(path) else ""
    if head in old:
        i = old.index(head)
        j = old.find("\n## ", i + len(head))
        new = old[:i] + text + (old[j + 1:] if j >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def write_named_section(path: str, head_prefix: str, text: str) -> None:
    """Replace the section whose heading starts with ``head_prefix`` (or append it)."""
    old = open(path).read() if os.path.exists(path) else ""
    i = old.find(head_prefix)
    if i >= 0:
        j = old.find("\n## ", i + len(head_prefix))
        new = old[:i] + text.rstrip("\n") + "\n\n" + (old[j + 1:] if j >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)
