"""A rank that finished its run says so on disk, so that how it exits cannot undo the run.

Issue 48: a rank that had trained every step and written its final state aborted while its
interpreter exited (SIGABRT), and the launcher reported the finished run as failed (and, with
``cluster.max_restarts``, could start it again). Each rank now writes ``run.dir/done/rank-R.json``
(atomically: a temporary name, fsync, rename) once its last step is logged, its final checkpoint
complete and its metrics closed, before the teardown. The launchers (dispatch/local.py, and on
SLURM dispatch/slurm_jobs.py through dispatch/slurm_restart.py) read these: every rank done is a
finished run whatever a rank did after, said in one line (:func:`exit_line`); a rank without its
marker died before the end, a failure as before. The launchers clear the folder before each
attempt. Torch-free.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import time
from typing import Optional

DIR = "done"


def folder(run_dir: str) -> str:
    return os.path.join(run_dir, DIR)


def marker(run_dir: str, rank: int) -> str:
    return os.path.join(folder(run_dir), f"rank-{int(rank)}.json")


def mark_done(run_dir: Optional[str], rank: int, step: int) -> Optional[str]:
    """This rank finished through ``step`` (its last): the marker, durable before it returns."""
    if not run_dir:
        return None
    d = folder(run_dir)
    os.makedirs(d, exist_ok=True)
    final = marker(run_dir, rank)
    tmp = f"{final}.tmp-{os.getpid()}"
    rec = {"rank": int(rank), "step": int(step), "host": socket.gethostname(), "pid": os.getpid(),
           "unix": time.time()}
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def clear(run_dir: str) -> None:
    """Before an attempt starts: no marker of an earlier attempt may count for this one."""
    d = folder(run_dir)
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.startswith("rank-"):
                try:
                    os.remove(os.path.join(d, name))
                except OSError:
                    pass


def done_ranks(run_dir: str) -> set[int]:
    """The ranks whose complete marker is in run.dir/done."""
    out: set[int] = set()
    d = folder(run_dir)
    if not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(d, name), encoding="utf-8") as f:
                out.add(int(json.load(f)["rank"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def all_done(run_dir: str, world: int) -> bool:
    """Every rank 0 … world-1 finished its run."""
    return world > 0 and set(range(int(world))) <= done_ranks(run_dir)


def plan_world(run_dir: str) -> int:
    """world_size of run.dir/plan.json (0 when it cannot be read)."""
    try:
        with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as f:
            return int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def how(exit_code: Optional[int]) -> str:
    """"aborted at exit (signal 6, SIGABRT)" for exit code -6 (torch elastic's signal N), or
    "exited with code C at exit"."""
    if exit_code is not None and exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = "unknown signal"
        verb = "aborted" if -exit_code == int(signal.SIGABRT) else "was killed"
        return f"{verb} at exit (signal {-exit_code}, {name})"
    return f"exited with code {exit_code} at exit"


def exit_line(failed: dict) -> str:
    """The one line a launcher prints when every rank finished but some ended badly after:
    ``failed`` maps rank -> exit code (negative: killed by that signal; None: unknown)."""
    parts = [f"rank {r} {how(c)}" for r, c in sorted(failed.items())]
    return f"paralayer: {'; '.join(parts)} after finishing every step; the run is complete"


def exit_zero_at_exit(run_dir: str, rank: int) -> bool:
    """A SLURM rank task whose run finished (its marker on disk): end the process with status 0,
    output flushed, as the interpreter begins to exit (registered last, this atexit handler runs
    first: after submitit has written the task's result), skipping the interpreter's teardown.

    Why os._exit is the honest end here: SLURM reads only the task's exit status, and a native
    abort in that teardown would make a finished job FAILED. teardown.finish joins every process
    group, but whatever else native a library leaves running (torch held the default group past
    ``destroy_process_group`` until compat.release_default_arguments, issue 48) would meet the
    dying interpreter. Nothing of the run is left to do: its marker is written only after the last
    step, the final checkpoint and the metrics. Returns whether it was registered."""
    if not os.path.exists(marker(run_dir, rank)):
        return False
    atexit.register(_exit_zero)
    return True


def _exit_zero() -> None:
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
