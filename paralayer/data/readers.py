"""Reading the files ``data.path`` names into rows of token ids, with errors that say where.

* ``format=tokens``: a JSONL file, one ``{"input_ids": [...]}`` per line, each exactly ``seq_len``
  long; line i is sequence i (file order, nothing dropped or reordered).
* ``format=text | jsonl | parquet``: ``datasets.load_dataset("text" | "json" | "parquet",
  data_files=...)`` (text: one document per line; jsonl/parquet: the ``data.text_field`` column);
  prepare.py tokenises them into indexed shards (each document followed by the EOS id).

When ``datasets`` fails (a binary file, a malformed JSON line, a corrupt parquet file) its error
names neither the file nor the line; :func:`locate_error` reads the files again to find the first
bad line or file, so the user gets ``data.path: FILE:LINE: what is wrong``. ``datasets`` runs in a
temporary cache that is removed afterwards (prepare.py's shards are what is cached), so it leaves
neither Arrow files nor ``.lock`` files behind.

Network: never. ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` are set before ``datasets``
is imported (and forced on if it already was).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import List, Optional

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402

from paralayer.data.errors import DataError  # noqa: E402
from paralayer.inputs.depth import MAX_DEPTH, json_depth  # noqa: E402


def _one(files: List[str]) -> Optional[str]:
    return files[0] if len(files) == 1 else None


def _lines(fname: str):
    """(line number, decoded line) of a text file; DataError at the first line that is not UTF-8."""
    with open(fname, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError("not UTF-8 text (a binary file?)", file=fname, line=lineno) from None
            if "\x00" in text:
                raise DataError("holds NUL bytes (a binary file?)", file=fname, line=lineno)
            yield lineno, text


def read_tokens(files: List[str], seq_len: int, vocab_size: Optional[int]) -> np.ndarray:
    """``format=tokens``: [N, seq_len] int64, line i = sequence i."""
    rows: List[List[int]] = []
    for fname in files:
        for lineno, line in _lines(fname):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise TypeError("input_ids is not a list of integers")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f'data.format=tokens expects {{"input_ids": [...]}} per line '
                                f"({e.__class__.__name__}: {e})", file=fname, line=lineno) from None
            if len(ids) != seq_len:
                raise DataError(f"{len(ids)} ids, model.seq_len is {seq_len} (each line must be exactly seq_len)",
                                file=fname, line=lineno)
            bad = next((i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)), None)
            if bad is not None:
                raise DataError(f"id {bad} is outside [0, {vocab_size}) (model.vocab_size)", file=fname, line=lineno)
            rows.append(ids)
    if not rows:
        raise DataError("no sequences (the file is empty or blank)", file=_one(files) or os.path.dirname(files[0]))
    return np.asarray(rows, dtype=np.int64)


def _load_hf(fmt: str, files: List[str], cache_dir: str):
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    with contextlib.suppress(Exception):
        datasets.disable_progress_bars()
    with contextlib.suppress(Exception):  # its "Failed to load JSON ..." lines: locate_error says it better
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    builder = {"text": "text", "jsonl": "json", "parquet": "parquet"}[fmt]
    return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir)


def _parquet_columns(fname: str) -> dict:
    """{column: type} of one parquet file (large_string read as string: the same text to us)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(fname)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
        raise DataError(f"not a readable parquet file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})", file=fname) from None
    same = {pa.large_string(): pa.string(), pa.large_binary(): pa.binary()}
    return {f.name: str(same.get(f.type, f.type)) for f in schema}


def check_parquet(files: List[str], text_field: str) -> None:
    """Every parquet file has one schema (``datasets`` casts a later file to the first one's: a
    column of ints becomes text, so numbers would be trained on as documents), and the text column
    holds strings. DataError naming the files and the columns that differ."""
    first, cols0 = None, None
    for fname in files:
        cols = _parquet_columns(fname)
        kind = cols.get(text_field)
        if kind is not None and kind not in ("string", "null"):
            raise DataError(f"data.text_field {text_field!r} is a column of {kind}; valid: a column of strings",
                            file=fname)
        if cols0 is None:
            first, cols0 = fname, cols
            continue
        if cols != cols0:
            diff = sorted(set(cols) ^ set(cols0)) or sorted(k for k in cols if cols[k] != cols0[k])
            what = ", ".join(f"{k} ({cols0.get(k, 'missing')} vs {cols.get(k, 'missing')})" for k in diff[:4])
            raise DataError(f"its schema differs from {first}'s: {what}; every parquet file of one data.path must "
                            "have the same columns and types", file=fname)


def locate_error(fmt: str, files: List[str], text_field: str, exc: BaseException) -> DataError:
    """The first file and line (or file, for parquet) that explains why ``datasets`` failed."""
    for fname in files:
        if fmt == "parquet":
            try:
                import pyarrow.parquet as pq

                pq.ParquetFile(fname).read(columns=None)
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
                return DataError(f"not a readable parquet file ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})", file=fname)
            continue
        try:
            for lineno, line in _lines(fname):
                if fmt != "jsonl" or not line.strip():
                    continue
                if json_depth(line) > MAX_DEPTH:  # before json recurses (a deep line exhausts the stack)
                    return DataError(f"nested more than {MAX_DEPTH} levels deep", file=fname, line=lineno)
                try:
                    obj = json.loads(line.strip())
                except json.JSONDecodeError as e:
                    return DataError(f"not valid JSON ({e.msg} at column {e.colno})", file=fname, line=lineno)
                if not isinstance(obj, dict):
                    return DataError(f"expected a JSON object per line, got {type(obj).__name__}",
                                     file=fname, line=lineno)
                if obj.get(text_field) is not None and not isinstance(obj[text_field], str):
                    return DataError(f"data.text_field {text_field!r} is {type(obj[text_field]).__name__}, "
                                     "not a string", file=fname, line=lineno)
        except DataError as e:
            return e
    first = str(exc).strip().splitlines()
    return DataError(f"cannot be read as data.format={fmt} ({type(exc).__name__}"
                     f"{': ' + first[0] if first else ''})", file=_one(files) or os.path.dirname(files[0]))
