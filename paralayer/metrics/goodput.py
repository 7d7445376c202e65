"""Goodput: where the wall time went, and the fraction of it spent in steps that counted.

Buckets (seconds): ``steps`` (steps whose update stands), ``checkpoint`` (save stalls), ``eval``
(a hook for the evaluation pass: ``with goodput.timed("eval")``), ``rollback`` (loading the
checkpoint plus the steps thrown away), ``skipped`` (steps whose update was skipped),
``restart`` (a later attempt's start-up plus the steps its predecessor ran after its last
checkpoint), ``startup`` (the first attempt's), and ``other`` (what is left: logging, the end).
Goodput = steps / total.

Rank 0 keeps one attempt's totals and rewrites ``run.dir/goodput.json`` (every attempt's) at most
once a second and at the end; a requeued or resumed job sums its attempts. The steps run since
the last checkpoint are kept by number so the next attempt can tell which of them were lost.
Torch-free.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator, Optional

BUCKETS = ("steps", "checkpoint", "eval", "rollback", "skipped", "restart", "startup", "other")
FILE = "goodput.json"


def process_start_time() -> Optional[float]:
    """Unix time this process started (Linux /proc: its start in ticks since boot, against the
    uptime on the same clock), so the interpreter's start-up and imports count too."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Goodput:
    def __init__(self, run_dir: Optional[str], enabled: bool, start_step: int, start_time: Optional[float] = None):
        self.path = os.path.join(run_dir, FILE) if (run_dir and enabled) else None
        self.t0 = start_time or process_start_time() or time.time()
        self.t = {b: 0.0 for b in BUCKETS}
        self.unsaved: dict[int, float] = {}  # step -> seconds, steps after the last checkpoint
        self.start_step = start_step
        self.last_step = start_step - 1
        self._written = 0.0
        self.previous = self._read_previous()
        self.first_attempt = not self.previous
        lost = sum(s for a in self.previous[-1:] for st, s in a.get("unsaved", {}).items() if int(st) >= start_step)
        if self.previous:
            self.previous[-1]["lost_s"] = lost

    def _read_previous(self) -> list[dict]:
        if not self.path or not os.path.isfile(self.path):
            return []
        try:
            with open(self.path) as f:
                return list(json.load(f).get("attempts", []))
        except (OSError, ValueError):
            return []

    def started(self) -> None:
        """The first step begins: what came before is start-up (a restart after the first attempt)."""
        self.t["startup" if self.first_attempt else "restart"] += time.time() - self.t0 - sum(self.t.values())

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.t[bucket] += time.perf_counter() - t

    def step(self, step: int, seconds: float, counted: bool = True) -> None:
        if counted:
            self.unsaved[step] = seconds
        else:
            self.t["skipped"] += seconds
        self.last_step = step
        self.maybe_write()

    def saved(self, step: int) -> None:
        for s in [s for s in self.unsaved if s <= step]:
            self.t["steps"] += self.unsaved.pop(s)

    def rolled_back(self, from_step: int, seconds: float) -> None:
        lost = [s for s in self.unsaved if s > from_step]
        self.t["rollback"] += seconds + sum(self.unsaved.pop(s) for s in lost)
        self.saved(from_step)

    def attempt(self, final: bool = False) -> dict:
        t = dict(self.t)
        t["steps"] += sum(self.unsaved.values())
        wall = time.time() - self.t0
        t["other"] = max(0.0, wall - sum(v for k, v in t.items() if k != "other"))
        return {"start_step": self.start_step, "last_step": self.last_step, "wall_s": wall, "buckets_s": t,
                "unsaved": {str(k): v for k, v in self.unsaved.items()}, "finished": final}

    def totals(self, final: bool = False) -> dict:
        """Summed over every attempt: ``goodput`` and ``goodput_<bucket>_s``."""
        attempts = self.previous + [self.attempt(final)]
        sums = {b: 0.0 for b in BUCKETS}
        for i, a in enumerate(attempts):
            for b, v in a["buckets_s"].items():
                sums[b] += v
            if i + 1 < len(attempts):  # a later attempt re-ran what this one did after its last save
                sums["steps"] -= a.get("lost_s", 0.0)
                sums["restart"] += a.get("lost_s", 0.0)
        wall = sum(a["wall_s"] for a in attempts)
        out = {f"goodput_{b}_s": v for b, v in sums.items()}
        out.update(goodput=sums["steps"] / wall if wall > 0 else None, goodput_wall_s=wall,
                   goodput_attempts=len(attempts))
        return out

    def maybe_write(self, final: bool = False) -> None:
        if self.path is None or (not final and time.monotonic() - self._written < 1.0):
            return
        self._written = time.monotonic()
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"attempts": self.previous + [self.attempt(final)], "totals": self.totals(final)}, f, indent=1)
        os.replace(tmp, self.path)



def summary_line(totals: dict) -> str:
    """The console's goodput line."""
    parts = ", ".join(f"{b} {totals[f'goodput_{b}_s']:.1f}s" for b in BUCKETS if totals[f"goodput_{b}_s"] > 0.05)
    g = totals["goodput"]
    return (f"paralayer: goodput {100 * g:.1f}% of {totals['goodput_wall_s']:.1f} s wall over "
            f"{totals['goodput_attempts']} attempt(s): {parts}")
