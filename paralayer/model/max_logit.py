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

from dataclasses import dataclass
from typing import Any, Optional

import torch

#: the most (b, heads, rows, s) scores formed at once (fp32: 64 MiB, + the GEMM's own output in
#: q's dtype), in blocks of heads, then of query rows (one head of b · s · s may be larger)
CHUNK_ELEMENTS = 1 << 24


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, window: Optional[int] = None,
                    q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(heads,) fp32: each query head's largest visible ``scale · q·k`` on (b, heads, s_q, d) q and
    (b, kv_heads, s_k, d) k (GQA: query head h reads kv head h // (heads / kv_heads), as the cores
    repeat K). ``q_pos``/``k_pos``: the rows' sequence positions (context parallel's zigzag
    shards); default 0 … s−1."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    groups = h // k.shape[1]
    q_pos = torch.arange(sq, device=q.device) if q_pos is None else q_pos.to(q.device)
    k_pos = torch.arange(sk, device=q.device) if k_pos is None else k_pos.to(q.device)
    diff = q_pos[:, None] - k_pos[None, :]
    hidden = diff < 0 if window is None else (diff < 0) | (diff >= window)
    per = max(1, min(h, CHUNK_ELEMENTS // max(1, b * sq * sk)))  # heads at once
    rows = sq if per > 1 else max(1, min(sq, CHUNK_ELEMENTS // max(1, b * sk)))  # query rows at once
    out = torch.full((h,), float("-inf"), dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # the GEMM in q's dtype, as the kernel's own
        for a in range(0, h, per):
            e = min(h, a + per)
            kv = k[:, torch.arange(a, e, device=q.device) // groups].transpose(-1, -2)
            for r in range(0, sq, rows):
                scores = torch.matmul(q[:, a:e, r:r + rows], kv).float().mul_(scale)
                m = scores.masked_fill_(hidden[r:r + rows], float("-inf")).amax(dim=(0, 2, 3))
                torch.maximum(out[a:e], m, out=out[a:e])
    return out


@dataclass
class ContextShards:
    """Context parallel: this rank holds the queries at ``q_pos``; every rank's keys are gathered
    over ``group`` (no grad, in rank order), their positions ``k_pos``."""
    group: Any
    world: int
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    @torch.no_grad()
    def all_keys(self, k: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        b, kvh, s, d = k.shape
        out = torch.empty((self.world * b, kvh, s, d), dtype=k.dtype, device=k.device)  # rank-major on dim 0
        dist.all_gather_into_tensor(out, k.contiguous(), group=self.group)
        return out.view(self.world, b, kvh, s, d).permute(1, 2, 0, 3, 4).reshape(b, kvh, self.world * s, d)


class MaxLogit:
    """A module's running per-head maximum over a step (its local heads: under tensor parallel the
    rank's own); ``reset`` before the step's first forward."""

    def __init__(self, heads: int, device: torch.device, cp: Optional[ContextShards] = None):
        self.cp = cp
        self.value = torch.full((heads,), float("-inf"), dtype=torch.float32, device=device)
        # False while a forward must not count: a pipeline stage's shape inference runs one on
        # uninitialised tensors (runtime/moe_step.py count_real_forwards_only toggles it)
        self.count_stats = True

    def reset(self) -> None:
        self.value.fill_(float("-inf"))

    def record(self, q: torch.Tensor, k: torch.Tensor, scale: float, window: Optional[int] = None) -> None:
        if not self.count_stats:
            return
        q, k = q.detach(), k.detach()
        if self.cp is None:
            m = head_max_logits(q, k, scale, window)
        else:  # this rank's queries against the whole sequence's keys
            m = head_max_logits(q, self.cp.all_keys(k), scale, window, self.cp.q_pos, self.cp.k_pos)
        torch.maximum(self.value, m, out=self.value)
