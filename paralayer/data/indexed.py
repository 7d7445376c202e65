"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, MMIDIDX v1): our own small reader
and writer, numpy memory maps only (megatron-core is the oracle in the tests, never a dependency).

Opening a shard reads its header only (paralayer/inputs/idx_header.py): a 4 GB shard opens like a
10 MB one. The index and the ids are memory-mapped (``tokens``, :meth:`document`); the training
path reads a sequence with one ``pread`` (:meth:`read`) instead of through the map, because pages
touched through a map count in the rank's resident memory (here in 2 MB folios: ~1.8 MB per random
sequence, growing towards the corpus size over a long run), while pread's pages stay in the shared
page cache only. Writing goes to temp
names beside the target, fsyncs, and renames the .bin first and the .idx last, so a prefix whose
.idx exists is complete (a half-written shard is never read).
"""
from __future__ import annotations

import contextlib
import os
import struct
from typing import List, Optional

import numpy as np

from paralayer.data.errors import DataError
from paralayer.inputs.idx_header import DTYPES, MAGIC, IdxError, IdxHeader, read_header


def open_header(prefix: str, field: str = "data.path") -> IdxHeader:
    """:func:`read_header` with its IdxError as a DataError naming ``field``."""
    try:
        return read_header(prefix)
    except IdxError as exc:
        raise DataError(exc.what + (f" (byte {exc.offset})" if exc.offset is not None else ""), field=field,
                        file=exc.file) from None


class IndexedShard:
    """One ``PREFIX.bin/.idx``: its ids as one flat memory-mapped stream (documents back to back)."""

    def __init__(self, prefix: str, field: str = "data.path"):
        self.prefix, self.field = prefix, field
        self.header = open_header(prefix, field)
        self.n_tokens = self.header.tokens
        self.dtype = np.dtype(self.header.dtype)
        self._fd: Optional[int] = None
        self._tokens: Optional[np.ndarray] = None

    @property
    def tokens(self) -> np.ndarray:
        """Every id, memory-mapped (read-only; an empty shard is an empty array)."""
        if self._tokens is None:
            self._tokens = (np.memmap(self.prefix + ".bin", dtype=self.dtype, mode="r", shape=(self.n_tokens,))
                            if self.n_tokens else np.zeros(0, dtype=self.dtype))
        return self._tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """ids [start, start + length) with one pread (no pages mapped into this process)."""
        if self._fd is None:
            self._fd = os.open(self.prefix + ".bin", os.O_RDONLY)
        size = self.dtype.itemsize
        buf = os.pread(self._fd, length * size, start * size)
        if len(buf) != length * size:
            raise DataError(f"read {len(buf)} of {length * size} bytes at byte {start * size} (truncated while "
                            "training?)", field=self.field, file=self.prefix + ".bin")
        return np.frombuffer(buf, dtype=self.dtype)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)

    @property
    def n_documents(self) -> int:
        return self.header.sequence_count

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        h = self.header
        lengths = np.memmap(self.prefix + ".idx", dtype=np.int32, mode="r", offset=h.lengths_offset,
                            shape=(h.sequence_count,))
        pointers = np.memmap(self.prefix + ".idx", dtype=np.int64, mode="r", offset=h.pointers_offset,
                             shape=(h.sequence_count,))
        return lengths, pointers

    def document(self, i: int) -> np.ndarray:
        """Document (Megatron: sequence) ``i``'s ids."""
        lengths, pointers = self._index()
        start = int(pointers[i]) // self.header.itemsize
        return np.asarray(self.tokens[start:start + int(lengths[i])])

    def check_vocab(self, vocab_size: int) -> None:
        """The dtype can hold every id of ``model.vocab_size`` (a uint8 shard cannot hold 50k ids)."""
        if vocab_size - 1 > self.header.max_id:
            raise DataError(f"dtype {self.header.dtype} (code {self.header.dtype_code}) cannot hold "
                            f"model.vocab_size={vocab_size} ids (largest {self.header.max_id})",
                            field=self.field, file=self.prefix + ".idx")


class IndexedWriter:
    """Append documents to ``PREFIX.bin`` and write ``PREFIX.idx`` at :meth:`finalize`, atomically.

    The lengths are kept in memory (4 bytes a document); the ids stream to the .bin temp file.
    """

    def __init__(self, prefix: str, dtype_code: int):
        if dtype_code not in DTYPES:
            raise ValueError(f"dtype code {dtype_code} is not one of {sorted(DTYPES)}")
        self.prefix, self.code = prefix, dtype_code
        self.dtype = np.dtype(DTYPES[dtype_code][0])
        os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
        self._tmp_bin = f"{prefix}.bin.tmp-{os.getpid()}"
        self._tmp_idx = f"{prefix}.idx.tmp-{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: List[np.ndarray] = []
        self.n_tokens = 0

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their ids back to back (``flat``) and each one's length."""
        flat = np.asarray(flat)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) > DTYPES[self.code][2]):
            raise ValueError(f"ids outside the range of {self.dtype} in documents for {self.prefix}")
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.n_tokens += int(flat.size)

    def add_document(self, ids) -> None:
        ids = np.asarray(ids)
        self.add_documents(ids, np.asarray([ids.size]))

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            with contextlib.suppress(OSError):
                os.unlink(p)

    def finalize(self) -> int:
        """fsync and rename (.bin, then .idx); returns the number of documents."""
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
            write_index(self._tmp_idx, self.code, lengths)
            os.replace(self._tmp_bin, self.prefix + ".bin")
            os.replace(self._tmp_idx, self.prefix + ".idx")
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.prefix)
        return int(lengths.size)


def write_index(path: str, dtype_code: int, lengths: np.ndarray, document_indices: Optional[np.ndarray] = None):
    """An MMIDIDX v1 index for documents of ``lengths`` ids (one Megatron sequence per document)."""
    itemsize = DTYPES[dtype_code][1]
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    docs = np.arange(lengths.size + 1, dtype=np.int64) if document_indices is None else document_indices
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, dtype_code, lengths.size, docs.size))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(docs, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(prefix: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(prefix)) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
