"""Where this rank is, cheaply: the step, the phase, and the last collective it entered.

Our own blocking collective call sites (the data-parallel gradient reduction, the loss average,
the gradient-norm sums, the pipeline's loss broadcast) run inside :meth:`CommTrace.collective`.
That costs one dict and two clock reads per collective, and buys three things:

- the watchdog (paralayer/runtime/health/watchdog.py) writes ``last`` (mesh axis, op, step, phase,
  microbatch) next to the stacks when a step hangs, so the launcher can name the rank that never
  entered the collective the others wait in;
- ``blocked_s`` (time inside those calls this step) is the "time in collectives" of the per-rank
  timing (paralayer/metrics/rank_timing.py);
- while the profiler runs (``profiling``), each call and each :meth:`region` is a
  ``record_function`` range named ``comm.<axis>.<op>`` (or the region's name); otherwise a region
  is a no-op (no profiler overhead when it is off).

Torch's own collectives are timed into ``blocked_s`` too (paralayer/parallel/collective_timing.py):
FSDP2's all-gathers and reduce-scatters, and the waits on DTensor's tensor-parallel ones.

Which rank the others waited for (paralayer/metrics/waited_for.py): each blocking collective on a
matched group (``match``: the layout's dp·cp, tp and pp groups) appends this rank's arrival
(``time.monotonic()`` as it enters) to ``arrivals[group]``; every member of a group enters its
collectives in the same order, so entry i is the same collective on each. Each point-to-point
send or receive records when it was posted and when this rank began to wait on it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Optional


class CommTrace:
    """One rank's "where am I": written by the step loop and our collective call sites, read by
    the watchdog thread (plain attribute writes: a reader sees the old or the new dict)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.step = 0
        self.phase = "setup"
        self.microbatch: Optional[int] = None
        self.last: Optional[dict] = None
        self.entered = 0  # collectives entered since the start (a rank behind has fewer)
        self.blocked_s = 0.0
        self.data_s = 0.0  # the step loop's time reading its batch
        self.profiling = False
        # "axis.kind" -> bytes sent: the cp ring's K/V (point-to-point), the ep rows by destination
        # (ep.local / ep.intra_node / ep.inter_node, parallel/expert_node.py)
        self.bytes_sent: dict[str, int] = {}
        self.axis_groups: dict[str, tuple] = {}  # our call sites' axis -> the matched group's ranks
        self.matched: list[tuple[tuple, Any]] = []  # (ranks, process group) exchanged at a logged step
        self.arrivals: dict[tuple, list[float]] = {}  # group ranks -> this step's arrival times, in order
        self.p2p: list[list] = []  # this step's point-to-point operations, in order of posting (see posted)
        self.p2p_s = 0.0  # this step's seconds waiting on point-to-point operations
        self.offsets: dict[int, float] = {}  # rank -> its monotonic clock minus rank 0's (other hosts)
        self._keys: dict[int, tuple] = {}

    def sent(self, axis: str, kind: str, nbytes: int) -> None:
        """Count bytes this rank sent (the cp ring's K/V and dK/dV; the ep rows), since the start."""
        key = f"{axis}.{kind}"
        self.bytes_sent[key] = self.bytes_sent.get(key, 0) + int(nbytes)

    def at(self, step: int, phase: str, microbatch: Optional[int] = None) -> None:
        """The loop's position: ``phase`` is data | forward | backward | reduce | optimizer | ..."""
        self.step, self.phase, self.microbatch = step, phase, microbatch

    def new_step(self, step: int) -> None:
        self.at(step, "data")
        self.blocked_s = 0.0
        self.data_s = 0.0
        self.arrivals, self.p2p, self.p2p_s = {}, [], 0.0

    def match(self, axes: dict[str, Any]) -> None:
        """Match arrivals on these groups (axis name -> process group; None or size 1: skipped)."""
        for axis, group in axes.items():
            key = self.key(group) if group is not None else None
            if key is not None and len(key) > 1:
                self.axis_groups[axis] = key
                if all(k != key for k, _ in self.matched):
                    self.matched.append((key, group))
        self.matched.sort(key=lambda kg: kg[0])  # one order on every rank: the exchanges cannot deadlock

    def key(self, group: Any) -> tuple:
        """A process group's global ranks (cached: a group lives as long as the run)."""
        k = self._keys.get(id(group))
        if k is None:
            import torch.distributed as dist

            k = self._keys[id(group)] = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        return k

    def arrive(self, key: Optional[tuple]) -> None:
        """This rank enters a collective on ``key``'s group (recorded if that group is matched)."""
        if key is not None and key in self.axis_groups.values():
            self.arrivals.setdefault(key, []).append(time.monotonic())

    def posted(self, peer: int, tag: int, send: bool) -> list:
        """A point-to-point send or receive with ``peer`` was posted now: its entry (for
        :meth:`p2p_wait`) ``[peer, tag, send, time posted, time its wait began (nan: none yet)]``."""
        self.p2p.append([peer, tag, send, time.monotonic(), float("nan")])
        return self.p2p[-1]

    def p2p_wait(self, entry: list, t0: float, seconds: float) -> None:
        """A point-to-point operation (its :meth:`posted` entry) was waited on from ``t0`` for ``seconds``."""
        if entry[4] != entry[4]:  # nan: the first wait on it
            entry[4] = t0
        self.p2p_s += seconds

    @contextlib.contextmanager
    def collective(self, axis: str, op: str, microbatch: Optional[int] = None) -> Iterator[None]:
        """Around one of our blocking collectives: remember it, time it, name it in a trace."""
        self.entered += 1
        self.last = {"axis": axis, "op": op, "step": self.step, "phase": self.phase,
                     "microbatch": self.microbatch if microbatch is None else microbatch, "seq": self.entered}
        self.arrive(self.axis_groups.get(axis))
        t0 = time.perf_counter()
        try:
            with self.region(f"comm.{axis}.{op}"):
                yield
        finally:
            self.blocked_s += time.perf_counter() - t0
            self.last = dict(self.last, done=True)

    def region(self, name: str) -> Any:
        """A profiler range while profiling, else nothing."""
        if not self.profiling:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(name)

    def snapshot(self) -> dict:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "microbatch": self.microbatch,
                "entered": self.entered, "last_collective": self.last}


def optional_region(trace: Optional[CommTrace], name: str) -> Any:
    """:meth:`CommTrace.region` where a caller may hold no trace."""
    return contextlib.nullcontext() if trace is None else trace.region(name)


def optional_collective(trace: Optional[CommTrace], axis: str, op: str, microbatch: Optional[int] = None) -> Any:
    """:meth:`CommTrace.collective` where a caller may hold no trace."""
    return contextlib.nullcontext() if trace is None else trace.collective(axis, op, microbatch)
