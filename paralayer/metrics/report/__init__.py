"""The sweep report: for every run, what the planner predicted beside what the run measured.

Why: a sweep over layouts exists to answer "which layout wins, and can the planner be trusted to
say so". One row per run holds the overrides that set it apart; predicted and measured step time,
tokens/s, MFU, memory per device and bubble, with the ratio measured/predicted of each; the final
loss; and the run's state (a failed or unfinished run is a row too, with the last line of its
error). Written as report.csv, report.md and report.png (measured against predicted step time,
one labelled point per layout with the y = x line; beside it memory), and printed as a table.

Where the numbers come from:
* predicted: the run's plan.json (``step_time_s``, ``tokens_per_s``, ``mfu`` when the plan has
  them; ``bubble_fraction``; ``memory_per_device_bytes.total``, the most loaded device). A plan
  without a time prediction gets the planner's cost model run on the run's resolved.yaml
  (``paralayer.resolve.planner.predict``, torch-free) and says so in ``predicted_by``.
* measured: medians over metrics.jsonl (the first step left out when there are ≥ 3; see
  :func:`paralayer.metrics.throughput.summarize`); memory is rank 0's peak (on CPU the process's
  peak RSS, Python and torch included, so it sits well above the tensor bytes predicted).

Torch-free: reading runs, writing the files and the picture need only matplotlib and rich.

The parts: ``runs`` (finding and reading the runs), ``table`` (CSV, markdown, the console table),
``plot`` (report.png); this module writes them and logs them to W&B.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from paralayer.inputs.untrusted import ArgParser, check_out, guard
from paralayer.metrics.report.runs import (  # noqa: F401 - the report's API
    ERROR_FILE,
    QUANTITIES,
    SWEEP_FILE,
    ReportError,
    Row,
    differing_overrides,
    find_runs,
    is_run,
    last_error_line,
    read_run,
    read_yaml,
    run_state,
)
from paralayer.metrics.report.table import (  # noqa: F401 - the report's API
    columns,
    markdown,
    print_table,
    row_values,
    table_cells,
    table_header,
    write_csv,
)


# ------------------------------------------------------------------ the report
@dataclass
class Report:
    """The rows and where the files went."""

    rows: List[Row]
    out_dir: str
    files: Dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> List[Row]:
        return [r for r in self.rows if r.state != "completed"]


def build(paths: Sequence[str]) -> List[Row]:
    """Rows for the runs in ``paths`` (see :func:`find_runs`). Runs without sweep metadata get
    as overrides the recipe keys that differ between them."""
    runs = find_runs(paths)
    rows = [read_run(d, i) for i, d in enumerate(runs)]
    if any(not r.overrides for r in rows) and len(rows) > 1:
        diffs = differing_overrides([read_yaml(os.path.join(r.run_dir, "resolved.yaml")) for r in rows])
        for r, d in zip(rows, diffs):
            r.overrides = r.overrides or d
    return rows


# ------------------------------------------------------------------ entry points
def write(paths: Sequence[str], out_dir: Optional[str] = None, show: bool = True, file: Any = None) -> Report:
    """Build the report for ``paths`` and write report.csv, report.md and report.png into
    ``out_dir`` (default: the folder given, or the runs' common parent); print it when ``show``."""
    from paralayer.metrics.report.plot import plot

    if out_dir is not None:
        check_out(out_dir, "--out")
    rows = build(paths)
    if out_dir is None:
        out_dir = os.path.abspath(paths[0]) if len(paths) == 1 and not is_run(paths[0]) else \
            os.path.commonpath([os.path.dirname(r.run_dir) for r in rows])
    os.makedirs(out_dir, exist_ok=True)
    rep = Report(rows, out_dir)
    rep.files = {k: os.path.join(out_dir, f"report.{k}") for k in ("csv", "md", "png")}
    tmp = {k: os.path.join(out_dir, f".report.tmp-{os.getpid()}.{k}") for k in rep.files}
    try:  # each file under a temporary name, renamed into place when whole
        write_csv(rows, tmp["csv"])
        with open(tmp["md"], "w", encoding="utf-8") as f:
            f.write(markdown(rows))
        plot(rows, tmp["png"])
        for k in rep.files:
            os.replace(tmp[k], rep.files[k])
    finally:
        for t in tmp.values():
            with contextlib.suppress(OSError):
                os.unlink(t)
    if show:
        print_table(rows, file)
        print(f"report: {rep.files['md']}, {rep.files['csv']}, {rep.files['png']}", file=file or sys.stdout)
    return rep


def log_to_wandb(rep: Report, mode: str, project: str, group: Optional[str], folder: Optional[str] = None) -> Any:
    """Log the report table and picture to a summary run of the sweep's W&B group (job type
    ``sweep-report``), written under ``folder`` (default: the report's folder). Returns the run's
    offline file (or None when disabled)."""
    from paralayer.metrics import wandb_log

    folder = folder or rep.out_dir
    run = wandb_log.start_run(folder, mode, project, group, {"runs": len(rep.rows), "failed": len(rep.failed)},
                              name=f"{group or 'sweep'}-report", job_type="sweep-report")
    if run is None:
        return None
    import wandb

    cols = columns()
    data = [[row_values(r)[c] for c in cols] for r in rep.rows]
    run.log({"report": wandb.Table(columns=cols, data=data), "report_plot": wandb.Image(rep.files["png"])})
    sync_file = getattr(getattr(run, "settings", None), "sync_file", None)
    wandb_log.finish_run(run, {"runs": len(rep.rows), "failed": len(rep.failed)})
    return sync_file


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m paralayer.report DIR [DIR ...] [--out DIR] [--wandb MODE]``: exit 0 when every
    run completed, 1 when one did not, 2 for bad input (nothing to report on, or a run folder whose
    files cannot be trusted: paralayer/inputs/untrusted.py), one line naming the folder or file."""
    return guard("report", lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    ap = ArgParser(prog="python -m paralayer.report",
                   description="predicted against measured, one row per run of a sweep")
    ap.add_argument("dirs", nargs="+", help="a sweep folder, a SLURM sweep's folder, or run folders")
    ap.add_argument("--out", default=None, help="where report.{csv,md,png} go (default: the folder given, "
                                                "or the runs' common parent)")
    ap.add_argument("--wandb", default="disabled", choices=("disabled", "offline", "online"),
                    help="also log the report to a summary run of the runs' W&B group")
    a = ap.parse_args(argv)
    rep = write(a.dirs, a.out)
    if a.wandb != "disabled":
        cfg = read_yaml(os.path.join(rep.rows[0].run_dir, "resolved.yaml"))
        wb = (cfg.get("logging") or {}).get("wandb") or {}
        log_to_wandb(rep, a.wandb, wb.get("project") or "paralayer", wb.get("group"))
    return 1 if rep.failed else 0
