"""The gradient-scaling contract: the one place that says who divides a gradient by what.

THE CONTRACT. After a step's backward and :func:`finish_grads`, every gradient on every rank is
the gradient of the step's loss: the mean next-token cross-entropy over the WHOLE global batch
(``global_batch`` sequences, ``seq_len − 1`` labels each), plus ``aux_loss_coef`` times the mean
MoE aux loss. Under any layout it equals the one-process gradient (tests/test_*_e2e parity).

How each layout gets there — three factors, each applied exactly once:

1. The microbatches (m per pipeline per step). The loss of one microbatch is its mean.
     * pp = 1: the step loop backpropagates ``loss / m`` (:attr:`GradScaling.loss_divisor`).
     * pp > 1, ZeRO-2/3 or dp·cp = 1: torch's schedule sums the m microbatch gradients and
       divides by m (``scale_grads=True``, :attr:`GradScaling.schedule_scales`).
     * pp > 1 with the ZeRO-0/1 reducer: the schedule leaves the gradients SUMMED
       (``scale_grads=False``) and the reducer divides by m together with the data-parallel mean,
       because its buckets start during the last backward, before the schedule could scale.
2. The data-parallel ranks (N = dp·cp; context ranks see other tokens of the same sequences, so
   their gradients add up exactly like data ranks').
     * ZeRO-0/1: :class:`paralayer.parallel.grad_sync.GradReducer` sums over dp·cp and divides by
       :attr:`GradScaling.reducer_divisor` (N, times m under pp, see 1.).
     * ZeRO-2/3: FSDP2 averages over the dp·cp mesh.
     * Context parallel: ranks hold unequal numbers of valid labels (the sequence's last position
       has none), so each rank's mean loss is re-weighted by :func:`cp_loss_weight` before the
       average; with it, sum/N is the global mean.
3. Experts under ep > 1 (see paralayer/parallel/expert.py for the layout). The all-to-all
   backward already SUMMED an expert's gradient over its ep group; the expert-data group (the
   N/ep ranks holding the same shard) sums the rest, and the divisor is N like every other weight.
     * ZeRO-0/1: the reducer all-reduces expert grads over the expert-data group and divides by the
       same :attr:`GradScaling.reducer_divisor`.
     * ZeRO-2/3: FSDP2 on the expert-data mesh divides by N/ep, so :func:`finish_grads` divides
       by :attr:`GradScaling.expert_fsdp_divisor` = ep afterwards (a custom FSDP divide factor needs
       PREMUL_SUM, which gloo lacks).
     * ep = 1: experts are ordinary data-parallel weights.

Tensor parallel adds no factor: tp replicas compute identical gradients and DTensor reduces its
Partial gradients. Tied embeddings add no factor either: after the reduction the embedding's and
the head's gradients are SUMMED (both are parts of one weight), locally or over the first/last
pipeline pair (:func:`paralayer.parallel.tied_embeddings.sum_tied_grads`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from paralayer.parallel.local_shard import local_tensor


@dataclass(frozen=True)
class GradScaling:
    """The contract's factors for one layout (module docstring)."""

    microbatches: int
    pp: int
    dp_cp: int
    ep: int
    zero: int

    @property
    def uses_reducer(self) -> bool:
        """ZeRO-0/1 over more than one data rank: the bucketed reducer averages the gradients."""
        return self.zero <= 1 and self.dp_cp > 1

    @property
    def loss_divisor(self) -> int:
        """What the plain (pp = 1) loop divides each microbatch's loss by before its backward."""
        return self.microbatches if self.pp == 1 else 1

    @property
    def schedule_scales(self) -> bool:
        """Whether torch's pipeline schedule divides the summed microbatch gradients by m."""
        return self.pp > 1 and not self.uses_reducer

    @property
    def reducer_divisor(self) -> int:
        """What the reducer divides the summed gradients by: N, times m when the schedule left them summed."""
        return self.dp_cp * (self.microbatches if self.pp > 1 else 1)

    @property
    def expert_fsdp_divisor(self) -> int:
        """ZeRO-2/3 with ep > 1: FSDP divided expert grads by N/ep; the rest of N is this."""
        return self.ep if (self.zero >= 2 and self.ep > 1 and self.dp_cp > 1) else 1


def cp_loss_weight(n_local: torch.Tensor, n_global: int, cp: int) -> torch.Tensor:
    """The factor on a context rank's mean loss that makes the dp·cp average the global mean."""
    return n_local * cp / n_global


@torch.no_grad()
def finish_grads(scaling: GradScaling, reducer: Any, expert_params: Iterable[nn.Parameter],
                 tied_chunks: Optional[list] = None, tied_group: Any = None) -> None:
    """Apply what is left of the contract after the backward: the reduction, the expert rescale,
    the tied-embedding sum (``tied_chunks`` None when the embeddings are not tied)."""
    if reducer is not None:
        reducer.reduce()
    elif scaling.expert_fsdp_divisor > 1:
        for p in expert_params:
            if p.grad is not None:
                local_tensor(p.grad).div_(scaling.expert_fsdp_divisor)
    if tied_chunks is not None:
        from paralayer.parallel import tied_embeddings

        tied_embeddings.sum_tied_grads(tied_chunks, tied_group)
