"""The run-health pieces one training run holds, behind a few calls the step loop makes.

:class:`RunHealth` owns the profiler (paralayer/metrics/profile.py), the per-rank timing and
straggler watch (metrics/rank_timing.py), the hang watchdog (runtime/health/watchdog.py) and the goodput
account (metrics/goodput.py); the loss-spike and rollback logic is runtime/health/stability.py.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator, Optional

import torch.distributed as dist

from paralayer.metrics import rank_timing, waited_for
from paralayer.metrics.goodput import Goodput
from paralayer.metrics.profile import StepProfiler
from paralayer.runtime.health.watchdog import Watchdog


def hang_timeout(train_cfg: Any) -> float:
    """``train.hang_timeout_s``; unset: three quarters of the process-group timeout; 0: off."""
    t = train_cfg.hang_timeout_s
    return 0.75 * float(train_cfg.collective_timeout_s) if t is None else float(t)


class RunHealth:
    def __init__(self, run: Any, run_dir: Optional[str], start_step: int, stop: int,
                 marks: Optional[dict] = None):
        cfg, rank = run.cfg, dist.get_rank()
        self.run, self.stop_step, self.rank = run, stop, rank
        self.log_every = max(1, int(cfg.train.log_every))
        self.profiler = StepProfiler(cfg.logging.profile, rank, run_dir, run.device, run.comm)
        printer = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
        self.straggler = rank_timing.StragglerWatch(cfg.logging.straggler_pct, rank_timing.hostnames(),
                                                    printer=printer)
        # the groups whose collectives name the rank that arrived late (metrics/waited_for.py)
        waited_for.match_layout(run.comm, run.meshes, self.straggler.hosts)
        timeout = hang_timeout(cfg.train)
        # under the local launcher (torch elastic) the launcher prints the diagnosis; elsewhere rank 0 does
        announce = "TORCHELASTIC_ERROR_FILE" not in os.environ
        self.watchdog = Watchdog(timeout, run_dir, rank, dist.get_world_size(), run.comm, announce=announce,
                                 cuda=run.device.type == "cuda") if (run_dir and timeout > 0) else None
        self.goodput = Goodput(run_dir, rank == 0, start_step, marks=marks)
        self.goodput.started()
        self._t_step = time.perf_counter()
        if self.watchdog is not None:
            self.watchdog.beat()  # armed from the first step on: a rank frozen in step 1 is named too

    def before_step(self, step: int) -> None:
        self.profiler.before(step)
        self._t_step = time.perf_counter()

    def beat(self, step: Optional[int] = None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def after_step(self, step: int, rec: Optional[dict]) -> dict:
        """The step finished (rec None: its update was skipped): the rank-timing fields to log."""
        self.beat(step)
        self.profiler.after(step)
        # a skipped update still took its step's time (goodput's ``skipped``)
        seconds = rec["step_time_s"] if rec is not None else time.perf_counter() - self._t_step
        self.goodput.step(step, seconds, counted=rec is not None)
        if rec is None or not (step % self.log_every == 0 or step == self.stop_step):
            return {}
        run = self.run
        idle = 0.0
        if run.runner is not None and run.runner.window is not None and run.runner.busy_by_rank:
            idle = max(0.0, run.runner.window - run.runner.busy_by_rank[run.runner.pp_rank])
        parts = rank_timing.split(seconds, run.comm.data_s, run.comm.blocked_s, idle)
        return rank_timing.maybe_fields(self.straggler, parts, run.device, step, run.comm)

    def saved(self, step: int) -> None:
        self.beat()
        self.goodput.saved(step)

    def rolled_back(self, from_step: int, seconds: float) -> None:
        self.goodput.rolled_back(from_step, seconds)

    def close(self, finished: bool) -> Optional[dict]:
        """Stop the watchdog and the profiler; write goodput.json; the totals (rank 0)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.profiler.close()
        self.goodput.maybe_write(final=finished)
        return self.goodput.totals(finished) if self.rank == 0 else None

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[None]:
        """``with health.timed("eval"):`` (the evaluation pass), or "checkpoint", "rollback": the
        time goes to that goodput bucket. The watchdog waits during an evaluation; a save is
        watched like a step (its clock restarts as the save begins): a rank frozen inside a save
        is named within ``train.hang_timeout_s``, not left to checkpoint.timeout_s."""
        if self.watchdog is not None:
            if bucket == "checkpoint":
                self.run.comm.at(self.run.comm.step, "checkpoint")
                self.watchdog.beat()
            else:
                self.watchdog.pause()
        try:
            with self.goodput.timed(bucket):
                yield
        finally:
            self.beat()
