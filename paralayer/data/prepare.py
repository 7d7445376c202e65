"""Prepare, outside the training job: text, JSONL or parquet → Megatron indexed shards.

    python -m paralayer.data.prepare INPUT... --out PREFIX [--format text|jsonl|parquet]
        [--text-field F] [--tokenizer FILE] [--workers N]

Reads through ``datasets`` (``load_dataset`` + batched ``map`` with ``num_proc``), tokenises with
the configured tokenizer (byte-level by default; tokenizers.py), appends the EOS id after each
document and writes ``PREFIX.bin`` + ``PREFIX.idx`` (MMIDIDX v1, dtype from the vocabulary size:
uint16 below 65,500 ids, else int32).

Resumable and atomic: the documents are cut into parts written one by one to
``PREFIX.parts/part-NNNNN.{bin,idx}`` (each atomically: temp name, fsync, rename, .idx last); a
rerun after an interruption keeps the parts already there (if the inputs and settings are the
same) and writes the rest. The parts are then joined into ``PREFIX.bin/.idx`` under temp names
and renamed, .idx last: a prefix whose .idx exists is complete. Training (``data.format`` text,
jsonl, parquet) runs the same code into ``data.cache_dir``, so there is one reader.

Nothing is lost (paralayer/inputs/untrusted.py): the inputs are untrusted (never under /proc,
/sys, /dev; never a FIFO); an ``--out`` whose files would write over an input is refused; a
``PREFIX.parts`` found at the start is resumed only when it holds this prepare's parts with the
same key, else refused and left as it is (never deleted); one this invocation made is removed
when the data turns out bad.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, List, Optional

import numpy as np

from paralayer.data import readers
from paralayer.data.errors import DataError
from paralayer.data.indexed import IndexedShard, IndexedWriter, fsync_dir, write_index
from paralayer.data.preflight import check_file, data_files
from paralayer.data.tokenizers import load_tokenizer
from paralayer.inputs.depth import MAX_DEPTH, json_depth
from paralayer.inputs.echo import one_line
from paralayer.inputs.idx_header import optimal_dtype_code
from paralayer.inputs.untrusted import (
    ArgParser,
    BadInput,
    check_dir,
    check_out,
    guard,
    read_json,
    refuse_overwrite,
    show,
)
from paralayer.inputs.untrusted import check_file as check_input

_PART_VERSION = 1


def _fingerprint(files: List[str]) -> list:
    out = []
    for f in files:
        st = os.stat(f)
        out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


class _BadDocument(ValueError):
    """A document that is not text (a number, NUL bytes): located and named by the caller."""


class _Encode:
    """The batched ``map`` function: a batch of documents → one row of their ids back to back
    (each followed by EOS) and their lengths. Picklable, for ``num_proc`` workers."""

    def __init__(self, tokenizer, field: str):
        self.tok, self.field = tokenizer, field

    def __call__(self, batch: dict) -> dict:
        col = batch[self.field]
        bad = next((t for t in col if t is not None and (not isinstance(t, str) or "\x00" in t)), None)
        if bad is not None:  # prepare_files names the file and line (readers.locate_error)
            raise _BadDocument("holds NUL bytes" if isinstance(bad, str) else f"a document is {type(bad).__name__}")
        texts = [t for t in col if t]
        eos = getattr(self.tok, "eos_id", None)
        docs = [np.asarray(ids, dtype=np.int32) for ids in self.tok.encode_batch(texts)] if texts else []
        if eos is not None:
            docs = [np.append(d, np.int32(eos)) for d in docs]
        flat = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        return {"ids": [flat], "lengths": [np.asarray([d.size for d in docs], dtype=np.int32)]}


def _load(fmt: str, files: List[str], field: str, scratch: str):
    try:
        ds = readers._load_hf(fmt, files, scratch)
    except Exception as exc:  # noqa: BLE001 - DatasetGenerationError and friends
        raise readers.locate_error(fmt, files, field, exc) from None
    col = "text" if fmt == "text" else field
    if col not in ds.column_names:
        raise DataError(f"no column {col!r} (columns: {', '.join(ds.column_names)})", field="data.text_field",
                        file=files[0] if len(files) == 1 else os.path.dirname(files[0]))
    return ds.select_columns([col]), col


def _write_part(ds, col: str, tokenizer, part: str, code: int, workers: int, scratch: str) -> tuple[int, int]:
    """Tokenise ``ds`` (one part) with ``datasets.map`` into ``part.bin/.idx``: (documents, ids)."""
    import datasets

    nproc = workers if workers > 1 and ds.num_rows >= 2 * workers else None
    batch = max(1, min(1000, math.ceil(ds.num_rows / (4 * (nproc or 1)))))
    feats = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32")),
                               "lengths": datasets.Sequence(datasets.Value("int32"))})
    out = ds.map(_Encode(tokenizer, col), batched=True, batch_size=batch, num_proc=nproc, remove_columns=[col],
                 features=feats, load_from_cache_file=False, desc=None,
                 cache_file_name=os.path.join(scratch, os.path.basename(part) + ".arrow"))
    w = IndexedWriter(part, code)
    try:
        for rb in out.data.to_batches(max_chunksize=256):
            ids, lens = rb.column("ids"), rb.column("lengths")
            flat = ids.values.to_numpy(zero_copy_only=False)
            lengths = lens.values.to_numpy(zero_copy_only=False)
            w.add_documents(flat, lengths)
        n_docs = w.finalize()
    except BaseException:
        w.abort()
        raise
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(scratch, os.path.basename(part) + ".arrow"))
    return n_docs, w.n_tokens


def _join(parts: List[str], prefix: str, code: int) -> None:
    """Parts → PREFIX.bin/.idx (temp names, fsync, rename; .idx last)."""
    tmp_bin, tmp_idx = f"{prefix}.bin.tmp-{os.getpid()}", f"{prefix}.idx.tmp-{os.getpid()}"
    try:
        lengths = []
        with open(tmp_bin, "wb") as out:
            for p in parts:
                sh = IndexedShard(p)
                lengths.append(np.asarray(sh._index()[0]))
                with open(p + ".bin", "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        write_index(tmp_idx, code, np.concatenate(lengths) if lengths else np.zeros(0, np.int32))
        os.replace(tmp_bin, prefix + ".bin")
        os.replace(tmp_idx, prefix + ".idx")
        fsync_dir(prefix)
    finally:
        for t in (tmp_bin, tmp_idx):
            with contextlib.suppress(OSError):
                os.unlink(t)


_PART_NAME = re.compile(r"^(manifest\.json|part-\d{5}\.(bin|idx)|.*\.tmp-\d+)$")


def _parts_dir(prefix: str, key: dict) -> tuple[str, bool]:
    """(PREFIX.parts, created now). An existing one is resumed only when it holds a prepare's parts
    started with the same key; anything else there (other files, other inputs or settings, a
    damaged manifest) is refused, never deleted: it was not made by this invocation."""
    d = prefix + ".parts"
    manifest = os.path.join(d, "manifest.json")
    if not os.path.lexists(d):
        os.makedirs(d)
        with open(manifest, "w") as f:
            json.dump(key, f)
        return d, True
    if os.path.islink(d) or not os.path.isdir(d):
        raise BadInput("--out", f"{show(d)} exists and is not a parts folder of prepare; move it or choose another --out")
    names = os.listdir(d)
    foreign = [n for n in names if not _PART_NAME.match(n)]
    try:
        same = read_json(manifest, "--out", 1 << 20) == key
    except BadInput:
        same = False
    if foreign or not same:
        what = f"holds {show(foreign[0], 60)}" if foreign else "holds the parts of another prepare (other inputs or settings)"
        raise BadInput("--out", f"{show(d)} {what}; it is left as it is: remove it to start over, or choose another --out")
    for n in names:  # the temp files of a part interrupted mid-write (prepare's own names)
        if ".tmp-" in n:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, n))
    return d, False


@contextlib.contextmanager
def _removed_on_bad_data(created: Optional[str]):
    """Bad data found while writing parts: the parts folder this invocation created goes (an
    interruption keeps it, to resume; one found at the start is never removed)."""
    try:
        yield
    except (DataError, BadInput):
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise


def check_nesting(files: List[str]) -> None:
    """Every JSONL line nests at most MAX_DEPTH levels, checked before any JSON parser recurses
    (``datasets``' reader crashes the process on a deeply nested line). A line can only be that
    deep if it holds that many brackets, so most lines cost one count."""
    for fname in files:
        with open(fname, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
                    depth = json_depth(raw.decode("utf-8", errors="replace"))
                    if depth > MAX_DEPTH:
                        raise DataError(f"nested {depth} levels deep; the limit is {MAX_DEPTH}", file=fname,
                                        line=lineno)


def _resumed(part: str) -> tuple[int, int]:
    """(documents, tokens) of a part a previous invocation finished; a damaged one is refused."""
    try:
        sh = IndexedShard(part)
        return sh.n_documents, sh.n_tokens
    except Exception as exc:  # noqa: BLE001 - a damaged header or size
        raise BadInput("--out", f"{show(part)}.idx (a part kept to resume) cannot be read ({one_line(exc, 120)}); "
                       f"remove {show(os.path.dirname(part))} to start over") from None


def prepare_files(files: List[str], prefix: str, fmt: str = "text", text_field: str = "text",
                  tokenizer: Any = None, workers: int = 1, progress: bool = False,
                  part_docs: Optional[int] = None) -> dict:
    """Tokenise ``files`` into ``PREFIX.bin/.idx``; returns {documents, tokens, shards, parts, bytes,
    seconds, resumed_parts}. DataError (naming the file and line) for data that cannot be read."""
    tokenizer = tokenizer or load_tokenizer(None)
    code = optimal_dtype_code(tokenizer.vocab_size)
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".datasets-", dir=os.path.dirname(os.path.abspath(prefix)))
    try:
        if fmt == "jsonl":
            check_nesting(files)
        elif fmt == "parquet":
            readers.check_parquet(files, text_field)
        ds, col = _load(fmt, files, text_field, scratch)
        n = ds.num_rows
        part_docs = part_docs or max(250_000, math.ceil(n / 64))  # each part starts a worker pool
        n_parts = max(1, math.ceil(n / part_docs))
        key = {"v": _PART_VERSION, "files": _fingerprint(files), "format": fmt, "field": col,
               "tokenizer": tokenizer.name, "part_docs": part_docs}
        pdir, created = _parts_dir(prefix, key)
        parts = [os.path.join(pdir, f"part-{i:05d}") for i in range(n_parts)]
        stats = {"documents": 0, "tokens": 0, "resumed_parts": 0}
        with _progress(progress, n) as bar, _removed_on_bad_data(pdir if created else None):
            for i, part in enumerate(parts):
                lo, hi = i * part_docs, min(n, (i + 1) * part_docs)
                if os.path.isfile(part + ".idx"):
                    docs, toks = _resumed(part)
                    stats["resumed_parts"] += 1
                else:
                    try:
                        docs, toks = _write_part(ds.select(range(lo, hi)), col, tokenizer, part, code, workers,
                                                 scratch)
                    except _BadDocument as exc:
                        raise readers.locate_error(fmt, files, text_field, exc) from None
                stats["documents"] += docs
                stats["tokens"] += toks
                bar(hi - lo, toks)
        if stats["documents"] == 0:
            raise DataError(f"holds no documents ({n} rows, all empty)", file=files[0] if len(files) == 1
                            else os.path.dirname(files[0]))
        _join(parts, prefix, code)
        shutil.rmtree(pdir, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**stats, "shards": 1, "parts": n_parts, "seconds": time.perf_counter() - t0,
            "bytes": os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx"),
            "dtype": IndexedShard(prefix).header.dtype}


@contextlib.contextmanager
def _progress(show: bool, total_docs: int):
    """A rich progress bar (documents, tokens, tokens/s) on stderr; a no-op when ``show`` is off."""
    if not show:
        yield lambda docs, toks: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    t0, done = time.perf_counter(), {"tok": 0}
    prog = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f} docs"),
                    TextColumn("{task.fields[tok]:,} tokens"), TextColumn("{task.fields[rate]:,.0f} tokens/s"),
                    TimeElapsedColumn(), console=Console(stderr=True))
    with prog:
        task = prog.add_task("prepare", total=total_docs, tok=0, rate=0.0)

        def advance(docs: int, toks: int) -> None:
            done["tok"] += toks
            prog.update(task, advance=docs, tok=done["tok"],
                        rate=done["tok"] / max(1e-9, time.perf_counter() - t0))

        yield advance


def prepare_tokens(files: List[str], prefix: str, seq_len: int, vocab_size: Optional[int]) -> dict:
    """``format=tokens`` (JSONL ``{"input_ids": [...]}``, each line exactly seq_len): one document
    per line, no EOS, so the packed stream cut at seq_len gives back the lines."""
    rows = readers.read_tokens(files, seq_len, vocab_size)
    hi = int(rows.max()) if rows.size else 0
    w = IndexedWriter(prefix, optimal_dtype_code(max(hi + 1, vocab_size or 0)))
    try:
        w.add_documents(rows.reshape(-1), np.full(rows.shape[0], seq_len, dtype=np.int32))
        n = w.finalize()
    except BaseException:
        w.abort()
        raise
    return {"documents": n, "tokens": int(rows.size), "shards": 1, "parts": 1,
            "bytes": os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx")}


# ------------------------------------------------------------------ the command
def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="python -m paralayer.data.prepare",
                                description="Tokenise text, JSONL or parquet into Megatron indexed shards "
                                            "(PREFIX.bin + PREFIX.idx)")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--format", default="text", choices=("text", "jsonl", "parquet"))
    p.add_argument("--text-field", default="text", help="the column of jsonl/parquet documents (default: text)")
    p.add_argument("--tokenizer", default=None, metavar="FILE", help="a tokenizers JSON file (default: bytes)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="datasets.map num_proc")
    p.add_argument("--part-docs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


#: the recipe field a DataError names -> this command's argument
_ARG_OF = {"data.path": "INPUT", "data.text_field": "--text-field", "data.tokenizer": "--tokenizer"}


def input_files(inputs: List[str], field: str = "INPUT") -> List[str]:
    """The files INPUT... name (a folder: its visible regular files), each checked as untrusted
    input: not under /proc, /sys, /dev; links followed only to regular files; never a FIFO."""
    out: List[str] = []
    for inp in inputs:
        if os.path.isdir(inp):
            check_dir(inp, field)
        else:
            check_input(inp, field)
        try:
            found = data_files(inp)
        except DataError as exc:
            raise BadInput(field, f"{show(exc.file or inp)}: {exc.reason}") from None
        for f in found:
            check_input(f, field)
            check_file(f)
        out += found
    return out


def check_args(args: argparse.Namespace, files: List[str]) -> None:
    """The flags, and the outputs against the inputs (nothing is written over what is read)."""
    if args.workers < 1:
        raise BadInput("--workers", f"must be >= 1, got {args.workers}")
    if args.part_docs is not None and args.part_docs < 1:
        raise BadInput("--part-docs", f"must be >= 1, got {args.part_docs}")
    check_out(args.out, "--out")
    reads = files + ([args.tokenizer] if args.tokenizer else [])
    refuse_overwrite([args.out + ".bin", args.out + ".idx", args.out + ".parts"], reads, "--out")


def _main(argv: Optional[List[str]]) -> int:
    args = build_parser().parse_args(argv)
    files = input_files(args.inputs)
    if args.tokenizer:
        check_input(args.tokenizer, "--tokenizer", 64 << 20)
    check_args(args, files)
    try:
        tok = load_tokenizer(args.tokenizer)
    except DataError as exc:
        raise BadInput("--tokenizer", f"{show(exc.file or args.tokenizer)}: {exc.reason}") from None
    try:
        st = prepare_files(files, args.out, args.format, args.text_field, tok, args.workers,
                           progress=not args.no_progress and sys.stderr.isatty(), part_docs=args.part_docs)
    except DataError as exc:  # named as the command's argument, not the recipe's field
        field = _ARG_OF.get(exc.field, exc.field)
        where = f"{show(exc.file)}{f':{exc.line}' if exc.line else ''}: " if exc.file else ""
        raise BadInput(field, f"{where}{exc.reason}") from None
    rate = st["tokens"] / max(st["seconds"], 1e-9)
    resumed = f", {st['resumed_parts']} resumed" if st["resumed_parts"] else ""
    print(f"prepared {show(args.out, 300)}.bin/.idx: documents {st['documents']:,}, tokens {st['tokens']:,}, "
          f"shards {st['shards']} ({st['parts']} parts{resumed}), "
          f"bytes {st['bytes']:,} ({st['dtype']}), {st['seconds']:.1f} s, {rate:,.0f} tokens/s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """The command: prints documents, tokens, shards, bytes; exit 2 with one line for bad input
    (paralayer/inputs/untrusted.py), naming the argument, the file and the line."""
    return guard("prepare", lambda: _main(argv))


if __name__ == "__main__":
    # through the imported module, never this ``__main__`` copy: the workers of ``datasets.map``
    # pickle ``__main__``'s classes by value, so a _BadDocument raised there came back as another
    # class that no ``except`` here caught (exit 1, "unexpected", instead of exit 2)
    from paralayer.data import prepare as _module

    sys.exit(_module.main())
