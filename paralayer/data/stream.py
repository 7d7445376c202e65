"""Packing without a packed copy: shards read as one token stream, cut lazily into sequences.

The documents of every shard of a source, in order, are one stream of ids (each shard's .bin
already holds its documents back to back, EOS ids included when prepare wrote them). Sequence i
of ``seq_len`` is ids [i·seq_len, (i+1)·seq_len) of that stream; the incomplete tail is dropped.
Nothing is computed per document or per sequence at start-up (only the shards' cumulative
sizes), so another ``seq_len`` re-tokenises nothing and a 4 GB corpus opens like a 10 MB one; a
batch reads its sequences with pread (indexed.py says why not through the map).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from paralayer.data.errors import DataError
from paralayer.data.indexed import IndexedShard


class TokenStream:
    """The ids of ``shards`` back to back; ``vocab_size`` (model.vocab_size) checks every read."""

    def __init__(self, shards: Sequence[IndexedShard], vocab_size: Optional[int] = None, field: str = "data.path"):
        self.shards = list(shards)
        self.offsets = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.n_tokens for s in self.shards], out=self.offsets[1:])
        self.vocab_size, self.field = vocab_size, field

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def files(self) -> List[str]:
        return [s.prefix + ".bin" for s in self.shards]

    def read(self, start: int, length: int) -> np.ndarray:
        """ids [start, start + length) as int64 (across shard boundaries)."""
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < length:
            lo = start + done - int(self.offsets[k])
            take = min(length - done, self.shards[k].n_tokens - lo)
            out[done:done + take] = self.shards[k].read(lo, take)
            done += take
            k += 1
        if self.vocab_size is not None and length:
            self._check_ids(out, start)
        return out

    def _check_ids(self, ids: np.ndarray, start: int) -> None:
        bad = np.flatnonzero((ids >= self.vocab_size) | (ids < 0))
        if bad.size:
            pos = start + int(bad[0])
            k = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            off = pos - int(self.offsets[k])
            raise DataError(f"id {int(ids[bad[0]])} at token offset {off} (byte "
                            f"{off * self.shards[k].header.itemsize}) is outside [0, {self.vocab_size}) "
                            "(model.vocab_size)", field=self.field, file=self.files[k])


class PackedSequences:
    """Sequences ``first`` … ``first + count − 1`` of a stream cut into ``seq_len`` ids."""

    def __init__(self, stream: TokenStream, seq_len: int, first: int = 0, count: Optional[int] = None):
        self.stream, self.seq_len, self.first = stream, int(seq_len), int(first)
        total = stream.n_tokens // self.seq_len
        self.count = total - self.first if count is None else int(count)
        if self.first < 0 or self.first + self.count > total:
            raise ValueError(f"sequences [{first}, {first + self.count}) outside the {total} of the stream")

    def __len__(self) -> int:
        return self.count

    def split_tail(self, n_tail: int) -> tuple["PackedSequences", "PackedSequences"]:
        """(the first count − n_tail sequences, the last n_tail): a held-out split, disjoint."""
        head = self.count - n_tail
        return (PackedSequences(self.stream, self.seq_len, self.first, head),
                PackedSequences(self.stream, self.seq_len, self.first + head, n_tail))

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        """[len(indices), seq_len] int64 of the sequences at ``indices`` (0-based in this range)."""
        idx = np.asarray(indices, dtype=np.int64)
        out = np.empty((idx.size, self.seq_len), dtype=np.int64)
        for j, i in enumerate(idx.tolist()):
            if not 0 <= i < self.count:
                raise IndexError(f"sequence {i} outside [0, {self.count})")
            out[j] = self.stream.read((self.first + i) * self.seq_len, self.seq_len)
        return out
