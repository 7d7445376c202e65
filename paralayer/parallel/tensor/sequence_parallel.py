"""Sequence-parallel GEMMs that save the sequence shard, not the gathered sequence (Megatron).

Under sequence parallel every column-parallel linear (wq/wk/wv, w1/w3) needs the whole sequence:
its input is all-gathered first. Through DTensor's ``PrepareModuleInput`` + ``ColwiseParallel``
autograd keeps the GATHERED input for the weight gradient: 2·h per token per layer that does not
shrink with tp (at tp 8 about 40% of a layer's saved bytes). Korthikanti et al. 2022 ("Reducing
Activation Recomputation", §4.2.2) keep the s/tp shard instead and all-gather it again in the
backward pass, overlapped with the input-gradient GEMM. That is what :class:`SpGemms` does, with
one bulk collective per GEMM (``parallel.tp_overlap`` decomposes the same collectives over a ring
instead: parallel/tensor/tp_overlap.py; both expose ``gather_matmul`` / ``matmul_scatter``).

    column  forward   x_full = all_gather(x)            out_i = x_full @ W_iᵀ     saves x (s/tp)
            backward  start all_gather(x) ─┐  gx_full = Σ g_i @ W_i
                                           └→ start reduce_scatter(gx_full); gW_i = g_iᵀ @ x_full
    row     forward   y @ Wᵀ, reduce_scatter over the sequence                       saves y
            backward  g_full = all_gather(g); gy = g_full @ W; gW = g_fullᵀ @ y

Under the zero-bubble schedules' split backward (zbv, dualpipev: an input-grad pass, later a
weight-grad pass over the same graph) each pass does only its own half (parallel/tensor/backward_pass.py):

    column  input pass   gx_full = Σ g_i @ W_i, reduce_scatter       weight pass  all_gather(x); gW_i
    row     input pass   g_full = all_gather(g); gy = g_full @ W     weight pass  gW from the kept g_full

so the two passes issue the collectives and GEMMs of one plain backward (the row GEMM's gathered
output grad, (b, s, k), waits for the weight pass instead of the s/tp shard torch keeps).

Works on gloo (CPU) and NCCL alike; the collectives run on the tp group (its timeout applies).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from paralayer.compat import private
from paralayer.parallel.local_shard import local_tensor as _local
from paralayer.parallel.tensor.backward_pass import keep, kept, later, wanted

funcol = private("torch.distributed._functional_collectives")


def _compute_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for x's device if autocast is on (the GEMMs run in it, as nn.Linear's do)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _start_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Start the all-gather of (b, s/tp, k) over the tp group: (tp·b, s/tp, k), waited on first use."""
    return funcol.all_gather_tensor(x.contiguous(), 0, group)


def _seq_of(buf: torch.Tensor, tp: int) -> torch.Tensor:
    """(tp·b, s/tp, k) gathered chunks -> (b, s, k) (waits for the gather)."""
    buf = funcol.wait_tensor(buf) if isinstance(buf, funcol.AsyncCollectiveTensor) else buf
    n, sl, k = buf.shape
    return buf.view(tp, n // tp, sl, k).permute(1, 0, 2, 3).reshape(n // tp, tp * sl, k)


def _start_scatter(full: torch.Tensor, group: dist.ProcessGroup, tp: int) -> torch.Tensor:
    """Start the reduce-scatter (sum) of (b, s, k) along the sequence: (b, s/tp, k) on first use."""
    b, s, k = full.shape
    chunks = full.reshape(b, tp, s // tp, k).permute(1, 0, 2, 3).reshape(tp * b, s // tp, k)
    # reduce_scatter_single in torch >= 2.13 (reduce_scatter_tensor is deprecated there), same op
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return rs(chunks.contiguous(), "sum", 0, group)


def _done(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _GatherMatmul(torch.autograd.Function):
    """(x local (b, s/t, h), W_1..W_n local (o_i, h)) -> (b, s, o_i); saves x's shard only."""

    @staticmethod
    def forward(ctx, x, group, tp, dtype, *weights):
        xs = x if dtype is None else x.to(dtype)
        ws = [w if dtype is None else w.to(dtype) for w in weights]
        full = _seq_of(_start_gather(xs, group), tp)
        with torch.autocast(x.device.type, enabled=False):
            outs = tuple(full @ w.t() for w in ws)
        ctx.group, ctx.tp, ctx.dtype = group, tp, dtype
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        group, tp, dtype = ctx.group, ctx.tp, ctx.dtype
        # under a split backward (zbv, dualpipev) the input pass wants gx only, the weight pass gW only
        need_x = wanted(ctx, 0, 0)
        need_w = [wanted(ctx, 4 + i, 1 + i) for i in range(len(weights))]
        xs = x if dtype is None else x.to(dtype)
        ws = [w if dtype is None else w.to(dtype) for w in weights]
        gs = [g if dtype is None else g.to(dtype) for g in grads]
        gather = _start_gather(xs, group) if any(need_w) else None  # overlaps the gx GEMMs
        scatter = None
        with torch.autocast(x.device.type, enabled=False):
            if need_x:
                gx_full = None
                for g, w in zip(gs, ws):
                    t = g @ w
                    gx_full = t if gx_full is None else gx_full + t
                scatter = _start_scatter(gx_full, group, tp)      # overlaps the weight-grad GEMMs
            gw = [None] * len(ws)
            if gather is not None:
                full = _seq_of(gather, tp).reshape(-1, xs.shape[-1])
                for i, (g, need) in enumerate(zip(gs, need_w)):
                    if need:
                        gw[i] = (g.reshape(-1, g.shape[-1]).t() @ full).to(weights[i].dtype)
        gx = None
        if scatter is not None:
            gx = _done(scatter).to(x.dtype)
        return (gx, None, None, None, *gw)


class _MatmulScatter(torch.autograd.Function):
    """(y (b, s, k), W local (o, k)) -> reduce_scatter(y @ Wᵀ) (b, s/t, o)."""

    @staticmethod
    def forward(ctx, y, group, tp, dtype, weight):
        ys = y if dtype is None else y.to(dtype)
        w = weight if dtype is None else weight.to(dtype)
        with torch.autocast(y.device.type, enabled=False):
            out = _done(_start_scatter(ys @ w.t(), group, tp))
        ctx.group, ctx.tp, ctx.dtype = group, tp, dtype
        ctx.save_for_backward(y, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        y, weight = ctx.saved_tensors
        group, tp, dtype = ctx.group, ctx.tp, ctx.dtype
        need_y, need_w = wanted(ctx, 0, 0), wanted(ctx, 4, 1)
        ys = y if dtype is None else y.to(dtype)
        w = weight if dtype is None else weight.to(dtype)
        # the gathered output grad: kept by a split backward's input pass for its weight pass
        full = kept(ctx, g) if not need_y else None
        if full is None and (need_y or need_w):
            full = _seq_of(_start_gather(g if dtype is None else g.to(dtype), group), tp)
        gy = gw = None
        with torch.autocast(y.device.type, enabled=False):
            if need_y:
                gy = (full @ w).to(y.dtype)
            if need_w:
                gw = (full.reshape(-1, full.shape[-1]).t() @ ys.reshape(-1, ys.shape[-1])).to(weight.dtype)
        if need_y and later(ctx, 4, 1):
            keep(ctx, g, full)
        return (gy, None, None, None, gw)


class SpGemms:
    """The column/row GEMM pair of one tp group under sequence parallel, saving only the shard;
    installed on the attention and feed-forward modules by ``apply_tensor_parallel``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.tp = dist.get_world_size(group)

    def gather_matmul(self, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """all_gather(x, seq) @ W_iᵀ for each W_i (column-parallel local shards)."""
        x = _local(x)
        return _GatherMatmul.apply(x, self.group, self.tp, _compute_dtype(x), *[_local(w) for w in weights])

    def matmul_scatter(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """reduce_scatter(y @ Wᵀ, seq) (row-parallel local shard)."""
        y = _local(y)
        return _MatmulScatter.apply(y, self.group, self.tp, _compute_dtype(y), _local(weight))
