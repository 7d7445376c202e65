"""Context parallelism: ring attention over the zigzag-sharded sequence.

torch's experimental ``context_parallel`` has no CPU sharding strategy for SDPA, so the ring is
written here (see REFERENCE.md, "Ring attention").

Layout
    The sequence is zigzag-sharded (paralayer/parallel/context/zigzag.py): cp rank r holds chunks r
    and 2·cp−1−r of 2·cp, so with causal attention every rank does the same amount of work at every
    ring step.

Forward
    K/V blocks (with n_kv_heads, i.e. the small GQA blocks) travel the cp ring with
    ``dist.batch_isend_irecv``; the exchange for step i+1 is posted before the block computation
    of step i so the transfer overlaps compute. Each block returns (out, lse); blocks are merged in
    fp32 with lse = lse₁ − log σ(lse₁ − lse₂), o = o₁ − σ(lse₂ − lse₁)(o₁ − o₂).

Backward
    An ``autograd.Function``: the CPU attention op gives no gradient through its logsumexp, so
    plain autograd through the merge is wrong. Each block's backward calls the op's own backward
    with the GLOBAL merged out and lse; dQ accumulates locally; partial dK/dV (fp32) ride a second
    ring, following the K/V block they belong to, and arrive home after cp hops.

Backends (per device; ``ring_attention(..., backend=...)`` forces one, as the tests do)
    cpu   aten._scaled_dot_product_flash_attention_for_cpu (+ its _backward)
    cuda  aten._scaled_dot_product_efficient_attention (+ its _backward); fp32/fp16/bf16
    math  explicit matmul/softmax in fp32; any device, used as a fallback and as a cross-check
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from paralayer.compat import aten_op
from paralayer.model.norms import wide, wide_dtype
from paralayer.model.sinks import add_sink, sink_grad

__all__ = [
    "RingAttention",
    "RingStats",
    "make_ring_attention",
    "ring_attention",
]

_KV_TAG = 11
_DKV_TAG = 12


# ----------------------------------------------------------------------------------------------
# Per-block attention kernels: (out, lse) forward and (dq, dk, dv) backward
# ----------------------------------------------------------------------------------------------

def _backend_for(device: torch.device, forced: str | None = None) -> str:
    if forced:
        if forced not in ("cpu", "cuda", "math"):
            raise ValueError(f"ring attention backend {forced!r}; valid: cpu, cuda, math")
        return forced
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "cuda"
    return "math"


def _math_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    s = torch.matmul(wide(q), wide(k).transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_fwd(backend: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """Attention of one block. Returns (out in q.dtype, lse fp32 contiguous (b, h, s_q))."""
    sq = q.size(2)
    if backend == "cpu":
        dv = v.size(-1)
        if dv != q.size(-1):  # its one head width: V padded with zeros here, after the ring carried it
            out, lse = aten_op("_scaled_dot_product_flash_attention_for_cpu")(
                q, k, F.pad(v, (0, q.size(-1) - dv)), 0.0, causal, scale=scale)
            return out[..., :dv], wide(lse).contiguous()
        out, lse = aten_op("_scaled_dot_product_flash_attention_for_cpu")(
            q, k, v, 0.0, causal, scale=scale)
    elif backend == "cuda":
        out, lse, _seed, _off = aten_op("_scaled_dot_product_efficient_attention")(
            q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., :sq]
    else:
        s = _math_scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), wide(v)).to(q.dtype)
    return out, wide(lse).contiguous()


def _block_bwd(backend: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
               lse: Tensor, causal: bool, scale: float):
    """Gradients of one block given the GLOBAL (merged) out and lse of these query rows."""
    if backend == "cpu":
        w = v.size(-1)
        if w != q.size(-1):  # as _block_fwd: zero columns of V, of the output and of its gradient
            pad = (0, q.size(-1) - w)
            dq, dk, dv = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
                F.pad(dout, pad), q, k, F.pad(v, pad), F.pad(out, pad), lse, 0.0, causal, scale=scale)
            return dq, dk, dv[..., :w]
        dq, dk, dv = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif backend == "cuda":
        sq = q.size(2)
        pad = (-sq) % 32  # the kernel's own lse is padded to a multiple of 32
        lse_p = F.pad(lse, (0, pad)) if pad else lse
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _db = aten_op("_scaled_dot_product_efficient_attention_backward")(
            dout, q, k, v, None, out, lse_p.contiguous(), zero, zero, 0.0,
            [True, True, True, False], causal, scale=scale)
    else:
        s = _math_scores(q, k, causal, scale)
        p = torch.exp(s - lse.unsqueeze(-1))
        do = wide(dout)
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, wide(v).transpose(-1, -2))
        delta = (do * wide(out)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, wide(k)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), wide(q)) * scale
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Ring plumbing
# ----------------------------------------------------------------------------------------------

class _Ring:
    """Send to the next cp rank, receive from the previous one (batch_isend_irecv)."""

    def __init__(self, group: dist.ProcessGroup | None):
        if group is None and not dist.is_initialized():
            self.group, self.rank, self.size = None, 0, 1
        else:
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.size = dist.get_world_size(self.group)
        if self.size > 1:
            self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def exchange(self, send: Tensor, tag: int):
        """Post send→next and recv←prev; return (recv buffer, works). Do not modify ``send``."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


def _step_blocks(step: int, rank: int, cp: int, causal: bool, c: int):
    """(q rows, kv rows, causal) blocks to compute at ``step``; rows are slices of the local 2c."""
    full, lo, hi = slice(0, 2 * c), slice(0, c), slice(c, 2 * c)
    if not causal:
        return [(full, full, False)]
    if step == 0:
        return [(lo, lo, True), (hi, lo, False), (hi, hi, True)]
    src = (rank - step) % cp
    if src < rank:
        return [(full, lo, False)]
    return [(hi, full, False)]


def _pairs(qr: slice, kr: slice, causal: bool) -> int:
    nq, nk = qr.stop - qr.start, kr.stop - kr.start
    return nq * (nq + 1) // 2 if causal else nq * nk


@dataclass
class RingStats:
    """Per-rank attention work, accumulated over calls (pairs are per batch element and head).

    Bounded: totals plus the per-step compute times of the latest call only.
    """
    pairs_fwd: int = 0          # query×key pairs computed in forward (causal block: n(n+1)/2)
    pairs_bwd: int = 0
    calls: int = 0
    time_fwd_s: float = 0.0     # block compute time, communication waits excluded
    time_bwd_s: float = 0.0
    last_step_times_fwd_s: list[float] = field(default_factory=list)
    last_step_times_bwd_s: list[float] = field(default_factory=list)
    kv_bytes_sent: int = 0      # K/V bytes this rank sent in forward (the window ring sends fewer)
    dkv_bytes_sent: int = 0     # partial dK/dV bytes sent in backward
    trace: object = None        # the rank's CommTrace (runtime/train.py links it): counts the bytes too

    def add_sent(self, kind: str, nbytes: int) -> None:
        """``kind`` kv | dkv: bytes this rank sent, here and in the comm trace."""
        if kind == "kv":
            self.kv_bytes_sent += nbytes
        else:
            self.dkv_bytes_sent += nbytes
        if self.trace is not None:
            self.trace.sent("cp", kind, nbytes)

    def reset(self) -> None:
        self.pairs_fwd = self.pairs_bwd = self.calls = 0
        self.kv_bytes_sent = self.dkv_bytes_sent = 0
        self.time_fwd_s = self.time_bwd_s = 0.0
        self.last_step_times_fwd_s = []
        self.last_step_times_bwd_s = []


def _expand(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce(dx: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


def _merge(out_acc: Tensor, lse_acc: Tensor, rows: slice, o: Tensor, lse: Tensor, fresh: bool):
    if fresh:
        out_acc[:, :, rows] = wide(o)
        lse_acc[:, :, rows] = lse
        return
    o1, l1 = out_acc[:, :, rows], lse_acc[:, :, rows]
    new_l = l1 - F.logsigmoid(l1 - lse)
    w2 = torch.sigmoid(lse - l1).unsqueeze(-1)
    out_acc[:, :, rows] = o1 - w2 * (o1 - wide(o))
    lse_acc[:, :, rows] = new_l


class _RingAttnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, stats, backend=None, sinks=None):
        b, h, s, _ = q.shape
        hkv = k.size(1)
        groups = h // hkv
        c = s // 2
        backend = _backend_for(q.device, backend)
        cp, rank = ring.size, ring.rank

        # (b, s, h, d) storage seen as (b, h, s, d), like SDPA's own output: the caller's
        # out.transpose(1, 2).reshape(b, s, -1) is then a view, not a second copy kept for wo.
        out_acc = torch.empty(b, s, h, v.size(-1), dtype=wide_dtype(q.dtype), device=q.device).transpose(1, 2)
        lse_acc = torch.empty(b, h, s, dtype=wide_dtype(q.dtype), device=q.device)
        dk = k.size(-1)
        kv = torch.cat([k, v], dim=-1).contiguous()  # one message, K and V at their own widths
        seen = set()
        if stats is not None:
            stats.last_step_times_fwd_s = []
        for step in range(cp):
            works = None
            if step < cp - 1:
                nxt, works = ring.exchange(kv, _KV_TAG)
                if stats is not None:
                    stats.add_sent("kv", kv.numel() * kv.element_size())
            t0 = time.perf_counter()
            kb, vb = kv[..., :dk], kv[..., dk:]
            for qr, kr, blk_causal in _step_blocks(step, rank, cp, causal, c):
                o, lse = _block_fwd(backend, q[:, :, qr], _expand(kb[:, :, kr], groups),
                                    _expand(vb[:, :, kr], groups), blk_causal, scale)
                key = (qr.start, qr.stop)
                _merge(out_acc, lse_acc, qr, o, lse, fresh=key not in seen and step == 0)
                seen.add(key)
                if stats is not None:
                    stats.pairs_fwd += _pairs(qr, kr, blk_causal)
            if stats is not None:
                dt = time.perf_counter() - t0
                stats.time_fwd_s += dt
                stats.last_step_times_fwd_s.append(dt)
            if works is not None:
                ring.wait(works)
                kv = nxt
        if stats is not None:
            stats.calls += 1
        if sinks is not None:  # GPT-OSS: the sink joins the merged log-sum-exp once
            add_sink(out_acc, lse_acc, sinks)

        out = out_acc.to(q.dtype)  # preserve_format: keeps the (b, s, h, d) layout
        ctx.sinks = sinks
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.ring, ctx.causal, ctx.scale, ctx.stats, ctx.backend = ring, causal, scale, stats, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale, stats, backend = ctx.ring, ctx.causal, ctx.scale, ctx.stats, ctx.backend
        b, h, s, d = q.shape
        groups = h // k.size(1)
        c = s // 2
        cp, rank = ring.size, ring.rank
        dout = dout.contiguous()

        dq = torch.zeros(b, h, s, d, dtype=wide_dtype(q.dtype), device=q.device)
        dk_w = k.size(-1)
        kv = torch.cat([k, v], dim=-1).contiguous()
        dkv_acc: Tensor | None = None
        dkv_works = None
        dkv_next: Tensor | None = None
        if stats is not None:
            stats.last_step_times_bwd_s = []
        for step in range(cp):
            kv_works = None
            if step < cp - 1:
                kv_next, kv_works = ring.exchange(kv, _KV_TAG)
            t0 = time.perf_counter()
            kb, vb = kv[..., :dk_w], kv[..., dk_w:]
            part = torch.zeros(kv.shape, dtype=wide_dtype(q.dtype), device=q.device)
            for qr, kr, blk_causal in _step_blocks(step, rank, cp, causal, c):
                # lse rows must be contiguous for the kernels
                dq_, dk_, dv_ = _block_bwd(
                    backend, dout[:, :, qr], q[:, :, qr], _expand(kb[:, :, kr], groups),
                    _expand(vb[:, :, kr], groups), out[:, :, qr], lse[:, :, qr].contiguous(),
                    blk_causal, scale)
                dq[:, :, qr] += wide(dq_)
                part[:, :, kr, :dk_w] += _reduce(wide(dk_), groups)
                part[:, :, kr, dk_w:] += _reduce(wide(dv_), groups)
                if stats is not None:
                    stats.pairs_bwd += _pairs(qr, kr, blk_causal)
            if stats is not None:
                dt = time.perf_counter() - t0
                stats.time_bwd_s += dt
                stats.last_step_times_bwd_s.append(dt)
            if step == 0:
                dkv_acc = part
            else:
                ring.wait(dkv_works)
                dkv_acc = dkv_next + part
            if cp > 1:
                # the partial dK/dV follows its K/V block one hop; after cp hops it is home
                dkv_next, dkv_works = ring.exchange(dkv_acc, _DKV_TAG)
                if stats is not None:
                    stats.add_sent("dkv", dkv_acc.numel() * dkv_acc.element_size())
            if kv_works is not None:
                ring.wait(kv_works)
                kv = kv_next
        if cp > 1:
            ring.wait(dkv_works)
            dkv_acc = dkv_next
        assert dkv_acc is not None
        dsinks = None if ctx.sinks is None else sink_grad(dout, out, lse, ctx.sinks)
        return (dq.to(q.dtype), dkv_acc[..., :dk_w].to(k.dtype), dkv_acc[..., dk_w:].to(v.dtype),
                None, None, None, None, None, dsinks)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------

def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None, *,
                   causal: bool = True, scale: float | None = None,
                   stats: RingStats | None = None, backend: str | None = None,
                   sinks: Tensor | None = None) -> Tensor:
    """Attention over a context-parallel sequence held in zigzag order.

    q: (b, n_heads, s_local, d); k, v: (b, n_kv_heads, s_local, d) with n_heads % n_kv_heads == 0.
    ``s_local`` is the rank's two zigzag chunks (see ``zigzag_shard``); ``group`` is the cp group
    (None: the default group, or no communication when torch.distributed is not initialised).
    Returns (b, n_heads, s_local, d), equal to the matching rows of causal SDPA on the full
    sequence. ``scale`` defaults to 1/sqrt(d). ``backend`` (cpu | cuda | math) forces the block
    kernels; None picks the device's. ``sinks`` (n_heads,): GPT-OSS's per-head logit in every
    softmax (paralayer/parallel/context/sinks.py).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ring_attention expects (b, heads, s, d) tensors")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if q.size(0) != k.size(0) or q.size(2) != k.size(2):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch/sequence")
    if q.size(1) % k.size(1):
        raise ValueError(f"n_heads {q.size(1)} must be a multiple of n_kv_heads {k.size(1)}")
    if q.size(2) % 2:
        raise ValueError(f"local sequence length {q.size(2)} must be even (two zigzag chunks)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    ring = _Ring(group)
    return _RingAttnFn.apply(q, k, v, ring, causal, float(scale), stats, backend, sinks)


class RingAttention(nn.Module):
    """Drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` under cp.

    Call ``attn(q, k, v)`` with (b, h, s_local, d) tensors in zigzag order; k/v may carry fewer
    (GQA) heads. ``self.stats`` records this rank's attention work.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, causal: bool = True):
        super().__init__()
        self.group = group
        self.causal = causal
        self.stats = RingStats()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool | None = None,
                scale: float | None = None) -> Tensor:
        causal = self.causal if is_causal is None else is_causal
        return ring_attention(q, k, v, self.group, causal=causal, scale=scale, stats=self.stats)


def make_ring_attention(group: dist.ProcessGroup | None = None,
                        stats: RingStats | None = None) -> Callable[..., Tensor]:
    """A function ``attn(q, k, v, is_causal=True, scale=None, backend=None)`` running ring
    attention on ``group`` (``backend``: :func:`ring_attention`'s)."""

    def attn(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True,
             scale: float | None = None, backend: str | None = None, sinks: Tensor | None = None) -> Tensor:
        return ring_attention(q, k, v, group, causal=is_causal, scale=scale, stats=stats, backend=backend,
                              sinks=sinks)

    return attn
