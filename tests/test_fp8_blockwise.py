"""Blockwise FP8 (train.fp8.recipe=blockwise, DeepSeek-V3's 1x128 / 128x128 recipe, emulated in
paralayer/model/float8.py) in one process against a tile-by-tile reference written here: whole
tiles, and the partial last tile or block of a K, N or token count that 128 does not divide (as
DeepSeek-V3's own kv_a, N = 576), with a planted scale grid that must fail. Its layouts (pp, dp,
ep, tp) against one process: tests/test_fp8.py."""
from __future__ import annotations

import torch
from torch import nn

from paralayer.model import float8 as f8


def _blockwise_reference(x: torch.Tensor, rows: int, cols: int, planted: bool = False) -> torch.Tensor:
    """Tile by tile (a tile side of 1 taken for every row / column at once): amax, scale 448/amax,
    round to e4m3, back. A slice past the end is the partial last tile, scaled by its own amax;
    ``planted``: by the amax of the whole tile before it, as a scale grid that floor-divides would."""
    out = torch.empty_like(x)
    m, k = x.shape
    rs, cs = m if rows == 1 else rows, k if cols == 1 else cols
    dims = [d for d, n in ((0, rows), (1, cols)) if n > 1]
    for i in range(0, m, rs):
        for j in range(0, k, cs):
            t = x[i:i + rs, j:j + cs]
            pi = i - rs if planted and i + rs > m and i else i
            pj = j - cs if planted and j + cs > k and j else j
            amax = x[pi:pi + rs, pj:pj + cs].abs().amax(dim=dims, keepdim=True)
            s = 448.0 / amax.clamp(min=1e-12)
            out[i:i + rs, j:j + cs] = (t * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s
    return out


def test_blockwise_tiles_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g) * torch.logspace(-2, 2, 256)[:, None]
    for rows, cols in ((1, 128), (128, 128), (128, 1)):
        assert torch.equal(f8.qdq_tiles(x, rows, cols), _blockwise_reference(x, rows, cols))
    a = torch.randn(2, 128, 256, generator=g, requires_grad=True)
    w = torch.randn(128, 256, generator=g, requires_grad=True)
    y = f8._BlockwiseMatmul.apply(a, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    a2, dy2 = a.detach().reshape(-1, 256), dy.reshape(-1, 128)
    wq = _blockwise_reference(w.detach(), 128, 128)
    assert torch.allclose(y.reshape(-1, 128), _blockwise_reference(a2, 1, 128) @ wq.t(), rtol=1e-6, atol=1e-5)
    assert torch.allclose(a.grad.reshape(-1, 256), _blockwise_reference(dy2, 1, 128) @ wq, rtol=1e-6, atol=1e-5)
    want_gw = _blockwise_reference(dy2.t().contiguous(), 1, 128) @ _blockwise_reference(a2, 128, 1)
    assert torch.allclose(w.grad, want_gw, rtol=1e-6, atol=1e-5)
    # the FP8 grads are not the plain ones
    assert not torch.allclose(w.grad, dy2.t() @ a2, rtol=1e-3, atol=1e-3)


def _partial_block_errs() -> list[float]:
    """DeepSeek-V3's kv_a width (N = 512 + 64 = 576) on K = 192 and 2 x 100 tokens: every GEMM
    operand ends in a partial tile or block. The blockwise linear's y, dx and dW against the loop
    reference (each partial tile scaled by its own amax): their relative errors."""
    g = torch.Generator().manual_seed(1)
    lin = f8.BlockwiseFp8Linear.from_float(nn.Linear(192, 576, bias=False))
    nn.init.normal_(lin.weight, std=0.2, generator=g)
    x = torch.randn(2, 100, 192, generator=g, requires_grad=True)
    y = lin(x)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 192), dy.reshape(-1, 576)
    wq = _blockwise_reference(lin.weight.detach(), 128, 128)
    want = (_blockwise_reference(x2, 1, 128) @ wq.t(), _blockwise_reference(dy2, 1, 128) @ wq,
            _blockwise_reference(dy2.t().contiguous(), 1, 128) @ _blockwise_reference(x2, 128, 1))
    got = (y.detach().reshape(-1, 576), x.grad.reshape(-1, 192), lin.weight.grad)
    return [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]


def test_blockwise_partial_blocks_take_their_own_amax(monkeypatch):
    """A K, N or token count that 128 does not divide: the last tile / block is scaled by its own
    elements' amax (DeepSeek's ceil-div scale grid), so DeepSeek-V3's kv_a runs its recipe. Planted:
    the partial tile scaled with the previous tile's amax (the reference then disagrees)."""
    assert max(_partial_block_errs()) < 1e-6
    monkeypatch.setattr(f8, "qdq_tiles", lambda x, rows, cols: _blockwise_reference(x, rows, cols, planted=True))
    assert min(_partial_block_errs()) > 1e-3
