"""Per-step metrics and where they go: the device peak (peaks), throughput and MFU (throughput),
metrics.jsonl (jsonl), the console (console), W&B (wandb_log), the logger that feeds them all
(logger), and the sweep report (report).

The public names are reachable from the package (``paralayer.metrics.step_record``); each is
imported on first use, so reading a run (the report) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DEVICE_PEAK_TFLOPS": "peaks", "lookup_device_peak_tflops": "peaks", "measure_cpu_peak_tflops": "peaks",
    "resolve_peak_tflops": "peaks",
    "peak_memory_bytes": "throughput", "step_record": "throughput", "summarize": "throughput",
    "read_records": "jsonl", "last_logged_step": "jsonl", "truncate_after": "jsonl",
    "strict_json_record": "jsonl",
    "MetricsLogger": "logger",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"paralayer.metrics.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'paralayer.metrics' has no attribute {name!r}")


__all__ = sorted(_WHERE)
