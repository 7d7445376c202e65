"""Ranks forked from a preloaded server instead of started as fresh interpreters: the rehearsal's
ranks, and the local launcher's (dispatch/local.py).

A fresh ``python -m paralayer.runtime.train`` imports torch and the runtime again in every rank:
~5 s of CPU each on the 2-core machine, 20 of a 4-rank tiny run's 30. multiprocessing's fork
server is a clean process started once per launcher (its environment, nothing of the caller's
state) that imports :data:`PRELOAD` once; each rank is a fork of it with them loaded. The
server outlives one attempt, so a restart, a local sweep's next element or a rehearsal forks from it
too.

How a rank is recognised (the hang monitor SIGKILLs a frozen rank; tests look for orphans): the
server's command line names what it preloaded, so every process forked from it carries
``paralayer.runtime.train`` in its command line, and a rank is such a process whose parent has the
same command line (the server itself is the launcher's child).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import types
from typing import Iterator

#: What the server imports once: the runtime (runtime/train.py pulls the model, the parallel axes,
#: the data and the metrics in with it) and the rehearsal's counters (rehearse/driver.py forks its
#: ranks from the same server; they cost nothing more to import beside the runtime); server_exit
#: lets the server end without tearing torch down. The rest is what a rank's train() imports lazily:
#: DTensor's and FSDP's first calls pull torch._dynamo (~1 CPU-s in every rank of a tiny 4-rank run,
#: 7 Dec), the pipeline torch.distributed.pipelining; the run's health, data and metrics modules.
PRELOAD = ("paralayer.runtime.train", "paralayer.rehearse.rank", "paralayer.rehearse.memory",
           "paralayer.rehearse.comm", "paralayer.rehearse.flops", "paralayer.parallel.mesh",
           "torch._subclasses.fake_tensor", "torch._dynamo", "torch.distributed.pipelining",
           "torch.distributed.fsdp", "torch.distributed.elastic.multiprocessing.api",
           "paralayer.runtime.health.run_health", "paralayer.runtime.teardown", "paralayer.data.dataset",
           "paralayer.data.prepare", "paralayer.metrics.jsonl", "numpy.ma", "yaml", "rich.console",
           "paralayer.rehearse.server_exit")
MARKER = "paralayer.runtime.train"


def context() -> mp.context.BaseContext:
    """The fork-server context; the preload is read when the server starts (once a process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
    """multiprocessing re-runs the caller's ``__main__`` script in each child (``launch.py`` would
    run the CLI again): a rank needs nothing of it, so while children start it sees a bare one."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def adopt_environment(env: dict) -> None:
    """A forked rank's environment: the launcher's at launch (``env``), with what torch elastic's
    agent set for this rank on top. The server's own environment is the launcher's at the first
    launch; keys the agent set are those it adds or changes there, and the agent's names."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({k: v for k, v in before.items() if k not in env or _agents(k)})


_AGENT_KEYS = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                         "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


def _agents(key: str) -> bool:
    return key in _AGENT_KEYS or key.startswith("TORCHELASTIC_")


def run_rank(run_dir: str, env: dict, *overrides: str) -> None:
    """One rank of the local launcher, in a process forked from the server: ``runtime.train``'s
    main, looked up at call time (what a test installs on the module applies); its non-zero
    status is the process's exit status, as ``python -m paralayer.runtime.train`` gave."""
    adopt_environment(env)
    release_server()
    from paralayer.runtime import train

    rc = train.main(run_dir, *overrides)
    if rc:
        raise SystemExit(rc)


def release_server() -> None:
    """A forked child holds the write end of the server's "alive" pipe, and the server lives until
    every holder closed it: a rank holding it would keep the server alive after the launcher's
    death, and the server, its parent, would keep the rank alive (the rank dies with its parent,
    runtime/health/orphans.py). Closed, the server ends with the launcher and the ranks with it."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(fd)
        except OSError:
            pass


def is_rank(pid: int) -> bool:
    """Whether ``pid`` is a rank forked from a rank server (Linux /proc): its command line names
    :data:`MARKER` and is its parent's (the server's)."""
    cmd = _cmdline(pid)
    if MARKER.encode() not in cmd:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return _cmdline(ppid) == cmd


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
