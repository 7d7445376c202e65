"""Attention sinks (GPT-OSS): a learned logit per head that joins every query's softmax with a
value of 0 (transformers' GptOss eager_attention_forward: the scores and a sink column softmaxed
together, the sink column dropped).

The sink joins the log-sum-exp of a query row ONCE, after the keys' (out, lse) are known:

    lse' = logaddexp(lse, sink),   out' = out · exp(lse − lse')

so a kernel that returns (out, lse) needs nothing else: one rank's core here (CPU: the flash
kernel, whose backward takes out and lse) and the rings of context parallel, which merge their
blocks first and then add the sink once (paralayer/parallel/context/ring.py, window_ring.py; adding
it per block would count it once per chunk). Backward for q, k, v: the kernel's own, given out' and
lse' (its probabilities exp(s − lse') are then the sink-inclusive ones, and rowsum(dout · out') the
right correction). The sink's gradient is that of a softmax logit of value 0:

    dsink[h] = −Σ_{b, rows} exp(sink[h] − lse') · rowsum(dout · out')

Nothing of (s, s) is kept for backward (the window's mask is made again there). Other devices
than the CPU take the eager form (:func:`eager_sink_attention`, which forms the scores)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from paralayer.model.norms import wide


def add_sink(out_acc: Tensor, lse_acc: Tensor, sinks: Tensor) -> None:
    """In place: fp32 ``out_acc`` (b, h, s, d) and ``lse_acc`` (b, h, s) with the sink of each head
    (``sinks`` (h,)) in the softmax."""
    lse_t = torch.logaddexp(lse_acc, wide(sinks.detach()).view(1, -1, 1))
    out_acc.mul_(torch.exp(lse_acc - lse_t).unsqueeze(-1))
    lse_acc.copy_(lse_t)


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks (h,) from these query rows (``out``, ``lse``: with the sink)."""
    p_sink = torch.exp(wide(sinks.detach()).view(1, -1, 1) - lse)
    delta = (wide(dout) * wide(out)).sum(-1)
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)


def _mask(s: int, window: Optional[int], device) -> Optional[Tensor]:
    """The window's additive mask (0 where a key is seen, −inf elsewhere); None for full causal."""
    if window is None:
        return None
    pos = torch.arange(s, device=device)
    diff = pos[:, None] - pos[None, :]
    return torch.zeros(s, s, device=device).masked_fill(~((diff >= 0) & (diff < window)), float("-inf"))


def _expand(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class _SinkAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, window, scale):
        from paralayer.compat import aten_op

        groups = q.size(1) // k.size(1)
        causal, mask = window is None, _mask(q.size(2), window, q.device)
        out, lse = aten_op("_scaled_dot_product_flash_attention_for_cpu")(
            q, _expand(k, groups), _expand(v, groups), 0.0, causal, attn_mask=mask, scale=scale)
        out32, lse = wide(out), wide(lse).contiguous()
        add_sink(out32, lse, sinks)
        out = out32.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        from paralayer.compat import aten_op

        q, k, v, out, lse, sinks = ctx.saved_tensors
        groups = q.size(1) // k.size(1)
        window = ctx.window
        dout = dout.contiguous()
        dq, dk, dv = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout, q, _expand(k, groups), _expand(v, groups), out, lse, 0.0, window is None,
            attn_mask=_mask(q.size(2), window, q.device), scale=ctx.scale)
        if groups > 1:
            b, h, s, d = dk.shape
            dk = dk.view(b, h // groups, groups, s, d).sum(2)
            dv = dv.view(b, h // groups, groups, s, dv.size(-1)).sum(2)
        return dq, dk, dv, sink_grad(dout, out, lse, sinks), None, None


def eager_sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, window: Optional[int],
                         scale: float) -> Tensor:
    """transformers' form: the (s, s) scores with a sink column, softmaxed in fp32, the column dropped."""
    groups = q.size(1) // k.size(1)
    s = torch.matmul(wide(q), wide(_expand(k, groups)).transpose(-1, -2)) * scale
    pos = torch.arange(q.shape[2], device=q.device)
    diff = pos[:, None] - pos[None, :]
    seen = (diff >= 0) & (diff < window) if window is not None else diff >= 0
    s = s.masked_fill(~seen, float("-inf"))
    sink = wide(sinks).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, wide(_expand(v, groups))).to(q.dtype)


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, window: Optional[int],
                   scale: Optional[float] = None) -> Tensor:
    """Causal (``window`` None) or windowed attention on (b, heads, s, d) with each head's sink in
    the softmax; k/v may carry fewer (GQA) heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype and q.size(-1) == v.size(-1):
        return _SinkAttnFn.apply(q, k, v, sinks, window, scale)
    return eager_sink_attention(q, k, v, sinks, window, scale)
