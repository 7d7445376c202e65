"""A rank dies with its launcher: no orphan keeps training after the launcher is gone.

A launcher killed with SIGKILL cannot stop its ranks; they were seen still training 15 minutes
later with parent pid 1. Each rank the local launcher starts asks Linux for a signal when its
parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes), and checks that the parent is
still the launcher whose pid the launcher put in the environment: a launcher that died before
the prctl call would otherwise never be noticed. A background thread also watches the parent pid
(where prctl is missing: not Linux, or a sandbox that refuses it).
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1
ENV = "PARALAYER_LAUNCHER_PID"  # set by paralayer/dispatch/local.py


def _prctl_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed launcher not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def die_with_launcher(poll_s: float = 1.0) -> Optional[int]:
    """In a rank: end this process when the launcher (``$PARALAYER_LAUNCHER_PID``) dies. Returns
    the launcher's pid, or None when not started by the local launcher."""
    pid = os.environ.get(ENV)
    if not pid or not pid.isdigit():
        return None
    launcher, parent = int(pid), os.getppid()
    if parent == launcher:  # our direct parent: the kernel tells us the moment it dies
        _prctl_pdeathsig(int(signal.SIGKILL))
    if not _alive(launcher) or (parent == launcher and os.getppid() != launcher):  # gone before prctl
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:  # prctl refused, or an intermediate process between the launcher and us
        stop = threading.Event()
        while not stop.wait(poll_s):
            if not _alive(launcher) or os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="paralayer-launcher-watch", daemon=True).start()
    return launcher
