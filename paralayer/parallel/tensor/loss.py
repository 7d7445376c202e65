"""Tensor parallel's loss: the vocab-parallel cross-entropy of the Shard(-1) logits.

:func:`tp_loss` computes the vocab-parallel cross-entropy of the Shard(-1) logits with
``torch.distributed.tensor.parallel.loss_parallel``; padded vocab columns (vocab rounded up to a
multiple of tp) get a large negative added so they never count. ``loss_parallel`` must be active
for the forward-loss-backward together::

    with loss_parallel_ctx(tp > 1):
        logits = model(tokens)
        loss = tp_loss(logits, labels, cfg.model.vocab_size)
        loss.backward()            # or the pipeline schedule's step(), which runs backward
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from paralayer.model.norms import wide

# Added to the padded vocab columns of the logits: exp(-1e9 - max) is exactly 0 in fp32/bf16.
_PAD_LOGIT = -1.0e9


def loss_parallel_ctx(enabled: bool) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when enabled (tp > 1), else a no-op. Wrap forward + loss + backward."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def tp_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Mean next-token cross-entropy of vocab-sharded logits; padded vocab columns never count.

    ``logits``: a DTensor (b, s, V_padded) placed Shard(-1) on the tp mesh (the output layer of
    :func:`apply_tensor_parallel`), or a plain tensor (tp == 1: falls back to ``lm_loss``).
    Must run inside :func:`loss_parallel_ctx` (and so must the backward). Returns a plain scalar
    tensor (the same value on every tp rank) that can be mixed with other plain tensors.
    """
    if not isinstance(logits, DTensor):
        from paralayer.model.transformer import lm_loss

        return lm_loss(logits, labels, vocab_size)
    mesh, placements = logits.device_mesh, logits.placements
    if len(placements) != 1 or not placements[0].is_shard() or \
            placements[0].dim not in (-1, logits.ndim - 1):
        raise ValueError(f"tp_loss expects logits placed Shard(-1) on a 1-D mesh, got {placements}")
    v_pad = logits.shape[-1]
    local = wide(logits.to_local())
    if vocab_size is not None and v_pad > vocab_size:
        # Columns of this rank: [start, start + width); mask those >= vocab_size.
        width = local.shape[-1]
        start = mesh.get_local_rank() * width
        cols = torch.arange(start, start + width, device=local.device)
        mask = torch.where(cols >= vocab_size, _PAD_LOGIT, 0.0).to(local.dtype)
        local = local + mask
    logits = DTensor.from_local(local, mesh, [Shard(local.ndim - 1)], run_check=False,
                                shape=logits.shape, stride=_contig_stride(logits.shape))
    loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _contig_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
