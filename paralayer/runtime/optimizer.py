"""AdamW with the fastest implementation the parameters' device has.

On CUDA, ``fused=True`` runs the whole update of every parameter in a few kernels (torchtitan's
default); elsewhere ``foreach=True`` (one vectorised op per step over lists of tensors). The
foreach kernels refuse to mix DTensors with plain tensors (MoE blocks stay plain under TP), so
each kind gets its own parameter group.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def param_groups(params: Sequence[nn.Parameter]) -> list[dict]:
    """DTensor parameters in one group, plain tensors in another (empty groups dropped)."""
    from torch.distributed.tensor import DTensor

    groups = ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
    return [{"params": g} for g in groups if g]


def adamw(params: Sequence[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float,
          eps: float = 1e-8, fused: Optional[bool] = None) -> torch.optim.AdamW:
    """AdamW, fused on CUDA (``fused=None``: decided by the first parameter's device)."""
    if fused is None:
        fused = bool(params) and params[0].device.type == "cuda"
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(param_groups(params), lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, **impl)


def implementation(opt: torch.optim.Optimizer) -> str:
    """'fused', 'foreach' or 'for-loop': what the optimizer's first group runs."""
    g = opt.param_groups[0]
    return "fused" if g.get("fused") else "foreach" if g.get("foreach") else "for-loop"
