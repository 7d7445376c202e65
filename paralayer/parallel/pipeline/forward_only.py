"""A forward-only pass through the pipeline, for the validation loss (paralayer/runtime/evaluate.py).

Each pp rank runs its chunks (from :func:`paralayer.parallel.pipeline.split.split_model`, in pipeline
order) over the step's microbatches, chunk by chunk and, inside a chunk, microbatch by
microbatch: it receives a microbatch's activation from the rank holding the previous chunk
(blocking), runs the chunk, and sends the result on without waiting. Every rank takes the
(chunk, microbatch) pairs in the same ascending order, each needs only the pair before it in
the pipe, and no send blocks, so the pass cannot deadlock; the microbatches still stream through
the stages (one chunk's forward overlaps the next chunk's), as a forward-only GPipe does. Where two
consecutive chunks sit on one rank (the turn of a V schedule) the activation stays in memory.
The last chunk computes each microbatch's loss; their mean is broadcast over the pp group.

Why not torch's ``schedule.eval()``: it flips the training schedule's ``has_backward``, which
re-initialises the stages on every switch (the P2P warm-up vote, new receive buffers) under the
training's instrumented stage methods (early receives, timings, ZeRO-2/3 hooks). This pass shares
no state with the training schedule: it calls the chunk modules (their hooks included: the bf16
boundary casts under autocast) under ``torch.no_grad``. The activation's shape and dtype cross
each rank boundary once, ahead of its first microbatch.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.parallel.pipeline.split import chunk_to_rank

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_META_LEN = 8  # dtype code, ndim, up to 6 dims


def _send_meta(x: torch.Tensor, group, peer: int) -> None:
    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=x.device)
    meta[0], meta[1] = _DTYPES.index(x.dtype), x.ndim
    meta[2:2 + x.ndim] = torch.tensor(x.shape, dtype=torch.int64)
    dist.send(meta, group=group, group_dst=peer)


def _recv_empty(group, peer: int, device: torch.device) -> torch.Tensor:
    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=device)
    dist.recv(meta, group=group, group_src=peer)
    meta = meta.tolist()
    return torch.empty(meta[2:2 + meta[1]], dtype=_DTYPES[meta[0]], device=device)


@torch.no_grad()
def forward_loss(chunks: Sequence[nn.Module], group, n_chunks: int, schedule: str,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 tokens: torch.Tensor, labels: torch.Tensor, microbatches: int, *,
                 loss_parallel: bool = False, autocast_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The mean of ``loss_fn`` over the ``microbatches`` microbatches of this pipeline's batch
    (``tokens``, ``labels`` split along dim 0), as a 0-d fp32 tensor on EVERY pp rank.

    ``chunks``: this rank's chunks (each carrying ``pp_chunk``); ``n_chunks``: pp·v in all.
    Collective over the pp ``group``: every pp rank calls it with the same ``microbatches``."""
    pp, me = dist.get_world_size(group), dist.get_rank(group)
    owner = [chunk_to_rank(c, pp, schedule) for c in range(n_chunks)]
    mine = {int(ch.pp_chunk): ch for ch in chunks}
    device = tokens.device
    held = list(tokens.chunk(microbatches))  # what this rank holds of each microbatch
    label_mbs = labels.chunk(microbatches)
    losses: list[torch.Tensor] = []
    sends: list = []
    ctx = contextlib.ExitStack()
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_cm

        ctx.enter_context(loss_parallel_cm())
    if autocast_dtype is not None:
        ctx.enter_context(torch.autocast(device.type, dtype=autocast_dtype))
    with ctx:
        for c in range(n_chunks):
            prev = owner[c - 1] if c > 0 else owner[c]
            if me not in (owner[c], prev) or (c in mine and prev == me):
                if c in mine:  # the previous chunk's output is already here
                    held = [mine[c](x) for x in held]
                continue
            if me == prev:  # hand chunk c−1's outputs to the rank running chunk c
                _send_meta(held[0], group, owner[c])
                sends += [dist.isend(x.contiguous(), group=group, group_dst=owner[c]) for x in held]
                continue
            buf = _recv_empty(group, prev, device)
            out = []
            for _ in range(microbatches):
                x = torch.empty_like(buf)
                dist.recv(x, group=group, group_src=prev)
                out.append(mine[c](x))
            held = out
        if owner[-1] == me:
            losses = [loss_fn(y, lab).detach().float().reshape(()) for y, lab in zip(held, label_mbs)]
    for w in sends:
        if w is not None:
            w.wait()
    loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32, device=device)
    loss = loss.reshape(1).contiguous()
    dist.broadcast(loss, group=group, group_src=owner[-1])
    return loss[0]
