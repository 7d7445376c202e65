"""Context parallelism's sequence layout: zigzag sharding into 2·cp chunks.

Layout
    The sequence of length S is cut into 2·cp equal chunks; cp rank r holds chunks r and
    2·cp−1−r (``zigzag_indices``), concatenated in that order. With causal attention every rank
    then does the same amount of work at every ring step:

    * step 0 (own K/V): chunk-lo × chunk-lo causal, chunk-hi × chunk-lo full, chunk-hi × chunk-hi
      causal;
    * K/V from a lower rank: all local Q against the FIRST chunk of the remote K/V;
    * K/V from a higher rank: the SECOND local Q chunk against all remote K/V.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["zigzag_indices", "zigzag_shard", "zigzag_unshard"]


def _check_zigzag(seq_len: int, cp: int, rank: int) -> int:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank}")
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"seq_len {seq_len} must be divisible by 2*cp = {2 * cp} for zigzag sharding")
    return seq_len // (2 * cp)


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.LongTensor:
    """Global token positions held by cp ``rank``: chunks ``rank`` and ``2cp−1−rank`` of 2cp."""
    c = _check_zigzag(seq_len, cp, rank)
    hi = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(hi * c, (hi + 1) * c)])


def zigzag_shard(x: Tensor, dim: int, cp: int, rank: int) -> Tensor:
    """The slice of ``x`` along ``dim`` that cp ``rank`` holds (zigzag order, two chunks)."""
    c = _check_zigzag(x.size(dim), cp, rank)
    hi = 2 * cp - 1 - rank
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, hi * c, c)], dim=dim)


def zigzag_unshard(parts: list[Tensor], dim: int, cp: int) -> Tensor:
    """Inverse of ``zigzag_shard``: ``parts[r]`` is rank r's shard; returns the full sequence."""
    if len(parts) != cp:
        raise ValueError(f"expected {cp} parts, got {len(parts)}")
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        if part.size(dim) % 2:
            raise ValueError(f"part {r} has odd length {part.size(dim)} along dim {dim}")
        lo, hi = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = lo, hi
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]
