"""Figures the README and docs quote from ``--dry-run`` / ``--plan`` come from the current resolver.

A quoted figure carries an invisible marker right before it:

    <!-- fig: recipe=llama3-8b-512k parallel.cp=1 --dry-run => memory_per_device_bytes.total GiB:.1f -->77.4

The marker holds the command's arguments (as given to ``launch.py``; ``--dry-run`` or ``--plan``),
a path into its JSON (``0.step_time_s`` for the planner's first layout) and a format (``GiB:.1f``
divides bytes by 2**30; ``:.2f``, ``d``, ``str``, ``pct:.1f`` (×100)). ``calib:KEY=VALUE`` tokens re-plan
with that calibration constant changed (the planner's sensitivity). The test recomputes every
marked figure (torch-free, in-process) and asserts the text shows exactly what it computes, so a
resolver change that moves a quoted figure fails here until the doc is updated.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- fig: (?P<args>.+?) => (?P<path>\S+) (?P<fmt>\S+) -->(?P<shown>[^\s|,;)`]+)")


def _markers() -> list[tuple[str, str, str, str, str]]:
    out = []
    for doc in DOCS:
        for m in MARK.finditer(doc.read_text()):
            out.append((doc.name, m["args"], m["path"], m["fmt"], m["shown"].rstrip(".")))
    return out


@functools.lru_cache(maxsize=None)
def _json(args: str) -> object:
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    tokens = args.split()
    calib = dict(t[len("calib:"):].split("=", 1) for t in tokens if t.startswith("calib:"))
    flags = {t for t in tokens if t.startswith("--")}
    overrides = [t for t in tokens if not t.startswith(("--", "calib:"))]
    cfg = load_config(overrides)
    if "--plan" in flags:
        from paralayer.resolve.cost.machine import GPU_CALIBRATION
        from paralayer.resolve.planner import plan_layouts
        from paralayer.resolve.planner import report as plan_report

        cal = dict(GPU_CALIBRATION, **{k: float(v) for k, v in calib.items()}) if calib else None
        return plan_layouts(cfg, calibration=cal, top=3, fixed=plan_report.fixed_from_overrides(overrides, cfg))
    assert "--dry-run" in flags, f"a marker needs --dry-run or --plan: {args}"
    return json.loads(json.dumps(resolve(cfg).to_dict()))


def _at(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def _fmt(value: object, fmt: str) -> str:
    if fmt == "str":
        return str(value).lower() if isinstance(value, bool) else str(value)
    if fmt.startswith("GiB"):
        return format(float(value) / 2**30, fmt[3:].lstrip(":"))
    if fmt.startswith("pct"):
        return format(float(value) * 100, fmt[3:].lstrip(":"))
    return format(value, fmt.lstrip(":"))


MARKERS = _markers()


def test_docs_carry_figure_markers():
    """The markers exist (a regex that matched nothing would make the check below vacuous)."""
    assert len(MARKERS) >= 12, MARKERS
    assert {m[0] for m in MARKERS} >= {"README.md", "BENCHMARKS.md", "planner.md"}


def _mismatches(text: str) -> list[str]:
    out = []
    for m in MARK.finditer(text):
        want = _fmt(_at(_json(m["args"]), m["path"]), m["fmt"])
        if m["shown"].rstrip(".") != want:
            out.append(f"`{m['args']}` gives {m['path']} = {want}, the doc says {m['shown']}")
    return out


@pytest.mark.parametrize("doc", sorted({m[0] for m in MARKERS}))
def test_quoted_figures_are_current(doc):
    path = next(d for d in DOCS if d.name == doc)
    bad = _mismatches(path.read_text())
    assert not bad, f"{doc}: " + "; ".join(bad)


def test_a_stale_figure_fails():
    """The check can fail: the first marker's figure moved by one in its last digit is caught."""
    doc, args, path, fmt, shown = MARKERS[0]
    assert not _mismatches(f"<!-- fig: {args} => {path} {fmt} -->{shown}")
    stale = shown[:-1] + str((int(shown[-1]) + 1) % 10)
    assert _mismatches(f"<!-- fig: {args} => {path} {fmt} -->{stale}")
