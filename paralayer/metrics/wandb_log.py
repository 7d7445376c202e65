"""The W&B sink: one run per training run, and one summary run per sweep that holds the report.

Everything stays inside the run (or sweep) folder: WANDB_DIR and wandb's cache, config and data
folders are pointed there. Mode offline (the default; ``DIR/wandb/offline-run-*/run-*.wandb``),
online, or disabled (then wandb is never imported).
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional


def _point_wandb_at(folder: str) -> None:
    folder = os.path.abspath(folder)
    os.environ["WANDB_DIR"] = folder
    os.environ["WANDB_CACHE_DIR"] = os.path.join(folder, "wandb", ".cache")
    os.environ["WANDB_CONFIG_DIR"] = os.path.join(folder, "wandb", ".config")
    os.environ["WANDB_DATA_DIR"] = os.path.join(folder, "wandb", ".data")
    os.environ.setdefault("WANDB_SILENT", "true")
    for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.makedirs(os.environ[k], exist_ok=True)


def start_run(folder: str, mode: str, project: str, group: Optional[str], config: Dict[str, Any],
              name: Optional[str] = None, job_type: Optional[str] = None) -> Any:
    """A wandb run writing under ``folder`` (its files, cache and config), or None when disabled."""
    if not mode or mode == "disabled":
        return None
    _point_wandb_at(folder)
    import wandb

    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
    return wandb.init(mode=mode, project=project, group=group, dir=os.path.abspath(folder), name=name,
                      job_type=job_type, config=config, settings=settings)


def log_step(run: Any, step: int, rec: Dict[str, Any]) -> None:
    """The record's numbers at this step (None and non-numbers left out; a map of numbers, such as
    ``source_sequences`` {path: n}, as ``source_sequences/path``)."""
    flat: Dict[str, Any] = {}
    for k, v in rec.items():
        flat.update({f"{k}/{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
    run.log({k: v for k, v in flat.items()
             if k != "step" and isinstance(v, (int, float)) and v is not None}, step=int(step))


def finish_run(run: Any, summary: Optional[Dict[str, Any]] = None) -> None:
    """Write the summary, finish, and wait until the offline run file is complete."""
    sync_file = getattr(getattr(run, "settings", None), "sync_file", None)
    for k, v in (summary or {}).items():
        if v is not None:
            run.summary[k] = v
    run.finish()
    wait_for_run_file(sync_file)


def wait_for_run_file(path: Optional[str], timeout_s: float = 10.0) -> None:
    """wandb 0.31's core process may still be writing the offline run file when ``finish()``
    returns (seen: only the 7-byte header right after it). Wait until it has records and its size
    holds still, so that a check right after the run ends finds a complete file."""
    if not path:
        return
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if size > 7 and size == last:
            return
        last = size
        time.sleep(0.05)
