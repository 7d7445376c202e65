"""Save before SLURM ends or requeues a job. Two signals, as Megatron's exit-signal handler and
submitit use them:

- ``USR2`` (``--signal=USR2@N`` before the time limit, or a preemption notice): the step in
  progress ends, every rank saves the checkpoint, and only then does the signal go on to the
  handler installed before ours (submitit's: rank 0 requeues the job with ``resume=auto``).
- ``SIGTERM`` (``scontrol requeue``, preemption with a grace time, ``scancel``): the same save,
  then the ranks wait for SLURM's SIGKILL (submitit ignores SIGTERM; the requeue is SLURM's own).

Without it a requeue restarts from the last periodic checkpoint and redoes up to
``checkpoint.every`` steps. Installed only where a Python handler already owns the signal (a
submitit task); a local run keeps the defaults. Ranks agree on the signal at the step's end (one
scalar all-reduce, MAX), so they stop at the same step even when it reaches them at different
moments.
"""
from __future__ import annotations

import signal
from typing import Any, Optional

import torch
import torch.distributed as dist

#: agreement codes: a rank that saw USR2 wins (the requeue must go through submitit)
_CODES = {signal.SIGTERM: 1, signal.SIGUSR2: 2}


class Preempted(Exception):
    """Raised by the training loop after the checkpoint is saved and the signal handed on."""


class PreemptSave:
    def __init__(self, sigs: tuple = (signal.SIGUSR2, signal.SIGTERM)):
        """Take over the signals a Python handler owns; inactive off the main thread."""
        self.previous: dict = {}
        self.seen = 0
        for sig in sigs:
            prev = signal.getsignal(sig)
            if callable(prev):
                try:
                    signal.signal(sig, self._note)
                except ValueError:  # not the main thread: signals are not ours to take
                    break
                self.previous[sig] = prev
        self.active = bool(self.previous)

    def _note(self, signum: int, frame: Optional[Any]) -> None:
        self.seen = max(self.seen, _CODES.get(signal.Signals(signum), 0))

    def agreed(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> Optional[signal.Signals]:
        """Collective over ``group``: the signal some rank got (USR2 over SIGTERM), else None."""
        if not self.active:
            return None
        t = torch.tensor([float(self.seen)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        code = int(t.item())
        return next((s for s, c in _CODES.items() if c == code), None)

    def restore(self) -> None:
        """Training is over: the signals go straight to the previous handlers again."""
        for sig, prev in self.previous.items():
            signal.signal(sig, prev)
        self.active = False

    def hand_on(self, sig: signal.Signals) -> None:
        """Give ``sig`` to the previous handler (for USR2 under submitit: rank 0 requeues)."""
        prev = self.previous.get(sig)
        self.restore()
        if sig == signal.SIGUSR2 and callable(prev):
            prev(sig, None)
