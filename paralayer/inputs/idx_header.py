"""The header of a Megatron indexed dataset (``PREFIX.idx``, MMIDIDX version 1), read with struct.

Torch- and numpy-free so the resolver can state the tokens of every source before launch;
paralayer/data/indexed.py builds its memory-mapped reader on it. It lives with the input
discipline, not in paralayer/data/: a shard is untrusted input (every field checked against the
file's size, a refusal names the field and its byte offset), and the resolver may not import
data/, which sits above it (data/preflight.py reads resolve/data_plan.py). Layout (little-endian), as
``megatron.core.datasets.indexed_dataset`` writes it::

    b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence_count | <Q document_count
    | int32 sequence_lengths[sequence_count] | int64 sequence_pointers[sequence_count]
    | int64 document_indices[document_count]

A Megatron "sequence" is one entry of the token stream (what we call a document: the .bin holds
them back to back); ``document_indices`` groups entries into documents. Reading the header costs
O(1): the token count comes from the last pointer and length (two seeks), never from a scan.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Optional

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34
#: Megatron's DType codes: code -> (numpy name, bytes per id, largest id it holds).
DTYPES = {1: ("uint8", 1, 2 ** 8 - 1), 2: ("int8", 1, 2 ** 7 - 1), 3: ("int16", 2, 2 ** 15 - 1),
          4: ("int32", 4, 2 ** 31 - 1), 5: ("int64", 8, 2 ** 63 - 1), 6: ("float64", 8, 2 ** 53),
          7: ("float32", 4, 2 ** 24), 8: ("uint16", 2, 2 ** 16 - 1)}
INTEGER_CODES = (1, 2, 3, 4, 5, 8)


class IdxError(ValueError):
    """A shard that cannot be read: ``what`` names the field of the format, ``file`` the file."""

    def __init__(self, file: str, what: str, offset: Optional[int] = None):
        where = f"{file}" + (f" at byte {offset}" if offset is not None else "")
        super().__init__(f"{where}: {what}")
        self.file, self.what, self.offset = file, what, offset


@dataclass(frozen=True)
class IdxHeader:
    prefix: str
    dtype_code: int
    sequence_count: int
    document_count: int
    tokens: int  # ids in the .bin per the .idx (last pointer / itemsize + last length)

    @property
    def dtype(self) -> str:
        return DTYPES[self.dtype_code][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype_code][1]

    @property
    def max_id(self) -> int:
        """The largest id this dtype can hold."""
        return DTYPES[self.dtype_code][2]

    @property
    def lengths_offset(self) -> int:
        return HEADER_BYTES

    @property
    def pointers_offset(self) -> int:
        return HEADER_BYTES + 4 * self.sequence_count


def optimal_dtype_code(vocab_size: int) -> int:
    """Megatron's choice (``DType.optimal_dtype``): uint16 below 65,500 ids, else int32."""
    return 8 if vocab_size < 65500 else 4


def is_prefix(path: str) -> bool:
    return os.path.isfile(path + ".idx") or os.path.isfile(path + ".bin")


def read_header(prefix: str, check_bin: bool = True) -> IdxHeader:
    """The header of ``PREFIX.idx``; IdxError naming the field (magic, version, dtype code, counts,
    the .bin's size) and the byte offset where it is wrong."""
    idx, binf = prefix + ".idx", prefix + ".bin"
    if not os.path.isfile(idx):
        raise IdxError(idx, "no such file (an indexed dataset is PREFIX.idx + PREFIX.bin)")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
        if head[:9] != MAGIC:
            raise IdxError(idx, f"magic is {head[:9]!r}, expected {MAGIC!r} (not an MMIDIDX index)", 0)
        if len(head) < HEADER_BYTES:
            raise IdxError(idx, f"header is {len(head)} bytes, expected {HEADER_BYTES} (truncated)", len(head))
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise IdxError(idx, f"version is {version}, expected 1", 9)
        if code not in DTYPES:
            raise IdxError(idx, f"dtype code is {code}, expected one of {sorted(DTYPES)}", 17)
        if code not in INTEGER_CODES:
            raise IdxError(idx, f"dtype is {DTYPES[code][0]}: token ids must be integers", 17)
        need = HEADER_BYTES + 12 * n_seq + 8 * n_doc
        if size < need:
            raise IdxError(idx, f"is {size} bytes, its header ({n_seq} sequences, {n_doc} documents) needs {need} "
                           "(truncated)", size)
        tokens = 0
        if n_seq:
            f.seek(HEADER_BYTES + 4 * (n_seq - 1))
            (last_len,) = struct.unpack("<i", f.read(4))
            f.seek(HEADER_BYTES + 4 * n_seq + 8 * (n_seq - 1))
            (last_ptr,) = struct.unpack("<q", f.read(8))
            itemsize = DTYPES[code][1]
            if last_len < 0 or last_ptr < 0 or last_ptr % itemsize:
                raise IdxError(idx, f"last sequence has length {last_len} at pointer {last_ptr} (corrupt)",
                               HEADER_BYTES + 4 * (n_seq - 1))
            tokens = last_ptr // itemsize + last_len
    hdr = IdxHeader(prefix=prefix, dtype_code=code, sequence_count=n_seq, document_count=n_doc, tokens=tokens)
    if check_bin:
        if not os.path.isfile(binf):
            raise IdxError(binf, "no such file (the .idx has no .bin beside it)")
        have = os.path.getsize(binf)
        if have < tokens * hdr.itemsize:
            raise IdxError(binf, f"size is {have} bytes, the .idx says {tokens * hdr.itemsize} ({tokens} ids of "
                           f"{hdr.dtype}): the .bin is shorter than its .idx says (truncated)", have)
    return hdr


def indexed_prefixes(path) -> list:
    """The shard prefixes ``data.path`` names under ``data.format=indexed``: a prefix (``PREFIX.idx``
    exists; a trailing ``.idx``/``.bin`` is dropped), a directory (every ``*.idx`` in it, sorted), or
    a list of those (in order). IdxError when a name is none of these."""
    if isinstance(path, (list, tuple)):
        return [p for item in path for p in indexed_prefixes(item)]
    path = str(path)
    for ext in (".idx", ".bin"):
        if path.endswith(ext) and os.path.isfile(path):
            path = path[: -len(ext)]
    if os.path.isdir(path):
        names = sorted(n[:-4] for n in os.listdir(path) if n.endswith(".idx") and not n.startswith("."))
        if not names:
            raise IdxError(path, "the directory holds no .idx files (data.format=indexed)")
        return [os.path.join(path, n) for n in names]
    if not is_prefix(path):
        raise IdxError(path, "no such indexed dataset (expected PREFIX.idx and PREFIX.bin, or a directory of them)")
    return [path]
