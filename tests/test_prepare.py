"""``python -m paralayer.data.prepare``: what it prints, that an interrupted run leaves no shard a
reader would take and resumes from its finished parts to the same bytes, jsonl/parquet fields,
a tokenizers file, several workers, and one line + exit 2 for bad input."""
from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest

from paralayer.data import prepare
from paralayer.data.indexed import IndexedShard
from paralayer.data.tokenizers import ByteTokenizer

DOCS = [f"line {i}: " + "tokens and more tokens " * (i % 4) for i in range(500)]


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = prepare.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _files(d):
    return sorted(os.listdir(d))


def test_prepare_prints_and_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    src = tmp_path / "c.txt"
    src.write_text("\n".join(DOCS) + "\n")
    tok = ByteTokenizer()
    want = sum((tok.encode(d) + [0] for d in DOCS), [])
    rc, out, err = _main([str(src), "--out", str(tmp_path / "a" / "c"), "--workers", "2", "--part-docs", "100"])
    assert rc == 0, err
    assert out.startswith(f"prepared {tmp_path / 'a' / 'c'}.bin/.idx: documents 500, tokens {len(want):,}, "
                          f"shards 1 (5 parts), bytes {2 * len(want) + 34 + 12 * 500 + 8 * 501:,} (uint16)")
    assert "tokens/s" in out and _files(tmp_path / "a") == ["c.bin", "c.idx"]
    sh = IndexedShard(str(tmp_path / "a" / "c"))
    assert np.asarray(sh.tokens).tolist() == want and sh.n_documents == 500
    # interrupted in the third part: no c.bin/c.idx, two parts kept
    real, calls = prepare._write_part, {"n": 0}

    def dies(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            open(os.path.join(tmp_path, "b", "c.parts", "part-00002.bin.tmp-1"), "wb").write(b"half")
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(prepare, "_write_part", dies)
    with pytest.raises(KeyboardInterrupt):
        prepare.main([str(src), "--out", str(tmp_path / "b" / "c"), "--part-docs", "100", "--no-progress"])
    assert _files(tmp_path / "b") == ["c.parts"]
    assert _files(tmp_path / "b" / "c.parts") == ["manifest.json", "part-00000.bin", "part-00000.idx",
                                                  "part-00001.bin", "part-00001.idx", "part-00002.bin.tmp-1"]
    monkeypatch.setattr(prepare, "_write_part", real)
    rc, out, _ = _main([str(src), "--out", str(tmp_path / "b" / "c"), "--part-docs", "100"])
    assert rc == 0 and "(5 parts, 2 resumed)" in out
    assert _files(tmp_path / "b") == ["c.bin", "c.idx"]
    for ext in (".bin", ".idx"):
        assert open(tmp_path / "a" / f"c{ext}", "rb").read() == open(tmp_path / "b" / f"c{ext}", "rb").read()


def test_jsonl_parquet_tokenizer_and_bad_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "c.parquet")
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    t.save(str(tmp_path / "tok.json"))
    eos = t.token_to_id("</s>")
    want = sum((t.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS), [])
    for fmt in ("jsonl", "parquet"):
        rc, out, err = _main([str(tmp_path / f"c.{fmt}"), "--out", str(tmp_path / fmt), "--format", fmt,
                              "--text-field", "body", "--tokenizer", str(tmp_path / "tok.json")])
        assert rc == 0, err
        assert np.asarray(IndexedShard(str(tmp_path / fmt)).tokens).tolist() == want
    rc, out, err = _main([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "x"), "--format", "jsonl"])
    assert rc == 2 and err.strip().splitlines() == [f"error: --text-field: {tmp_path / 'c.jsonl'}: no column "
                                                    "'text' (columns: body)"]
    rc, out, err = _main([str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x")])
    assert rc == 2 and err.strip() == f"error: INPUT: {tmp_path / 'nope.txt'}: no such file"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("x.", ".datasets-"))]


def test_a_document_that_is_not_text_is_exit_2_from_python_m(tmp_path):
    """``python -m paralayer.data.prepare`` with workers: the _BadDocument a worker raises is caught
    (issue 46: exit 1 "unexpected", as ``__main__``'s classes came back from the workers by value)."""
    import subprocess
    import sys

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]) + '{"text": ["a", "list"]}\n')
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "paralayer.data.prepare", str(src), "--out", str(tmp_path / "o"),
                        "--format", "jsonl", "--workers", "2", "--no-progress"], env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: INPUT: {src}:21: data.text_field 'text' is list, not a string"], p.stderr


def test_parquet_text_of_ints_and_a_folder_of_mixed_schemas_are_refused(tmp_path):
    """A text column of ints, and a folder whose files differ in schema (``datasets`` cast the
    second file's ints to text and trained on them: exit 0), are exit 2 naming the file and the
    columns; the same columns in another order, or large_string for string, are one schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def folder(name, *tables):
        (tmp_path / name).mkdir()
        for i, t in enumerate(tables):
            pq.write_table(pa.table(t), tmp_path / name / f"{i}.parquet")
        return str(tmp_path / name)

    cases = {
        folder("ints", {"text": list(range(40))}):
            "0.parquet: data.text_field 'text' is a column of int64; valid: a column of strings",
        folder("mixed", {"text": ["a b", "c"]}, {"text": [1, 2]}):
            "1.parquet: data.text_field 'text' is a column of int64; valid: a column of strings",
        folder("extra", {"text": ["a b"], "n": [1]}, {"text": ["x"], "n": ["s"]}):
            "1.parquet: its schema differs from {d}/0.parquet's: n (int64 vs string); every parquet file of one "
            "data.path must have the same columns and types",
        folder("missing", {"text": ["a b"]}, {"body": ["x"]}):
            "1.parquet: its schema differs from {d}/0.parquet's: body (missing vs string), text (string vs "
            "missing); every parquet file of one data.path must have the same columns and types"}
    for d, want in cases.items():
        rc, out, err = _main([d, "--out", str(tmp_path / "o"), "--format", "parquet", "--workers", "1"])
        assert rc == 2 and err.strip().splitlines() == [f"error: INPUT: {d}/{want.format(d=d)}"], err
    same = folder("same", {"text": ["a b"], "n": [1]},
                  {"n": [2], "text": pa.array(["c"], pa.large_string())})
    rc, out, err = _main([same, "--out", str(tmp_path / "o"), "--format", "parquet", "--workers", "1"])
    assert rc == 0 and "documents 2" in out, err
