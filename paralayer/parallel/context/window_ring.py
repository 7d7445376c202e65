"""Context parallel for a sliding-window layer: only the K/V chunks some local query can see move.

The sequence is zigzag-sharded as for full attention (paralayer/parallel/context/zigzag.py): 2·cp chunks
of c tokens, rank r holds chunks r and 2cp−1−r, so the balance of the causal work is kept. With
a window w, query chunk a sees key chunk b only when a ≥ b and (a−b)·c − (c−1) < w; every other
(query chunk, key chunk) pair is skipped: no send, no compute. Each rank sends ITS OWN chunks
straight to the ranks that need them (one batch of point-to-point ops, posted before the local
blocks are computed), not round a ring that would carry every block cp−1 hops. Example: window =
seq/4 under cp4 moves 11 chunks where full attention's ring moves 24.

A block is computed by the fast kernel when it is wholly visible (full) or the diagonal with
w ≥ c (causal), else in fp32 with the explicit window mask. Blocks merge by log-sum-exp as in the
full ring; the diagonal blocks go first, so every query row starts from a block that holds at
least itself. Backward: every block's gradient from the global out and lse; the partial dK/dV of
a received chunk goes back to its owner in one batch (the forward's messages reversed).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from paralayer.config.cp_window import blocks, chunk_sends, needed  # noqa: F401 - chunk_sends: callers import it here
from paralayer.model.sinks import add_sink, sink_grad
from paralayer.model.norms import wide, wide_dtype
from paralayer.parallel.context.ring import RingStats, _backend_for, _block_bwd, _block_fwd, _expand, _merge, _reduce

_WKV_TAG, _WDKV_TAG = 21, 22


def _mask(a: int, b: int, c: int, w: int, device) -> Tensor:
    i = torch.arange(c, device=device)
    diff = (a - b) * c + i[:, None] - i[None, :]
    return (diff >= 0) & (diff < w)


def _masked_fwd(q, k, v, mask, scale):
    s = torch.matmul(wide(q), wide(k).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.where(mask, torch.exp(s - safe.unsqueeze(-1)), torch.zeros_like(s))
    return torch.matmul(p, wide(v)).to(q.dtype), lse.contiguous()


def _masked_bwd(dout, q, k, v, out, lse, mask, scale):
    s = torch.matmul(wide(q), wide(k).transpose(-1, -2)) * scale
    p = torch.where(mask, torch.exp(s - lse.unsqueeze(-1)), torch.zeros_like(s))
    do = wide(dout)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, wide(v).transpose(-1, -2)) - (do * wide(out)).sum(-1, keepdim=True))
    return torch.matmul(ds, wide(k)) * scale, torch.matmul(ds.transpose(-1, -2), wide(q)) * scale, dv


class _Peers:
    """The cp group's ranks, global ids, and one batch of point-to-point messages."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def exchange(self, sends: dict[int, Tensor], recv_shapes: dict[int, tuple], tag: int, like: Tensor):
        recvs = {src: torch.empty(shape, dtype=like.dtype, device=like.device) for src, shape in recv_shapes.items()}
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, dst), self.group, tag)
               for dst, t in sorted(sends.items())]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, src), self.group, tag)
                for src, t in sorted(recvs.items())]
        return recvs, (dist.batch_isend_irecv(ops) if ops else [])


def _slots(x: Tensor, slots: list[int], c: int) -> Tensor:
    """(len(slots), *x[..., chunk, :]) for x (..., 2c, d)."""
    return torch.stack([x[..., s * c:(s + 1) * c, :] for s in slots]).contiguous()


class _WindowRingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, peers, window, scale, stats, backend=None, sinks=None):
        b, h, s, _ = q.shape
        groups, c, cp, rank = h // k.size(1), s // 2, peers.size, peers.rank
        backend = _backend_for(q.device, backend)
        kv = torch.stack([k, v])  # (2, b, hkv, 2c, d)
        sends = {dst: _slots(kv, need[rank], c) for dst in range(cp) if dst != rank
                 for need in [needed(cp, dst, c, window)] if rank in need}
        mine = needed(cp, rank, c, window)
        shapes = {src: (len(sl),) + tuple(kv.shape[:3]) + (c, kv.size(-1)) for src, sl in mine.items()}
        recvs, works = peers.exchange(sends, shapes, _WKV_TAG, kv)
        if stats is not None:
            stats.add_sent("kv", sum(t.numel() * t.element_size() for t in sends.values()))
        out_acc = torch.empty(b, s, h, v.size(-1), dtype=wide_dtype(q.dtype), device=q.device).transpose(1, 2)
        lse_acc = torch.empty(b, h, s, dtype=wide_dtype(q.dtype), device=q.device)
        fresh, waited = {0, 1}, False
        for src, k_slot, q_slot, kind, a, bb in blocks(cp, rank, c, window):
            if src != rank and not waited:
                for w_ in works:
                    w_.wait()
                waited = True
            kb, vb = _kv_block(kv, recvs, mine, rank, src, k_slot, c)
            qr = slice(q_slot * c, (q_slot + 1) * c)
            qb, kb, vb = q[:, :, qr], _expand(kb, groups), _expand(vb, groups)
            if kind == "mask":
                o, lse = _masked_fwd(qb, kb, vb, _mask(a, bb, c, window, q.device), scale)
            else:
                o, lse = _block_fwd(backend, qb, kb, vb, kind == "causal", scale)
            _merge(out_acc, lse_acc, qr, o, lse, fresh=q_slot in fresh)
            fresh.discard(q_slot)
            if stats is not None:
                stats.pairs_fwd += c * (c + 1) // 2 if kind == "causal" else c * c
        if not waited:
            for w_ in works:
                w_.wait()
        if stats is not None:
            stats.calls += 1
        if sinks is not None:  # GPT-OSS: the sink joins the merged log-sum-exp once
            add_sink(out_acc, lse_acc, sinks)
        out = out_acc.to(q.dtype)
        ctx.sinks = sinks
        ctx.save_for_backward(q, k, v, out, lse_acc, *[recvs[src] for src in sorted(recvs)])
        ctx.peers, ctx.window, ctx.scale, ctx.stats, ctx.backend = peers, window, scale, stats, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *recv_list = ctx.saved_tensors
        peers, window, scale, stats, backend = ctx.peers, ctx.window, ctx.scale, ctx.stats, ctx.backend
        b, h, s, d = q.shape
        groups, c, cp, rank = h // k.size(1), s // 2, peers.size, peers.rank
        mine = needed(cp, rank, c, window)
        recvs = dict(zip(sorted(mine), recv_list))
        kv = torch.stack([k, v])
        dout = dout.contiguous()
        dq = torch.zeros(b, h, s, d, dtype=wide_dtype(q.dtype), device=q.device)
        dkv = torch.zeros(kv.shape, dtype=wide_dtype(q.dtype), device=q.device)
        dremote = {src: torch.zeros(t.shape, dtype=wide_dtype(q.dtype), device=q.device) for src, t in recvs.items()}
        for src, k_slot, q_slot, kind, a, bb in blocks(cp, rank, c, window):
            kb, vb = _kv_block(kv, recvs, mine, rank, src, k_slot, c)
            qr = slice(q_slot * c, (q_slot + 1) * c)
            args = (dout[:, :, qr], q[:, :, qr], _expand(kb, groups), _expand(vb, groups), out[:, :, qr],
                    lse[:, :, qr].contiguous())
            if kind == "mask":
                dq_, dk_, dv_ = _masked_bwd(*args, _mask(a, bb, c, window, q.device), scale)
            else:
                dq_, dk_, dv_ = _block_bwd(backend, *args, kind == "causal", scale)
            dq[:, :, qr] += wide(dq_)
            if src == rank:
                target = dkv[..., k_slot * c:(k_slot + 1) * c, :]
                target[0] += _reduce(wide(dk_), groups)
                target[1] += _reduce(wide(dv_), groups)
            else:
                i = mine[src].index(k_slot)
                dremote[src][i, 0] += _reduce(wide(dk_), groups)
                dremote[src][i, 1] += _reduce(wide(dv_), groups)
            if stats is not None:
                stats.pairs_bwd += c * (c + 1) // 2 if kind == "causal" else c * c
        # the partial dK/dV of each received chunk goes home: the forward's messages reversed
        back_shapes = {dst: (len(need[rank]),) + tuple(dkv.shape[:3]) + (c, d) for dst in range(cp) if dst != rank
                       for need in [needed(cp, dst, c, window)] if rank in need}
        got, works = peers.exchange(dremote, back_shapes, _WDKV_TAG, dkv)
        if stats is not None:
            stats.add_sent("dkv", sum(t.numel() * t.element_size() for t in dremote.values()))
        for w_ in works:
            w_.wait()
        for dst, t in got.items():
            for i, slot in enumerate(needed(cp, dst, c, window)[rank]):
                dkv[..., slot * c:(slot + 1) * c, :] += t[i]
        dsinks = None if ctx.sinks is None else sink_grad(dout, out, lse, ctx.sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, dsinks


def _kv_block(kv, recvs, mine, rank, src, k_slot, c):
    if src == rank:
        blk = kv[..., k_slot * c:(k_slot + 1) * c, :]
    else:
        blk = recvs[src][mine[src].index(k_slot)]
    return blk[0], blk[1]


def window_ring_attention(q: Tensor, k: Tensor, v: Tensor, group, window: int, *, scale: Optional[float] = None,
                          stats: Optional[RingStats] = None, backend: Optional[str] = None,
                          sinks: Optional[Tensor] = None) -> Tensor:
    """Sliding-window attention over a zigzag-sharded cp sequence: (b, h, 2c, d) in, the rows of
    windowed causal SDPA on the full sequence out (k/v may carry fewer GQA heads)."""
    if q.size(2) % 2:
        raise ValueError(f"local sequence length {q.size(2)} must be even (two zigzag chunks)")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return _WindowRingFn.apply(q, k, v, _Peers(group), int(window), float(scale), stats, backend, sinks)


def make_window_ring_attention(group, window: int, stats: Optional[RingStats] = None):
    """``attn(q, k, v)`` for a sliding-window layer under cp (the Attention module's attn_fn)."""

    def attn(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, sinks: Optional[Tensor] = None) -> Tensor:
        return window_ring_attention(q, k, v, group, window, scale=scale, stats=stats, sinks=sinks)

    attn.window = window
    return attn
