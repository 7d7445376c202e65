"""One rank's checkpoints: the resume at start-up, the periodic save, the save on SLURM's signal,
and the run's :class:`~paralayer.checkpoint.dcp.Checkpointer` (the step loop in
paralayer/runtime/train.py calls these; the rollback in runtime/health/stability.py loads through
:func:`checkpoints` and :func:`restore_extra`).

A checkpoint's ``extra`` holds the step, the LR schedule, the RNG, the stability state (the data
skipped by rollbacks) and a blend's data schedule: what :func:`_save` writes, :func:`restore_extra`
reads back."""
from __future__ import annotations

import signal
from typing import Any, Optional, Protocol

from paralayer.runtime import optimizer
from paralayer.runtime.health.preempt import Preempted, PreemptSave


class CheckpointedRun(Protocol):
    """What these functions read of a rank's run (runtime/train.py's RankRun), named here so that this
    module does not import train.py, which imports it."""

    cfg: Any
    built: Any
    checkpointer: Any
    ckpt_dir: Optional[str]
    dataset: Any
    device: Any
    hooks: Any
    opt: Any
    rank: int
    sched: Any
    stability: Any


def resume(run: CheckpointedRun) -> int:
    """Load ``train.resume`` (auto: the newest good checkpoint, a path, or none); the first step to run."""
    resume_from = run.cfg.train.resume
    if resume_from == "none" or run.ckpt_dir is None:
        return 1
    from paralayer.checkpoint import dcp as ckpt

    group = checkpoints(run).group
    recipe_values = optimizer.recipe_hyperparams(run.opt)  # the recipe's decay/betas win over the checkpoint's
    if resume_from == "auto":  # falls back past damaged ones; raises if some exist but none loads
        found = ckpt.resume_latest(run.ckpt_dir, run.built.chunks, [run.opt], group=group)
    else:
        found = (resume_from, ckpt.load_checkpoint(resume_from, run.built.chunks, [run.opt], group=group))
    if found is None:
        return 1
    optimizer.reapply_hyperparams(run.opt, recipe_values)
    path, extra = found
    restore_extra(run, extra)
    start_step = int(extra["step"]) + 1
    if run.rank == 0:
        print(f"paralayer: resumed from {path} at step {start_step}", flush=True)
    return start_step


def restore_extra(run: CheckpointedRun, extra: dict, rolling_back: bool = False) -> None:
    """A loaded checkpoint's small state: the LR schedule, the RNG, the data skipped by rollbacks."""
    from paralayer.checkpoint import dcp as ckpt

    run.sched.load_state_dict(extra["scheduler"])
    ckpt.set_rng_state(extra["rng"])
    run.stability.load_state_dict(extra.get("stability"), rolling_back)
    if extra.get("data") and hasattr(run.dataset, "load_state_dict"):  # a blend's schedule, O(sources)
        run.dataset.load_state_dict(extra["data"])


def save_if_due(run: CheckpointedRun, step: int, stop: int) -> bool:
    """A periodic checkpoint (every ``checkpoint.every`` steps and at the run's last step)."""
    every = run.cfg.checkpoint.every
    if not (every and run.ckpt_dir and (step % every == 0 or step == stop)):
        if run.checkpointer is not None:
            run.checkpointer.poll()  # an asynchronous save becomes COMPLETE once every rank wrote it
        return False
    _save(run, step)
    return True


def stop_if_signalled(run: CheckpointedRun, preempt: PreemptSave, step: int, stop: int, saved: bool, logger) -> None:
    """SLURM's USR2/TERM, agreed by every rank: save (unless just saved), hand the signal on, raise."""
    sig = preempt.agreed(run.device) if (preempt.active and step < stop) else None
    if sig is None:
        return
    if run.ckpt_dir and not saved:
        _save(run, step)
    if run.checkpointer is not None:
        run.checkpointer.wait()
    if run.rank == 0:
        then = "handing the signal to the requeue" if sig == signal.SIGUSR2 else "waiting for SLURM"
        print(f"paralayer: {sig.name} after step {step}: checkpoint saved, {then}", flush=True)
    if logger is not None:
        logger.close()
    preempt.hand_on(sig)
    raise Preempted(f"stopped after step {step} on {sig.name}")


def checkpoints(run: CheckpointedRun):
    """The run's Checkpointer: its own gloo group with checkpoint.timeout_s (collective on first use)."""
    if run.checkpointer is None:
        from paralayer.checkpoint import dcp as ckpt
        from paralayer.checkpoint.group import checkpoint_group

        c = run.cfg.checkpoint
        run.checkpointer = ckpt.Checkpointer(run.ckpt_dir, c.keep, checkpoint_group(c.timeout_s),
                                             async_save=c.async_save, timeout_s=c.timeout_s)
    return run.checkpointer


def _save(run: CheckpointedRun, step: int) -> None:
    from paralayer.checkpoint import dcp as ckpt

    extra = {"step": step, "scheduler": run.sched.state_dict(), "rng": ckpt.rng_state(),
             "stability": run.stability.state_dict(),
             "data": run.dataset.state_dict() if hasattr(run.dataset, "state_dict") else None}
    run.hooks.before_save(run.rank, step)
    checkpoints(run).save(step, run.built.chunks, [run.opt], extra)
