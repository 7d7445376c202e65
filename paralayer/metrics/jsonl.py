"""metrics.jsonl: one strict-JSON object per logged step, and the helpers a resumed run and the
sweep report read it with.

The file is strict JSON (a non-finite float is written as ``null`` and its key listed under
``nonfinite``). Resume: :func:`last_logged_step` and :func:`truncate_after` let a resumed run drop
records past its checkpoint so no step is ever logged twice. Torch-free, so the report can read
runs without importing torch.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Dict, List, Optional


def to_py(v: Any) -> Any:
    """A tensor or numpy scalar as a plain Python number (or list); anything else unchanged."""
    if hasattr(v, "numel") and hasattr(v, "tolist") and callable(v.numel):  # a torch tensor
        return v.item() if v.numel() == 1 else v.tolist()
    if hasattr(v, "item") and callable(v.item) and type(v).__module__ == "numpy":
        return v.item()
    return v


def read_records(path: str) -> List[Dict[str, Any]]:
    """The complete records of a metrics.jsonl in file order (a line cut short by a crash is
    skipped); a missing file gives []."""
    out = []
    if not os.path.isfile(path):
        return out
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
    return out


def last_logged_step(path: str) -> Optional[int]:
    """The largest ``step`` among the complete records of a metrics.jsonl, or None (no file or no
    complete record)."""
    recs = read_records(path)
    return max(r["step"] for r in recs) if recs else None


def _kept(rec: Dict[str, Any], step: int) -> bool:
    """A step's record up to ``step``; a rollback event (paralayer/runtime/health/stability.py) when the
    checkpoint resumed from was taken after it, i.e. its ``from_step`` is before ``step``."""
    if rec.get("event") == "rollback" and isinstance(rec.get("from_step"), int):
        return rec["from_step"] < step
    return rec["step"] <= step


def truncate_after(path: str, step: int, keep_events: bool = False) -> int:
    """Keep only the complete records with ``step <= step`` (dropping lines cut short by a crash),
    rewriting the file atomically; returns how many records were kept. A missing file: 0."""
    if not os.path.isfile(path):
        return 0
    keep = [r for r in read_records(path) if _kept(r, step) or (keep_events and "event" in r)]
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".metrics-", dir=d)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return len(keep)


def strict_json_record(record: Dict[str, Any]) -> Dict[str, Any]:
    """The record with plain values and every non-finite float as None (listed under ``nonfinite``)."""
    rec = {k: to_py(v) for k, v in record.items()}
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    for k in bad:
        rec[k] = None
    if bad:
        rec["nonfinite"] = bad
    return rec


class JsonlWriter:
    """Appends records to ``run_dir/metrics.jsonl``, one flushed line each. Opened for append: a
    resumed run continues the file, starting on a fresh line when a crash left the last one cut
    short. ``keep_through``: the records after that step are dropped (:func:`truncate_after`) when
    the first record is written, not before: a run that fails before its first step leaves the
    file it found byte for byte."""

    def __init__(self, run_dir: str, keep_through: Optional[int] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._keep_through = keep_through
        self._file = None

    def _open(self):
        if self._keep_through is not None and os.path.exists(self.path):
            truncate_after(self.path, self._keep_through)
        f = open(self.path, "a+", encoding="utf-8")
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(f.tell() - 1)
            last = f.read(1)
            f.seek(0, os.SEEK_END)
            if last != "\n":
                f.write("\n")
                f.flush()
        return f

    def write(self, record: Dict[str, Any]) -> None:
        if self._file is None:
            self._file = self._open()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
