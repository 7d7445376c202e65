"""Which checkpoints live in ``checkpoint.dir``, which are kept, and where damaged ones go.

The rules (docs/checkpoints.md): keep the ``keep`` newest checkpoints that verify, never delete
the one just written, never delete anything newer than the newest one that verifies, and never
delete a damaged checkpoint: it is renamed ``step-N.damaged`` with a warning that names the file
and the reason, so a person can look at it. Only rank 0 runs these (after a save is complete).
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Optional

from paralayer.checkpoint.manifest import COMPLETE, CheckpointDamaged, CheckpointError, verify_checkpoint

STEP_RE = re.compile(r"^step-(\d{8})$")
TMP_RE = re.compile(r"^step-(\d{8})\.tmp$")
DAMAGED_RE = re.compile(r"^step-(\d{8})\.damaged(-\d+)?$")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, set aside or an unfinished save was cleaned up."""


def warn(msg: str) -> None:
    """One line on stderr in a run (no source line under it); a catchable warning in tests."""
    warnings.warn_explicit(msg, CheckpointWarning, "paralayer", 0, module="paralayer.checkpoint")


def step_dir(ckpt_root: str, step: int) -> str:
    return os.path.join(ckpt_root, f"step-{step:08d}")


def checkpoint_step(path: str) -> int:
    m = STEP_RE.match(os.path.basename(os.path.normpath(path)))
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step-XXXXXXXX)")
    return int(m.group(1))


def complete_steps(ckpt_root: str) -> list[int]:
    """Steps whose directory carries a COMPLETE marker (not verified), ascending."""
    if not os.path.isdir(ckpt_root):
        return []
    out = []
    for name in os.listdir(ckpt_root):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(ckpt_root, name, COMPLETE)):
            out.append(int(m.group(1)))
    return sorted(out)


def list_checkpoints(ckpt_root: str) -> list[str]:
    """Directories named like complete checkpoints (not verified), oldest first."""
    return [step_dir(ckpt_root, s) for s in complete_steps(ckpt_root)]


def set_aside(path: str, reason: str) -> str:
    """Rename a damaged checkpoint to ``step-N.damaged`` (``-2``, ... if taken), warning with the reason."""
    dest = path.rstrip(os.sep) + ".damaged"
    i = 1
    while os.path.exists(dest):
        i += 1
        dest = f"{path.rstrip(os.sep)}.damaged-{i}"
    os.replace(path, dest)
    warn(f"checkpoint {path} is damaged and was set aside as {dest}: {reason}")
    return dest


def _remove_unfinished(ckpt_root: str, current: int) -> None:
    """Saves killed before they finished (``.tmp``) and replaced copies (``.old-PID``)."""
    for name in sorted(os.listdir(ckpt_root)):
        p = os.path.join(ckpt_root, name)
        m = TMP_RE.match(name)
        if m and int(m.group(1)) != current and os.path.isdir(p):
            warn(f"removing {p}: a save that never finished (no {COMPLETE} marker), e.g. killed mid-way")
            shutil.rmtree(p, ignore_errors=True)
        elif ".old-" in name and STEP_RE.match(name.split(".old-")[0]) and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)


def apply_retention(ckpt_root: str, keep: Optional[int], current: int) -> list[int]:
    """After ``current`` was written: set damaged checkpoints aside, then delete verified ones
    beyond the ``keep`` newest (``keep`` None or <= 0: keep all). Returns the steps kept.

    The cheap check (manifest, presence, sizes) decides; the just-written checkpoint counts as
    verified. Nothing newer than the newest verified checkpoint is ever deleted: such a one is
    either verified itself (then it is the newest) or damaged (then it is set aside, not deleted).
    """
    _remove_unfinished(ckpt_root, current)
    verified: list[int] = []
    for s in sorted(complete_steps(ckpt_root), reverse=True):
        path = step_dir(ckpt_root, s)
        if s != current:
            try:
                verify_checkpoint(path, full=False)
            except CheckpointDamaged as exc:
                set_aside(path, str(exc))
                continue
            except CheckpointError:
                continue  # not damaged, not ours to judge (e.g. no marker any more): leave it
        verified.append(s)
    if keep is None or keep <= 0:
        return verified
    kept = set(verified[:keep]) | {current}
    for s in verified:
        if s not in kept:
            shutil.rmtree(step_dir(ckpt_root, s), ignore_errors=True)
    return sorted(kept)
