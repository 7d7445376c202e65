"""The plan's figures quoted in the docs, computed by the resolver, so that none can go stale.

Two forms, both checked by tests/test_doc_figures.py:

- a figure in prose carries an invisible marker right before it,

      <!-- fig: recipe=llama3-8b-512k parallel.cp=1 --dry-run => memory_per_device_bytes.total GiB:.1f -->77.4

  holding the command's arguments (as given to ``launch.py``; ``--dry-run`` or ``--plan``), a path
  into its JSON (``0.step_time_s`` for the planner's first layout) and a format (``GiB:.1f`` divides
  bytes by 2**30, ``GB``/``MB`` by 1e9/1e6; ``:.2f``, ``d``, ``str``, ``pct:.1f`` (x100)).
  ``calib:KEY=VALUE`` tokens re-plan with that calibration constant changed (the planner's sensitivity).
- a table of every shipped recipe's plan (memory per part, step time, MFU, device-hours) between
  ``<!-- generated: recipes -->`` and ``<!-- /generated -->`` in docs/models.md.

    python benchmarks/doc_figures.py           # list what is stale (exit 1 if anything is)
    python benchmarks/doc_figures.py --write   # rewrite every marked figure and the recipe table

Torch-free and in-process: the whole check takes seconds.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- fig: (?P<args>.+?) => (?P<path>\S+) (?P<fmt>\S+) -->(?P<shown>[^\s|,;)`%]+)")
TABLE_DOC = REPO / "docs" / "models.md"
TABLE_OPEN, TABLE_CLOSE = "<!-- generated: recipes -->", "<!-- /generated -->"
GiB = 2**30


@functools.lru_cache(maxsize=None)
def plan_json(args: str) -> object:
    """The JSON of ``launch.py ARGS`` (``--dry-run`` or ``--plan``), as the command prints it."""
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
    if "--dry-run" not in flags:
        raise ValueError(f"a marker needs --dry-run or --plan: {args}")
    return json.loads(json.dumps(resolve(cfg).to_dict()))


def at(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def fmt(value: object, spec: str) -> str:
    if spec == "str":
        return str(value).lower() if isinstance(value, bool) else str(value)
    if spec.startswith("GiB"):
        return format(float(value) / GiB, spec[3:].lstrip(":"))
    if spec.startswith(("GB", "MB")):
        return format(float(value) / (1e9 if spec.startswith("GB") else 1e6), spec[2:].lstrip(":"))
    if spec.startswith("pct"):
        return format(float(value) * 100, spec[3:].lstrip(":"))
    return format(value, spec.lstrip(":"))


def markers(text: str) -> list[re.Match]:
    return list(MARK.finditer(text))


def current(m: re.Match) -> str:
    """What the marked figure is today."""
    return fmt(at(plan_json(m["args"]), m["path"]), m["fmt"])


def stale_markers(text: str) -> list[str]:
    return [f"`{m['args']}` gives {m['path']} = {current(m)}, the doc says {m['shown']}"
            for m in markers(text) if m["shown"].rstrip(".") != current(m)]


def rewrite_markers(text: str) -> str:
    def one(m: re.Match) -> str:
        trail = m["shown"][len(m["shown"].rstrip(".")):]
        return m.group(0)[: m.start("shown") - m.start()] + current(m) + trail

    return MARK.sub(one, text)


# ----------------------------------------------------------------------------- the recipe table
def shipped_recipes() -> list[str]:
    """Every recipe planned for a GPU cluster (the tiny CPU recipes have no device-hours)."""
    out = []
    for p in sorted((REPO / "recipes").glob("*.yaml")):
        if p.stem != "base" and plan_json(f"recipe={p.stem} --dry-run").get("gpu"):
            out.append(p.stem)
    return out


def _layout(d: dict) -> str:
    deg = d["degrees"]
    parts = [f"{k}{deg[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if deg.get(k, 1) != 1]
    extra = [d["schedule"]] if deg.get("pp", 1) > 1 else []
    return " ".join(parts + extra + [f"zero{d['zero']}", f"recompute {d['recompute']}"])


def recipe_table() -> str:
    from paralayer.config import load_config

    head = ("| recipe | cluster | layout | params | grads | optimizer | activations | total GiB | fits "
            "| step s | MFU | device-hours |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for name in shipped_recipes():
        d = plan_json(f"recipe={name} --dry-run")
        m = d["memory_per_device_bytes"]
        mem = " | ".join(f"{m[k] / GiB:.2f}" for k in ("params", "grads", "optimizer", "activations", "total"))
        cl = load_config([f"recipe={name}"]).cluster
        rows.append(f"| {name} | {cl.nodes} x {cl.name} | {_layout(d)} | {mem} | "
                    f"{'yes' if d['fits'] else 'no'} | {d['step_time_s']:.2f} | {d['mfu']:.3f} | "
                    f"{d['device_hours']:,.0f} |")
    return head + "\n".join(rows) + "\n"


def table_in(text: str) -> str | None:
    i, j = text.find(TABLE_OPEN), text.find(TABLE_CLOSE)
    return None if i < 0 or j < i else text[i + len(TABLE_OPEN):j].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    i, j = text.find(TABLE_OPEN), text.find(TABLE_CLOSE)
    if i < 0 or j < i:
        raise ValueError(f"{TABLE_DOC.name} has no {TABLE_OPEN} ... {TABLE_CLOSE} block")
    return text[: i + len(TABLE_OPEN)] + "\n" + table + text[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the stale figures in place")
    a = ap.parse_args(argv)
    stale = 0
    for doc in DOCS:
        text = doc.read_text()
        new = rewrite_markers(text)
        if doc == TABLE_DOC:
            new = with_table(new, recipe_table())
        if new != text:
            stale += 1
            what = "; ".join(stale_markers(text)) or "the recipe table"
            print(f"{doc.relative_to(REPO)}: " + ("rewritten" if a.write else f"stale: {what}"))
            if a.write:
                doc.write_text(new)
    return 0 if (a.write or not stale) else 1


if __name__ == "__main__":
    sys.exit(main())
