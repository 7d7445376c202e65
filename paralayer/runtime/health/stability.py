"""Loss spikes and non-finite steps, handled as the large runs do (PaLM, OPT: restart from a
checkpoint before the spike and skip the batches that caused it).

:class:`Stability` looks at each step's global loss (identical on every rank, so every rank
decides the same without a collective) before the update is applied:

- non-finite loss or grad norm → ``train.on_nonfinite`` (skip | rollback | stop; unset: the old
  ``train.skip_nonfinite`` flag, true = skip, false = stop);
- a spike, loss > mean + ``threshold_sigma`` · std of the last ``window`` accepted losses →
  ``train.spike.action`` (warn | skip | rollback | stop; ``threshold_sigma`` 0 = off).

skip: the update is not applied (the schedule still advances). rollback: :func:`rollback` loads
the newest verified checkpoint taken before the bad step, and the bad step's data batch and the
``train.rollback_skip_margin`` batches after it are skipped; the good batches between the
checkpoint and the bad step are read again. The mapping from training step to data batch is
:meth:`Stability.batch_for` (step s reads the s-th batch that is not skipped), a pure function of
``skipped``, which each checkpoint stores (with the spike window), so a resumed run and a rerun
read exactly the same batches. A second rollback, to a checkpoint older than the first's, keeps
the first's skips and drops nothing else (the batches are identified, not counted).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

MAX_ROLLBACKS = 100  # a run that keeps spiking after this many rollbacks needs a person


class LossSpike(RuntimeError):
    pass


@dataclass
class Verdict:
    action: str  # warn | skip | rollback | stop
    why: str
    nonfinite: bool


class Stability:
    def __init__(self, train_cfg: Any):
        t = train_cfg
        self.on_nonfinite = t.on_nonfinite or ("skip" if t.skip_nonfinite else "stop")
        self.window = int(t.spike.window)
        self.sigma = float(t.spike.threshold_sigma)
        self.spike_action = t.spike.action
        self.margin = int(t.rollback_skip_margin)
        self.history: deque = deque(maxlen=self.window)
        self.skipped: list[int] = []  # the data batches no step reads (sorted)
        self.rollbacks = 0

    # ---- the data a step reads
    def batch_for(self, step: int) -> int:
        """The data batch training step ``step`` reads: the step-th batch that is not skipped."""
        b = step
        for x in self.skipped:
            if x > b:
                break
            b += 1
        return b

    # ---- the verdict on a step
    def check(self, step: int, loss: float, grad_norm: float) -> Optional[Verdict]:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Verdict(self.on_nonfinite, f"step {step}: loss is {loss} (grad norm {grad_norm})", True)
        if self.sigma > 0 and len(self.history) == self.window:
            mean = statistics.fmean(self.history)
            std = statistics.pstdev(self.history)
            if loss > mean and loss > mean + self.sigma * std:
                return Verdict(self.spike_action, f"step {step}: loss spike {loss:.4f} > mean {mean:.4f} + "
                               f"{self.sigma:g} sigma (std {std:.4f}) of the last {self.window} steps", False)
        return None

    def accept(self, loss: float) -> None:
        self.history.append(float(loss))

    # ---- what a checkpoint keeps
    def state_dict(self) -> dict:
        return {"skipped": list(self.skipped), "history": list(self.history), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: Optional[dict], rolling_back: bool = False) -> None:
        """A checkpoint's state. Rolling back keeps the skips made so far (the checkpoint predates
        them, and a skipped batch must stay skipped); a resume takes the checkpoint's."""
        state = state or {}
        self.history = deque((float(x) for x in state.get("history", [])), maxlen=self.window)
        if not rolling_back:
            self.skipped = sorted(int(b) for b in state.get("skipped", _from_ranges(state.get("skips", []))))
            self.rollbacks = int(state.get("rollbacks", 0))

    def skip_after(self, from_step: int, bad_step: int) -> list[int]:
        """Record the skip of a rollback from ``bad_step`` to the checkpoint at ``from_step``; the
        data batches skipped: the one ``bad_step`` read and the ``margin`` unskipped ones after it."""
        new = [self.batch_for(bad_step)]
        b = new[0] + 1
        while len(new) < 1 + self.margin:
            if b not in self.skipped:
                new.append(b)
            b += 1
        self.skipped = sorted(set(self.skipped) | set(new))
        self.rollbacks += 1
        return new


def _from_ranges(skips: list) -> list[int]:
    """An older checkpoint's ``skips`` ([after_step, n]: steps > after_step read n batches later)
    as the batch ids they skipped."""
    out: list[int] = []
    for i, (after, n) in enumerate(skips):
        first = int(after) + 1 + sum(int(m) for a, m in skips[:i] if int(after) + 1 > int(a))
        out += range(first, first + int(n))
    return out


def rollback(run: Any, bad_step: int, group: Any, load_extra) -> dict:
    """Load the newest verified checkpoint before ``bad_step`` into the run; the rollback event.

    ``load_extra(extra)`` restores the scheduler, RNG and this module's state from the loaded
    checkpoint's extra (runtime/rank_checkpoints.py owns those). Collective over the checkpoint group."""
    from paralayer.checkpoint import dcp as ckpt
    from paralayer.checkpoint import group as grp
    from paralayer.checkpoint.manifest import CheckpointError
    from paralayer.checkpoint.retention import checkpoint_step, list_checkpoints

    stab = run.stability
    if stab.rollbacks >= MAX_ROLLBACKS:
        raise LossSpike(f"step {bad_step}: {MAX_ROLLBACKS} rollbacks already; stopping")
    if run.checkpointer is not None:
        run.checkpointer.wait()
    mine = None
    if grp.rank(group) == 0 and run.ckpt_dir is not None:  # rank 0 lists, every rank loads the same
        mine = [p for p in reversed(list_checkpoints(run.ckpt_dir)) if checkpoint_step(p) < bad_step]
    candidates = grp.broadcast_obj(mine, group) or []
    for path in candidates:
        try:
            extra = ckpt.load_checkpoint(path, run.built.chunks, [run.opt], group=group)
        except CheckpointError:
            continue
        load_extra(extra)
        from_step = int(extra["step"])
        skipped = stab.skip_after(from_step, bad_step)
        return {"event": "rollback", "step": bad_step, "from_step": from_step, "skipped_batches": skipped}
    raise LossSpike(f"step {bad_step}: no verified checkpoint before this step to roll back to "
                    f"(set checkpoint.every, or train.on_nonfinite / train.spike.action to skip or stop)")
