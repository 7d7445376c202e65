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
