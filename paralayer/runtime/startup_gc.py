"""The cyclic garbage collector off while a rank starts, and on again before its first step.

Why: a rank's start-up (torch, DTensor and the runtime imported, the model built, a checkpoint
loaded) makes about a million Python objects and frees few of them; the collector's passes over
them are about a fifth of the imports' CPU (``import torch, torch.distributed.tensor``: 2.0 → 1.6
CPU s on the 2-core machine), and a restarted job waits on that time (issue #36, the recovery's
"imports and process group"). Training itself runs with the collector on, as before. Imports no
torch: the rank's entries call :func:`pause` before importing it.
"""
from __future__ import annotations

import gc


def pause() -> None:
    """At a rank's entry (``python -m paralayer.runtime.train``; SLURM's ``RankTask``)."""
    gc.disable()


def resume() -> None:
    """Before the first step (``train.train``): what the start-up made is moved out of the
    collector's view (``gc.freeze``: those objects live as long as the rank anyway), so its first
    passes do not make up the skipped work inside the first steps (+0.9 s of "replay of lost
    steps" without it, benchmarks/recovery.py); then the collector is on. A no-op where it was on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
