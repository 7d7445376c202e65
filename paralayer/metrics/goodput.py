"""Goodput: where the wall time went, and the fraction of it spent in steps that counted.

Buckets (seconds): ``steps`` (steps whose update stands), ``checkpoint`` (save stalls), ``eval``
(a hook for the evaluation pass: ``with goodput.timed("eval")``), ``rollback`` (loading the
checkpoint plus the steps thrown away), ``skipped`` (steps whose update was skipped),
``restart`` (a later attempt's start-up), ``startup`` (the first attempt's), ``lost`` (the steps
a dead attempt ran after its last checkpoint: the next attempt runs them again), ``failure`` (a
dead attempt's time after its last recorded step: the hang until the watchdog fired, detection,
teardown), and ``other`` (what is left: logging, the end). Goodput = steps / total.

Rank 0 keeps one attempt's totals and rewrites ``run.dir/goodput.json`` (every attempt's) at most
once a second and at the end; a requeued or resumed job sums its attempts. The steps run since
the last checkpoint are kept by number so that a later attempt's start step tells which were lost.
A killed or hung rank 0 cannot write its last second, so the launcher that ran the attempt closes
its account (:func:`account_attempt`): the attempt's wall time on the launcher's clock, the steps
metrics.jsonl shows after rank 0's last write, and the rest as ``failure``.
Torch-free.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator, Optional

BUCKETS = ("steps", "checkpoint", "eval", "rollback", "skipped", "restart", "startup", "lost", "failure", "other")
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
    def __init__(self, run_dir: Optional[str], enabled: bool, start_step: int, start_time: Optional[float] = None,
                 marks: Optional[dict] = None):
        self.path = os.path.join(run_dir, FILE) if (run_dir and enabled) else None
        self.t0 = start_time or process_start_time() or time.time()
        self.t = {b: 0.0 for b in BUCKETS}
        self.unsaved: dict[int, float] = {}  # step -> seconds, steps after the last checkpoint
        self.start_step = start_step
        self.last_step = start_step - 1
        # unix times at which start-up parts ended (train_start: imports and process group done,
        # setup, loaded: the checkpoint; first_step: the first step finished): benchmarks/recovery.py
        self.marks = dict(marks or {})
        self._written = 0.0
        self.previous = self._read_previous()
        self.first_attempt = not self.previous

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
        self.marks.setdefault("first_step", time.time())
        if counted:
            self.unsaved[step] = seconds
        else:
            self.t["skipped"] += seconds
        self.last_step = step
        self.maybe_write()

    def saved(self, step: int) -> None:
        for s in [s for s in self.unsaved if s <= step]:
            self.t["steps"] += self.unsaved.pop(s)
        self._written = 0.0  # written now: a save is what a dead attempt's account starts from
        self.maybe_write()

    def rolled_back(self, from_step: int, seconds: float) -> None:
        lost = [s for s in self.unsaved if s > from_step]
        self.t["rollback"] += seconds + sum(self.unsaved.pop(s) for s in lost)
        self.saved(from_step)

    def attempt(self, final: bool = False) -> dict:
        t = dict(self.t)
        t["steps"] += sum(self.unsaved.values())
        wall = time.time() - self.t0
        t["other"] = max(0.0, wall - sum(v for k, v in t.items() if k != "other"))
        now = time.time()
        return {"attempt": None, "start_step": self.start_step, "last_step": self.last_step,
                "wall_s": wall, "buckets_s": t, "unsaved": {str(k): v for k, v in self.unsaved.items()},
                "finished": final, "t0_unix": self.t0, "written_unix": now, "marks": self.marks}

    def totals(self, final: bool = False) -> dict:
        """Summed over every attempt: ``goodput`` and ``goodput_<bucket>_s``."""
        return totals_of(self.previous + [self.attempt(final)])

    def maybe_write(self, final: bool = False) -> None:
        if self.path is None or (not final and time.monotonic() - self._written < 1.0):
            return
        self._written = time.monotonic()
        attempts = self.previous + [self.attempt(final)]
        _write(self.path, attempts)


def _write(path: str, attempts: list[dict]) -> None:
    totals = totals_of(attempts)  # marks each attempt's lost steps
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"attempts": attempts, "totals": totals}, f, indent=1)
    os.replace(tmp, path)


def totals_of(attempts: list[dict]) -> dict:
    """Summed over ``attempts``: ``goodput``, ``goodput_<bucket>_s``, ``goodput_lost_steps``.

    The steps an attempt ran after its last checkpoint are those at or past the start step of the
    next attempt that reached its loop: they move from ``steps`` to ``lost`` (each attempt gets
    ``lost_s`` and ``lost_steps``)."""
    sums = {b: 0.0 for b in BUCKETS}
    n_lost = 0
    for i, a in enumerate(attempts):
        for b, v in a["buckets_s"].items():
            sums[b] = sums.get(b, 0.0) + v
        later = [x["start_step"] for x in attempts[i + 1:] if x.get("start_step") is not None]
        if later:  # a later attempt re-ran what this one did after its last save
            lost = sorted(int(st) for st in a.get("unsaved", {}) if int(st) >= later[0])
            a["lost_steps"], a["lost_s"] = lost, sum(a["unsaved"][str(st)] for st in lost)
            sums["steps"] -= a["lost_s"]
            sums["lost"] += a["lost_s"]
            n_lost += len(lost)
    wall = sum(a["wall_s"] for a in attempts)
    out = {f"goodput_{b}_s": v for b, v in sums.items()}
    out.update(goodput=sums["steps"] / wall if wall > 0 else None, goodput_wall_s=wall,
               goodput_attempts=len(attempts), goodput_lost_steps=n_lost)
    return out


def read_totals(run_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(run_dir, FILE)) as f:
            return json.load(f).get("totals")
    except (OSError, ValueError):
        return None


def account_attempt(run_dir: str, attempt: int, start: float, end: float, finished: bool) -> dict:
    """The launcher closes attempt ``attempt``'s account in goodput.json, after its ranks are gone.

    Its wall time is ``end - start`` on the launcher's clock (start-up and teardown included, and
    the time after rank 0's last write that a killed or hung attempt never recorded): the time
    before rank 0's process started goes to start-up (``restart`` after the first attempt); of a
    dead attempt, the steps metrics.jsonl shows after rank 0's last write join ``steps`` (and the
    unsaved ones a later attempt may find lost), the rest after that write is ``failure``; of a
    finished one, what follows rank 0's last write is ``other``. An attempt that died before rank 0
    reached its loop is all start-up. Returns the attempt's entry."""
    from paralayer.metrics.jsonl import read_records

    path = os.path.join(run_dir, FILE)
    attempts: list[dict] = []
    try:
        with open(path) as f:
            attempts = list(json.load(f).get("attempts", []))
    except (OSError, ValueError):
        pass
    # rank 0's entry of this attempt: the one its process started within this attempt's window
    entry = next((a for a in reversed(attempts) if a.get("attempt") is None
                  and a.get("t0_unix", 0.0) >= start - 1.0), None)
    wall = max(0.0, end - start)
    boot = "startup" if attempt == 1 else "restart"
    if entry is None or entry.get("start_step") is None:
        entry = {"attempt": attempt, "start_step": None, "last_step": None, "wall_s": wall, "unsaved": {},
                 "buckets_s": dict({b: 0.0 for b in BUCKETS}, **{boot: wall}), "finished": False}
        attempts.append(entry)
    else:
        t = entry["buckets_s"]
        t[boot] = t.get(boot, 0.0) + max(0.0, entry.get("t0_unix", start) - start)
        written = entry.get("written_unix", end)
        if not finished:
            recs = read_records(os.path.join(run_dir, "metrics.jsonl"))
            tail = {r["step"]: float(r.get("step_time_s") or 0.0) for r in recs if "event" not in r
                    and r["step"] > (entry.get("last_step") or 0) and r["step"] >= entry["start_step"]}
            t["steps"] = t.get("steps", 0.0) + sum(tail.values())
            entry["unsaved"].update({str(k): v for k, v in tail.items()})
            if tail:
                entry["last_step"] = max(tail)
            t["failure"] = t.get("failure", 0.0) + max(0.0, end - written - sum(tail.values()))
        rest = sum(v for k, v in t.items() if k != "other")
        t["other"] = max(0.0, wall - rest)
        entry["wall_s"] = max(wall, rest)
        entry["finished"] = bool(finished)
    entry.update(attempt=attempt, launcher_start_unix=start, launcher_end_unix=end)
    _write(path, attempts)
    return entry



def summary_line(totals: dict) -> str:
    """The console's goodput line."""
    parts = ", ".join(f"{b} {totals[f'goodput_{b}_s']:.1f}s" for b in BUCKETS if totals[f"goodput_{b}_s"] > 0.05)
    g = totals["goodput"]
    return (f"paralayer: goodput {100 * g:.1f}% of {totals['goodput_wall_s']:.1f} s wall over "
            f"{totals['goodput_attempts']} attempt(s): {parts}")
