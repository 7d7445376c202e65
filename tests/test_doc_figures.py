"""Figures the README and docs quote from ``--dry-run`` / ``--plan`` come from the current resolver.

The figures are written by one script, benchmarks/doc_figures.py (markers before figures in prose,
and the generated table of every shipped recipe's plan in docs/models.md); these tests recompute
them torch-free and in-process and assert the docs show exactly that, so a resolver change that
moves a quoted figure fails here until ``python benchmarks/doc_figures.py --write`` is run.
"""
from __future__ import annotations

import pytest

from benchmarks import doc_figures as figs

MARKERS = [(doc.name, m) for doc in figs.DOCS for m in figs.markers(doc.read_text())]


def test_docs_carry_figure_markers():
    """The markers exist (a regex that matched nothing would make the check below vacuous)."""
    assert len(MARKERS) >= 12, MARKERS
    assert {name for name, _ in MARKERS} >= {"README.md", "BENCHMARKS.md", "planner.md", "models.md"}


@pytest.mark.parametrize("doc", sorted({name for name, _ in MARKERS}))
def test_quoted_figures_are_current(doc):
    path = next(d for d in figs.DOCS if d.name == doc)
    bad = figs.stale_markers(path.read_text())
    assert not bad, f"{doc}: " + "; ".join(bad) + " (python benchmarks/doc_figures.py --write)"


def test_a_stale_figure_fails():
    """The check can fail: the first marker's figure moved by one in its last digit is caught, and
    the writer puts it back."""
    _, m = MARKERS[0]
    line = m.group(0)
    assert not figs.stale_markers(line)
    shown = m["shown"].rstrip(".")
    stale = line.replace("-->" + shown, "-->" + shown[:-1] + str((int(shown[-1]) + 1) % 10))
    assert figs.stale_markers(stale)
    assert figs.rewrite_markers(stale) == line


def test_the_recipe_table_is_every_shipped_recipe_as_planned():
    """docs/models.md's table of the shipped recipes is what the resolver plans today: every GPU
    recipe in recipes/ a row (a new recipe without its row fails), every cell current."""
    shown = figs.table_in(figs.TABLE_DOC.read_text())
    assert shown is not None, f"no {figs.TABLE_OPEN} block in docs/models.md"
    names = figs.shipped_recipes()
    assert len(names) >= 15 and {"deepseek-v3", "llama3-405b", "kimi-k2", "qwen3-8b"} <= set(names)
    want = figs.recipe_table()
    assert [r.split(" | ")[0] for r in shown.splitlines()[2:]] == [f"| {n}" for n in names]
    assert shown == want, "docs/models.md's recipe table is stale: python benchmarks/doc_figures.py --write"


def test_a_stale_table_cell_fails():
    table = figs.recipe_table()
    row = table.splitlines()[2]
    cells = row.split(" | ")
    cells[7] = f"{float(cells[7]) + 0.01:.2f}"  # the total GiB of the first recipe, off by 0.01
    assert table.replace(row, " | ".join(cells)) != table
