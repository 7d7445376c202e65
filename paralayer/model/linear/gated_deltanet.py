"""The Gated DeltaNet layer of Qwen3-Next (transformers 5.25 ``Qwen3NextGatedDeltaNet``, the
torch fallback), with its weights named and laid out as there:

    in_proj_qkvz (d → per k-head [q dk | k dk | v r·dv | z r·dv], r = v_heads / k_heads)
    in_proj_ba   (d → per k-head [b r | a r])
    conv1d       depthwise over the channels [q of every head | k … | v …], kernel K, then SiLU
    beta = sigmoid(b)                        how strongly each token writes
    g = -exp(A_log) · softplus(a + dt_bias)  the per-token decay (log) of the state
    q, k l2-normed; the delta rule (paralayer/model/linear/delta_rule.py)
    norm: RMSNorm per value head with gain w (init 1), × silu(z)   (the output gate)
    out_proj (v_heads·dv → d)

Grouped per k-head, the projections split by heads under tensor parallel as they stand (a
column split of in_proj_qkvz / in_proj_ba gives a rank whole k-heads with their v-heads, and
dt_bias / A_log split by rows follow); the conv's channels are not grouped so: its weight is
replicated and each rank reads its own heads' rows (:meth:`conv_rows`), its gradient a partial
sum the tp all-reduce completes, as the gated norm's gain shared by every head
(paralayer/parallel/tensor/layout.py)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from paralayer.model.linear.delta_rule import chunk_gated_delta_rule, l2norm
from paralayer.model.linear.short_conv import causal_conv


def _local(p: torch.Tensor, partial: bool = False) -> torch.Tensor:
    """A parameter as this rank's plain tensor: a tp DTensor's local part; ``partial``: a replicated
    one read by this rank's heads only, so its gradient is a partial sum (summed over tp)."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(p, DTensor):
        return p
    return p.to_local(grad_placements=[Partial()] if partial else None)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with gain ``weight``, times silu(gate), in fp32 (as transformers'
    Qwen3NextRMSNormGated)."""
    dtype = x.dtype
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; ``forward(x, cos, sin)`` like attention (RoPE unused)."""

    def __init__(self, d_model: int, k_heads: int, v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, chunk: int = 64, eps: float = 1e-6):
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"v_heads {v_heads} must be a multiple of k_heads {k_heads}")
        self.k_heads, self.v_heads, self.dk, self.dv = k_heads, v_heads, head_k_dim, head_v_dim
        self.chunk, self.eps = chunk, eps
        r = v_heads // k_heads
        self.in_proj_qkvz = nn.Linear(d_model, k_heads * (2 * head_k_dim + 2 * r * head_v_dim), bias=False)
        self.in_proj_ba = nn.Linear(d_model, k_heads * 2 * r, bias=False)
        channels = 2 * k_heads * head_k_dim + v_heads * head_v_dim
        self.conv1d = nn.Conv1d(channels, channels, conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(head_v_dim))
        self.out_proj = nn.Linear(v_heads * head_v_dim, d_model, bias=False)
        self.tp_size, self.tp_rank = 1, 0  # set by tensor parallel (this rank holds k_heads / tp_size)
        # set by context parallel (paralayer/parallel/context/linear_state.py): the conv and the delta
        # rule of a zigzag shard, the conv's tail and the recurrent state passed over the cp ranks
        self.conv_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
        self.rule_fn: Optional[Callable[..., torch.Tensor]] = None

    def conv_rows(self) -> Optional[torch.Tensor]:
        """The conv channels of this rank's heads ([q | k | v] blocks each split), None for all."""
        if self.tp_size == 1:
            return None
        q, v = self.k_heads * self.dk // self.tp_size, self.v_heads * self.dv // self.tp_size
        r, kd = self.tp_rank, self.k_heads * self.dk
        return torch.cat([torch.arange(r * q, (r + 1) * q), kd + torch.arange(r * q, (r + 1) * q),
                          2 * kd + torch.arange(r * v, (r + 1) * v)])

    def project(self, x: torch.Tensor):
        """x (b, s, d) → q, k (b, s, hk, dk), v, z (b, s, hv, dv), b, a (b, s, hv): this rank's heads."""
        bsz, s = x.shape[:2]
        r = self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(x).view(bsz, s, -1, 2 * self.dk + 2 * r * self.dv)
        ba = self.in_proj_ba(x).view(bsz, s, -1, 2 * r)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=3)
        b, a = torch.split(ba, [r, r], dim=3)
        return (q, k, v.reshape(bsz, s, -1, self.dv), z.reshape(bsz, s, -1, self.dv),
                b.reshape(bsz, s, -1), a.reshape(bsz, s, -1))

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None,
                sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        bsz, s = x.shape[:2]
        q, k, v, z, b, a = self.project(x)
        hk, hv = q.shape[2], v.shape[2]
        mixed = torch.cat([q.reshape(bsz, s, -1), k.reshape(bsz, s, -1), v.reshape(bsz, s, -1)], dim=-1)
        weight = _local(self.conv1d.weight, partial=True)
        rows = self.conv_rows()
        if rows is not None:
            weight = weight.index_select(0, rows.to(weight.device))
        mixed = causal_conv(mixed, weight)[0] if self.conv_fn is None else self.conv_fn(mixed, weight)
        q, k, v = torch.split(mixed, [hk * self.dk, hk * self.dk, hv * self.dv], dim=-1)
        q = l2norm(q.reshape(bsz, s, hk, self.dk).float())
        k = l2norm(k.reshape(bsz, s, hk, self.dk).float())
        v = v.reshape(bsz, s, hv, self.dv)
        beta = b.sigmoid()
        a_log, dt_bias = _local(self.A_log), _local(self.dt_bias)
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        out = (chunk_gated_delta_rule(q, k, v, g, beta, self.chunk)[0] if self.rule_fn is None
               else self.rule_fn(q, k, v, g, beta))
        out = gated_rms_norm(out.to(x.dtype), _local(self.norm.weight, partial=True), z, self.eps)
        return self.out_proj(out.reshape(bsz, s, -1))
