"""A rank's orderly end: nothing native left running when its interpreter exits.

Issue 48: about one finished run in twelve, a rank aborted after its last step ("terminate called
without an active exception", SIGABRT) and the launcher called the run failed. What was alive at
exit on every rank of that run (dp2, ZeRO-3), after ``destroy_process_group()`` had returned: four
gloo process groups, 12 native threads (4 ``gloo_tcp_loop``, 8 ``pt_gloo_runloop``). Destroy
shuts the groups down and forgets them, but each DeviceMesh keeps its groups in a dict and
DTensor's sharding caches keep the meshes, so the groups' C++ objects were freed only while the
interpreter was being torn down, where a gloo work object that still holds tensors takes the GIL
of a dying interpreter and aborts (pytorch/pytorch#179291, #190489: the same abort from a group
never destroyed). :func:`finish` ends in order: a barrier after the last collective (the
successful path only: a failed rank's peers may never come), destroy, the meshes' groups
released, torch's default arguments that hold the default group dropped (both in
paralayer/compat.py) and collected, so the groups' destructors join their threads
here, on the main thread, while the interpreter is whole.
"""
from __future__ import annotations

import datetime
import gc
import os
from typing import Optional

import torch.distributed as dist

from paralayer import compat

#: native thread names of a gloo process group (its transport loop and its work threads)
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def finish(ok: bool, barrier_timeout_s: Optional[float] = None) -> None:
    """Barrier (when ``ok``), destroy every process group, free what still holds them."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if ok:
            barrier(barrier_timeout_s)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already torn down by a failure: nothing left to end
            pass
        gc.unfreeze()  # what start-up made was frozen out of the collector's view (runtime/startup_gc.py)
        compat.release_mesh_groups()
        compat.release_default_arguments()
        gc.collect()


def barrier(timeout_s: Optional[float]) -> None:
    """Every rank past its last collective. On gloo a monitored barrier, which names the rank that
    did not come within ``timeout_s``; elsewhere the group's own timeout bounds it."""
    if timeout_s is not None and dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=float(timeout_s)))
    else:
        dist.barrier()


def native_threads() -> list[str]:
    """The names of this process's threads other than the calling one (Linux; [] elsewhere)."""
    me = str(getattr(os, "gettid", lambda: -1)())
    out = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in sorted(tasks):
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                out.append(f.read().strip())
        except OSError:
            continue
    return out


def gloo_threads() -> list[str]:
    """The gloo threads still running in this process (none, after :func:`finish`)."""
    return [t for t in native_threads() if t.startswith(GLOO_THREADS)]
