"""Multi-token prediction's per-step bookkeeping in training: which chunk holds the MTP depths,
and the step's ``mtp_loss`` (L_MTP, λ included) over the whole global batch."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.parallel.mesh import Meshes


def mtp_chunk(chunks: Sequence[nn.Module]) -> Optional[nn.Module]:
    """This rank's chunk holding the MTP depths (the last chunk), or None."""
    for c in chunks:
        if getattr(c, "mtp", None) is not None:
            return c
    return None


def reset(chunks: Sequence[nn.Module]) -> None:
    c = mtp_chunk(chunks)
    if c is not None:
        c.mtp.reset_step_stats()


def step_loss(chunks: Sequence[nn.Module], meshes: Meshes, pp: int, depth: int, device: torch.device) -> dict:
    """{"mtp_loss": the mean over microbatches and data ranks of L_MTP}; identical on every rank
    (one all-reduce over dp·cp, one over pp, where the last stage alone holds the value)."""
    if depth <= 0:
        return {}
    c = mtp_chunk(chunks)
    t = torch.zeros(2, dtype=torch.float64)
    if c is not None:
        t[0], t[1] = c.mtp.loss_sum, c.mtp.forwards
    t = t.to(device)
    if meshes.size("dp_cp") > 1:
        dist.all_reduce(t, group=meshes["dp_cp"].get_group())
    if pp > 1:
        dist.all_reduce(t, group=meshes["pp"].get_group())
    t = t.cpu()
    return {"mtp_loss": float(t[0] / t[1]) if float(t[1]) > 0 else float("nan")}
