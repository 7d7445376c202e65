"""Every attempt of a run, recorded in ``run.dir/attempts.jsonl``: why it ended and what died.

A run that restarts by itself (``cluster.max_restarts`` locally, ``cluster.slurm.max_restarts`` on
SLURM) leaves one line per attempt: ``attempt`` (1, 2, ...), ``cause`` (``done``, ``rank_died``,
``hang``, ``bad_input``), ``ranks`` (the ranks that died on their own, the root of the failure),
``ranks_failed`` (every rank that ended badly, including those stopped because a peer died),
``host``, ``exit_code`` and ``signal`` (a rank killed by a signal has exit code null), ``line``
(the one line the launcher printed), ``start_unix`` / ``end_unix`` / ``wall_s`` (the launcher's
clock: the whole attempt, start-up and teardown included), ``restart`` (whether another attempt
follows). Torch-free.
"""
from __future__ import annotations

import json
import os
import signal
import socket
from typing import Any, Optional

FILE = "attempts.jsonl"

#: exit status of a rank that found bad input (data, checkpoints): never restarted
EXIT_BAD_INPUT = 2


def path(run_dir: str) -> str:
    return os.path.join(run_dir, FILE)


def read(run_dir: str) -> list[dict]:
    """The recorded attempts in order ([] when none)."""
    out = []
    try:
        with open(path(run_dir), encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def clear(run_dir: str) -> None:
    """A fresh launch starts a fresh list (a restarted attempt appends to it)."""
    try:
        os.remove(path(run_dir))
    except OSError:
        pass


def signal_name(exit_code: Optional[int]) -> Optional[str]:
    """torch elastic reports a rank killed by signal N as exit code -N."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def record(run_dir: str, attempt: int, cause: str, start_unix: float, end_unix: float, *,
           ranks: Optional[list] = None, ranks_failed: Optional[list] = None, exit_code: Optional[int] = None,
           host: Optional[str] = None, line: Optional[str] = None, restart: bool = False,
           **extra: Any) -> dict:
    """Append one attempt's line; returns it."""
    sig = signal_name(exit_code)
    rec = {"attempt": attempt, "cause": cause, "ranks": sorted(ranks or []), "ranks_failed": sorted(ranks_failed or []),
           "host": host or socket.gethostname(), "exit_code": None if sig else exit_code, "signal": sig,
           "line": line, "start_unix": start_unix, "end_unix": end_unix, "wall_s": end_unix - start_unix,
           "restart": restart}
    rec.update(extra)
    with open(path(run_dir), "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return rec


def should_restart(cause: str, attempt: int, max_restarts: int) -> bool:
    """Any death but bad input restarts, until ``max_restarts`` restarts were made."""
    return cause in ("rank_died", "hang") and attempt <= max_restarts


def limit_line(attempt: int, max_restarts: int, key: str) -> str:
    """The one line that says the restarts stop here."""
    return (f"paralayer: attempt {attempt} failed and the restart limit is reached ({key}={max_restarts}, "
            f"{attempt - 1} restart(s) made); not restarting")


def restart_line(attempt: int, max_restarts: int, what: str) -> str:
    return (f"paralayer: attempt {attempt} ended ({what}); restarting from the newest verified checkpoint "
            f"(restart {attempt} of {max_restarts})")
