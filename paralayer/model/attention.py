"""Self-attention: projections, optional per-head q/k RMSNorm (Qwen3), RoPE, and the core.

The core is one of two variants, chosen once per layer from the config (``model.sliding_window``
and the layer pattern of paralayer/config/layer_pattern.py):

    causal_attention         every earlier key (SDPA's causal kernel)
    WindowAttention(w)       the key j of query i counts when 0 <= i - j < w (transformers'
                             sliding_window: the query itself and the w-1 before it)

Context parallel replaces ``attn_fn`` with its ring (paralayer/parallel/context/layers.py), which reads
``window`` to mask its blocks and skip those outside every local query's window.
``head_dim`` is ``model.head_dim`` (default d_model / n_heads); q_norm / k_norm weights are
(head_dim,), shared by every head, so under tensor parallel they are replicated.
``model.query_pre_attn_scalar`` (Gemma 3) sets the softmax scale to 1/sqrt(it) instead of
1/sqrt(head_dim): every core takes it as ``scale=`` (SDPA's own argument; the rings of context
parallel pass it to their block kernels). Multiplying q by sqrt(head_dim / it) instead costs
precision: against transformers' Gemma3 at init 0.2 the logits moved 3.9e-6 and the gradients
1.3e-5 relative, where the scale passed through moved them 0.0 and 1.2e-6.
GPT-OSS (``model.attn_bias``, ``model.attn_sinks``): biases on q/k/v/o, and a learned logit per
head that joins each query's softmax with value 0 (paralayer/model/sinks.py; every core takes
``sinks=``, the rings of context parallel too).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from paralayer.config import ModelConfig
from paralayer.model.norms import make_norm
from paralayer.model.positions import apply_rope
from paralayer.model.recompute import recompute
from paralayer.model.sinks import sink_attention

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """GQA: K/V heads repeated to the query heads."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return k, v


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention on (b, heads, s, d); GQA by repeating K/V heads to the query heads."""
    if sinks is not None:
        return sink_attention(q, k, v, sinks, None, scale)
    k, v = _repeat_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """(len(q_pos), len(k_pos)) bool: key j visible to query i (causal, and within the window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    keep = diff >= 0
    return keep & (diff < window) if window is not None else keep


class WindowAttention:
    """Sliding-window causal attention on (b, heads, s, d): query i sees keys i-w+1 … i."""

    def __init__(self, window: int):
        self.window = int(window)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if sinks is not None:
            return sink_attention(q, k, v, sinks, self.window, scale)
        k, v = _repeat_kv(q, k, v)
        pos = torch.arange(q.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(pos, pos, self.window), scale=scale)


def core_for(window: Optional[int]) -> AttnFn:
    """The attention core of a layer with this window (None: full causal)."""
    return sdpa_causal if window is None else WindowAttention(window)


def head_dim_of(cfg: ModelConfig) -> int:
    return int(cfg.head_dim) if cfg.head_dim else cfg.d_model // cfg.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: Optional[int] = None):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        self.rope_theta = cfg.rope_theta
        self.window = window
        bias = bool(cfg.attn_bias)  # GPT-OSS
        # model.attn_gate (Qwen3-Next): q_proj makes [q | gate] per head, the output × sigmoid(gate);
        # per head, so a column split under tensor parallel keeps each head's pair together
        self.gated = bool(cfg.attn_gate)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim * (2 if self.gated else 1), bias=bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=bias)
        # GPT-OSS: a learned logit per head in the softmax (under tp split with the heads)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attn_sinks else None
        # the softmax scale of model.query_pre_attn_scalar, passed to the core (none: 1/sqrt(head_dim))
        qpas = cfg.query_pre_attn_scalar
        self.core_kw = {} if qpas is None else {"scale": float(qpas) ** -0.5}
        if cfg.qk_norm:  # Qwen3, Gemma 3: per head, before RoPE
            self.q_norm = make_norm(self.head_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = make_norm(self.head_dim, cfg.norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        # Replaced by ring attention under context parallel; wrapped by selective recompute.
        self.attn_fn: AttnFn = core_for(window)
        self.recompute_core = False
        self.max_logit = None  # QK-clip on: a paralayer.model.max_logit.MaxLogit of this rank's heads
        # parallel.tp_overlap: the tp collectives fused into the GEMMs (parallel/tensor/tp_overlap.py)
        self.tp_overlap = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.tp_overlap is not None:  # x: this rank's s/tp tokens; q, k, v: the whole sequence
            q, k, v = self.tp_overlap.gather_matmul(x, (self.wq.weight, self.wk.weight, self.wv.weight))
            if self.wq.bias is not None:  # this rank's heads' biases (the linears' hooks do not run)
                q, k, v = q + _local(self.wq.bias), k + _local(self.wk.bias), v + _local(self.wv.bias)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]
        gate = None
        if self.gated:
            q, gate = q.view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, -1)
        # -1 heads: under tensor parallel each rank holds n_heads/tp of them.
        q = q.reshape(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.recompute_core:
            out = recompute(self._core, q, k, v, cos, sin)
        else:
            out = self._core(q, k, v, cos, sin)
        out = out.transpose(1, 2).reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        if self.tp_overlap is not None:
            y = self.tp_overlap.matmul_scatter(out, self.wo.weight)
            # each rank adds the replicated bias to its s/tp tokens: its gradient is a partial sum
            return y if self.wo.bias is None else y + _local(self.wo.bias, partial=True)
        return self.wo(out)

    def _core(self, q, k, v, cos, sin):
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.max_logit is not None:
            self.max_logit.record(q, k, self.core_kw.get("scale", self.head_dim ** -0.5), self.window)
        if self.sinks is None:
            return self.attn_fn(q, k, v, **self.core_kw)
        return self.attn_fn(q, k, v, **self.core_kw, sinks=_local(self.sinks))


def _local(p: torch.Tensor, partial: bool = False) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard under tp); ``partial``: its gradient
    is this rank's share of a sum (a Replicate bias added to s/tp tokens; summed by align_grad)."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(p, DTensor):
        return p
    return p.to_local(grad_placements=[Partial()] * p.device_mesh.ndim) if partial else p.to_local()
