"""Time in FSDP2's own collectives counts as waiting, not compute (the straggler watch).

Under ZeRO-2/3 the data-parallel traffic is FSDP2's all-gathers (forward, and backward at ZeRO-3)
and reduce-scatters (backward), issued from its hooks, not from our collective call sites
(paralayer/parallel/comm_trace.py). A rank that waits there for a slow peer looked busy, so every
rank looked equally slow and the slowed one was not named. FSDP2 lets a module take its own
all-gather and reduce-scatter (``set_custom_all_gather`` / ``set_custom_reduce_scatter``): ours
are torch's defaults, timed into the trace's ``blocked_s``. An asynchronous all-gather returns a
:class:`TimedWork` whose ``wait()`` (where FSDP2 blocks for the peers) is timed too. The
collectives and their results are torch's own: the numbers do not change.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterable, Iterator

import torch.distributed as dist
from torch import nn


class TimedWork(dist.Work):
    """A collective's handle whose ``wait()`` adds its time to the trace's ``blocked_s``."""

    def __init__(self, inner: dist.Work, trace: Any):
        super().__init__()
        self.inner, self.trace = inner, trace

    def wait(self, timeout: Any = None) -> bool:
        t = time.perf_counter()
        try:
            return self.inner.wait() if timeout is None else self.inner.wait(timeout)
        finally:
            self.trace.blocked_s += time.perf_counter() - t

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> Any:
        return self.inner.get_future()


def _comms(trace: Any) -> tuple:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            t = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, async_op=async_op)
            trace.blocked_s += time.perf_counter() - t
            return TimedWork(work, trace) if isinstance(work, dist.Work) else work

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            t = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
            trace.blocked_s += time.perf_counter() - t
            return TimedWork(work, trace) if isinstance(work, dist.Work) else work

    return TimedAllGather(), TimedReduceScatter()


def time_fsdp(chunks: Iterable[nn.Module], trace: Any) -> int:
    """Give every FSDP2 module of ``chunks`` the timed collectives; how many modules got them.

    No FSDP2 module can exist unless torch.distributed.fsdp was imported (fully_shard lives there):
    a ZeRO-0/1 rank skips that import (~0.3 s CPU, issue #36) instead of importing it to find none."""
    if "torch.distributed.fsdp" not in sys.modules:
        return 0
    from torch.distributed.fsdp import FSDPModule

    gather, scatter = _comms(trace)
    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, FSDPModule):
                try:
                    m.set_custom_all_gather(gather)
                    m.set_custom_reduce_scatter(scatter)
                except (ValueError, AttributeError):  # several param groups: left as torch's
                    continue
                n += 1
    return n


@contextlib.contextmanager
def tensor_parallel_waits(trace: Any, on: bool) -> Iterator[None]:
    """While a step's forward and backward run (``on``: tp > 1), the waits on DTensor's
    collectives count as waiting. DTensor issues them as functional collectives whose result is
    an AsyncCollectiveTensor, waited on at first use through the module's ``wait_tensor``: that
    function is timed for the step and put back after it (the same op, the same result)."""
    if not on:
        yield
        return
    import torch.distributed._functional_collectives as funcol

    plain = funcol.wait_tensor

    def timed(tensor):
        t = time.perf_counter()
        try:
            return plain(tensor)
        finally:
            trace.blocked_s += time.perf_counter() - t

    funcol.wait_tensor = timed
    try:
        yield
    finally:
        funcol.wait_tensor = plain
