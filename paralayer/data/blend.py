"""Blends (``data.blend: [{path, weight}, ...]``): each step's sequences drawn from weighted sources.

Position p (0-based) of the blended stream goes to the source with the largest deficit
``w_s · max(p, 1) − c_s(p)`` (normalised weight times positions so far, minus the sequences it
has given; ties to the first source): Megatron's ``build_blending_indices`` rule, so after any
number of positions every source's count is within one sequence of its target. The source's
c-th sequence is its own stream's position c (its epoch c // N_s, shuffled by its own seed), so a
source that runs out wraps into its next epoch; a warning names it.

Pure function of the step: the schedule is replayed from position 0 the first time a process asks
(a straight run then advances it step by step; a resume replays it once, about a microsecond per
position), and only its counts are kept: O(sources) memory.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from paralayer.data.errors import DataError
from paralayer.data.sampler import rank_share, stream_indices


def blend_entries(blend: Sequence[Any]) -> list[tuple[Any, float, str]]:
    """(path, weight, field name) of each ``data.blend`` entry; DataError for a bad entry or weight."""
    out = []
    for i, e in enumerate(blend):
        name = f"data.blend[{i}]"
        get = (lambda k, e=e: e.get(k)) if hasattr(e, "get") else (lambda k, e=e: getattr(e, k, None))
        path, weight = get("path"), get("weight")
        if path is None:
            raise DataError("needs a path (each entry is {path: P, weight: W})", field=f"{name}.path")
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise DataError(f"{weight!r} is not a number", field=f"{name}.weight", file=str(path)) from None
        if not math.isfinite(w) or w <= 0:
            raise DataError(f"is {weight}: a weight must be a finite number > 0", field=f"{name}.weight",
                            file=str(path))
        out.append((path, w, f"{name}.path"))
    return out


class _Schedule:
    """The greedy largest-deficit assignment of positions to sources, replayed forward."""

    def __init__(self, weights: Sequence[float]):
        total = float(sum(weights))
        self.w = [float(x) / total for x in weights]
        self.pos = 0
        self.counts = [0] * len(self.w)

    def _advance_to(self, pos: int) -> None:
        if pos < self.pos:
            self.pos, self.counts = 0, [0] * len(self.w)
        w, c, n = self.w, self.counts, len(self.w)
        for p in range(self.pos, pos):
            t = float(max(p, 1))
            best, be = 0, w[0] * t - c[0]
            for s in range(1, n):
                e = w[s] * t - c[s]
                if e > be:
                    best, be = s, e
            c[best] += 1
        self.pos = pos

    def counts_at(self, pos: int) -> List[int]:
        self._advance_to(pos)
        return list(self.counts)

    def assign(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's position) of positions start … start+length−1."""
        self._advance_to(start)
        src = np.empty(length, dtype=np.int64)
        idx = np.empty(length, dtype=np.int64)
        w, c, n = self.w, self.counts, len(self.w)
        for j, p in enumerate(range(start, start + length)):
            t = float(max(p, 1))
            best, be = 0, w[0] * t - c[0]
            for s in range(1, n):
                e = w[s] * t - c[s]
                if e > be:
                    best, be = s, e
            src[j], idx[j] = best, c[best]
            c[best] += 1
        self.pos = start + length
        return src, idx


class BlendedDataset:
    """Sources (TokenDataset each) blended by weight; the TokenDataset batch interface."""

    def __init__(self, sources: Sequence[Any], weights: Sequence[float], global_batch: Optional[int] = None):
        self.sources = list(sources)
        self.weights = [float(x) / float(sum(weights)) for x in weights]
        self.global_batch = global_batch
        self.seq_len = self.sources[0].seq_len
        self._schedule = _Schedule(weights)
        self._warned: set = set()

    @property
    def n_sequences(self) -> int:
        return sum(s.n_sequences for s in self.sources)

    def __len__(self) -> int:
        return self.n_sequences

    @property
    def files(self) -> List[str]:
        return [f for s in self.sources for f in s.files]

    def global_rows(self, step: int, global_batch: Optional[int] = None) -> list[tuple[int, int]]:
        """(source, sequence index in that source) of each sequence of step ``step``'s global batch."""
        gb = int(global_batch or self.global_batch or 0)
        if step < 1 or gb < 1:
            raise ValueError(f"need step >= 1 and global_batch >= 1, got {step}, {gb}")
        src, pos = self._schedule.assign((step - 1) * gb, gb)
        out = [(0, 0)] * gb
        for s, ds in enumerate(self.sources):
            m = np.flatnonzero(src == s)
            if not m.size:
                continue
            idx = stream_indices(pos[m], ds.n_sequences, ds.shuffle, ds.seed)
            for j, i in zip(m.tolist(), idx.tolist()):
                out[j] = (s, i)
            self._warn_wrap(s, int(pos[m].max()) // ds.n_sequences)
        return out

    def _warn_wrap(self, s: int, epoch: int) -> None:
        if epoch > 0 and (s, epoch) not in self._warned:
            self._warned.add((s, epoch))
            ds = self.sources[s]
            print(f"paralayer: warning: data.blend source {ds.source} ran out of its {ds.n_sequences} sequences; "
                  f"wrapping into epoch {epoch + 1}", file=sys.stderr, flush=True)

    def get_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1,
                  global_batch: Optional[int] = None) -> torch.Tensor:
        rows = rank_share(self.global_rows(step, global_batch), dp_rank, dp_size)
        out = np.empty((len(rows), self.seq_len), dtype=np.int64)
        for j, (s, i) in enumerate(rows):
            out[j] = self.sources[s].rows([i])[0]
        return torch.from_numpy(out)

    def source_sequences(self, step: int, global_batch: Optional[int] = None) -> Dict[str, int]:
        """{source path: sequences it gave in steps 1..step}."""
        gb = int(global_batch or self.global_batch or 0)
        counts = self._schedule.counts_at(int(step) * gb)
        out: Dict[str, int] = {}
        for ds, c in zip(self.sources, counts):
            out[ds.source] = out.get(ds.source, 0) + int(c)
        return out
