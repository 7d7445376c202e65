"""Labels and the stateless global-batch sampler: which sequences step k reads, on which dp rank.

:func:`global_batch_indices` is a pure function of (step, global_batch, n_sequences, shuffle,
seed). With ``shuffle=false`` step k (1-based) takes sequences (k−1)·B … k·B−1 in order, wrapping
around at the end of the data; with ``shuffle=true`` the same positions index a permutation of the
sequences, a seeded Feistel bijection of [0, N) per epoch (O(1) memory, no permutation is
ever drawn). Each dp rank takes a contiguous share of the global
batch (:func:`rank_share`), so any dp size sees the same global batch. The resume state is the step.
"""
from __future__ import annotations

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
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2**64)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix_np(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_ROUNDS = 4


def permute(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """A seeded bijection of [0, n), evaluated at ``index`` (int64 array): O(1) memory, a pure
    function of (seed, epoch, index).

    A balanced Feistel network of 4 rounds over 2·h bits (2**(2h) >= n, so at most 4n values),
    whose round function is splitmix64 of (right half, round key); values that land outside [0, n)
    are encrypted again (cycle walking) until they fall inside, which keeps the map a bijection of
    [0, n). Expected work: under 4 passes per index.
    """
    index = np.asarray(index, dtype=np.int64)
    if n <= 1:
        return np.zeros_like(index)
    h = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, sh = np.uint64((1 << h) - 1), np.uint64(h)
    base = _mix(_mix(int(seed) & _M64) ^ (int(epoch) & _M64))
    keys = [np.uint64(_mix(base ^ r)) for r in range(_ROUNDS)]
    x = index.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            v = x[todo]
            left, right = v >> sh, v & mask
            for k in keys:
                left, right = right, left ^ (_mix_np(right ^ k) & mask)
            x[todo] = (left << sh) | right
            todo = x >= np.uint64(n)
    return x.astype(np.int64)


def stream_indices(positions: np.ndarray, n_sequences: int, shuffle: bool, seed: int) -> np.ndarray:
    """The sequence read at each position of the endless stream over n sequences: epoch
    e = p // n, then p mod n in order (``shuffle=False``) or through :func:`permute` (seed, e)."""
    pos = np.asarray(positions, dtype=np.int64)
    if not shuffle:
        return pos % n_sequences
    out = np.empty_like(pos)
    epochs = pos // n_sequences
    for e in np.unique(epochs):
        m = epochs == e
        out[m] = permute(pos[m] % n_sequences, n_sequences, seed, int(e))
    return out


def global_batch_indices(step: int, global_batch: int, n_sequences: int, shuffle: bool,
                         seed: int) -> List[int]:
    """The sequence indices of step ``step``'s (1-based) global batch.

    Position p = (step−1)·global_batch + j (j < global_batch) of the endless stream; epoch
    e = p // n_sequences. ``shuffle=False``: index p mod n (file order, wrapping around).
    ``shuffle=True``: index perm_e(p mod n), perm_e the Feistel bijection of (seed, e).
    Pure function: the sampler's only state is the step.
    """
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if global_batch < 1 or n_sequences < 1:
        raise ValueError(f"need global_batch >= 1 and n_sequences >= 1, got {global_batch}, {n_sequences}")
    start = (step - 1) * global_batch
    pos = np.arange(start, start + global_batch, dtype=np.int64)
    return stream_indices(pos, n_sequences, shuffle, seed).tolist()


def rank_share(indices: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """dp rank r's contiguous share ``indices[r·B/dp:(r+1)·B/dp]`` of a global batch of B."""
    b = len(indices)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    if b % dp_size:
        raise ValueError(f"train.global_batch {b} is not divisible by dp={dp_size}")
    per = b // dp_size
    return list(indices[dp_rank * per:(dp_rank + 1) * per])
