"""RMSNorm's hand-written backward (model/norms.py ``_RMSNormFn``) against two outside oracles:
fp64 autograd of the formula y = x / sqrt(mean(x²) + eps) · w, and ``torch.nn.functional.rms_norm``
(forward and backward). Norm weights are drawn away from 1 and the input is not centred, so a
backward that drops a term, or sums the weight's gradient wrongly, shows; planted errors must fail."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paralayer.model.norms import RMSNorm, _RMSNormFn

D, EPS = 64, 1e-6


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 17, D, generator=g, dtype=torch.float64) * 2.0 + 0.5)
    w = torch.rand(D, generator=g, dtype=torch.float64) + 0.5  # uniform in [0.5, 1.5)
    gy = torch.randn(3, 17, D, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), gy.to(dtype)


def _run(fn, x, w, gy):
    """(y, dx, dw) of ``fn(x, w)`` under autograd with upstream gradient ``gy``."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(gy)
    return y.detach(), x.grad, w.grad


def _formula_fp64(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _ours(x, w):
    return _RMSNormFn.apply(x, w, EPS)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _errors(fn, dtype=torch.float32):
    x, w, gy = _inputs(dtype)
    got = _run(fn, x, w, gy)
    want = _run(_formula_fp64, *(t.double() for t in (x, w, gy)))
    return [_rel(a, b) for a, b in zip(got, want)]


def test_matches_fp64_autograd_of_the_formula():
    errs = _errors(_ours)
    print(f"ours vs fp64 autograd: y {errs[0]:.1e}, dx {errs[1]:.1e}, dw {errs[2]:.1e}")
    assert max(errs) < 1e-6, errs


def test_matches_torch_rms_norm_forward_and_backward():
    x, w, gy = _inputs()
    ours = _run(_ours, x, w, gy)
    torch_ = _run(lambda a, b: F.rms_norm(a, (D,), b, EPS), x, w, gy)
    errs = [_rel(a, b) for a, b in zip(ours, torch_)]
    print(f"ours vs F.rms_norm: y {errs[0]:.1e}, dx {errs[1]:.1e}, dw {errs[2]:.1e}")
    assert max(errs) < 1e-6, errs


def test_module_is_the_function():
    """The model's RMSNorm module runs this function with its own weight and eps."""
    x, w, gy = _inputs()
    norm = RMSNorm(D, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(w)
    xr = x.clone().requires_grad_(True)
    norm(xr).backward(gy)
    y, dx, dw = _run(_ours, x, w, gy)
    assert torch.equal(norm(x).detach(), y) and torch.equal(xr.grad, dx) and torch.equal(norm.weight.grad, dw)


def test_bf16_within_bf16_rounding():
    errs = _errors(_ours, torch.bfloat16)
    print(f"bf16 ours vs fp64: {errs}")
    assert max(errs) < 2e-2, errs


class _NoProjection(_RMSNormFn):
    """Planted: dx = rstd · g·w, the term through the rms dropped."""

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        return (rstd * g * weight).to(x.dtype), (g * x * rstd).sum(dim=(0, 1)), None


class _WeightGradOffByEps(_RMSNormFn):
    """Planted: dw from x / sqrt(mean(x²)) with eps 1e-3 in place of 1e-6 (dx right)."""

    @staticmethod
    def backward(ctx, g):
        gx = _RMSNormFn.backward(ctx, g)[0]
        x, _, _ = ctx.saved_tensors
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)
        return gx, (g * xhat).sum(dim=(0, 1)), None


@pytest.mark.parametrize("planted", [_NoProjection, _WeightGradOffByEps], ids=["no-projection", "dw-eps"])
def test_planted_backward_errors_fail(planted):
    errs = _errors(lambda x, w: planted.apply(x, w, EPS))
    print(f"planted {planted.__name__}: y {errs[0]:.1e}, dx {errs[1]:.1e}, dw {errs[2]:.1e}")
    assert errs[0] < 1e-6 and max(errs[1:]) > 1e-5, errs  # forward right, a gradient wrong
