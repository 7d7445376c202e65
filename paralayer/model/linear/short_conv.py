"""The short causal depthwise convolution before the delta rule (kernel 4 in Qwen3-Next), with
SiLU after it, as transformers' ``causal_conv1d_fn`` fallback.

Output t reads inputs t-K+1 … t. The first K-1 outputs of a sequence read zeros before it, or,
under context parallel, the previous rank's last K-1 inputs (``tail``): passing them makes the cut
invisible. Returns the new tail (this chunk's last K-1 inputs) for the next rank."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (b, s, c); weight: (c, 1, K) (nn.Conv1d's depthwise layout); tail: (b, K-1, c) or None
    (zeros). Returns (silu(conv) (b, s, c), x's last K-1 positions with the tail before them)."""
    kernel = weight.shape[-1]
    s = x.shape[1]
    if tail is None:
        tail = x.new_zeros(x.shape[0], kernel - 1, x.shape[2])
    full = torch.cat([tail.to(x.dtype), x], dim=1)  # (b, K-1+s, c)
    y = F.conv1d(full.transpose(1, 2), weight, groups=x.shape[2])  # valid: exactly s outputs
    return F.silu(y).transpose(1, 2), full[:, s:]
