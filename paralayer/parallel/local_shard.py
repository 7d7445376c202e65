"""A parameter's or gradient's local shard, whatever parallelism made it a DTensor.

Its own file because every axis needs it (tensor, tp_overlap, grad_sync, data, tied embeddings)
and none of them should have to import another axis for it.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (TP, FSDP), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
