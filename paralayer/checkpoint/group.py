"""The process group checkpoints talk over, and the few collectives they need.

Why a group of its own: saving or loading terabytes takes longer than the training collectives'
timeout (train.collective_timeout_s), and an asynchronous save runs DCP's collectives on a background
thread, which must not share a group with the training step. ``checkpoint_group`` makes a gloo
group over the same ranks with ``checkpoint.timeout_s`` (what torchtitan does for async saves).
Every helper is the identity without a process group, so one plain process can load a checkpoint.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def checkpoint_group(timeout_s: float, ranks: Optional[list[int]] = None):
    """A gloo group over ``ranks`` (default: the world) whose collectives time out after
    ``timeout_s`` seconds. Collective: every rank of the world calls it. None without a group."""
    if not initialized():
        return None
    return dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))


def rank(group=None) -> int:
    return dist.get_rank(group) if initialized() else 0


def world(group=None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def barrier(group=None) -> None:
    if initialized():
        dist.barrier(group=group)


def broadcast_obj(obj: Any, group=None) -> Any:
    """rank 0 of ``group`` → everyone (the identity without a process group)."""
    if not initialized():
        return obj
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_obj(obj: Any, group=None) -> list:
    if not initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: Optional[str], group=None) -> Optional[str]:
    """Every rank learns whether any rank failed (the lowest failing rank's message), so all ranks
    raise together or none does: a rank that raised alone would leave the others in a collective."""
    return next((e for e in all_gather_obj(error, group) if e), None)
