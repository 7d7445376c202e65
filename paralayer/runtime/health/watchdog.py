"""A hang gets a diagnosis, not a timeout.

A frozen peer (SIGSTOP, a dead NIC, a GPU stuck in a kernel) keeps its sockets open, so the
process-group timeout may never fire and the job burns its allocation doing nothing. Each rank
runs a :class:`Watchdog` thread: when no step has finished for ``train.hang_timeout_s`` (armed
once the first step finished, so a slow first step or compile does not trip it) it writes
``run.dir/hang/rank-R.txt``: where the loop was and the last collective this rank entered
(paralayer/parallel/comm_trace.py), then every thread's Python stack (faulthandler). On NCCL it
also dumps torch's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, set at init) beside it.

The stuck rank cannot write its own file. :func:`diagnose` compares the files: the ranks with no
file, or behind the others, or not inside a collective while the others wait in one, are the
ones that never entered it. The local launcher (paralayer/dispatch/local.py) watches the folder,
prints that one line and ends every rank; elsewhere (SLURM) the lowest rank that wrote a file
prints it, and every rank that could write exits non-zero after a grace period so that the job
step ends.
"""
from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from typing import Optional

HANG_DIR = "hang"
EXIT_HANG = 1


def hang_dir(run_dir: str) -> str:
    return os.path.join(run_dir, HANG_DIR)


def clear(run_dir: str) -> None:
    """Remove a previous attempt's reports (before any rank can write this attempt's)."""
    d = hang_dir(run_dir)
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.startswith("rank-"):
                os.remove(os.path.join(d, name))


class Watchdog:
    """One thread per rank: ``beat()`` after every finished step; ``stop()`` at the end."""

    def __init__(self, timeout_s: float, run_dir: str, rank: int, world: int, trace, *,
                 announce: bool = True, grace_s: float = 10.0, cuda: bool = False):
        self.timeout_s = float(timeout_s)
        self.dir = hang_dir(run_dir)
        self.rank, self.world, self.trace = rank, world, trace
        self.announce, self.grace_s, self.cuda = announce, grace_s, cuda
        self.last_step: Optional[int] = None
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paralayer-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: Optional[int] = None) -> None:
        """A step (or a long pause the loop knows of, such as a checkpoint save) finished."""
        self._last = time.monotonic()
        self._armed = True
        if step is not None:
            self.last_step = step

    def pause(self) -> None:
        """Disarm until the next beat: a checkpoint save or load has its own timeout
        (checkpoint.timeout_s) and may rightly take longer than a step."""
        self._armed = False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        poll = max(0.05, min(1.0, self.timeout_s / 10))
        while not self._stop.wait(poll):
            if self._armed and time.monotonic() - self._last > self.timeout_s:
                self.fire()
                return

    def fire(self) -> str:
        """Write this rank's report; then (announce) name the culprit, and end the process."""
        path = self.write_report(time.monotonic() - self._last)
        if self.cuda:
            dump_flight_recorder(os.path.join(self.dir, f"rank-{self.rank}.nccl-trace.pickle"))
        if self._stop.wait(self.grace_s):  # the loop finished after all (or the test stopped us)
            return path
        if self.announce:
            present = sorted(reports(self.dir))
            if present and present[0] == self.rank:
                line = diagnose(self.dir, self.world)
                print(line, file=sys.stderr, flush=True)
                with open(os.path.join(os.path.dirname(self.dir), "error.txt"), "w", encoding="utf-8") as f:
                    f.write(line + "\n")  # what the sweep report shows for this run
        os._exit(EXIT_HANG)

    def write_report(self, idle_s: float) -> str:
        os.makedirs(self.dir, exist_ok=True)
        final = os.path.join(self.dir, f"rank-{self.rank}.txt")
        tmp = final + ".tmp"
        where = self.trace.snapshot() if self.trace is not None else {}
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"paralayer hang report: rank {self.rank} of {self.world}, host {socket.gethostname()}, "
                    f"pid {os.getpid()}\n")
            f.write(f"no step finished for {idle_s:.1f} s (train.hang_timeout_s={self.timeout_s:g}); "
                    f"last finished step: {self.last_step}\n")
            f.write("where: " + json.dumps(where) + "\n")
            f.write("--- Python stacks (all threads) ---\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, final)
        return final


def dump_flight_recorder(path: str) -> bool:
    """NCCL only: torch's flight recorder (the last collectives per communicator) as a pickle."""
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace

        with open(path, "wb") as f:
            f.write(_dump_nccl_trace())
        return True
    except Exception:  # noqa: BLE001 - no NCCL, or torch without the recorder
        return False


def reports(d: str) -> dict[int, dict]:
    """rank -> the ``where`` object of each complete ``rank-R.txt`` in ``d``."""
    out: dict[int, dict] = {}
    if not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if not (name.startswith("rank-") and name.endswith(".txt")):
            continue
        try:
            rank = int(name[5:-4])
            with open(os.path.join(d, name), encoding="utf-8") as f:
                for line in f:
                    if line.startswith("where: "):
                        out[rank] = json.loads(line[7:])
                        break
        except (ValueError, OSError):
            continue
    return out


def _inside(where: dict) -> Optional[dict]:
    last = where.get("last_collective")
    return last if last and not last.get("done") else None


def culprits(found: dict[int, dict], world: int) -> tuple[list[int], Optional[dict]]:
    """(ranks that never entered the collective the others wait in, that collective)."""
    missing = [r for r in range(world) if r not in found]
    if not found:
        return missing, None
    top = max(w.get("step", 0) for w in found.values())
    behind = [r for r, w in found.items() if w.get("step", 0) < top]
    waiting = {r: _inside(w) for r, w in found.items() if _inside(w) and w.get("step", 0) == top}
    idle = [r for r, w in found.items() if r not in waiting and r not in behind] if waiting else []
    coll = None
    if waiting:
        first = min(waiting)
        coll = waiting[first]
    # the strongest evidence first: a rank that could not write (frozen, dead) explains the others;
    # a rank in a collective torch runs for us (DTensor's) looks "not inside" ours, so idle comes last
    return sorted(missing or behind or idle), coll


def diagnose(d: str, world: int) -> str:
    """The one line the launcher prints for a hang."""
    found = reports(d)
    bad, coll = culprits(found, world)
    what = "the collective the others wait in"
    if coll is not None:
        mb = "" if coll.get("microbatch") is None else f", microbatch {coll['microbatch']}"
        what = (f"the collective the others wait in ({coll['axis']} {coll['op']}, step {coll['step']}, "
                f"{coll['phase']}{mb})")
    if not bad:
        return (f"paralayer: hang: no step finished on any of {world} rank(s) and no rank is behind "
                f"(a mismatched collective?); stacks in {d}")
    ranks = ", ".join(str(r) for r in bad)
    return (f"paralayer: hang: rank{'s' if len(bad) > 1 else ''} {ranks} never entered {what}; "
            f"stacks of the others in {d}")
