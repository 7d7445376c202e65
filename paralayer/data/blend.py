"""Blends (``data.blend: [{path, weight}, ...]``): each step's sequences drawn from weighted sources.

Position p (0-based) of the blended stream goes to a source with a large deficit (normalised
weight times positions so far, minus the sequences it has given), by Tijdeman's rule (see
:class:`_Schedule`), so after any number of positions every source's count is within one
sequence of its target. The source's
c-th sequence is its own stream's position c (its epoch c // N_s, shuffled by its own seed), so a
source that runs out wraps into its next epoch; a warning names it.

Pure function of the step: the schedule's state is its position and one count per source (O(sources)
memory); a straight run advances it step by step. A resume does not replay it: the checkpoint holds
that state (:meth:`BlendedDataset.state_dict`, the ``data`` entry of a checkpoint's extra state), so a
resume at any position costs O(sources) plus its batch (a replay from 0 took ~4.7 µs a position:
~2.5 hours at the 1.9·10⁹ sequences of a Llama 3 405B-length run; benchmarks/blend_resume.py). A
process asked for a position before its state, or holding no state, replays from 0 (the same counts).
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
            if isinstance(weight, bool):  # true is no weight (booleans are refused as numbers everywhere)
                raise TypeError
            w = float(weight)
        except (TypeError, ValueError):
            raise DataError(f"{weight!r} is not a number", field=f"{name}.weight", file=str(path)) from None
        if not math.isfinite(w) or w <= 0:
            raise DataError(f"is {weight}: a weight must be a finite number > 0", field=f"{name}.weight",
                            file=str(path))
        out.append((path, w, f"{name}.path"))
    return out


class _Schedule:
    """The deterministic assignment of blend positions to sources, replayed forward.

    Tijdeman's rule for the chairman assignment problem (a refinement of Megatron's
    largest-deficit-first, whose plain form drifts up to ~1.19 sequences from the target): the
    draw number t = p + 1 goes, among the sources whose deficit ``w_s·t − c_s`` is at least
    δ = 1/(2S−2), to the one with the earliest deadline ``(c_s + 1 − δ) / w_s``. Then
    ``|c_s − w_s·t| ≤ 1 − δ < 1`` for every source after every draw (Tijdeman 1980).
    """

    def __init__(self, weights: Sequence[float]):
        total = float(sum(weights))
        self.w = [float(x) / total for x in weights]
        self.delta = 1.0 / (2 * len(self.w) - 2) if len(self.w) > 1 else 0.0
        self.pos = 0
        self.counts = [0] * len(self.w)

    def _pick(self, t: float) -> int:
        w, c, d = self.w, self.counts, self.delta
        best, deadline = -1, math.inf
        for s in range(len(w)):
            if w[s] * t - c[s] >= d - 1e-9:
                dl = (c[s] + 1 - d) / w[s]
                if dl < deadline:
                    best, deadline = s, dl
        return best

    def _advance_to(self, pos: int) -> None:
        if pos < self.pos:
            self.pos, self.counts = 0, [0] * len(self.w)
        for p in range(self.pos, pos):
            self.counts[self._pick(float(p + 1))] += 1
        self.pos = max(self.pos, pos)

    def counts_at(self, pos: int) -> List[int]:
        self._advance_to(pos)
        return list(self.counts)

    def state_dict(self) -> dict:
        """Position, counts and the normalised weights they belong to (plain types)."""
        return {"weights": list(self.w), "pos": int(self.pos), "counts": [int(c) for c in self.counts]}

    def load_state_dict(self, state: Optional[dict]) -> bool:
        """Take a saved state when it is this blend's (the same weights) and consistent (counts sum
        to the position); otherwise keep replaying. True when taken."""
        if not state or [float(x) for x in state.get("weights", ())] != self.w:
            return False
        pos, counts = int(state["pos"]), [int(c) for c in state["counts"]]
        if len(counts) != len(self.w) or sum(counts) != pos or min(counts) < 0:
            return False
        self.pos, self.counts = pos, counts
        return True

    def assign(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's position) of positions start … start+length−1."""
        self._advance_to(start)
        src = np.empty(length, dtype=np.int64)
        idx = np.empty(length, dtype=np.int64)
        for j in range(length):
            s = self._pick(float(start + j + 1))
            src[j], idx[j] = s, self.counts[s]
            self.counts[s] += 1
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

    def global_rows(self, step: int, global_batch: Optional[int] = None, warn: bool = True) -> list[tuple[int, int]]:
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
            if warn:
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
        rows = rank_share(self.global_rows(step, global_batch, warn=dp_rank == 0), dp_rank, dp_size)
        out = np.empty((len(rows), self.seq_len), dtype=np.int64)
        for j, (s, i) in enumerate(rows):
            out[j] = self.sources[s].rows([i])[0]
        return torch.from_numpy(out)

    def state_dict(self) -> dict:
        """What a checkpoint keeps so a resume does not replay the schedule: its state, O(sources)."""
        return {"blend_schedule": self._schedule.state_dict()}

    def load_state_dict(self, state: Optional[dict]) -> bool:
        """A checkpoint's :meth:`state_dict` (from another blend, or none: the schedule replays)."""
        return self._schedule.load_state_dict((state or {}).get("blend_schedule"))

    def source_sequences(self, step: int, global_batch: Optional[int] = None) -> Dict[str, int]:
        """{source path: sequences it gave in steps 1..step}."""
        gb = int(global_batch or self.global_batch or 0)
        counts = self._schedule.counts_at(int(step) * gb)
        out: Dict[str, int] = {}
        for ds, c in zip(self.sources, counts):
            out[ds.source] = out.get(ds.source, 0) + int(c)
        return out
