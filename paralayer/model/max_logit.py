"""The largest pre-softmax logit of each attention head over a step, for QK-clip (Kimi K2's MuonClip).

    S_max^h = max over the step's sequences (every microbatch) and the visible pairs (i, j) of
              scale · q_i^h · k_j^h          (after RoPE; the causal mask and any window applied)

The attention kernels (SDPA, the flash op) never return it, so it is computed beside them, without
gradient, only when QK-clip is on (paralayer/optim/qk_clip.py sets a :class:`MaxLogit` on each
softmax attention module; None otherwise: nothing runs). One extra q·kᵀ GEMM per layer and
microbatch, in fp32, over a few heads at a time so that at most ``CHUNK_ELEMENTS`` scores exist at
once (the kernels themselves never hold the (s, s) scores either). A recomputed core records
the same maxima again, which a max does not mind.
"""
from __future__ import annotations

from typing import Optional

import torch

#: the most (b, heads, s, s) scores formed at once (fp32: 256 MiB)
CHUNK_ELEMENTS = 1 << 26


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, window: Optional[int] = None) -> torch.Tensor:
    """(heads,) fp32: each query head's largest visible ``scale · q·k`` on (b, heads, s, d) q and
    (b, kv_heads, s, d) k (GQA: query head h reads kv head h // (heads / kv_heads), as the cores
    repeat K)."""
    b, h, s, _ = q.shape
    groups = h // k.shape[1]
    pos = torch.arange(s, device=q.device)
    diff = pos[:, None] - pos[None, :]
    hidden = diff < 0 if window is None else (diff < 0) | (diff >= window)
    per = max(1, min(h, CHUNK_ELEMENTS // max(1, b * s * s)))
    out = torch.empty(h, dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # the GEMM in q's dtype, as the kernel's own
        for a in range(0, h, per):
            e = min(h, a + per)
            kv = torch.arange(a, e, device=q.device) // groups
            scores = torch.matmul(q[:, a:e], k[:, kv].transpose(-1, -2)).float().mul_(scale)
            out[a:e] = scores.masked_fill_(hidden, float("-inf")).amax(dim=(0, 2, 3))
    return out


class MaxLogit:
    """A module's running per-head maximum over a step (its local heads: under tensor parallel the
    rank's own); ``reset`` before the step's first forward."""

    def __init__(self, heads: int, device: torch.device):
        self.value = torch.full((heads,), float("-inf"), dtype=torch.float32, device=device)
        # False while a forward must not count: a pipeline stage's shape inference runs one on
        # uninitialised tensors (runtime/moe_step.py count_real_forwards_only toggles it)
        self.count_stats = True

    def reset(self) -> None:
        self.value.fill_(float("-inf"))

    def record(self, q: torch.Tensor, k: torch.Tensor, scale: float, window: Optional[int] = None) -> None:
        if not self.count_stats:
            return
        torch.maximum(self.value, head_max_logits(q.detach(), k.detach(), scale, window), out=self.value)
