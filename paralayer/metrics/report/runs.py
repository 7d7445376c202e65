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

from paralayer.inputs import untrusted
from paralayer.inputs.echo import one_line
from paralayer.inputs.untrusted import BadInput, show
from paralayer.metrics.throughput import summarize

#: (key, what) of each quantity set side by side; the CSV has predicted_KEY, measured_KEY, ratio_KEY
QUANTITIES = (("step_time_s", "step time (s)"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
              ("memory_bytes", "memory per device (bytes)"), ("bubble", "bubble fraction"))
SWEEP_FILE = "sweep.json"
ERROR_FILE = "error.txt"


class ReportError(BadInput):
    """Nothing to report on (a folder that does not exist or holds no run), or a run folder whose
    files cannot be trusted (paralayer/inputs/untrusted.py): exit 2, naming the folder or file."""

    def __init__(self, message: str, field: str = "DIR"):
        super().__init__(field, message)


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
    """A run's JSON file (plan.json, sweep.json) as untrusted input: missing is {}; a link out of
    the folder to /proc, a FIFO, a huge, deep or broken file is ReportError naming it."""
    if not os.path.lexists(path):
        return {}
    return untrusted.read_json(path, "DIR")


def _typed(obj: Dict[str, Any], key: str, kinds: tuple, where: str, what: str) -> Any:
    """``obj[key]`` when it is missing, None or of ``kinds`` (a bool is no number); else ReportError."""
    v = obj.get(key)
    if v is None or (isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)):
        return v
    raise ReportError(f"{where}: {key} must be {what}, got {show(repr(v), 60)}")


_NUMBER = (int, float)


def _check_sweep(meta: Dict[str, Any], path: str) -> Dict[str, Any]:
    where = show(path)
    _typed(meta, "index", (int,), where, "an integer")
    _typed(meta, "name", (str,), where, "text")
    for key in ("runs", "overrides"):
        _typed(meta, key, (list,), where, "a list")
    for r in meta.get("runs") or []:
        if not isinstance(r, dict) or not isinstance(r.get("dir"), str):
            raise ReportError(f"{where}: runs must list objects with a 'dir' text, got {show(repr(r), 60)}")
    if not all(isinstance(o, str) for o in meta.get("overrides") or []):
        raise ReportError(f"{where}: overrides must list texts")
    slurm = _typed(meta, "slurm", (dict,), where, "an object") or {}
    _typed(slurm, "job_id", (str, int), f"{where} slurm", "a job id")
    _typed(slurm, "state", (str,), f"{where} slurm", "text")
    logs = _typed(slurm, "stderr", (list,), f"{where} slurm", "a list of log files") or []
    if not all(isinstance(x, str) for x in logs):
        raise ReportError(f"{where}: slurm.stderr must list file names")
    return meta


def _check_plan(plan: Dict[str, Any], path: str) -> Dict[str, Any]:
    where = show(path)
    for key in ("bubble_fraction", "step_time_s", "tokens_per_s", "mfu"):
        _typed(plan, key, _NUMBER, where, "a number")
    _typed(plan, "device", (str,), where, "text")
    mem = _typed(plan, "memory_per_device_bytes", (dict,), where, "an object") or {}
    _typed(mem, "total", _NUMBER, f"{where} memory_per_device_bytes", "a number")
    return plan


#: metrics.jsonl keys the report computes with: numbers (or null)
_RECORD_NUMBERS = ("loss", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "bubble_measured")


def read_records(path: str) -> List[Dict[str, Any]]:
    """metrics.jsonl as untrusted input: the records with an integer ``step`` (a line cut short by
    a crash skipped); a binary, non-UTF-8 or deeply nested line, or a record whose numbers are
    not numbers, is ReportError naming the file, line and key."""
    if not os.path.lexists(path):
        return []
    out = []
    for n, rec in untrusted.jsonl_records(path, "DIR"):
        if not isinstance(rec, dict) or isinstance(rec.get("step"), bool) or not isinstance(rec.get("step"), int):
            continue
        for key in _RECORD_NUMBERS:
            _typed(rec, key, _NUMBER, f"{show(path)} line {n}", "a number")
        out.append(rec)
    return out


def find_runs(paths: Sequence[str]) -> List[str]:
    """The run folders (each holding plan.json) in ``paths``: a run folder itself, a sweep folder
    (its sweep.json lists the runs in sweep order), or any folder whose sub-folders (two levels
    deep at most) are runs. Order: the sweep index when every run has one, else as found (folders
in name order). Raises ReportError when none is found."""
    found: List[str] = []
    for p in paths:
        p = os.path.abspath(p)
        untrusted.check_dir(p, "DIR")
        if is_run(p):
            found.append(p)
            continue
        sweep_file = os.path.join(p, SWEEP_FILE)
        listed = [os.path.join(p, r["dir"]) for r in _check_sweep(_load_json(sweep_file), sweep_file).get("runs") or []]
        for d in listed:
            untrusted.check_dir(d, f"{show(sweep_file)} runs")
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
        raise ReportError(f"{show(', '.join(paths))}: no run folder (one holding plan.json) found")
    index = {d: _check_sweep(_load_json(os.path.join(d, SWEEP_FILE)), os.path.join(d, SWEEP_FILE)).get("index")
             for d in runs}
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
    """resolved.yaml as untrusted input: missing is {}; unreadable or not a mapping, ReportError."""
    if not os.path.lexists(path):
        return {}
    data = untrusted.read_yaml(path, "DIR")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ReportError(f"{show(path)}: must hold a mapping (the resolved recipe), got {type(data).__name__}")
    return data


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
    plan = _check_plan(_load_json(os.path.join(run_dir, "plan.json")), os.path.join(run_dir, "plan.json"))
    cfg = read_yaml(os.path.join(run_dir, "resolved.yaml"))
    meta = _check_sweep(_load_json(os.path.join(run_dir, SWEEP_FILE)), os.path.join(run_dir, SWEEP_FILE))
    records = read_records(os.path.join(run_dir, "metrics.jsonl"))
    s = summarize(records)
    train = cfg.get("train") or {}
    where = f"{show(os.path.join(run_dir, 'resolved.yaml'))} train"
    if not isinstance(train, dict):
        raise ReportError(f"{show(os.path.join(run_dir, 'resolved.yaml'))}: train must be a mapping")
    planned = int(_typed(train, "stop_at_step", (int,), where, "an integer") or
                  _typed(train, "steps", (int,), where, "an integer") or 0)
    pred, source = _predicted(run_dir, plan)
    row = Row(index=int(meta.get("index", index)), name=one_line(meta.get("name") or "", 200), run_dir=run_dir,
              overrides=[one_line(o, 200) for o in meta.get("overrides") or []], state="", steps_logged=len(records),
              steps_planned=planned, predicted=pred, final_loss=s["last_loss"], predicted_by=source,
              device=str(plan.get("device") or ""))
    row.measured = {"step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
                    "memory_bytes": s["peak_memory_bytes"], "bubble": s["bubble_measured"]}
    last_step = max((r["step"] for r in records), default=0)
    row.state, row.error = run_state(run_dir, meta, last_step, planned)
    row.error = one_line(row.error, 500)
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
    """The tail of a log as untrusted input: missing is ""; a link to /proc/self/environ (secrets),
    a FIFO or a device is ReportError naming it, never read."""
    if not os.path.lexists(path):
        return ""
    return untrusted.read_tail(path, "DIR", tail_bytes)


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
