"""MetricsLogger: each logged step goes to metrics.jsonl, the console and W&B; at the end, the
summary table and the W&B summary."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from paralayer.metrics import wandb_log
from paralayer.metrics.console import ConsoleProgress
from paralayer.metrics.jsonl import JsonlWriter, strict_json_record, truncate_after
from paralayer.metrics.throughput import summarize


class MetricsLogger:
    """Console (rich progress bar + closing summary), ``run_dir/metrics.jsonl`` and W&B.

    Only the logging rank (``is_logging_rank``) does anything; on the others every method is a no-op.
    metrics.jsonl is opened for append (a resumed run continues it; call
    :func:`paralayer.metrics.jsonl.truncate_after` first to drop steps past the checkpoint) and
    flushed after each line. W&B: see :mod:`paralayer.metrics.wandb_log`; its config is
    ``{"recipe": cfg_dict, "plan": plan_dict}``, its group the sweep's (``wandb_group``).
    ``log_every`` (``train.log_every``): metrics.jsonl gets every step; the console and W&B every
    N-th step and the last one (a long run's W&B history and SLURM log stay small).
    """

    def __init__(self, run_dir: str, cfg_dict: Dict[str, Any], plan_dict: Dict[str, Any],
                 is_logging_rank: bool, wandb_mode: str = "offline",
                 wandb_project: str = "paralayer", wandb_group: Optional[str] = None,
                 total_steps: int = 0, progress: bool = True, run_name: Optional[str] = None,
                 peak_source: Optional[str] = None, console: Any = None, log_every: int = 1,
                 keep_through: Optional[int] = None):
        self.enabled = bool(is_logging_rank)
        self.log_every = max(1, int(log_every))
        self.run_dir = run_dir
        self.total_steps = int(total_steps or 0)
        self.records: List[Dict[str, Any]] = []
        self.peak_source = peak_source
        self._closed = False
        self._wandb_run = None
        if not self.enabled:
            return
        self._jsonl = JsonlWriter(run_dir, keep_through)  # cut back at the first record, not before
        self.path = self._jsonl.path
        self._console = ConsoleProgress(self.total_steps, progress, console, every=self.log_every)
        self.console = self._console.console
        self._wandb_run = wandb_log.start_run(run_dir, wandb_mode, wandb_project, wandb_group,
                                              {"recipe": cfg_dict, "plan": plan_dict}, name=run_name)

    def log(self, step: int, record: Dict[str, Any]) -> None:
        """Write one record (``step`` is set into it) to metrics.jsonl; to the console and W&B
        when the step is a multiple of ``log_every`` or the last one."""
        if not self.enabled or self._closed:
            return
        rec = strict_json_record({**record, "step": int(step)})
        rec = {"step": rec.pop("step"), **rec}
        self._jsonl.write(rec)
        self.records.append(rec)
        if step % self.log_every and step != self.total_steps and "val_loss" not in rec:
            return
        if self._wandb_run is not None:
            wandb_log.log_step(self._wandb_run, step, rec)
        self._console.step(step, rec)

    def rewind(self, step: int, event: Dict[str, Any]) -> None:
        """A rollback (paralayer/runtime/health/stability.py): drop the records after ``step`` (they will be
        run again), then write the ``event`` line; W&B keeps it in the summary (its history cannot
        go back in steps)."""
        if not self.enabled or self._closed:
            return
        self._jsonl.close()
        truncate_after(self.path, step, keep_events=True)  # earlier rollbacks still stand
        self._jsonl = JsonlWriter(self.run_dir)
        self.records = [r for r in self.records if r["step"] <= step]
        self._jsonl.write(strict_json_record(event))
        self.rollbacks = getattr(self, "rollbacks", 0) + 1
        if self._wandb_run is not None:
            self._wandb_run.summary["rollbacks"] = self.rollbacks
            self._wandb_run.summary[f"rollback_{self.rollbacks}"] = {k: v for k, v in event.items()
                                                                    if k != "skipped_batches"}

    def summary(self) -> Dict[str, Any]:
        """Medians over the logged steps (see :func:`paralayer.metrics.throughput.summarize`)."""
        return summarize(self.records)

    def close(self, extra: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
        """Stop the bar, print the summary table, finish W&B, close metrics.jsonl. Idempotent.
        ``extra`` (the goodput totals, paralayer/metrics/goodput.py) joins the W&B summary and is
        printed as one line after the table."""
        if not self.enabled or self._closed:
            return None
        self._closed = True
        s = {**self.summary(), **(extra or {})}
        self._console.close(s, self.peak_source)
        if extra and extra.get("goodput") is not None:
            from paralayer.metrics.goodput import summary_line

            print(summary_line(extra), flush=True)
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            wandb_log.finish_run(run, s)
        self._jsonl.close()
        return s

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
