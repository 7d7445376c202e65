"""The training dataset: N packed sequences of ``seq_len`` ids, cached, and its stateless batches.

Conventions (every format)
--------------------------
* A dataset is N sequences of exactly ``seq_len`` token ids (``model.seq_len``).
* The model input is the whole sequence; the labels are the same ids shifted left by one inside the
  sequence, the last position ignored (``-100``), see :func:`sampler.labels_for`: the Hugging Face
  convention (``model(input_ids, labels=input_ids)``).
* How each format becomes sequences: readers.py. ``data.path: null``: the offline corpus
  (corpus.py, format text).

The tokenised/packed result is cached in ``cache_dir`` (one ``.npy`` per (file, size, mtime,
format, text field, tokenizer content, seq_len)); ranks that build it at the same time take a file
lock (cache.py), so one builds and the others read. Bad data raises DataError naming data.path,
the file and the line or row where known.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from paralayer.data.cache import atomic_write_bytes, file_lock
from paralayer.data.corpus import default_corpus_path, make_corpus
from paralayer.data.errors import DataError
from paralayer.data.preflight import FORMATS, check_file, data_files
from paralayer.data.readers import pack_documents, read_tokens
from paralayer.data.sampler import global_batch_indices, rank_share
from paralayer.data.tokenizers import load_tokenizer

_CACHE_VERSION = 1


@dataclass
class TokenDataset:
    """N sequences of ``seq_len`` token ids (``array``: [N, seq_len], uint16/int32, memory-mapped
    from the cache) and the sampler settings. Stateless: :meth:`get_batch` depends on the step only.
    """

    array: np.ndarray
    seq_len: int
    shuffle: bool
    seed: int
    global_batch: Optional[int] = None
    source: str = ""
    tokenizer_name: str = "byte"
    from_cache: bool = False

    @property
    def n_sequences(self) -> int:
        return int(self.array.shape[0])

    def __len__(self) -> int:
        return self.n_sequences

    def sequences(self, indices: Sequence[int]) -> torch.Tensor:
        """LongTensor [len(indices), seq_len]."""
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.array[idx], dtype=np.int64))

    def global_indices(self, step: int, global_batch: Optional[int] = None) -> List[int]:
        gb = global_batch or self.global_batch
        if not gb:
            raise ValueError("global_batch not given (pass it to build_dataset or get_batch)")
        return global_batch_indices(step, gb, self.n_sequences, self.shuffle, self.seed)

    def get_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1,
                  global_batch: Optional[int] = None) -> torch.Tensor:
        """This dp rank's share of step ``step``'s (1-based) global batch: LongTensor
        [global_batch/dp_size, seq_len]. Labels: :func:`labels_for`."""
        return self.sequences(rank_share(self.global_indices(step, global_batch), dp_rank, dp_size))



def _file_fingerprint(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def build_dataset(data_cfg, seq_len: int, seed: int, cache_dir: str, *,
                  global_batch: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> TokenDataset:
    """Build (or load from ``cache_dir``) the packed dataset that ``data_cfg``
    (:class:`paralayer.config.DataConfig`: path, format, shuffle, tokenizer, text_field) describes.

    ``seed`` seeds the shuffle (``train.seed``); ``global_batch`` (``train.global_batch``) is the
    default for :meth:`TokenDataset.get_batch`; ``vocab_size`` (``model.vocab_size``), when given,
    is checked against the tokenizer and the ids. ``data.path: null`` → the offline corpus of
    :func:`make_corpus` in ``cache_dir``.
    """
    fmt = data_cfg.format
    if fmt not in FORMATS:
        raise DataError(f"{fmt!r} is not one of {', '.join(FORMATS)}", field="data.format")
    os.makedirs(cache_dir, exist_ok=True)
    path = data_cfg.path
    if path is None:
        path = make_corpus(default_corpus_path(cache_dir))
        fmt = "text"
    files = data_files(path)
    for f in files:
        check_file(f)
    tokenizer = None if fmt == "tokens" else load_tokenizer(data_cfg.tokenizer)
    tok_name = "none" if tokenizer is None else tokenizer.name
    if tokenizer is not None and vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise DataError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({tokenizer.vocab_size}, {data_cfg.tokenizer or 'byte-level'})", field="model.vocab_size")
    key_src = {"v": _CACHE_VERSION, "files": [_file_fingerprint(f) for f in files], "format": fmt,
               "text_field": data_cfg.text_field if fmt in ("jsonl", "parquet") else None,
               "tokenizer": tok_name, "seq_len": int(seq_len)}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:20]
    cache_file = os.path.join(cache_dir, f"packed-{fmt}-{seq_len}-{key}.npy")
    from_cache = True
    if not os.path.isfile(cache_file):
        with file_lock(cache_file + ".lock"):
            if not os.path.isfile(cache_file):
                from_cache = False
                if fmt == "tokens":
                    arr = read_tokens(files, seq_len, vocab_size)
                else:
                    arr = pack_documents(fmt, files, tokenizer, seq_len, data_cfg.text_field, cache_dir)
                hi = int(arr.max()) if arr.size else 0
                arr = arr.astype(np.uint16 if hi < 2**16 else np.int32)
                bio = io.BytesIO()
                np.save(bio, arr)
                meta = {"max_id": hi, "n_sequences": int(arr.shape[0]), "key": key_src}
                atomic_write_bytes(cache_file + ".json", json.dumps(meta).encode())
                atomic_write_bytes(cache_file, bio.getvalue())  # last: its presence = complete
    arr = np.load(cache_file, mmap_mode="r")
    with open(cache_file + ".json") as f:
        max_id = json.load(f)["max_id"]
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(f"holds id {max_id}, but model.vocab_size={vocab_size}", file=path)
    return TokenDataset(array=arr, seq_len=int(seq_len), shuffle=bool(data_cfg.shuffle),
                        seed=int(seed), global_batch=global_batch, source=os.path.abspath(path),
                        tokenizer_name=tok_name, from_cache=from_cache)
