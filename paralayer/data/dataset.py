"""The training dataset: N sequences of ``seq_len`` ids read lazily from indexed shards, and its
stateless batches.

Conventions (every format)
--------------------------
* A dataset is N sequences of exactly ``seq_len`` token ids (``model.seq_len``).
* The model input is the whole sequence; the labels are the same ids shifted left by one inside the
  sequence, the last position ignored (``-100``), see :func:`sampler.labels_for`.
* ``data.format=indexed``: ``data.path`` names Megatron shards (a prefix, a directory, a list);
  their documents back to back, cut into ``seq_len`` chunks, the tail dropped (stream.py).
* ``text | jsonl | parquet``: prepared once per corpus (files, format, text field, tokenizer; not
  seq_len) into ``data.cache_dir`` by prepare.py, then read like ``indexed``: one reader.
  ``tokens``: each line one document of exactly seq_len ids (no EOS), so sequence i = line i.
  ``data.path: null``: the offline corpus (corpus.py, format text).
* ``data.blend``: a list of {path, weight}: blend.py. ``data.valid_fraction``: the last fraction of
  each source's sequences is held out of training (:func:`build_valid_dataset` returns them).

Ranks that prepare the same corpus at the same time take a file lock (cache.py): one builds, the
others wait and read. Bad data raises DataError naming the field, the file and the line or offset.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from paralayer.data.cache import atomic_write_bytes, file_lock
from paralayer.data.corpus import default_corpus_path, make_corpus
from paralayer.data.errors import DataError
from paralayer.data.indexed import IndexedShard
from paralayer.data.preflight import FORMATS, check_file, data_files
from paralayer.data.sampler import global_batch_indices, rank_share
from paralayer.data.stream import PackedSequences, TokenStream
from paralayer.data.tokenizers import load_tokenizer
from paralayer.inputs.idx_header import IdxError, indexed_prefixes

_CACHE_VERSION = 2


@dataclass
class TokenDataset:
    """N sequences of ``seq_len`` ids (``seqs``: lazily packed from memory-mapped shards) and the
    sampler settings. Stateless: :meth:`get_batch` depends on the step only."""

    seqs: PackedSequences
    seq_len: int
    shuffle: bool
    seed: int
    global_batch: Optional[int] = None
    source: str = ""
    tokenizer_name: str = "byte"
    from_cache: bool = False

    @property
    def n_sequences(self) -> int:
        return len(self.seqs)

    def __len__(self) -> int:
        return self.n_sequences

    @property
    def files(self) -> List[str]:
        return self.seqs.stream.files

    def rows(self, indices: Sequence[int]) -> np.ndarray:
        return self.seqs.rows(indices)

    def sequences(self, indices: Sequence[int]) -> torch.Tensor:
        """LongTensor [len(indices), seq_len]."""
        return torch.from_numpy(self.seqs.rows(indices))

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

    def source_sequences(self, step: int, global_batch: Optional[int] = None) -> Dict[str, int]:
        """{source: sequences drawn in steps 1..step} (metrics.jsonl ``source_sequences``)."""
        return {self.source: int(step) * int(global_batch or self.global_batch or 0)}


# ------------------------------------------------------------------ one source
def _file_fingerprint(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _indexed_stream(path: Any, vocab_size: Optional[int], field: str) -> TokenStream:
    try:
        prefixes = indexed_prefixes(path)
    except IdxError as exc:
        raise DataError(exc.what, field=field, file=exc.file) from None
    shards = [IndexedShard(p, field) for p in prefixes]
    if vocab_size is not None:
        for s in shards:
            s.check_vocab(vocab_size)
    return TokenStream(shards, vocab_size, field)


def _prepared_stream(path: str, fmt: str, data_cfg: Any, seq_len: int, cache_dir: str,
                     vocab_size: Optional[int], field: str) -> tuple[TokenStream, str, bool]:
    """text/jsonl/parquet/tokens → an indexed shard in the cache (keyed by the corpus; tokens also
    by seq_len, whose lines must be exactly that long), read like data.format=indexed."""
    from paralayer.data import prepare

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
               "tokenizer": tok_name, "seq_len": int(seq_len) if fmt == "tokens" else None}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:20]
    prefix = os.path.join(cache_dir, f"indexed-{fmt}-{key}")
    from_cache = True
    if not os.path.isfile(prefix + ".json"):
        with file_lock(prefix + ".lock"):
            if not os.path.isfile(prefix + ".json"):
                from_cache = False
                if fmt == "tokens":
                    st = prepare.prepare_tokens(files, prefix, seq_len, vocab_size)
                else:
                    st = prepare.prepare_files(files, prefix, fmt, data_cfg.text_field, tokenizer, workers=1)
                shard = IndexedShard(prefix)
                hi = int(np.max(shard.tokens)) if shard.n_tokens else 0
                meta = {"max_id": hi, "tokens": st["tokens"], "documents": st["documents"], "key": key_src}
                atomic_write_bytes(prefix + ".json", json.dumps(meta).encode())  # last: complete
    with open(prefix + ".json") as f:
        max_id = json.load(f)["max_id"]
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(f"holds id {max_id}, but model.vocab_size={vocab_size}", field=field, file=path)
    return TokenStream([IndexedShard(prefix, field)], None, field), tok_name, from_cache


def open_source(path: Any, data_cfg: Any, seq_len: int, cache_dir: str, vocab_size: Optional[int],
                     field: str = "data.path") -> tuple[PackedSequences, str, bool]:
    """(the packed sequences of one source, tokenizer name, from the cache?)."""
    fmt = data_cfg.format
    if fmt not in FORMATS:
        raise DataError(f"{fmt!r} is not one of {', '.join(FORMATS)}", field="data.format")
    if fmt == "indexed":
        stream, tok, cached = _indexed_stream(path, vocab_size, field), "indexed", True
    else:
        stream, tok, cached = _prepared_stream(path, fmt, data_cfg, seq_len, cache_dir, vocab_size, field)
    if stream.n_tokens < seq_len:
        raise DataError(f"holds {stream.n_tokens} tokens, fewer than one sequence (model.seq_len={seq_len})",
                        field=field, file=_name(path))
    return PackedSequences(stream, seq_len), tok, cached


def _name(path: Any) -> str:
    return ", ".join(map(str, path)) if isinstance(path, (list, tuple)) else str(path)


def held_out(n: int, fraction: float) -> int:
    """Sequences held out of n by ``data.valid_fraction`` (at least one when the fraction is > 0)."""
    return 0 if fraction <= 0 else max(1, min(n - 1, int(math.floor(n * fraction))))


# ------------------------------------------------------------------ the builders
def _sources(data_cfg: Any, cache_dir: str) -> list[tuple[Any, float, str]]:
    """(path, weight, field) of each source: data.blend's entries, or data.path with weight 1."""
    from paralayer.data.blend import blend_entries

    blend = getattr(data_cfg, "blend", None) or []
    if blend:
        if data_cfg.path is not None:
            raise DataError(f"data.path is also set ({data_cfg.path}): a run reads data.path or data.blend, not both "
                            "(set data.path=null)", field="data.blend")
        return blend_entries(blend)
    path = data_cfg.path
    if path is None:
        path = make_corpus(default_corpus_path(cache_dir))
    return [(path, 1.0, "data.path")]


def _build(data_cfg: Any, seq_len: int, seed: int, cache_dir: str, global_batch: Optional[int],
           vocab_size: Optional[int], part: str):
    """The training part (``part="train"``) or the held-out part (``"valid"``) of every source."""
    from paralayer.data.blend import BlendedDataset

    if data_cfg.path is None and not getattr(data_cfg, "blend", None):
        data_cfg = dataclasses.replace(data_cfg, format="text")
    os.makedirs(cache_dir, exist_ok=True)
    frac = float(getattr(data_cfg, "valid_fraction", 0.0) or 0.0)
    out = []
    for i, (path, weight, field) in enumerate(_sources(data_cfg, cache_dir)):
        seqs, tok, cached = open_source(path, data_cfg, seq_len, cache_dir, vocab_size, field)
        n_out = held_out(len(seqs), frac)
        if n_out and len(seqs) < 2:
            raise DataError(f"holds {len(seqs)} sequence of model.seq_len={seq_len}: nothing to hold out for "
                            "data.valid_fraction", field=field, file=_name(path))
        train, valid = seqs.split_tail(n_out)
        chosen = train if part == "train" else valid
        out.append((weight, TokenDataset(
            seqs=chosen, seq_len=int(seq_len), shuffle=bool(data_cfg.shuffle) and part == "train",
            seed=int(seed) + 1_000_003 * i, global_batch=global_batch, source=_name(path),
            tokenizer_name=tok, from_cache=cached)))
    if part == "valid" and not frac:
        return None
    if not getattr(data_cfg, "blend", None):
        ds = out[0][1]
        ds.seed = int(seed)
        return ds
    return BlendedDataset([d for _, d in out], [w for w, _ in out], global_batch=global_batch)


def build_dataset(data_cfg, seq_len: int, seed: int, cache_dir: str, *,
                  global_batch: Optional[int] = None,
                  vocab_size: Optional[int] = None):
    """The training dataset ``data_cfg`` (:class:`paralayer.config.DataConfig`) describes: a
    :class:`TokenDataset`, or a :class:`blend.BlendedDataset` under ``data.blend`` (same interface:
    ``get_batch(step, dp_rank, dp_size, global_batch)``, ``n_sequences``, ``source_sequences``).

    ``seed`` seeds the shuffle (``train.seed``); ``global_batch`` (``train.global_batch``) is the
    default for ``get_batch``; ``vocab_size`` (``model.vocab_size``), when given, is checked against
    the tokenizer, the shards' dtype and the ids. ``data.valid_fraction`` > 0 leaves each source's
    held-out tail out. ``data.path: null`` → the offline corpus of :func:`make_corpus`.
    """
    return _build(data_cfg, seq_len, seed, cache_dir, global_batch, vocab_size, "train")


def build_valid_dataset(data_cfg, seq_len: int, seed: int, cache_dir: str, *,
                        global_batch: Optional[int] = None, vocab_size: Optional[int] = None,
                        path: Any = None):
    """The validation dataset, unshuffled (batch k = sequences (k−1)·B … k·B−1, wrapping):

    * ``path`` given (``data.valid``): that corpus, read with ``data.format`` by the same builder;
      DataError (field data.valid) if it shares a file with the training data;
    * else ``data.valid_fraction`` > 0: the held-out tail of each source (blended by the same
      weights under ``data.blend``), disjoint from what :func:`build_dataset` trains on;
    * else None.
    """
    if path is not None:
        from paralayer.data.preflight import shared_files

        shared = shared_files(data_cfg, path)
        if shared:
            raise DataError(f"is also training data ({shared[0]}): validation and training share a file",
                            field="data.valid", file=_name(path))
        cfg = dataclasses.replace(data_cfg, path=path, blend=[], valid_fraction=0.0, shuffle=False)
        ds = _build(cfg, seq_len, seed, cache_dir, global_batch, vocab_size, "train")
        return ds
    return _build(data_cfg, seq_len, seed, cache_dir, global_batch, vocab_size, "valid")
