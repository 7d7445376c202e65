"""Profiler traces on request: ``logging.profile: {start, steps, ranks, memory}``.

On the chosen ranks, steps ``start`` … ``start + steps - 1`` run under ``torch.profiler``; the
trace is written as Chrome/Perfetto JSON (``run.dir/profile/rank-R.json``, also what TensorBoard's
profiler plugin reads). Ranges: ``forward``, ``backward``, ``optimizer`` (the step loop),
``pipeline.<F|B|W>.mb<i>.chunk<c>`` (each pipeline action, besides torch's own), and
``comm.<axis>.<op>`` (our collectives; DTensor's appear as c10d ops). ``memory: true``: on CUDA
``torch.cuda.memory._record_memory_history`` and a snapshot ``rank-R-memory.pickle`` (for
pytorch.org/memory_viz); on CPU the profiler's own memory events (``profile_memory``). With
``start`` 0 (the default) nothing is created and nothing runs.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch


class StepProfiler:
    def __init__(self, cfg: Any, rank: int, run_dir: Optional[str], device: torch.device, trace: Any):
        ranks = cfg.ranks
        self.on = bool(run_dir) and cfg.start > 0 and (ranks is None or rank in ranks)
        self.first, self.last = cfg.start, cfg.start + cfg.steps - 1
        self.memory = bool(cfg.memory)
        self.cuda = device.type == "cuda"
        self.dir = os.path.join(run_dir, "profile") if run_dir else None
        self.rank, self.trace = rank, trace
        self.prof = None
        self.paths: list[str] = []

    def before(self, step: int) -> None:
        if not self.on or self.prof is not None or not self.first <= step <= self.last:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.memory and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = profile(activities=acts, profile_memory=self.memory and not self.cuda, record_shapes=False)
        self.prof.__enter__()
        self.trace.profiling = True

    def after(self, step: int) -> None:
        if self.prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write (also when the run ends before the last profiled step)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        self.trace.profiling = False
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank-{self.rank}.json")
        prof.export_chrome_trace(path)
        self.paths.append(path)
        if self.memory and self.cuda:
            snap = os.path.join(self.dir, f"rank-{self.rank}-memory.pickle")
            torch.cuda.memory._dump_snapshot(snap)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.paths.append(snap)
