"""Labels and the stateless global-batch sampler: which sequences step k reads, on which dp rank.

:func:`global_batch_indices` is a pure function of (step, global_batch, n_sequences, shuffle,
seed). With ``shuffle=false`` step k (1-based) takes sequences (k−1)·B … k·B−1 in order, wrapping
around at the end of the data; with ``shuffle=true`` the same positions index a permutation of the
sequences drawn per epoch from (seed, epoch). Each dp rank takes a contiguous share of the global
batch (:func:`rank_share`), so any dp size sees the same global batch. The resume state is the step.
"""
from __future__ import annotations

import functools
from typing import List, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


def labels_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction inside each sequence: ``labels[..., i] = ids[..., i+1]``,
    the last position ``-100`` (ignored by ``cross_entropy(ignore_index=-100)``)."""
    ids = torch.as_tensor(input_ids)
    labels = torch.full_like(ids, IGNORE_INDEX, dtype=torch.long)
    labels[..., :-1] = ids[..., 1:]
    return labels


# ---------------------------------------------------------------------------------- sampling
@functools.lru_cache(maxsize=8)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch)]).permutation(n)


def global_batch_indices(step: int, global_batch: int, n_sequences: int, shuffle: bool,
                         seed: int) -> List[int]:
    """The sequence indices of step ``step``'s (1-based) global batch.

    Position p = (step−1)·global_batch + j (j < global_batch) of the endless stream; epoch
    e = p // n_sequences. ``shuffle=False``: index p mod n (file order, wrapping around).
    ``shuffle=True``: index perm_e[p mod n], perm_e a permutation drawn from (seed, e).
    Pure function: the sampler's only state is the step.
    """
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if global_batch < 1 or n_sequences < 1:
        raise ValueError(f"need global_batch >= 1 and n_sequences >= 1, got {global_batch}, {n_sequences}")
    start = (step - 1) * global_batch
    pos = np.arange(start, start + global_batch, dtype=np.int64)
    if not shuffle:
        return (pos % n_sequences).tolist()
    out = np.empty(global_batch, dtype=np.int64)
    epochs = pos // n_sequences
    for e in np.unique(epochs):
        m = epochs == e
        out[m] = _epoch_permutation(n_sequences, seed, int(e))[pos[m] % n_sequences]
    return out.tolist()


def rank_share(indices: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """dp rank r's contiguous share ``indices[r·B/dp:(r+1)·B/dp]`` of a global batch of B."""
    b = len(indices)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    if b % dp_size:
        raise ValueError(f"train.global_batch {b} is not divisible by dp={dp_size}")
    per = b // dp_size
    return list(indices[dp_rank * per:(dp_rank + 1) * per])
