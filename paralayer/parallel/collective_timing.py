"""Time in FSDP2's own collectives counts as waiting, not compute (the straggler watch).

Under ZeRO-2/3 the data-parallel traffic is FSDP2's all-gathers (forward, and backward at ZeRO-3)
and reduce-scatters (backward), issued from its hooks, not from our collective call sites
(paralayer/parallel/comm_trace.py). A rank that waits there for a slow peer looked busy, so every
rank looked equally slow and the slowed one was not named. FSDP2 lets a module take its own
all-gather and reduce-scatter (``set_custom_all_gather`` / ``set_custom_reduce_scatter``): ours
are torch's defaults, timed into the trace's ``blocked_s``. An asynchronous all-gather returns a
:class:`TimedWork` whose ``wait()`` (where FSDP2 blocks for the peers) is timed too. The
collectives and their results are torch's own: the numbers do not change.

Each such collective is also one arrival on its group (paralayer/parallel/comm_trace.py: the time
blocked in its call and its ``wait()``), so the exchange of paralayer/metrics/waited_for.py can
tell which member the others waited for; the point-to-point waits of a step (:func:`p2p_waits`:
the pipeline's sends and receives, the cp ring's) name the peer waited on.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterable, Iterator

import torch.distributed as dist
from torch import nn


class TimedWork(dist.Work):
    """A collective's handle whose ``wait()`` hands when it began (monotonic) and its seconds to
    ``waited`` (the trace's ``blocked_s``, or a point-to-point operation's ``p2p_wait``)."""

    def __init__(self, inner: dist.Work, waited: Callable[[float, float], None]):
        super().__init__()
        self.inner, self.waited = inner, waited

    def wait(self, timeout: Any = None) -> bool:
        t0, t = time.monotonic(), time.perf_counter()
        try:
            return self.inner.wait() if timeout is None else self.inner.wait(timeout)
        finally:
            self.waited(t0, time.perf_counter() - t)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> Any:
        return self.inner.get_future()


def _comms(trace: Any) -> tuple:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def blocked(t0: float, seconds: float) -> None:
        trace.blocked_s += seconds

    def timed(call: Callable[[], Any], group: Any) -> Any:
        trace.arrive(trace.key(group))
        t = time.perf_counter()
        work = call()
        trace.blocked_s += time.perf_counter() - t
        return TimedWork(work, blocked) if isinstance(work, dist.Work) else work

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            return timed(lambda: super(TimedAllGather, self).__call__(output_tensor, input_tensor, group,
                                                                      async_op=async_op), group)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            return timed(lambda: super(TimedReduceScatter, self).__call__(output_tensor, input_tensor, group, op,
                                                                          async_op=async_op), group)

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
    function is timed for the step and put back after it (the same op, the same result). Each
    wait is an arrival on the tp group (the ranks of a tp group run the same modules, so they wait
    in the same order; an expert all-to-all waited on here is counted on the tp group too)."""
    if not on:
        yield
        return
    import torch.distributed._functional_collectives as funcol

    plain = funcol.wait_tensor
    key = trace.axis_groups.get("tp")

    def timed(tensor):
        trace.arrive(key)
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


class _Posted(dist.P2POp):
    """A P2POp already recorded (torch's _batch_p2p passes mixed batches on to batch_isend_irecv)."""

    @classmethod
    def of(cls, op: dist.P2POp) -> "_Posted":
        new = object.__new__(cls)
        new.__dict__.update(op.__dict__)
        return new


@contextlib.contextmanager
def p2p_waits(trace: Any) -> Iterator[None]:
    """While a step's forward and backward run, each point-to-point wait names its peer
    (``trace.posted`` / ``p2p_wait``): ``dist.batch_isend_irecv`` (the cp ring, the early receives of
    paralayer/parallel/early_recv.py) and the pipeline schedules' ``_batch_p2p`` hand out handles
    whose ``wait()`` is timed. Put back after the step. A batch that comes back as fewer handles
    than operations (NCCL coalesces them) is left untimed."""
    import torch.distributed as tdist

    sched = sys.modules.get("torch.distributed.pipelining.schedules")
    plain_batch = tdist.batch_isend_irecv
    plain_sched = getattr(sched, "_batch_p2p", None)

    def wrap(ops: list, post: Callable[[], Any]) -> list:
        if not ops or isinstance(ops[0], _Posted):
            return list(post())  # torch's _batch_p2p handing a mixed batch to batch_isend_irecv
        entries = [trace.posted(op.peer, op.tag, getattr(op.op, "__name__", "") == "isend") for op in ops]
        works = list(post())
        if len(works) != len(ops):
            return works
        return [w if not isinstance(w, dist.Work) else
                TimedWork(w, lambda t0, s, e=e: trace.p2p_wait(e, t0, s)) for e, w in zip(entries, works)]

    def batch(ops):
        return wrap(ops, lambda: plain_batch([_Posted.of(op) for op in ops]))

    def sched_batch(ops, desc=None):
        return wrap(ops, lambda: plain_sched([_Posted.of(op) for op in ops], desc=desc))

    tdist.batch_isend_irecv = batch
    if plain_sched is not None:
        sched._batch_p2p = sched_batch
    try:
        yield
    finally:
        tdist.batch_isend_irecv = plain_batch
        if plain_sched is not None:
            sched._batch_p2p = plain_sched


@contextlib.contextmanager
def step_waits(trace: Any, tp: bool) -> Iterator[None]:
    """A step's forward and backward: DTensor's waits (``tp``) and every point-to-point wait timed."""
    with tensor_parallel_waits(trace, tp), p2p_waits(trace):
        yield
