"""Tensor-parallel communication overlapped with the GEMMs (Megatron's ``--tp-comm-overlap``).

Under sequence parallel every split linear pairs a collective with a GEMM: the column-parallel
ones (wq/wk/wv, w1/w3) need the sequence all-gathered first, the row-parallel ones (wo, w2)
reduce-scatter their partial sums after. Done as two steps the GEMM waits for the wire. Here both
are decomposed over the tp ring (Wang et al., "Overlap Communication with Dependent Computation
via Decomposition", ASPLOS 2023): in each of the tp steps a rank multiplies the sequence chunk it
holds while the next chunk travels to its neighbour, so only one chunk's transfer is exposed.

    all-gather + matmul  (column)   step k: out[chunk (r−k)] = x_chunk @ Wᵀ; pass x_chunk on
    matmul + reduce-scatter (row)   step k: acc = y[chunk (r−k−1)] @ Wᵀ + acc from r−1; pass on;
                                    after tp−1 steps the accumulator is this rank's chunk, summed

Backward is the same two rings swapped: the column GEMM's input grad reduce-scatters (and its
weight grad re-gathers the input, chunk by chunk, on the same ring: only the local chunk is saved,
not the gathered sequence), the row GEMM's output grad is all-gathered chunk by chunk. Under a
split backward (zbv, dualpipev) the input pass walks the column's scatter ring and the row's gather
ring (keeping the gathered output grad), the weight pass the column's gather ring and the row's
weight-grad GEMM on what was kept: the rings of one plain backward (parallel/tensor/backward_pass.py).

Plain send/recv on the tp group, no symmetric memory: works on gloo (CPU) and NCCL alike. Results
equal the two-step path up to the order of the reduction's sums (tests/test_tp_overlap.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from paralayer.parallel.local_shard import local_tensor
from paralayer.parallel.tensor.backward_pass import keep, kept, later, wanted


class _Ring:
    """Neighbour exchange on a tp group: send to rank r+1, receive from r−1 (group ranks)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops)


def _wait(works: Optional[list]) -> None:
    for w in works or ():
        w.wait()


def _compute_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for x's device if autocast is on (the GEMMs run in it, as nn.Linear's do)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _gather_ring(ring: _Ring, x: torch.Tensor, visit) -> None:
    """Walk the all-gather ring: ``visit(chunk, j)`` for every rank j's chunk, the next in flight."""
    cur = x.contiguous()
    for k in range(ring.size):
        works, nxt = None, None
        if k < ring.size - 1:
            nxt = torch.empty_like(cur)
            works = ring.start(cur, nxt)
        visit(cur, (ring.rank - k) % ring.size)
        _wait(works)
        if nxt is not None:
            cur = nxt


def _scatter_ring(ring: _Ring, partial) -> torch.Tensor:
    """Walk the reduce-scatter ring: ``partial(j)`` is this rank's term for chunk j; returns the
    sum over ranks of chunk ``ring.rank``. Each step computes the next term while the last travels."""
    acc, works, inbox = None, None, None
    for k in range(ring.size):
        term = partial((ring.rank - k - 1) % ring.size)
        _wait(works)
        acc = term if inbox is None else term + inbox
        if k < ring.size - 1:
            acc = acc.contiguous()
            inbox = torch.empty_like(acc)
            works = ring.start(acc, inbox)
    return acc


class _GatherMatmul(torch.autograd.Function):
    """(x local (b, s/t, h), W_1..W_n local (o_i, h)) -> outputs (b, s, o_i): all-gather x over
    the sequence, multiply, with the gather decomposed over the ring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ring: _Ring, dtype, *weights: torch.Tensor):
        xs = x if dtype is None else x.to(dtype)
        ws = [w if dtype is None else w.to(dtype) for w in weights]
        b, sl, _ = xs.shape
        outs = [xs.new_empty(b, sl * ring.size, w.shape[0]) for w in ws]

        def visit(chunk, j):
            for o, w in zip(outs, ws):
                o[:, j * sl:(j + 1) * sl] = chunk @ w.t()

        with torch.autocast(x.device.type, enabled=False):
            _gather_ring(ring, xs, visit)
        ctx.ring, ctx.dtype = ring, dtype
        ctx.save_for_backward(x, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        ring, dtype = ctx.ring, ctx.dtype
        xs = x if dtype is None else x.to(dtype)
        ws = [w if dtype is None else w.to(dtype) for w in weights]
        gs = [g.contiguous() if dtype is None else g.to(dtype).contiguous() for g in grads]
        b, sl, h = xs.shape
        # under a split backward (zbv, dualpipev) the input pass wants gx only, the weight pass gW only
        need_x = wanted(ctx, 0, 0)
        need_w = [wanted(ctx, 3 + i, 1 + i) for i in range(len(weights))]
        gw = [torch.zeros(w.shape, dtype=torch.float32 if dtype else w.dtype, device=w.device)
              if need else None for w, need in zip(ws, need_w)]

        def visit(chunk, j):  # weight grads: the input re-gathered a chunk at a time
            xc = chunk.reshape(-1, h)
            for acc, g in zip(gw, gs):
                if acc is not None:
                    acc.add_(g[:, j * sl:(j + 1) * sl].reshape(-1, g.shape[-1]).t() @ xc)

        def partial(j):  # input grad: chunk j's share of Σ_i g_i W_i, reduce-scattered
            term = None
            for g, w in zip(gs, ws):
                t = g[:, j * sl:(j + 1) * sl] @ w
                term = t if term is None else term + t
            return term

        with torch.autocast(x.device.type, enabled=False):
            if any(need_w):
                _gather_ring(ring, xs, visit)
            gx = _scatter_ring(ring, partial) if need_x else None
        gx = None if gx is None else gx.to(x.dtype)
        return (gx, None, None, *[None if a is None else a.to(w.dtype) for a, w in zip(gw, weights)])


class _MatmulScatter(torch.autograd.Function):
    """(y (b, s, k) full sequence, W local (o, k)) -> (b, s/t, o): multiply and reduce-scatter the
    partial sums over the sequence, the scatter decomposed over the ring."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, ring: _Ring, dtype, weight: torch.Tensor):
        ys = y if dtype is None else y.to(dtype)
        w = weight if dtype is None else weight.to(dtype)
        sl = ys.shape[1] // ring.size
        with torch.autocast(y.device.type, enabled=False):
            out = _scatter_ring(ring, lambda j: ys[:, j * sl:(j + 1) * sl] @ w.t())
        ctx.ring, ctx.dtype = ring, dtype
        ctx.save_for_backward(y, weight)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, weight = ctx.saved_tensors
        ring, dtype = ctx.ring, ctx.dtype
        ys = y if dtype is None else y.to(dtype)
        w = weight if dtype is None else weight.to(dtype)
        gs = g if dtype is None else g.to(dtype)
        b, sl, o = gs.shape
        need_y, need_w = wanted(ctx, 0, 0), wanted(ctx, 3, 1)
        # a split backward's input pass keeps the gathered output grad for its weight pass
        full = kept(ctx, g) if not need_y else None
        buf = gs.new_empty(b, sl * ring.size, o) if need_y and later(ctx, 3, 1) else None
        gy = torch.empty_like(ys) if need_y else None
        gw = (torch.zeros(w.shape, dtype=torch.float32 if dtype else w.dtype, device=w.device)
              if need_w else None)

        def visit(chunk, j):  # the output grad all-gathered a chunk at a time
            if gy is not None:
                gy[:, j * sl:(j + 1) * sl] = chunk @ w
            if gw is not None:
                gw.add_(chunk.reshape(-1, o).t() @ ys[:, j * sl:(j + 1) * sl].reshape(-1, ys.shape[-1]))
            if buf is not None:
                buf[:, j * sl:(j + 1) * sl] = chunk

        with torch.autocast(y.device.type, enabled=False):
            if full is not None and gw is not None:  # the weight pass: the input pass gathered it
                gw.add_(full.reshape(-1, o).t() @ ys.reshape(-1, ys.shape[-1]))
            elif gy is not None or gw is not None:
                _gather_ring(ring, gs, visit)
        if buf is not None:
            keep(ctx, g, buf)
        return (None if gy is None else gy.to(y.dtype), None, None,
                None if gw is None else gw.to(weight.dtype))


class TpOverlap:
    """The overlapped pair of GEMM helpers for one tp group; installed on the attention and
    feed-forward modules by :func:`paralayer.parallel.tensor.apply_tensor_parallel`."""

    def __init__(self, group: dist.ProcessGroup):
        self.ring = _Ring(group)

    def gather_matmul(self, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """all_gather(x, seq) @ W_iᵀ for each W_i (column-parallel local shards)."""
        x = local_tensor(x)
        return _GatherMatmul.apply(x, self.ring, _compute_dtype(x), *[local_tensor(w) for w in weights])

    def matmul_scatter(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """reduce_scatter(y @ Wᵀ, seq) (row-parallel local shard)."""
        y = local_tensor(y)
        return _MatmulScatter.apply(y, self.ring, _compute_dtype(y), local_tensor(weight))
