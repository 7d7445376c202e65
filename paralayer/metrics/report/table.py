"""The sweep report's table: the CSV columns (stable: scripts read them), report.md and the
table printed on the console, one row per run.
"""
from __future__ import annotations

import csv
import sys
from typing import Any, Dict, List, Optional, Sequence

from paralayer.inputs.echo import one_line
from paralayer.metrics.report.runs import QUANTITIES, Row


def columns() -> List[str]:
    """The CSV header (stable: scripts read it)."""
    cols = ["index", "name", "overrides", "state", "steps_logged", "steps_planned"]
    for key, _ in QUANTITIES:
        cols += [f"predicted_{key}", f"measured_{key}", f"ratio_{key}"]
    return cols + ["final_loss", "predicted_by", "error", "run_dir"]


def _csv_row(r: Row) -> Dict[str, Any]:
    return {k: ("" if v is None else v) for k, v in row_values(r).items()}


def row_values(r: Row) -> Dict[str, Any]:
    d: Dict[str, Any] = {"index": r.index, "name": r.name, "overrides": " ".join(r.overrides), "state": r.state,
                         "steps_logged": r.steps_logged, "steps_planned": r.steps_planned,
                         "final_loss": r.final_loss, "predicted_by": r.predicted_by, "error": r.error,
                         "run_dir": r.run_dir}
    for key, _ in QUANTITIES:
        d[f"predicted_{key}"], d[f"measured_{key}"] = r.predicted.get(key), r.measured.get(key)
        d[f"ratio_{key}"] = r.ratio(key)
    return d


def write_csv(rows: Sequence[Row], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns())
        w.writeheader()
        for r in rows:
            w.writerow(_csv_row(r))


# ------------------------------------------------------------------ formatting
def _fmt(key: str, v: Optional[float]) -> str:
    if v is None:
        return "-"
    if key == "step_time_s":
        return f"{v:.3g} s"
    if key == "tokens_per_s":
        return f"{v:,.0f}"
    if key == "mfu":
        return f"{100 * v:.2f}%"
    if key == "memory_bytes":
        return f"{v / 2**20:,.1f} MiB"
    return f"{v:.3f}"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def table_cells(r: Row) -> List[str]:
    """The row as the printed and markdown tables show it."""
    cells = [r.label, " ".join(r.overrides) or "-", r.state + (f" ({r.steps_logged}/{r.steps_planned})"
                                                                if r.state != "completed" else "")]
    for key, _ in QUANTITIES:
        cells += [_fmt(key, r.predicted.get(key)), _fmt(key, r.measured.get(key)), _ratio(r.ratio(key))]
    cells.append("-" if r.final_loss is None else f"{r.final_loss:.4f}")
    return cells


_SHORT = {"step_time_s": "step time", "tokens_per_s": "tokens/s", "mfu": "MFU", "memory_bytes": "memory/device",
          "bubble": "bubble"}


def table_header() -> List[str]:
    head = ["run", "overrides", "state"]
    for key, _ in QUANTITIES:
        head += [f"{_SHORT[key]} pred", f"{_SHORT[key]} meas", f"{_SHORT[key]} m/p"]
    return head + ["final loss"]


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(rows: Sequence[Row], title: str = "Sweep report") -> str:
    """report.md: the table, the errors of the runs that did not complete, and how to read it."""
    head = table_header()
    out = [f"# {title}", "", f"{len(rows)} run(s); m/p = measured / predicted.", "",
           "| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(_md_escape(c) for c in table_cells(r)) + " |" for r in rows]
    bad = [r for r in rows if r.state != "completed"]
    if bad:
        out += ["", "## Runs that did not complete", ""]
        out += [f"- **{_md_escape(r.label)}** ({r.state}, {r.steps_logged}/{r.steps_planned} steps): "
                f"`{_md_escape(r.error) or 'no error recorded'}` — {_md_escape(one_line(r.run_dir))}" for r in bad]
    out += ["", "Predicted: the run's plan.json (memory: the most loaded device; time: " +
            "; ".join(sorted({r.predicted_by for r in rows})) + "). Measured: medians of metrics.jsonl "
            "(first step left out when there are 3 or more); memory is rank 0's peak (on CPU the whole "
            "process's peak RSS, Python and torch included).", "", "![report](report.png)", ""]
    return "\n".join(out)


def print_table(rows: Sequence[Row], file: Any = None) -> None:
    """The table on the console (rich): one cell per quantity, ``predicted → measured`` over
    ``×ratio``; each run that did not complete is followed by its error line."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(file=file or sys.stdout, width=max(180, Console().width))
    t = Table(title="paralayer sweep report: predicted → measured (×measured/predicted)")
    t.add_column("run", overflow="fold", min_width=min(40, max(len(r.label) for r in rows)))
    t.add_column("state", no_wrap=True)
    for key, _ in QUANTITIES:
        t.add_column(_SHORT[key], justify="right", no_wrap=True)
    t.add_column("final loss", justify="right")
    for r in rows:
        ovs = " ".join(r.overrides)
        cells = [r.label + ("" if r.label == ovs or not ovs else "\n" + ovs),
                 r.state if r.state == "completed" else f"{r.state} ({r.steps_logged}/{r.steps_planned})"]
        for key, _ in QUANTITIES:
            pm = f"{_fmt(key, r.predicted.get(key))} → {_fmt(key, r.measured.get(key))}"
            cells.append(f"{pm}\n×{_ratio(r.ratio(key))}")
        cells.append("-" if r.final_loss is None else f"{r.final_loss:.4f}")
        t.add_row(*(escape(c) for c in cells), style=None if r.state == "completed" else "red")
    con.print(t)
    for r in rows:
        if r.state != "completed":
            con.print(f"[red]{escape(r.label)}[/red]: {r.state}" + (f": {escape(r.error)}" if r.error else ""),
                      highlight=False)
