"""Megatron's indexed dataset both ways, against the real library (megatron-core 0.16.1, a dev
dependency used only as the oracle): megatron reads the shards prepare writes, document for
document; shards written by megatron's IndexedDatasetBuilder are packed here exactly as the
contract says (documents back to back, cut into seq_len, tail dropped, step k = sequences
(k−1)·B … k·B−1), from a prefix, a directory and a list."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paralayer.config import DataConfig
from paralayer.data.dataset import build_dataset
from paralayer.data.indexed import IndexedShard, IndexedWriter
from paralayer.data.prepare import prepare_files
from paralayer.data.tokenizers import ByteTokenizer
from tests.megatron_oracle import megatron

DOCS = [f"doc {i}: " + "pack me, " * (i % 7) + "Ünïcödé ✓" for i in range(300)]


def _megatron_shard(prefix: str, docs: list, dtype=np.uint16) -> None:
    IndexedDatasetBuilder = megatron("IndexedDatasetBuilder")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_item(torch.tensor(d, dtype=torch.int64))
        b.end_document()
    b.finalize(prefix + ".idx")


def _docs(seed: int, n: int, vocab: int, max_len: int = 40) -> list:
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, size=int(g.integers(1, max_len))).tolist() for _ in range(n)]


def test_megatron_reads_our_shards_token_for_token(tmp_path):
    IndexedDataset = megatron("IndexedDataset")
    (tmp_path / "c.txt").write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "out" / "corpus")
    st = prepare_files([str(tmp_path / "c.txt")], prefix, "text", workers=2, part_docs=70)
    tok = ByteTokenizer()
    want = [tok.encode(d) + [tok.eos_id] for d in DOCS]
    assert st["documents"] == len(DOCS) and st["parts"] == 5 and st["tokens"] == sum(map(len, want))
    m = IndexedDataset(prefix)
    assert len(m) == len(DOCS) and m.index.dtype == np.uint16
    for i in (0, 1, 69, 70, 150, 299):  # across part boundaries too
        assert m[i].tolist() == want[i]
    assert np.concatenate([m[i] for i in range(len(m))]).tolist() == sum(want, [])
    assert m.document_indices.tolist() == list(range(len(DOCS) + 1))
    # int32 for a vocabulary of 65,500 ids or more (Megatron's optimal dtype)
    w = IndexedWriter(str(tmp_path / "big"), 4)
    big = [[70000, 1, 2], [65535, 99999]]
    for d in big:
        w.add_document(d)
    w.finalize()
    m = IndexedDataset(str(tmp_path / "big"))
    assert m.index.dtype == np.int32 and [m[i].tolist() for i in range(2)] == big


def test_megatron_shards_pack_exactly_here(tmp_path):
    seq, gb = 16, 4
    a, b = _docs(0, 50, 200), _docs(1, 30, 200)
    (tmp_path / "dir").mkdir()
    _megatron_shard(str(tmp_path / "dir" / "a"), a)
    _megatron_shard(str(tmp_path / "dir" / "b"), b)
    stream_a = np.asarray(sum(a, []))
    stream_ab = np.asarray(sum(a + b, []))
    cases = [(str(tmp_path / "dir" / "a"), stream_a), (str(tmp_path / "dir"), stream_ab),
             ([str(tmp_path / "dir" / "a"), str(tmp_path / "dir" / "b.idx")], stream_ab)]
    for path, stream in cases:
        ds = build_dataset(DataConfig(path=path, format="indexed", shuffle=False), seq, 0, str(tmp_path / "c"),
                           global_batch=gb, vocab_size=256)
        n = len(stream) // seq
        want = stream[: n * seq].reshape(n, seq)
        assert ds.n_sequences == n
        np.testing.assert_array_equal(ds.rows(range(n)), want)
        for k in (1, 2, n // gb + 1):  # step k = sequences (k-1)*B .. k*B-1, wrapping
            np.testing.assert_array_equal(ds.get_batch(k).numpy(), want[[((k - 1) * gb + j) % n for j in range(gb)]])
    # another seq_len: the same shards cut differently, nothing written
    ds = build_dataset(DataConfig(path=str(tmp_path / "dir"), format="indexed", shuffle=False), 24, 0,
                       str(tmp_path / "c"), global_batch=gb)
    np.testing.assert_array_equal(ds.get_batch(1).numpy(), stream_ab[: 4 * 24].reshape(4, 24))
    # int32 shards (a big vocabulary) read too
    _megatron_shard(str(tmp_path / "w"), [[70000, 5] * 20], dtype=np.int32)
    sh = IndexedShard(str(tmp_path / "w"))
    assert sh.header.dtype == "int32" and sh.document(0).tolist() == [70000, 5] * 20


def test_reader_maps_not_loads(tmp_path):
    """Opening a shard reads its header only: the ids stay in the page cache (a memmap)."""
    _megatron_shard(str(tmp_path / "a"), _docs(2, 20, 100))
    sh = IndexedShard(str(tmp_path / "a"))
    assert isinstance(sh.tokens, np.memmap)
    with pytest.raises(ValueError):
        sh.tokens[0] = 1  # read-only


def test_megatron_shards_train_through_the_launcher(tmp_path):
    """``python launch.py data.format=indexed data.path=PREFIX`` on megatron-written shards: a
    one-rank run trains (the loss falls below ln 256 on this learnable stream) and metrics.jsonl
    counts the sequences drawn."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    g = np.random.default_rng(0)
    docs = [(np.arange(int(g.integers(20, 60))) % 16 + 65).tolist() for _ in range(200)]  # "ABC..P" runs
    _megatron_shard(str(tmp_path / "m"), docs)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, os.path.join(repo, "launch.py"), "recipe=tiny", "parallel.tp=1",
                        "parallel.pp=1", "parallel.dp=1", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                        "model.n_kv_heads=2", "model.ffn_hidden=64", "model.seq_len=32", "train.global_batch=4",
                        "train.micro_batch=4", "train.steps=8", "train.lr=1e-2", "train.threads=1",
                        "data.format=indexed", f"data.path={tmp_path / 'm'}", f"run.dir={run}",
                        "logging.wandb.mode=disabled", "logging.progress=false"],
                       capture_output=True, text=True, timeout=300, cwd=repo,
                       env={**os.environ, "PYTHONPATH": repo})
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [x["step"] for x in recs] == list(range(1, 9))
    assert [x["source_sequences"][str(tmp_path / "m")] for x in recs] == [4 * k for k in range(1, 9)]
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0
