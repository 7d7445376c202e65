"""ZeRO-0/1 gradient averaging over the data group, overlapped with the backward (DDP's buckets).

Every dense parameter counts the gradient accumulations of a step (a post-accumulate-grad hook):
after the step's last microbatch has accumulated into it, its gradient is final. The parameters
are grouped into buckets of about ``bucket_bytes``, in reverse order of registration (about the
order in which the backward finishes them). A bucket's flat all-reduce starts, asynchronously, as
soon as it and every bucket before it are final — the same collectives start in the same order on
every rank — while the rest of the backward runs. ``reduce()`` starts what is left (a parameter
that got no gradient, a schedule that accumulates differently), waits, and writes the averages
back. Expert weights under ep are averaged at the end, over the expert-data group: a rank's experts
may see no tokens in a microbatch, so their hooks cannot say when they are final.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from paralayer.parallel.local_shard import local_tensor
from paralayer.parallel.tensor.layout import align_grad

#: DDP's default bucket size.
BUCKET_BYTES = 25 * 2**20


def _flat(params: list[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(0), grads
    return torch.cat([g.reshape(-1) for g in grads]), grads


def _write_back(flat: torch.Tensor, grads: list[torch.Tensor], divide: float) -> None:
    flat.div_(divide)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset: offset + n].view_as(g))
        offset += n


class GradReducer:
    """Averages gradients over ``group`` (dp·cp) in buckets that start during the backward.

    ``microbatches``: gradient accumulations per parameter per step. ``divide``: what the summed
    gradients are divided by (``GradScaling.reducer_divisor``, paralayer/parallel/grad_scaling.py)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, world: int,
                 expert_params: Iterable[nn.Parameter] = (), expert_group: Optional[dist.ProcessGroup] = None,
                 *, microbatches: int = 1, divide: Optional[float] = None, bucket_bytes: int = BUCKET_BYTES):
        expert_ids = {id(p) for p in expert_params}
        self.dense = [p for p in params if id(p) not in expert_ids]
        self.experts = [p for p in params if id(p) in expert_ids]
        self.group, self.world, self.expert_group = group, world, expert_group
        self.m = max(int(microbatches), 1)
        self.divide = float(divide if divide is not None else world)
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes + 1
        for p in reversed(self.dense):
            nbytes = local_tensor(p).numel() * local_tensor(p).element_size()
            if size + nbytes > bucket_bytes and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        #: buckets the hooks started during the backward, last step (tests and benchmarks read it)
        self.started_in_backward = 0
        self._reset()
        if world > 1:
            for p in self.dense:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self) -> None:
        self._count = {id(p): 0 for p in self.dense}
        self._left = [len(b) for b in self.buckets]
        self._next = 0
        self._inflight: list = []
        self._started_now = 0

    def _on_grad(self, p: nn.Parameter) -> None:
        n = self._count[id(p)] = self._count[id(p)] + 1
        if n != self.m:
            return
        # tensor.py's hook brings a DTensor grad to its parameter's placements (an SP norm's
        # Partial grad); registered after this one, so do it here before the grad is sent
        align_grad(p)
        self._left[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._start(self._next)
            self._started_now += 1

    def _start(self, i: int) -> None:
        flat, grads = _flat(self.buckets[i])
        work = dist.all_reduce(flat, group=self.group, async_op=True) if grads else None
        self._inflight.append((work, flat, grads))
        self._next = i + 1

    def reduce(self) -> None:
        """Start the buckets the backward did not, wait for all, write the averages back."""
        if self.world > 1:
            while self._next < len(self.buckets):
                self._start(self._next)
            for work, flat, grads in self._inflight:
                if work is not None:
                    work.wait()
                    _write_back(flat, grads, self.divide)
        elif self.divide != 1:
            for p in self.dense:
                if p.grad is not None:
                    local_tensor(p.grad).div_(self.divide)
        # Expert grads already summed their ep peers' tokens through the all-to-all backward.
        if self.experts:
            flat, grads = _flat(self.experts)
            if grads:
                if self.expert_group is not None:
                    dist.all_reduce(flat, group=self.expert_group)
                _write_back(flat, grads, self.divide)
        self.started_in_backward = self._started_now
        self._reset()
