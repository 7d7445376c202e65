"""The local launcher's side of a hang (paralayer/runtime/health/watchdog.py is the ranks' side).

A thread polls ``run.dir/hang/``. Once reports have appeared and no new one came for
``settle_s`` (or every rank wrote one), it keeps :func:`~paralayer.runtime.health.watchdog.diagnose`'s
line and SIGKILLs the rank processes: a rank frozen by SIGSTOP ignores the agent's SIGTERM, and
the agent would wait 30 s before its own SIGKILL.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from paralayer.rehearse import fork_server
from paralayer.runtime.health import watchdog


def rank_children() -> list[int]:
    """The ranks this launcher started (Linux /proc): processes forked from its rank server, which
    is its child (rehearse/fork_server.py)."""
    ranks = []
    for child in _children(os.getpid()):
        ranks += [pid for pid in _children(child) if fork_server.is_rank(pid)]
    return ranks


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return pids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


class HangMonitor:
    def __init__(self, run_dir: str, world: int, settle_s: float = 2.0, poll_s: float = 0.25):
        self.dir = watchdog.hang_dir(run_dir)
        self.world, self.settle_s, self.poll_s = world, settle_s, poll_s
        self.line: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paralayer-hang-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen, since = 0, None
        while not self._stop.wait(self.poll_s):
            n = len(watchdog.reports(self.dir))
            if n == 0:
                continue
            if n != seen:
                seen, since = n, time.monotonic()
            if n >= self.world or time.monotonic() - since >= self.settle_s:
                self.line = watchdog.diagnose(self.dir, self.world)
                for pid in rank_children():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
