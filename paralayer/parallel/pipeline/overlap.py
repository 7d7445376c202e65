"""DualPipe's overlapped forward-backward: one microbatch's forward and another's backward on the
same rank, each one's communication in flight while the other computes (arXiv 2412.19437 §3.2.1).

torch's ScheduleDualPipeV places the pairs (``OVERLAP_F_B``: a forward on one chunk beside a full
backward on the rank's other chunk) and runs their halves one after the other unless a framework
registers what runs inside (``register_custom_function``). Here the two halves run as two
cooperative tasks that hand the rank back and forth at every expert-parallel all-to-all:

    F: attention → counts → dispatch ┐ experts → combine ┐ next layer's attention ...
    B:                  head grads ... ┘ combine' ─────── ┘ experts' → dispatch' ...

A half issues its all-to-all asynchronously (``async_op=True``: on CPU gloo runs it on its own
threads; on CUDA NCCL runs it on its own stream, the side stream DeepSeek gives its 20 SMs), hands
the rank to the other half, which computes up to its own next all-to-all, and waits on its
collective only when the rank comes back. Forward's send to the next stage is posted as soon as
the forward ends, so it travels while the backward still computes (the backward's send follows
in the schedule's order: both may go to the same peer, and point-to-point messages match in
order). Exactly one half runs at any moment, and where they switch depends only on the program
(the number and order of all-to-alls), so every rank of an expert group issues its collectives
in the same order and each half computes exactly what it computes alone: losses and gradients
equal the schedule's serial order bit for bit (tests/test_overlap.py).

Which half is calling is read from autograd, not from the thread: the backward half is the one
inside a backward pass (on CUDA autograd runs the backward's nodes on its device thread, not the
caller's). The backward half runs on a helper thread (one per rank, kept) that takes the caller's
grad mode, autocast state and CUDA device (all thread-local in torch).

``log`` holds this step's (half, event, label) records: ``issue`` (a collective posted), ``wait``
(its wait returned), ``run`` (a half got the rank), ``done`` (a half ended), and ``start`` at each
overlapped action. A collective was overlapped when the other
half ran between its issue and its wait (:func:`hidden_collectives`).
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from paralayer.compat import in_backward


def _other(half: str) -> str:
    return "B" if half == "F" else "F"


class OverlappedFB:
    """The runtime of torch's ``OVERLAP_F_B`` action over one rank's stages (see the module docstring).

    Args:
        stages: this rank's PipelineStages (the two chunks of the V).
        device: where they compute (CUDA: the helper thread selects it too).
    """

    def __init__(self, stages: list, device: torch.device):
        self.by_index = {st.stage_index: st for st in stages}
        # chunks with expert all-to-alls (DeepSeek-V3's first chunk holds the dense layers only)
        self.has_a2a = {st.stage_index: any(getattr(m, "ep_group", None) is not None for m in st.submod.modules())
                        for st in stages}
        self.device = torch.device(device)
        self.log: list[tuple[str, str, str]] = []
        self.actions = 0  # overlapped actions run since the last reset
        self._cv = threading.Condition()
        self._turn: Optional[str] = None  # the half that may run; None outside an overlapped action
        self._done: set[str] = set()
        self._sent: dict[int, set[int]] = {}  # stage index -> microbatches whose F send went out early
        self._sends: list = []  # those sends' works, waited on by finish()
        # one helper thread for the rank's life, not one started per action
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-backward")
        for st in stages:
            self._defer_send(st)

    # ---- the step
    def register(self, schedule: Any) -> None:
        """Make ``schedule`` (a ScheduleDualPipeV) run its overlapped actions here."""
        from torch.distributed.pipelining.schedules import OVERLAP_F_B

        schedule.register_custom_function(OVERLAP_F_B, self.run)

    def reset(self) -> None:
        """Start of a step."""
        self.log, self.actions, self._sent = [], 0, {}

    def finish(self) -> None:
        """End of a step: wait for the sends posted early."""
        for works in self._sends:
            for w in works:
                w.wait()
        self._sends = []

    # ---- the point where a half hands the rank over (expert.py's all-to-all calls it)
    def wait(self, work: Any, label: str) -> None:
        """Wait on ``work`` (an issued collective); inside an overlapped action, let the other half
        run first, while it is in flight."""
        half = self._half()
        if half is None:
            work.wait()
            return
        self.log.append((half, "issue", label))
        self._switch(half)
        work.wait()
        self.log.append((half, "wait", label))

    def _half(self) -> Optional[str]:
        if self._turn is None:
            return None
        return "B" if in_backward() else "F"

    def _switch(self, me: str) -> None:
        other = _other(me)
        with self._cv:
            if other in self._done:
                return
            self._turn = other
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == me)
        self.log.append((me, "run", ""))

    # ---- the action
    def run(self, action: Any, ctx: Any) -> None:
        """torch's custom function for ``OVERLAP_F_B``: ``action.sub_actions`` = (forward, full backward)."""
        fwd, bwd = action.sub_actions
        sched = ctx.schedule_ref
        errors: dict[str, BaseException] = {}
        self.actions += 1
        self.log.append(("", "start", ""))
        self._done = set()
        # the half with all-to-alls goes first: its first one is then in flight while the other computes
        self._turn = "B" if self.has_a2a[bwd.stage_index] and not self.has_a2a[fwd.stage_index] else "F"
        state = _thread_state(self.device)

        def half(name: str, fn: Callable[[], None]) -> None:
            try:
                with self._cv:
                    self._cv.wait_for(lambda: self._turn == name)
                self.log.append((name, "run", ""))
                fn()
            except BaseException as e:  # noqa: BLE001 - raised again by the caller
                errors[name] = e
            finally:
                self.log.append((name, "done", ""))
                with self._cv:
                    self._done.add(name)
                    self._turn = _other(name)
                    self._cv.notify_all()

        helper = self._helper.submit(state, lambda: half("B", lambda: self._backward(sched, bwd)))
        try:
            half("F", lambda: self._forward(sched, fwd, ctx))
        finally:
            helper.result()
            self._turn = None
        for name in ("F", "B"):
            if name in errors:
                raise errors[name]

    def _forward(self, sched: Any, a: Any, ctx: Any) -> None:
        """torch's FORWARD action (schedules.py, _PipelineScheduleRuntime), its send posted at once."""
        i, mb = a.stage_index, a.microbatch_index
        stage = self.by_index[i]
        sched._assert_unsharded(stage)
        if not stage.is_first and (i - 1) not in self.by_index:
            for w in sched.fwd_recv_ops.pop((i, mb)):
                w.wait()
        out = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
        sched._maybe_compute_loss(stage, out, ctx.target_mbs, mb)
        if (i + 1) in self.by_index:
            self.by_index[i + 1].set_local_fwd_input(out, mb)
        elif not stage.is_last:
            ops = stage.get_fwd_send_ops(mb)
            if ops:
                self._sends.append(dist.batch_isend_irecv(ops))
            self._sent.setdefault(i, set()).add(mb)

    def _backward(self, sched: Any, a: Any) -> None:
        """torch's FULL_BACKWARD action (schedules.py, _PipelineScheduleRuntime)."""
        i, mb = a.stage_index, a.microbatch_index
        stage = self.by_index[i]
        sched._assert_unsharded(stage)
        if not stage.is_last and (i + 1) not in self.by_index:
            for w in sched.bwd_recv_ops.pop((i, mb)):
                w.wait()
        loss = sched._maybe_get_loss(stage, mb)
        sched.backward_counter[i] += 1
        last = sched.backward_counter[i] == sched._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if (i - 1) in self.by_index:
            self.by_index[i - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def _defer_send(self, stage: Any) -> None:
        """The schedule's own SEND_F for a forward whose send already went out posts nothing."""
        get = stage.get_fwd_send_ops

        def send_ops(mb: int) -> list:
            if mb in self._sent.get(stage.stage_index, ()):
                return []
            return get(mb)

        stage.get_fwd_send_ops = send_ops


def _thread_state(device: torch.device) -> Callable[[Callable[[], None]], None]:
    """A runner that gives a helper thread the caller's grad mode, autocast and CUDA device."""
    grad = torch.is_grad_enabled()
    casts = [(dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")
             if (dev == "cpu" or torch.cuda.is_available()) and torch.is_autocast_enabled(dev)]
    cache = torch.is_autocast_cache_enabled()

    def run(fn: Callable[[], None]) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad), contextlib.ExitStack() as stack:
            for dev, dtype in casts:
                stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
            fn()

    return run


def hidden_collectives(log: list[tuple[str, str, str]]) -> tuple[int, int]:
    """(collectives during which the other half ran, collectives issued while the other half had
    work left), over a step's ``log``. The overlap hides every one it can: the two are equal; a
    runtime that waits on each collective before the other half starts gives (0, n)."""
    hidden = hideable = 0
    open_: dict[str, bool] = {}
    done: set[str] = set()
    for half, event, _ in log:
        if event == "start":  # a new overlapped action: both halves alive again
            done.clear()
            open_.clear()
        elif event == "issue":
            hideable += _other(half) not in done
            open_[half] = False
        elif event == "wait":
            hidden += open_.pop(half, False)
        elif event == "done":
            done.add(half)
        for h in open_:
            if h != half:
                open_[h] = True
    return hidden, hideable
