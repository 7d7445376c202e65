"""Post a pipeline stage's next receive before its current action computes; send without waiting.

torch's GPipe and 1F1B schedules post a receive only when the action that needs it is next:
stage 0 of 1F1B finishes F(i+1), then posts the receive for grad(i), which stage 1 produced while
F(i+1) ran. On gloo a send completes only once its receive is posted (the receiver announces its
buffer, then the data flows), and NCCL pairs them the same way, so every hand-off paid a round
trip plus the transfer after the consumer became free — idle time the schedule's own
dependencies do not need (benchmarks/bubble.py: measured against the replay with no time between
actions). Here each action, before it computes, posts the next receive of each kind this stage
takes (activations from the previous stage, gradients from the next), so the data arrives while
it computes; the action that needs it waits on it first. Sends are posted as soon as the
schedule asks for them and waited on at the end of the step (torch's 1F1B waits for each send to
complete before the stage's next action, and its first-stage F output waits a whole action before
it is even posted); the tensors they read are fresh per microbatch and the pending work keeps them.

Receives of one kind are posted in ascending microbatch order, whoever posts them (this class or
the schedule), which is the order the peer sends them in: a receive can never be matched with
another microbatch's send. At most one early receive per kind is outstanding. Used for the
one-stage-per-rank schedules (gpipe, 1f1b); the multi-stage schedules run torch's action lists.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

KINDS = {"F": "get_fwd_recv_ops", "B": "get_bwd_recv_ops"}
SENDS = ("get_fwd_send_ops", "get_bwd_send_ops")


class EarlyRecv:
    """Wraps one PipelineStage's receive getters and its F/B actions (see the module docstring)."""

    def __init__(self, stage: Any, n_microbatches: int):
        self.stage, self.m = stage, n_microbatches
        self._get = {kind: getattr(stage, name) for kind, name in KINDS.items()}
        self.reset()
        for kind, name in KINDS.items():
            setattr(stage, name, self._getter(kind))
        for name in SENDS:
            setattr(stage, name, self._sender(getattr(stage, name)))
        stage.forward_one_chunk = self._action("F", stage.forward_one_chunk)
        stage.backward_one_chunk = self._action("B", stage.backward_one_chunk)

    def reset(self) -> None:
        """Start of a step: nothing posted."""
        self.next = {"F": 0, "B": 0}  # lowest microbatch whose receive is not posted yet
        self.early: dict[tuple[str, int], list] = {}  # posted here, not yet waited on
        self.sends: list = []  # posted sends, waited on by finish()

    def finish(self) -> None:
        """End of a step: wait for every send posted here."""
        for works in self.sends:
            for w in works:
                w.wait()
        self.sends = []

    def _sender(self, get: Callable[[int], list]) -> Callable[[int], list]:
        def send(mb: int) -> list:
            ops = get(mb)
            if ops:
                self.sends.append(dist.batch_isend_irecv(ops))
            return []  # nothing left for the schedule to post or wait on
        return send

    def _getter(self, kind: str) -> Callable[[int], list]:
        def get(mb: int) -> list:
            if (kind, mb) in self.early or mb < self.next[kind]:
                return []  # posted early: the action waits on it
            ops = self._get[kind](mb)
            self.next[kind] = mb + 1
            return ops
        return get

    def _post_next(self) -> None:
        for kind in KINDS:
            mb = self.next[kind]
            if mb >= self.m or any(k == kind for k, _ in self.early):
                continue
            ops = self._get[kind](mb)
            self.next[kind] = mb + 1
            if ops:
                self.early[(kind, mb)] = dist.batch_isend_irecv(ops)

    def _action(self, kind: str, fn: Callable) -> Callable:
        def run(mb: int, *args, **kwargs):
            for w in self.early.pop((kind, mb), ()):
                w.wait()
            self._post_next()
            return fn(mb, *args, **kwargs)
        return run
