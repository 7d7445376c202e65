"""RMSNorm with a hand-written backward that keeps less for the backward pass than torch's
composite (tests/test_rmsnorm.py checks it against two outside oracles). Used for the block's
norms and for Qwen3's per-head q/k norms; :class:`OffsetRMSNorm` is Gemma's (gain 1 + w)."""
from __future__ import annotations

import torch
from torch import nn


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a sum or a softmax's statistics over ``dtype`` values: fp32, or fp64 for fp64
    (the FP8 layout tests' reference precision, where an fp32 sum's order would show)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`wide_dtype` (``t.float()`` that keeps fp64)."""
    return t.to(wide_dtype(t.dtype))


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) · (w + offset), computed in fp32; saves x (in its own dtype) and the per-token
    1/rms. offset 0: Llama's (the normalised x cast to x's dtype, then × w); offset 1: Gemma's (the
    gain 1 + w applied in fp32 before the cast, as transformers' Gemma3RMSNorm)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
        xf = wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        if offset:
            return (xf * rstd * (wide(weight) + offset)).to(x.dtype)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = wide(x) * rstd  # recomputed: one elementwise pass instead of a saved fp32 copy
        gf = wide(g)
        gw = (gf * xhat).sum(dim=tuple(range(g.dim() - 1))).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gy = gf * (wide(weight) + ctx.offset)
            gx = (rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that keeps less for backward: its input and the per-token 1/rms, not the
    fp32 copy of the input and the fp32 normalised input torch's composite keeps (4h + 2 bytes
    per token in bf16, 8h + 4 in fp32, where this keeps 2h + 4 and 4h + 4). What Megatron's and
    Apex's fused norms save; same parameter, same result (tests/test_recompute.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormFn.apply(x, self.weight, eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight w scales by (1 + w), in fp32 (transformers' Gemma3RMSNorm);
    init w = 0 (model.norm_offset, paralayer/model/transformer.py). Saves what :class:`RMSNorm` saves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormFn.apply(x, self.weight, eps, 1.0)


def make_norm(dim: int, eps: float, offset: bool) -> RMSNorm:
    """The config's RMSNorm over ``dim``: Gemma's (1 + w) when ``offset`` (model.norm_offset)."""
    return (OffsetRMSNorm if offset else RMSNorm)(dim, eps=eps)
