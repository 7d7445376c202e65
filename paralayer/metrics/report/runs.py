"""The sweep report's runs: finding them (a sweep folder, a SLURM sweep's folder, run folders),
reading one (plan.json, resolved.yaml, metrics.jsonl, sweep metadata) into a :class:`Row` of
predicted beside measured, and its state (completed, failed, unfinished; the last error line).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
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
def is_run(path: str) -> bool:
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
        if is_run(p):
            found.append(p)
            continue
        listed = [os.path.join(p, r["dir"]) for r in _load_json(os.path.join(p, SWEEP_FILE)).get("runs", [])]
        if listed:
            found.extend(os.path.abspath(d) for d in listed)
            continue
        for root, dirs, _ in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "wandb", "slurm-logs")))
            if root != p and is_run(root):
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


def read_yaml(path: str) -> Dict[str, Any]:
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
    cfg = read_yaml(os.path.join(run_dir, "resolved.yaml"))
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
