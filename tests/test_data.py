"""paralayer.data: real `datasets` loads of local text/jsonl/parquet files, the tokens format's order
contract, packing, dp shares, determinism, caching, no network."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from paralayer.config import DataConfig
from paralayer.data.corpus import make_corpus
from paralayer.data.dataset import build_dataset
from paralayer.data.errors import DataError
from paralayer.data.sampler import global_batch_indices, labels_for, rank_share
from paralayer.data.tokenizers import ByteTokenizer, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [f"Document number {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1)
        + "Ünïcödé ✓" for i in range(60)]
SEQ = 32


def _expected_packed(docs, seq_len, tok=None):
    tok = tok or ByteTokenizer()
    stream = []
    for d in docs:
        stream += tok.encode(d)
        if tok.eos_id is not None:
            stream.append(tok.eos_id)
    n = len(stream) // seq_len
    return np.asarray(stream[: n * seq_len]).reshape(n, seq_len)


def _all(ds):
    return ds.rows(range(ds.n_sequences))


def _write_text(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(docs) + "\n")


def _write_jsonl(path, docs, field="body"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def _write_parquet(path, docs, field="content"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path)


def _write_tokens(path, n, seq_len, vocab=256):
    rows = [[(i * 7 + j) % vocab for j in range(seq_len)] for i in range(n)]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r}) + "\n")
    return np.asarray(rows)


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_formats_pack_exactly(tmp_path, fmt):
    if fmt == "text":
        p, field = tmp_path / "c.txt", "text"
        _write_text(p, DOCS)
    elif fmt == "jsonl":
        p, field = tmp_path / "c.jsonl", "body"
        _write_jsonl(p, DOCS, field)
    else:
        p, field = tmp_path / "c.parquet", "content"
        _write_parquet(p, DOCS, field)
    cfg = DataConfig(path=str(p), format=fmt, shuffle=False, text_field=field)
    ds = build_dataset(cfg, SEQ, seed=0, cache_dir=str(tmp_path / "cache"), global_batch=4, vocab_size=256)
    exp = _expected_packed(DOCS, SEQ)
    assert ds.n_sequences == len(exp) > 20
    np.testing.assert_array_equal(_all(ds), exp)
    b = ds.get_batch(1)
    assert b.dtype == torch.long and b.shape == (4, SEQ)
    np.testing.assert_array_equal(b.numpy(), exp[:4])
    assert not ds.from_cache
    ds2 = build_dataset(cfg, SEQ, seed=0, cache_dir=str(tmp_path / "cache"), global_batch=4)
    assert ds2.from_cache
    np.testing.assert_array_equal(_all(ds2), exp)
    # another seq_len re-tokenises nothing: the same prepared shard, cut into 16s
    ds3 = build_dataset(cfg, 16, seed=0, cache_dir=str(tmp_path / "cache"))
    assert ds3.from_cache and ds3.rows([0]).shape == (1, 16)
    np.testing.assert_array_equal(_all(ds3), _expected_packed(DOCS, 16))


def test_missing_text_field_names_it(tmp_path):
    p = tmp_path / "c.jsonl"
    _write_jsonl(p, DOCS, "body")
    cfg = DataConfig(path=str(p), format="jsonl", text_field="text")
    with pytest.raises(ValueError, match=r"data.text_field.*'text'.*body"):
        build_dataset(cfg, SEQ, 0, str(tmp_path / "cache"))


def test_tokens_format_order_contract(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = _write_tokens(p, n=10, seq_len=SEQ)
    cfg = DataConfig(path=str(p), format="tokens", shuffle=False)
    ds = build_dataset(cfg, SEQ, seed=123, cache_dir=str(tmp_path / "cache"), global_batch=4, vocab_size=256)
    assert ds.n_sequences == 10
    # step k consumes lines (k-1)*B .. k*B-1 in file order, wrapping around
    for k in range(1, 7):
        want = [((k - 1) * 4 + j) % 10 for j in range(4)]
        np.testing.assert_array_equal(ds.get_batch(k).numpy(), rows[want])
    # labels: the same ids shifted left inside the line, last ignored
    x = ds.get_batch(1)
    y = labels_for(x)
    assert torch.equal(y[:, :-1], x[:, 1:]) and (y[:, -1] == -100).all()


def test_tokens_format_errors(tmp_path):
    p = tmp_path / "t.jsonl"
    _write_tokens(p, n=3, seq_len=SEQ)
    with open(p, "a") as f:
        f.write(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = DataConfig(path=str(p), format="tokens", shuffle=False)
    with pytest.raises(ValueError, match=r"t.jsonl:4: 3 ids, model.seq_len is 32"):
        build_dataset(cfg, SEQ, 0, str(tmp_path / "cache"))
    q = tmp_path / "big.jsonl"
    with open(q, "w") as f:
        f.write(json.dumps({"input_ids": [300] * SEQ}) + "\n")
    with pytest.raises(ValueError, match="vocab_size"):
        build_dataset(DataConfig(path=str(q), format="tokens"), SEQ, 0, str(tmp_path / "c2"), vocab_size=256)


def test_global_batch_indices_and_shares():
    n, B = 37, 8
    # shuffle=false: file order with wrap-around
    assert global_batch_indices(1, B, n, False, 0) == list(range(8))
    assert global_batch_indices(5, B, n, False, 0) == [32, 33, 34, 35, 36, 0, 1, 2]
    # shuffle=true: every epoch is a permutation; deterministic for the seed; seeds differ
    epoch0 = sum((global_batch_indices(k, 1, n, True, 7) for k in range(1, n + 1)), [])
    epoch1 = sum((global_batch_indices(k, 1, n, True, 7) for k in range(n + 1, 2 * n + 1)), [])
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1 and epoch0 != list(range(n))
    assert global_batch_indices(3, B, n, True, 7) == global_batch_indices(3, B, n, True, 7)
    assert global_batch_indices(3, B, n, True, 7) != global_batch_indices(3, B, n, True, 8)
    # batches of B positions over the stream agree with the 1-at-a-time view
    flat = sum((global_batch_indices(k, B, n, True, 7) for k in range(1, 10)), [])
    one = sum((global_batch_indices(k, 1, n, True, 7) for k in range(1, 9 * B + 1)), [])
    assert flat == one
    # dp shares: disjoint, contiguous, union = the global batch
    g = global_batch_indices(4, B, n, True, 7)
    for dp in (1, 2, 4, 8):
        shares = [rank_share(g, r, dp) for r in range(dp)]
        assert sum(shares, []) == g
        assert all(len(s) == B // dp for s in shares)
    with pytest.raises(ValueError, match="divisible"):
        rank_share(g, 0, 3)
    with pytest.raises(ValueError):
        global_batch_indices(0, B, n, False, 0)


def test_dp_sizes_see_the_same_global_batch(tmp_path):
    p = tmp_path / "c.txt"
    _write_text(p, DOCS)
    ds = build_dataset(DataConfig(path=str(p), format="text", shuffle=True), SEQ, seed=3,
                       cache_dir=str(tmp_path / "cache"), global_batch=8)
    for step in (1, 2, 9):
        full = ds.get_batch(step, 0, 1)
        for dp in (2, 4):
            parts = [ds.get_batch(step, r, dp) for r in range(dp)]
            assert all(pt.shape == (8 // dp, SEQ) for pt in parts)
            assert torch.equal(torch.cat(parts), full)
    # deterministic across a fresh build (resume = the step only)
    ds2 = build_dataset(DataConfig(path=str(p), format="text", shuffle=True), SEQ, seed=3,
                        cache_dir=str(tmp_path / "cache2"), global_batch=8)
    assert torch.equal(ds2.get_batch(9), ds.get_batch(9))


def test_hf_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS, trainer)
    tpath = tmp_path / "tok.json"
    tok.save(str(tpath))
    t = load_tokenizer(str(tpath))
    assert t.eos_id == tok.token_to_id("</s>") and 256 < t.vocab_size <= 300
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    p = tmp_path / "c.txt"
    _write_text(p, DOCS)
    cfg = DataConfig(path=str(p), format="text", shuffle=False, tokenizer=str(tpath))
    ds = build_dataset(cfg, SEQ, 0, str(tmp_path / "cache"), global_batch=2, vocab_size=512)
    np.testing.assert_array_equal(_all(ds), _expected_packed(DOCS, SEQ, t))
    assert ds.n_sequences < len(_expected_packed(DOCS, SEQ))  # BPE compresses vs bytes
    with pytest.raises(ValueError, match="model.vocab_size=256"):
        build_dataset(cfg, SEQ, 0, str(tmp_path / "cache"), vocab_size=256)
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_generated_corpus_is_deterministic_cached_and_learnable(tmp_path):
    a = make_corpus(str(tmp_path / "a.txt"), n_bytes=100_000, seed=0)
    b = make_corpus(str(tmp_path / "b.txt"), n_bytes=100_000, seed=0)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert 100_000 <= os.path.getsize(a) < 102_000
    m = os.stat(a).st_mtime_ns
    make_corpus(a, n_bytes=100_000, seed=0)
    assert os.stat(a).st_mtime_ns == m  # cached by path
    assert open(make_corpus(str(tmp_path / "c.txt"), 100_000, seed=1), "rb").read() != open(a, "rb").read()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    # data.path: null → the generated corpus; a bigram model learns it well below ln(256)=5.55 in
    # 40 steps of the tiny recipe's batch (16 x 128)
    ds = build_dataset(DataConfig(path=None, format="text", shuffle=True), 128, 0,
                       str(tmp_path / "cache"), global_batch=16, vocab_size=256)
    assert ds.n_sequences > 10_000
    torch.manual_seed(0)
    emb = torch.nn.Embedding(256, 256)
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    for step in range(1, 41):
        x = ds.get_batch(step)
        loss = torch.nn.functional.cross_entropy(emb(x).view(-1, 256), labels_for(x).view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 3.0


_NO_NET = textwrap.dedent("""
    import json, os, socket, sys
    def _refuse(*a, **k):
        raise RuntimeError("network access attempted")
    socket.socket.connect = _refuse
    socket.socket.connect_ex = _refuse
    socket.create_connection = _refuse
    socket.getaddrinfo = _refuse
    from paralayer.config import DataConfig
    from paralayer.data.dataset import build_dataset
    d = sys.argv[1]
    out = {}
    for fmt, name, field in [("text", "c.txt", "text"), ("jsonl", "c.jsonl", "body"),
                             ("parquet", "c.parquet", "content")]:
        ds = build_dataset(DataConfig(path=os.path.join(d, name), format=fmt, text_field=field),
                           32, 0, os.path.join(d, "cache"), global_batch=4)
        out[fmt] = ds.n_sequences
    print(json.dumps(out))
""")


def test_no_network(tmp_path):
    _write_text(tmp_path / "c.txt", DOCS)
    _write_jsonl(tmp_path / "c.jsonl", DOCS, "body")
    _write_parquet(tmp_path / "c.parquet", DOCS, "content")
    script = tmp_path / "nonet.py"
    script.write_text(_NO_NET)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["HOME"] = str(tmp_path / "home")  # anything written to ~ would show up here
    cmd = [sys.executable, str(script), str(tmp_path)]
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        cmd = [unshare, "-n"] + cmd  # and no network namespace at all
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    n = json.loads(r.stdout.strip().splitlines()[-1])
    assert n["text"] == n["jsonl"] == n["parquet"] == len(_expected_packed(DOCS, 32))
    assert not os.path.exists(tmp_path / "home" / ".cache"), os.listdir(tmp_path / "home" / ".cache")
