"""Bad data: one line naming data.path, the file and the line or row; exit 2 from the launcher with
rank 0 reporting; what is known before launch fails --dry-run; no lock files left in the cache."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from paralayer.config import DataConfig
from paralayer.data.dataset import build_dataset
from paralayer.data.errors import DataError
from paralayer.data.preflight import check_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 16


def _build(path, fmt, cache):
    return build_dataset(DataConfig(path=str(path), format=fmt, shuffle=False), SEQ, 0, str(cache))


def _leftovers(cache) -> list[str]:
    out = []
    for root, dirs, files in os.walk(cache):
        out += [os.path.join(root, n) for n in files + dirs if n.endswith(".lock") or n.startswith(".datasets-")]
    return out


def _docs(n=40):
    return [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(n)]


@pytest.mark.parametrize("fmt", ["text", "jsonl", "tokens", "parquet"])
def test_empty_file(tmp_path, fmt):
    f = tmp_path / f"empty.{fmt}"
    f.write_bytes(b"")
    with pytest.raises(DataError) as err:
        _build(f, fmt, tmp_path / "cache")
    assert str(err.value) == f"data.path: {f}: the file is empty"
    assert _leftovers(tmp_path / "cache") == []


def test_binary_file_names_the_line(tmp_path):
    f = tmp_path / "binary.txt"
    f.write_bytes(("\n".join(_docs(5)) + "\n").encode() + bytes(range(256)) * 4)
    with pytest.raises(DataError, match=rf"^data.path: {f}:6: (not UTF-8 text|holds NUL bytes) \(a binary file\?\)$"):
        _build(f, "text", tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []


def test_malformed_jsonl_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": d}) for d in _docs(10)]
    lines[3] = '{"text": "no closing brace"'
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^data.path: {f}:4: not valid JSON"):
        _build(f, "jsonl", tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []


def test_corrupt_parquet_names_the_file(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": _docs()}), d / "a.parquet")
    (d / "b.parquet").write_bytes(b"PAR1" + b"\x00garbage" * 50)
    with pytest.raises(DataError, match=rf"^data.path: {d / 'b.parquet'}: not a readable parquet file"):
        _build(d, "parquet", tmp_path / "cache")


def test_tokens_bad_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"input_ids": list(range(SEQ))}) + "\n" + "[1, 2]\n")
    with pytest.raises(DataError, match=rf"^data.path: {f}:2: data.format=tokens expects"):
        _build(f, "tokens", tmp_path / "cache")


def _build_in_child(path, cache, q):
    ds = _build(path, "text", cache)
    q.put(ds.n_sequences)


def test_concurrent_builders_share_the_cache_and_leave_no_lock(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("\n".join(_docs(200)) + "\n")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(f), str(tmp_path / "cache"), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    counts = [q.get(timeout=5) for _ in procs]
    assert len(set(counts)) == 1 and counts[0] > 0
    assert _leftovers(tmp_path / "cache") == []
    assert sorted(n.split(".")[-1] for n in os.listdir(tmp_path / "cache")) == ["bin", "idx", "json"]


def test_preflight(tmp_path):
    empty = tmp_path / "e.txt"
    empty.write_text("")
    (tmp_path / "d").mkdir()
    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n")
    assert check_data(DataConfig(path=None)) == []
    assert check_data(DataConfig(path=str(ok))) == []
    assert check_data(DataConfig(path=str(tmp_path / "missing.txt"))) == \
        [("data.path", f"{tmp_path / 'missing.txt'}: no such file or directory")]
    assert check_data(DataConfig(path=str(empty))) == [("data.path", f"{empty}: the file is empty")]
    assert check_data(DataConfig(path=str(tmp_path / "d"))) == \
        [("data.path", f"{tmp_path / 'd'}: the directory holds no files")]
    assert check_data(DataConfig(path=str(ok), tokenizer=str(tmp_path / "tok.json"))) == \
        [("data.tokenizer", f"{tmp_path / 'tok.json'}: no such file")]


def _launch(args, timeout=300):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_dry_run_fails_for_missing_and_empty(tmp_path):
    r = _launch(["--dry-run", f"data.path={tmp_path / 'nope.jsonl'}"], timeout=120)
    assert r.returncode == 2 and f"error: data.path: {tmp_path / 'nope.jsonl'}: no such file or directory" in r.stderr
    assert "Traceback" not in r.stderr
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    r = _launch(["--dry-run", "--json", f"data.path={empty}", "data.format=jsonl"], timeout=120)
    assert r.returncode == 2
    assert {"field": "data.path", "message": f"{empty}: the file is empty"} in json.loads(r.stdout)["errors"]


def test_launch_bad_jsonl_two_ranks_one_line_exit_2(tmp_path):
    """2 ranks read a JSONL file whose line 31 is cut: exit 2, one error line naming data.path,
    the file and the line (rank 0's; the other rank is quiet), no traceback, no lock file."""
    f = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": d}) for d in _docs(40)]
    lines[30] = lines[30][:-3]
    f.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    r = _launch(["recipe=tiny", "parallel.tp=1", "parallel.dp=2", "model.n_layers=1", "model.d_model=32",
                 "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64", f"model.seq_len={SEQ}",
                 "train.steps=1", "train.global_batch=2", "train.micro_batch=1", f"data.path={f}", "data.format=jsonl",
                 f"data.cache_dir={cache}", f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"])
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert errors == [f"error: data.path: {f}:31: not valid JSON (Unterminated string starting at: column 9)"] \
        or (len(errors) == 1 and errors[0].startswith(f"error: data.path: {f}:31: not valid JSON")), r.stderr
    assert _leftovers(cache) == []


def _hold_lock(path, scratch):
    from paralayer.data.cache import file_lock

    with file_lock(path):
        os.makedirs(scratch)
        try:
            time.sleep(60)
        finally:
            os.rmdir(scratch)


def test_sigterm_while_holding_the_cache_lock_leaves_nothing(tmp_path):
    """The local launcher stops the other ranks with SIGTERM when one fails: a rank stopped while it
    builds the cache still removes its lock file and its scratch files (it exits 143)."""
    lock, scratch = tmp_path / "c.npy.lock", tmp_path / ".scratch"
    p = mp.get_context("fork").Process(target=_hold_lock, args=(str(lock), str(scratch)))
    p.start()
    deadline = time.time() + 30
    while not scratch.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert scratch.exists() and lock.exists()
    os.kill(p.pid, signal.SIGTERM)
    p.join(30)
    assert p.exitcode == 128 + signal.SIGTERM
    assert not lock.exists() and not scratch.exists()
