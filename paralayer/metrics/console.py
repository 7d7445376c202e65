"""The console sink: a rich progress bar on a terminal, otherwise (SLURM logs, pipes) a plain line
about every 5% of the run, and the closing summary table."""
from __future__ import annotations

from typing import Any, Dict, Optional


def step_info(rec: Dict[str, Any]) -> str:
    """``loss 5.1234  12,345 tok/s  MFU 12.3%`` for one record (missing parts left out)."""
    parts = []
    if rec.get("loss") is not None:
        parts.append(f"loss {rec['loss']:.4f}")
    if rec.get("val_loss") is not None:
        parts.append(f"val_loss {rec['val_loss']:.4f}")
    if rec.get("tokens_per_s") is not None:
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    return "  ".join(parts)


class ConsoleProgress:
    """Shows each logged step: a live bar when the console is a terminal, plain lines otherwise;
    ``show=False`` prints nothing at all."""

    def __init__(self, total_steps: int, show: bool = True, console: Any = None, every: int = 1):
        from rich.console import Console

        self.console = console or Console(stderr=False)
        self.total_steps = int(total_steps or 0)
        self.show = bool(show)
        # plain lines (no terminal): about 20 per run, each on a step the logger hands over (every N-th)
        every = max(1, int(every))
        self._plain_every = every * max(1, self.total_steps // (20 * every)) if self.total_steps else every
        self._progress = None
        self._task = None
        if self.show and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=self.total_steps or None, info="")
            self._progress.start()

    def step(self, step: int, rec: Dict[str, Any]) -> None:
        info = step_info(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=int(step), info=info)
        elif self.show and (step % self._plain_every == 0 or step == self.total_steps or step == 1
                            or "val_loss" in rec):
            tot = f"/{self.total_steps}" if self.total_steps else ""
            self.console.print(f"step {step}{tot}  {info}", highlight=False)

    def close(self, summary: Optional[Dict[str, Any]], peak_source: Optional[str] = None) -> None:
        """Stop the bar and print the summary table (when there is one to print)."""
        if self._progress is not None:
            self._progress.stop()
        if self.show and summary and summary.get("steps_logged"):
            self.console.print(summary_table(summary, peak_source))


def summary_table(s: Dict[str, Any], peak_source: Optional[str] = None) -> Any:
    """The run's closing table (a rich Table) from :func:`paralayer.metrics.throughput.summarize`."""
    from rich.table import Table

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    t = Table(title="paralayer run summary", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("steps logged", str(s["steps_logged"]))
    t.add_row("tokens/s (median)", f(s["tokens_per_s"], ",.0f"))
    t.add_row("tokens/s per device", f(s["tokens_per_s_per_device"], ",.0f"))
    t.add_row("TFLOP/s per device", f(s["tflops_per_device"], ".3f"))
    mfu = "n/a (no peak known)" if s["mfu"] is None else f"{100 * s['mfu']:.2f}%"
    if peak_source and s["mfu"] is not None:
        mfu += f"  [{peak_source}]"
    t.add_row("MFU", mfu)
    t.add_row("step time (median)", f(s["step_time_s"], ".3f") + (" s" if s["step_time_s"] else ""))
    mem = s["peak_memory_bytes"]
    t.add_row("peak memory", "n/a" if mem is None else f"{mem / 2**20:,.1f} MiB")
    t.add_row("loss first → last", f"{f(s['first_loss'], '.4f')} → {f(s['last_loss'], '.4f')}")
    return t
