"""Bad data, named: each case exits 2 with one line naming the field and the file (and the byte
offset where known); what the .idx headers and the recipe tell fails ``--dry-run`` already (the
resolver reads only headers), ids beyond the vocabulary fail at the batch that reads them. The
plan states tokens and epochs per source and warns when one repeats more than 4 times."""
from __future__ import annotations

import contextlib
import io
import json
import os
import struct

import numpy as np
import pytest
import torch

from paralayer import cli
from paralayer.config import DataConfig, load_config
from paralayer.data.dataset import build_dataset, build_valid_dataset
from paralayer.data.errors import DataError
from paralayer.resolve.plan import resolve
from tests.megatron_oracle import megatron

SEQ = 16
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64",
        "model.vocab_size=256", f"model.seq_len={SEQ}", "train.global_batch=4", "train.micro_batch=1",
        "train.steps=10", "data.format=indexed", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1"]


def _shard(prefix, n_tokens, hi=200, dtype=np.uint16, seed=0):
    IndexedDatasetBuilder = megatron("IndexedDatasetBuilder")
    g = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for k in range(0, n_tokens, 25):
        b.add_item(torch.tensor(g.integers(0, hi, size=min(25, n_tokens - k))))
        b.end_document()
    b.finalize(str(prefix) + ".idx")
    return str(prefix)


def _dry(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--dry-run", "--json", *TINY, *args])
    return rc, json.loads(out.getvalue()), err.getvalue()


def _one_error(args, field):
    rc, plan, err = _dry(args)
    assert rc == 2, plan["errors"]
    got = [e for e in plan["errors"] if e["field"] == field]
    assert len(got) == 1, plan["errors"]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: {field}: {got[0]['message']}"]
    return got[0]["message"]


def _build(path, vocab=256):
    return build_dataset(DataConfig(path=path, format="indexed", shuffle=False), SEQ, 0, "/nonexistent-cache",
                         global_batch=4, vocab_size=vocab)


def test_truncated_bin_bad_magic_bad_version_named(tmp_path):
    p = _shard(tmp_path / "a", 400)
    with open(p + ".bin", "r+b") as f:
        f.truncate(500)
    msg = _one_error([f"data.path={p}"], "data.path")
    assert msg.startswith(f"{p}.bin at byte 500: size is 500 bytes, the .idx says 800") and "shorter" in msg
    with pytest.raises(DataError, match=rf"^data.path: {p}.bin: size is 500 bytes.*\(byte 500\)$"):
        _build(p)
    q = _shard(tmp_path / "b", 400)
    raw = bytearray(open(q + ".idx", "rb").read())
    open(q + ".idx", "wb").write(b"NOTANIDX!" + raw[9:])
    assert "magic is b'NOTANIDX!', expected b'MMIDIDX\\x00\\x00'" in _one_error([f"data.path={q}"], "data.path")
    raw[9:17] = struct.pack("<Q", 2)
    open(q + ".idx", "wb").write(bytes(raw))
    assert _one_error([f"data.path={q}"], "data.path") == f"{q}.idx at byte 9: version is 2, expected 1"
    with pytest.raises(DataError, match="version is 2, expected 1"):
        _build(q)


def test_dtype_too_small_and_ids_beyond_the_vocabulary(tmp_path):
    p = _shard(tmp_path / "u8", 400, hi=250, dtype=np.uint8)
    msg = _one_error([f"data.path={p}", "model.vocab_size=1000"], "data.path")
    assert msg == f"{p}.idx: dtype uint8 (code 1) cannot hold model.vocab_size=1000 ids (largest 255)"
    with pytest.raises(DataError, match="dtype uint8"):
        _build(p, vocab=1000)
    # ids >= model.vocab_size: the read that meets one names the file and the offset
    q = _shard(tmp_path / "ids", 400, hi=100)
    with open(q + ".bin", "r+b") as f:
        f.seek(2 * 37)
        f.write(np.uint16(300).tobytes())
    ds = _build(q, vocab=256)
    ds.get_batch(2)  # sequences 4-7: clean
    with pytest.raises(DataError, match=rf"^data.path: {q}.bin: id 300 at token offset 37 \(byte 74\) is outside "
                                        r"\[0, 256\) \(model.vocab_size\)$"):
        ds.get_batch(1)


def test_blend_weights_short_sources_and_shared_valid(tmp_path):
    a, b = _shard(tmp_path / "a", 400), _shard(tmp_path / "b", 400, seed=1)
    short = _shard(tmp_path / "short", SEQ - 1)
    for w in ("0", "-1", "nan"):
        blend = f"data.blend=[{{path: {a}, weight: 1}},{{path: {b}, weight: {w}}}]"
        msg = _one_error([blend], "data.blend[1].weight")
        assert msg.startswith(f"{b}: is ") and "a weight must be a finite number > 0" in msg
        with pytest.raises(DataError, match=r"^data.blend\[1\].weight: .*finite number > 0"):
            build_dataset(load_config(TINY + [blend]).data, SEQ, 0, str(tmp_path / "c"), global_batch=4)
    assert _one_error([f"data.path={a}", f"data.blend=[{{path: {b}, weight: 1}}]"], "data.blend") == \
        f"data.path is also set ({a}): a run reads data.path or data.blend, not both (set data.path=null)"
    blend = f"data.blend=[{{path: {a}, weight: 1}},{{path: {short}, weight: 1}}]"
    assert _one_error([blend], "data.blend[1].path") == \
        f"{short}: holds {SEQ - 1} tokens, fewer than one sequence (model.seq_len={SEQ})"
    with pytest.raises(DataError, match=rf"^data.blend\[1\].path: {short}: holds 15 tokens, fewer than one sequence"):
        build_dataset(load_config(TINY + [blend]).data, SEQ, 0, str(tmp_path / "c"), global_batch=4)
    # validation sharing a file with training: a plan error and a DataError
    cfg = load_config(TINY + [f"data.path={tmp_path}"])
    cfg.data.valid = b  # data.valid (the validation helper's key) names a shard of the training directory
    errs = [e for e in resolve(cfg).errors if e["field"] == "data.valid"]
    assert errs == [{"field": "data.valid", "message": f"{b}: validation and training share a file ({b}.bin)"}]
    with pytest.raises(DataError, match=rf"^data.valid: {b}: is also training data \({b}.bin\)"):
        build_valid_dataset(cfg.data, SEQ, 0, str(tmp_path / "c"), global_batch=4, path=b)


def test_plan_states_tokens_epochs_and_repeats(tmp_path):
    a, b = _shard(tmp_path / "a", 1600), _shard(tmp_path / "b", 160, seed=1)
    rc, plan, _ = _dry([f"data.blend=[{{path: {a}, weight: 3}},{{path: {b}, weight: 1}}]", "train.steps=50"])
    assert rc == 0, plan["errors"]
    src = plan["data"]["sources"]
    assert [(s["path"], s["tokens"], s["weight"]) for s in src] == [(a, 1600, 0.75), (b, 160, 0.25)]
    # 50 steps x 4 sequences = 200 draws: a gives 150 of its 100 sequences, b 50 of its 10
    assert src[0]["epochs"] == pytest.approx(1.5) and src[1]["epochs"] == pytest.approx(5.0)
    warn = [w for w in plan["warnings"] if w["field"] == "data.blend[1].path"]
    assert len(warn) == 1 and "read 5.0 times" in warn[0]["message"] and "more than 4 times" in warn[0]["message"]
    assert not [w for w in plan["warnings"] if w["field"] == "data.blend[0].path"]
    # the table says it too; train.tokens sets the draws instead of train.steps
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--dry-run", *TINY, f"data.path={a}", "train.tokens=12800"]) == 0
    assert f"data: {a}: 1,600 tokens, weight 1, 8 epochs in this run" in " ".join(out.getvalue().split())
    # a held-out fraction leaves each source's tail out of training (and out of the epochs)
    rc, plan, _ = _dry([f"data.path={a}", "data.valid_fraction=0.1"])
    assert plan["data"]["sources"][0]["sequences"] == 90 and plan["data"]["sources"][0]["epochs"] == \
        pytest.approx(40 / 90)
    assert os.path.exists(a + ".idx")
