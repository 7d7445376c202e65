"""Attention sinks (GPT-OSS, paralayer/model/sinks.py) on one process: the flash-kernel core with
the sink joining the lse once equals transformers' eager form (a sink column softmaxed with the
scores) in output and in every gradient, the sinks' included, full and windowed, GQA; the ring of
context parallel (one rank, three blocks merged) equals it too, and a planted sink added to each
block's lse before the merge (counted once per block, not once) fails. Fast: no rank is started."""
from __future__ import annotations

import pytest
import torch

from paralayer.model import sinks as sk
from paralayer.parallel.context import ring


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 32, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 32, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 32, 8, generator=g, requires_grad=True)
    s = (torch.randn(4, generator=g) * 2).requires_grad_(True)
    return q, k, v, s


def _run(fn):
    q, k, v, s = _inputs()
    out = fn(q, k, v, s)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, s.grad]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _transformers(q, k, v, s, window):
    """transformers' GptOss eager_attention_forward, written out: scores, mask, a sink column."""
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    w = q @ kk.transpose(-1, -2) * 8 ** -0.5
    i = torch.arange(32)
    seen = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    w = w.masked_fill(~seen, float("-inf"))
    logits = torch.cat([w, s.view(1, -1, 1, 1).expand(2, -1, 32, 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1] @ vv


@pytest.mark.parametrize("window", [None, 8])
def test_flash_core_with_the_sink_in_the_lse_equals_the_eager_form(window):
    want = _run(lambda q, k, v, s: _transformers(q, k, v, s, window))
    got = _run(lambda q, k, v, s: sk.sink_attention(q, k, v, s, window))
    errs = [_rel(a, b) for a, b in zip(got, want)]
    print(f"window {window}: out, dq, dk, dv, dsinks rel err {['%.1e' % e for e in errs]}")
    assert max(errs) < 1e-5, errs
    bad = _run(lambda q, k, v, s: sk.sink_attention(q, k, v, s * 0 - 1e4, window))  # the sink left out
    assert _rel(bad[0], want[0]) > 1e-2


def test_ring_adds_the_sink_once_after_its_blocks_merge(monkeypatch):
    want = _run(lambda q, k, v, s: _transformers(q, k, v, s, None))
    got = _run(lambda q, k, v, s: ring.ring_attention(q, k, v, None, sinks=s))
    errs = [_rel(a, b) for a, b in zip(got, want)]
    print(f"ring (one rank, 3 blocks): out, dq, dk, dv, dsinks rel err {['%.1e' % e for e in errs]}")
    assert max(errs) < 1e-5, errs

    # planted: the sink joins each block's lse before the merge (the second half's rows see it twice)
    merge = ring._merge

    def per_block(out_acc, lse_acc, rows, o, lse, fresh):
        o, lse = o.float().clone(), lse.clone()
        sk.add_sink(o, lse, per_block.sinks)
        merge(out_acc, lse_acc, rows, o, lse, fresh)

    q, k, v, s = _inputs()
    per_block.sinks = s
    monkeypatch.setattr(ring, "_merge", per_block)
    monkeypatch.setattr(ring, "add_sink", lambda *a: None)
    bad = ring.ring_attention(q, k, v, None, sinks=s).detach()
    print(f"planted sink per block: out rel err {_rel(bad, want[0]):.1e}")
    assert _rel(bad, want[0]) > 1e-2
