"""Context parallel for Gated DeltaNet (linear-attention) layers: the recurrent state and the short
conv's tail passed from cp rank to rank in sequence order.

Layout
    The sequence stays zigzag-sharded as for ring attention (paralayer/parallel/context/zigzag.py):
    cp rank r holds chunks r ("lo") and 2·cp−1−r ("hi") of 2·cp. Nothing is permuted. A recurrence
    must visit the chunks in sequence order 0, 1, …, 2·cp−1, which over the ranks is a snake:

        rank 0 lo → rank 1 lo → … → rank cp−1 lo → rank cp−1 hi → rank cp−2 hi → … → rank 0 hi

    so rank r takes its lo chunk's initial state from rank r−1 (zeros on rank 0) and sends the final
    state to rank r+1; its hi chunk starts from rank r+1's hi final state (rank cp−1: its own lo
    chunk's) and sends its final state to rank r−1. Each rank runs the same two chunks' worth of the
    delta rule (balanced work); the state pass itself is sequential: 2·cp−2 hops per layer, one
    (b, h_v, d_k, d_v) fp32 state each, and rank r's hi chunk waits for the snake to come back.

Conv tail
    The depthwise conv (kernel K) reads the K−1 inputs before each chunk: the lo chunk's come from
    rank r−1's lo chunk, the hi chunk's from rank r+1's hi chunk (rank cp−1: its own lo chunk). They
    do not depend on the recurrence, so one exchange (both directions at once) moves them before
    the conv; its backward returns their gradients the opposite way. Needs chunks of >= K−1 tokens
    (paralayer/config/model_checks.py refuses shorter ones by name).

Backward
    Gradients of the states travel the snake in reverse (rank 0 hi → … → rank cp−1 hi → rank cp−1
    lo → … → rank 0 lo). The forward saves the chunks' inputs and received states, not the core's
    graph; the backward reruns each chunk's delta rule (the core only, no communication, under the
    forward's autocast state) to differentiate it between receiving its final state's gradient and
    sending its initial state's. The core thus runs 4 forward passes' worth in a cp step, not 3.

Every send/recv is point-to-point on the cp group passed in (``group``), waited on under that
process group's timeout (set at init_process_group); tags keep them apart from the ring's."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from paralayer.model.linear.delta_rule import chunk_gated_delta_rule
from paralayer.model.linear.short_conv import causal_conv

__all__ = ["Snake", "cp_causal_conv", "cp_delta_rule", "apply_linear_context_parallel"]

_TAIL_TAG = 21
_STATE_TAG = 22


class Snake:
    """A cp rank's neighbours in sequence order (global ranks of cp rank r−1 and r+1, or None)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.prev = dist.get_global_rank(group, self.rank - 1) if self.rank > 0 else None
        self.next = dist.get_global_rank(group, self.rank + 1) if self.rank < self.size - 1 else None
        self.sent_bytes = 0  # what this rank sent, forward and backward (tests count it)

    def p2p(self, sends: list[tuple[Tensor, Optional[int]]], recvs: list[tuple[Tensor, Optional[int]]],
            tag: int) -> None:
        """Post every send and recv whose peer is not None at once, then wait for all of them."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.group, tag) for t, peer in sends if peer is not None]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group, tag) for t, peer in recvs if peer is not None]
        self.sent_bytes += sum(t.numel() * t.element_size() for t, peer in sends if peer is not None)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


class _Tails(torch.autograd.Function):
    """(lo's last K−1 inputs, hi's last K−1 inputs) → (the K−1 inputs before lo, before hi)."""

    @staticmethod
    def forward(ctx, lo_last: Tensor, hi_last: Tensor, snake: Snake):
        before_lo = lo_last.new_zeros(lo_last.shape)  # rank 0: the sequence's start reads zeros
        before_hi = lo_last.clone() if snake.next is None else hi_last.new_empty(hi_last.shape)
        snake.p2p([(lo_last, snake.next), (hi_last, snake.prev)],
                  [(before_lo, snake.prev), (before_hi, snake.next)], _TAIL_TAG)
        ctx.snake = snake
        return before_lo, before_hi

    @staticmethod
    def backward(ctx, d_before_lo: Tensor, d_before_hi: Tensor):
        snake = ctx.snake
        d_lo_last = d_before_hi.clone() if snake.next is None else d_before_hi.new_empty(d_before_hi.shape)
        d_hi_last = d_before_lo.new_zeros(d_before_lo.shape)
        snake.p2p([(d_before_lo, snake.prev), (d_before_hi, snake.next)],
                  [(d_lo_last, snake.next), (d_hi_last, snake.prev)], _TAIL_TAG)
        return d_lo_last, d_hi_last, None


def cp_causal_conv(x: Tensor, weight: Tensor, snake: Snake) -> Tensor:
    """:func:`causal_conv` of a zigzag shard (b, 2c, channels): each chunk read after its tail."""
    c, tail = x.shape[1] // 2, weight.shape[-1] - 1
    lo, hi = x[:, :c], x[:, c:]
    if tail == 0:
        return torch.cat([causal_conv(lo, weight)[0], causal_conv(hi, weight)[0]], dim=1)
    before_lo, before_hi = _Tails.apply(lo[:, c - tail:], hi[:, c - tail:], snake)
    return torch.cat([causal_conv(lo, weight, before_lo)[0], causal_conv(hi, weight, before_hi)[0]], dim=1)


def _rule_grads(inputs: list[Tensor], state_in: Tensor, chunk: int, d_out: Tensor,
                d_state_out: Optional[Tensor], amp: tuple[bool, torch.dtype]) -> tuple[list[Optional[Tensor]], Tensor]:
    """Rerun one chunk's delta rule from ``state_in`` (under the forward's autocast state ``amp``)
    and return (d inputs, d state_in)."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    s0 = state_in.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autocast(s0.device.type, dtype=amp[1], enabled=amp[0]):
        out, s1 = chunk_gated_delta_rule(*leaves, chunk=chunk, initial_state=s0)
        outs, grads = [out], [d_out]
        if d_state_out is not None:
            outs.append(s1)
            grads.append(d_state_out)
        got = torch.autograd.grad(outs, leaves + [s0], grads, allow_unused=True)
    return list(got[:-1]), got[-1] if got[-1] is not None else torch.zeros_like(s0)


class _SnakeRule(torch.autograd.Function):
    """The gated delta rule over a zigzag shard, the state passed along the snake (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, snake: Snake, chunk: int):
        c = q.shape[1] // 2
        lo = [t[:, :c] for t in (q, k, v, g, beta)]
        hi = [t[:, c:] for t in (q, k, v, g, beta)]
        b, hv, dk, dv = v.shape[0], v.shape[2], k.shape[3], v.shape[3]
        dtype = torch.promote_types(v.dtype, torch.float32)
        state_lo = torch.zeros(b, hv, dk, dv, dtype=dtype, device=v.device)
        snake.p2p([], [(state_lo, snake.prev)], _STATE_TAG)
        out_lo, end_lo = chunk_gated_delta_rule(*lo, chunk=chunk, initial_state=state_lo)
        state_hi = end_lo if snake.next is None else torch.empty_like(end_lo)
        snake.p2p([(end_lo, snake.next)], [(state_hi, snake.next)], _STATE_TAG)
        out_hi, end_hi = chunk_gated_delta_rule(*hi, chunk=chunk, initial_state=state_hi)
        snake.p2p([(end_hi, snake.prev)], [], _STATE_TAG)
        ctx.save_for_backward(q, k, v, g, beta, state_lo, state_hi)
        ctx.snake, ctx.chunk = snake, chunk
        dev = v.device.type
        ctx.amp = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return torch.cat([out_lo, out_hi], dim=1)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, g, beta, state_lo, state_hi = ctx.saved_tensors
        snake, chunk, c = ctx.snake, ctx.chunk, q.shape[1] // 2
        inputs = (q, k, v, g, beta)
        d_end_hi = None if snake.prev is None else torch.empty_like(state_hi)
        snake.p2p([], [(d_end_hi, snake.prev)], _STATE_TAG)
        d_hi, d_state_hi = _rule_grads([t[:, c:] for t in inputs], state_hi, chunk, d_out[:, c:], d_end_hi,
                                         ctx.amp)
        d_end_lo = d_state_hi if snake.next is None else torch.empty_like(state_lo)
        snake.p2p([(d_state_hi, snake.next)], [(d_end_lo, snake.next)], _STATE_TAG)
        d_lo, d_state_lo = _rule_grads([t[:, :c] for t in inputs], state_lo, chunk, d_out[:, :c], d_end_lo,
                                         ctx.amp)
        snake.p2p([(d_state_lo, snake.prev)], [], _STATE_TAG)
        grads = []
        for t, a, z in zip(inputs, d_lo, d_hi):
            grads.append(torch.cat([a if a is not None else torch.zeros_like(t[:, :c]),
                                    z if z is not None else torch.zeros_like(t[:, c:])], dim=1))
        return (*grads, None, None)


def cp_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, snake: Snake, chunk: int) -> Tensor:
    """:func:`chunk_gated_delta_rule`'s output for a zigzag shard (b, 2c, …), the state passed across cp."""
    return _SnakeRule.apply(q, k, v, g, beta, snake, chunk)


def apply_linear_context_parallel(layer, group: dist.ProcessGroup) -> Snake:
    """Give a GatedDeltaNet layer the cp conv and delta rule over ``group``; returns its Snake."""
    snake = Snake(group)
    layer.conv_fn = _bind_conv(snake)
    layer.rule_fn = _bind_rule(snake, layer.chunk)
    layer.snake = snake
    return snake


def _bind_conv(snake: Snake) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, weight: cp_causal_conv(x, weight, snake)


def _bind_rule(snake: Snake, chunk: int) -> Callable[..., Tensor]:
    return lambda q, k, v, g, beta: cp_delta_rule(q, k, v, g, beta, snake, chunk)
