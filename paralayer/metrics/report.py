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
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from paralayer.metrics.jsonl import read_records
from paralayer.metrics.throughput import summarize

#: (key, what) of each quantity set side by side; the CSV has predicted_KEY, measured_KEY, ratio_KEY
QUANTITIES = (("step_time_s", "step time (s)"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
              ("memory_bytes", "memory per device (bytes)"), ("bubble", "bubble fraction"))
SWEEP_FILE = "sweep.json"
ERROR_FILE = "error.txt"


class ReportError(ValueError):
    """Nothing to report on: a folder that does not exist or holds no run."""


@dataclass
class Row:
    """One run of the report."""

    index: int
    name: str
    run_dir: str
    overrides: List[str]
    state: str
    error: str = ""
    steps_logged: int = 0
    steps_planned: int = 0
    predicted: Dict[str, Optional[float]] = field(default_factory=dict)
    measured: Dict[str, Optional[float]] = field(default_factory=dict)
    final_loss: Optional[float] = None
    predicted_by: str = ""
    device: str = ""

    def ratio(self, key: str) -> Optional[float]:
        """measured / predicted, or None when either is missing or the prediction is 0."""
        p, m = self.predicted.get(key), self.measured.get(key)
        if p is None or m is None or p == 0:
            return None
        return m / p

    @property
    def label(self) -> str:
        return self.name or " ".join(self.overrides) or os.path.basename(self.run_dir)


# ------------------------------------------------------------------ finding the runs
def _is_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "plan.json"))


def _load_json(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def find_runs(paths: Sequence[str]) -> List[str]:
    """The run folders (each holding plan.json) in ``paths``: a run folder itself, a sweep folder
    (its sweep.json lists the runs in sweep order), or any folder whose sub-folders (two levels
    deep at most) are runs. Order: the sweep index when every run has one, else as found (folders
in name order). Raises ReportError when none is found."""
    found: List[str] = []
    for p in paths:
        p = os.path.abspath(p)
        if not os.path.isdir(p):
            raise ReportError(f"{p}: no such folder")
        if _is_run(p):
            found.append(p)
            continue
        listed = [os.path.join(p, r["dir"]) for r in _load_json(os.path.join(p, SWEEP_FILE)).get("runs", [])]
        if listed:
            found.extend(os.path.abspath(d) for d in listed)
            continue
        for root, dirs, _ in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "wandb", "slurm-logs")))
            if root != p and _is_run(root):
                found.append(root)
                dirs[:] = []
            elif root.count(os.sep) - p.count(os.sep) >= 2:
                dirs[:] = []
    runs = list(dict.fromkeys(found))
    if not runs:
        raise ReportError(f"{', '.join(paths)}: no run folder (one holding plan.json) found")
    index = {d: _load_json(os.path.join(d, SWEEP_FILE)).get("index") for d in runs}
    if all(isinstance(i, int) for i in index.values()):
        return sorted(runs, key=lambda d: (index[d], d))
    return runs


# ------------------------------------------------------------------ reading one run
def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: keys that tell runs apart without being what was compared
_NOT_OVERRIDES = ("run.", "logging.wandb.group", "checkpoint.dir", "sweep.")


def differing_overrides(configs: Sequence[Dict[str, Any]]) -> List[List[str]]:
    """``key=value`` of every recipe key whose value differs between the configs (flattened
    resolved.yaml dicts, in the schema's order), per config; run folders, W&B groups and
    checkpoint paths left out."""
    flat = [_flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flat for k in f))  # the recipe's order: tp before pp
    diff = [k for k in keys if not k.startswith(_NOT_OVERRIDES)
            and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1]
    return [[f"{k}={_show_value(f.get(k))}" for k in diff] for f in flat]


def _show_value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if v is not None else "null"
    if isinstance(v, list):
        return "[" + ",".join(_show_value(x) for x in v) + "]"
    return str(v)


def _read_yaml(path: str) -> Dict[str, Any]:
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        return data if isinstance(data, dict) else {}
    except Exception:  # noqa: BLE001 - unreadable or broken YAML: reported as a missing resolved.yaml
        return {}


def _predicted(run_dir: str, plan: Dict[str, Any]) -> tuple:
    """(predictions, where they came from)."""
    mem = (plan.get("memory_per_device_bytes") or {}).get("total")
    pred = {"memory_bytes": mem, "bubble": plan.get("bubble_fraction"),
            "step_time_s": plan.get("step_time_s"), "tokens_per_s": plan.get("tokens_per_s"),
            "mfu": plan.get("mfu")}
    if pred["step_time_s"] is not None:
        return pred, "plan.json"
    try:
        from paralayer import config as config_mod
        from paralayer.resolve.planner import predict

        p = predict(config_mod.from_yaml_file(os.path.join(run_dir, "resolved.yaml")))
    except Exception as exc:  # noqa: BLE001 - a run whose layout the cost model cannot time
        return pred, f"plan.json (no time prediction: {type(exc).__name__}: {exc})"
    pred.update(step_time_s=p["step_time_s"], tokens_per_s=p["tokens_per_s"], mfu=p["mfu"])
    return pred, "plan.json + cost model on resolved.yaml"


def read_run(run_dir: str, index: int = 0) -> Row:
    """One run folder as a report row (whatever state it is in)."""
    plan = _load_json(os.path.join(run_dir, "plan.json"))
    cfg = _read_yaml(os.path.join(run_dir, "resolved.yaml"))
    meta = _load_json(os.path.join(run_dir, SWEEP_FILE))
    records = read_records(os.path.join(run_dir, "metrics.jsonl"))
    s = summarize(records)
    train = cfg.get("train") or {}
    planned = int(train.get("stop_at_step") or train.get("steps") or 0)
    pred, source = _predicted(run_dir, plan)
    row = Row(index=int(meta.get("index", index)), name=str(meta.get("name", "")), run_dir=run_dir,
              overrides=list(meta.get("overrides", [])), state="", steps_logged=len(records),
              steps_planned=planned, predicted=pred, final_loss=s["last_loss"], predicted_by=source,
              device=str(plan.get("device") or ""))
    row.measured = {"step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
                    "memory_bytes": s["peak_memory_bytes"], "bubble": s["bubble_measured"]}
    last_step = max((r["step"] for r in records), default=0)
    row.state, row.error = run_state(run_dir, meta, last_step, planned)
    return row


# ------------------------------------------------------------------ state and error
def _is_error_line(line: str) -> bool:
    """``SomeError: ...`` (a traceback's last line, torch's ``[rank0]: `` prefix allowed) or
    ``error: ...`` (the one line a rank prints for bad input)."""
    bare = re.sub(r"^\[[^\]]*\]:?\s*", "", line)
    head = bare.split(":", 1)[0].split(".")[-1]
    if bare.startswith("error: "):
        return True
    return ":" in bare and head.isidentifier() and head.endswith(("Error", "Exception", "Interrupt", "Exit",
                                                                  "Loss", "Failure"))


def last_error_line(text: str) -> str:
    """The line that says what went wrong: the last error line of a traceback or log (see
    :func:`_is_error_line`), else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if _is_error_line(ln)), lines[-1] if lines else "")


def _read_text(path: str, tail_bytes: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _slurm_state(job_id: str) -> Optional[str]:
    """The job's state (array element ids like 12_0 included): slurmctld's (squeue) while it is
    queued or running, where sacct still lists a pending array as one line; sacct's after. None
    when neither knows it."""
    base = job_id.split("_")[0]
    for cmd in (["squeue", "-h", "-r", "-o", "%i|%T", "-j", base],
                ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", base]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 2 and parts[0] == job_id and parts[1].split():
                return parts[1].split()[0].upper()
    return None


#: SLURM states of a job that has not ended (its logs are no verdict yet)
_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
         "RESIZING", "SUSPENDED"}


def run_state(run_dir: str, meta: Dict[str, Any], last_step: int, planned: int) -> tuple:
    """(state, last line of its error). completed: every planned step logged and no error;
    failed: the dispatcher left error.txt, or SLURM says the job failed (its stderr logs give the
    line); incomplete: some steps logged, not all; not started: none logged. On SLURM the job's
    state (squeue, sacct) names the unfinished ones (pending, running, timeout, cancelled, ...)."""
    err = last_error_line(_read_text(os.path.join(run_dir, ERROR_FILE)))
    slurm = meta.get("slurm") or {}
    sstate = slurm.get("state")
    if slurm.get("job_id") and (not sstate or sstate in _LIVE | {"UNKNOWN"}):
        sstate = _slurm_state(str(slurm["job_id"])) or sstate
    done = planned > 0 and last_step >= planned
    if not err and sstate and sstate not in _LIVE and not (sstate == "COMPLETED" and done):
        # ended short of its steps: its logs say why (a job SLURM calls COMPLETED included: a
        # rank that returned an exit status instead of raising)
        logs = [last_error_line(_read_text(p)) for p in slurm.get("stderr", [])]
        err = next((ln for ln in logs if _is_error_line(ln)),
                   "" if sstate == "COMPLETED" else next((ln for ln in logs if ln), ""))
    if err:
        return ("failed" if sstate in (None, "COMPLETED", "FAILED") else sstate.lower()), err
    if sstate and sstate not in ("COMPLETED",):
        return sstate.lower(), ""
    if done:
        return "completed", ""
    return ("incomplete" if last_step else "not started"), ""


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
        diffs = differing_overrides([_read_yaml(os.path.join(r.run_dir, "resolved.yaml")) for r in rows])
        for r, d in zip(rows, diffs):
            r.overrides = r.overrides or d
    return rows


def columns() -> List[str]:
    """The CSV header (stable: scripts read it)."""
    cols = ["index", "name", "overrides", "state", "steps_logged", "steps_planned"]
    for key, _ in QUANTITIES:
        cols += [f"predicted_{key}", f"measured_{key}", f"ratio_{key}"]
    return cols + ["final_loss", "predicted_by", "error", "run_dir"]


def _csv_row(r: Row) -> Dict[str, Any]:
    return {k: ("" if v is None else v) for k, v in _values(r).items()}


def _values(r: Row) -> Dict[str, Any]:
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
                f"`{_md_escape(r.error) or 'no error recorded'}` — {r.run_dir}" for r in bad]
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


# ------------------------------------------------------------------ entry points
def write(paths: Sequence[str], out_dir: Optional[str] = None, show: bool = True, file: Any = None) -> Report:
    """Build the report for ``paths`` and write report.csv, report.md and report.png into
    ``out_dir`` (default: the folder given, or the runs' common parent); print it when ``show``."""
    from paralayer.metrics.report_plot import plot

    rows = build(paths)
    if out_dir is None:
        out_dir = os.path.abspath(paths[0]) if len(paths) == 1 and not _is_run(paths[0]) else \
            os.path.commonpath([os.path.dirname(r.run_dir) for r in rows])
    os.makedirs(out_dir, exist_ok=True)
    rep = Report(rows, out_dir)
    rep.files = {k: os.path.join(out_dir, f"report.{k}") for k in ("csv", "md", "png")}
    write_csv(rows, rep.files["csv"])
    with open(rep.files["md"], "w", encoding="utf-8") as f:
        f.write(markdown(rows))
    plot(rows, rep.files["png"])
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
    data = [[_values(r)[c] for c in cols] for r in rep.rows]
    run.log({"report": wandb.Table(columns=cols, data=data), "report_plot": wandb.Image(rep.files["png"])})
    sync_file = getattr(getattr(run, "settings", None), "sync_file", None)
    wandb_log.finish_run(run, {"runs": len(rep.rows), "failed": len(rep.failed)})
    return sync_file


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m paralayer.report DIR [DIR ...] [--out DIR] [--wandb MODE]``: exit 0 when every
    run completed, 1 when one did not, 2 when there is nothing to report on."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m paralayer.report",
                                 description="predicted against measured, one row per run of a sweep")
    ap.add_argument("dirs", nargs="+", help="a sweep folder, a SLURM sweep's folder, or run folders")
    ap.add_argument("--out", default=None, help="where report.{csv,md,png} go (default: the folder given, "
                                                "or the runs' common parent)")
    ap.add_argument("--wandb", default="disabled", choices=("disabled", "offline", "online"),
                    help="also log the report to a summary run of the runs' W&B group")
    a = ap.parse_args(argv)
    try:
        rep = write(a.dirs, a.out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.wandb != "disabled":
        cfg = _read_yaml(os.path.join(rep.rows[0].run_dir, "resolved.yaml"))
        wb = (cfg.get("logging") or {}).get("wandb") or {}
        log_to_wandb(rep, a.wandb, wb.get("project") or "paralayer", wb.get("group"))
    return 1 if rep.failed else 0
