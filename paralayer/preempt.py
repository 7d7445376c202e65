"""Save before a SLURM requeue: USR2 (``--signal=USR2@N`` before the time limit, or a preemption
notice) ends the step in progress, every rank saves the checkpoint, and only then does the signal go
on to the handler that was installed before ours (submitit's: rank 0 requeues the job with
``resume=auto``). Without it the requeue would restart from the last periodic checkpoint and
redo up to ``checkpoint.every`` steps.

Installed only where a Python handler already owns the signal (a submitit task); a local run keeps
USR2's default. Ranks agree on the signal at the step's end (one scalar all-reduce, MAX), so they
stop at the same step even when the signal reaches them at different moments.
"""
from __future__ import annotations

import signal
from typing import Any, Optional

import torch
import torch.distributed as dist


class Preempted(Exception):
    """Raised by the training loop after the checkpoint is saved and the signal handed on."""


class PreemptSave:
    def __init__(self, sig: int = signal.SIGUSR2):
        self.sig = sig
        self.previous: Any = signal.getsignal(sig)
        self.signalled = False
        self.active = callable(self.previous)
        if self.active:
            signal.signal(sig, self._note)

    @classmethod
    def install(cls, sig: int = signal.SIGUSR2) -> "PreemptSave":
        """Take over ``sig`` if a Python handler owns it; inactive off the main thread."""
        try:
            return cls(sig)
        except ValueError:  # signal.signal outside the main thread
            inactive = cls.__new__(cls)
            inactive.sig, inactive.previous, inactive.signalled, inactive.active = sig, None, False, False
            return inactive

    def _note(self, signum: int, frame: Optional[Any]) -> None:
        self.signalled = True

    def agreed(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> bool:
        """Collective over ``group``: did any rank get the signal?"""
        if not self.active:
            return False
        t = torch.tensor([1.0 if self.signalled else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item() > 0)

    def restore(self) -> None:
        """Training is over: the signal goes straight to the previous handler again."""
        if self.active:
            signal.signal(self.sig, self.previous)
            self.active = False

    def hand_on(self) -> None:
        """Give the signal to the previous handler (on rank 0 submitit requeues the job)."""
        signal.signal(self.sig, self.previous)
        if callable(self.previous):
            self.previous(self.sig, None)
