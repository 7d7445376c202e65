"""A rank dies with its launcher: no orphan keeps training after the launcher is gone.

A launcher killed with SIGKILL cannot stop its ranks; they were seen still training 15 minutes
later with parent pid 1. Each rank the local launcher starts (torch elastic's agent runs in the
launcher's process and forks every rank from the launcher's fork server, rehearse/fork_server.py,
which ends with the launcher; it leaves TORCHELASTIC_ERROR_FILE in their environment) asks Linux for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)`` through ctypes). A parent that died before the call is caught by checking the parent pid after
it, and a thread watches the parent pid too (where prctl is refused: a sandbox, not Linux).
Under SLURM the job step's own teardown ends the tasks, and nothing here runs.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1


def _prctl_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class LauncherWatch:
    """The thread that watches the launcher's pid; :meth:`stop` ends and joins it (the rank's
    teardown: no thread of ours is left running while the interpreter exits)."""

    def __init__(self, launcher: int, poll_s: float):
        self.pid = launcher
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="paralayer-launcher-watch",
                                        daemon=True)
        self._thread.start()

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            if os.getppid() != self.pid:
                os.kill(os.getpid(), signal.SIGKILL)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def die_with_launcher(poll_s: float = 1.0) -> Optional[LauncherWatch]:
    """In a rank of the local launcher: end this process when the launcher (its parent) dies.
    Returns the watch (its ``pid`` is the launcher's), or None elsewhere (SLURM, a test calling
    ``main`` directly)."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return None
    launcher = os.getppid()
    if launcher == 1:  # already orphaned
        os.kill(os.getpid(), signal.SIGKILL)
    _prctl_pdeathsig(int(signal.SIGKILL))
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return LauncherWatch(launcher, poll_s)
