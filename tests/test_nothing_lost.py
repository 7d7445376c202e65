"""Nothing is lost (issue 35): no command writes over its own inputs, deletes what it did not create,
reuses another run's folder, or truncates what it found when it fails at the start. Each case here
failed before the input discipline (paralayer/inputs/untrusted.py): the file named was replaced,
deleted or emptied. Every protected file is compared byte for byte afterwards."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paralayer import cli
from tests.fault_hook import fault_env

REPO = Path(__file__).resolve().parent.parent


def _digest(root: Path) -> dict:
    """{relative path: sha256} of every file under ``root`` (or of ``root`` itself)."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _prepare(argv, capsys):
    rc = cli.main(["prepare", "--no-progress", "--workers", "1", *argv])
    return rc, capsys.readouterr().err


def test_prepare_never_writes_over_its_input(tmp_path, capsys):
    x = tmp_path / "x.bin"
    x.write_text("hello world\nsecond document\n")
    before = _digest(x)
    rc, err = _prepare([str(x), "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and err.startswith("error: --out: ") and "would write over the input" in err, err
    assert len(err.strip().splitlines()) == 1
    assert _digest(x) == before


def test_prepare_never_writes_over_a_shard_it_reads(tmp_path, capsys):
    """``prepare good.bin --out good``: good.bin is a real shard (binary), read as text and replaced."""
    (tmp_path / "d.txt").write_text("one\ntwo\n")
    assert _prepare([str(tmp_path / "d.txt"), "--out", str(tmp_path / "good")], capsys)[0] == 0
    before = {**_digest(tmp_path / "good.bin"), **_digest(tmp_path / "good.idx")}
    rc, err = _prepare([str(tmp_path / "good.bin"), "--out", str(tmp_path / "good")], capsys)
    assert rc == 2 and "--out" in err, err
    assert {**_digest(tmp_path / "good.bin"), **_digest(tmp_path / "good.idx")} == before


def test_prepare_never_deletes_an_input_folder_named_like_its_parts(tmp_path, capsys):
    """``--out corp`` with the input folder ``corp.parts``: it was taken for stale parts and deleted."""
    parts = tmp_path / "corp.parts"
    parts.mkdir()
    (parts / "a.txt").write_text("a document\n")
    before = _digest(parts)
    rc, err = _prepare([str(parts), "--out", str(tmp_path / "corp")], capsys)
    assert rc == 2 and err.startswith("error: --out: "), err
    assert _digest(parts) == before


def test_prepare_never_deletes_a_folder_it_did_not_make(tmp_path, capsys):
    """A PREFIX.parts that is not this prepare's (other files, another prepare's key, a damaged
    manifest) is left as it is: exit 2 naming it, not rmtree."""
    (tmp_path / "in.txt").write_text("doc\n")
    for content in ({"notes.txt": "mine"}, {"manifest.json": '{"v": 1}'}, {"manifest.json": "{bad"}):
        parts = tmp_path / "c.parts"
        parts.mkdir()
        for name, text in content.items():
            (parts / name).write_text(text)
        before = _digest(parts)
        rc, err = _prepare([str(tmp_path / "in.txt"), "--out", str(tmp_path / "c")], capsys)
        assert rc == 2 and "c.parts" in err and err.startswith("error: --out: "), err
        assert _digest(parts) == before
        for p in parts.iterdir():
            p.unlink()
        parts.rmdir()


def test_prepare_failing_on_bad_data_removes_only_what_it_made(tmp_path, capsys):
    (tmp_path / "nul.txt").write_bytes(b"a\x00b\n")
    rc, err = _prepare([str(tmp_path / "nul.txt"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and err.startswith("error: INPUT: ") and "nul.txt:1" in err, err
    assert sorted(os.listdir(tmp_path)) == ["nul.txt"]


def _run_folder(d: Path) -> None:
    d.mkdir()
    (d / "resolved.yaml").write_text("recipe: other\n")
    (d / "plan.json").write_text('{"world_size": 1}\n')
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.0}\n')
    buckets = {b: 0.5 if b == "steps" else 0.0 for b in ("steps", "checkpoint", "eval", "rollback", "skipped",
                                                         "restart", "startup", "other")}
    attempt = {"start_step": 1, "last_step": 2, "wall_s": 1.0, "buckets_s": buckets, "unsaved": {}, "finished": True}
    (d / "goodput.json").write_text(json.dumps({"attempts": [attempt]}) + "\n")


def test_a_run_never_reuses_another_runs_folder(tmp_path, capsys):
    run = tmp_path / "other"
    _run_folder(run)
    before = _digest(run)
    rc = cli.main(["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"run.dir={run}", "train.steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines() == [
        f"error: run.dir: {run} holds another run's files (resolved.yaml, plan.json, metrics.jsonl, goodput.json); "
        "choose a new run.dir, or set train.resume=auto to resume that run"], err
    assert _digest(run) == before


def test_a_sweep_checks_every_folder_before_writing_any(tmp_path, capsys):
    sweep = tmp_path / "sw"
    sweep.mkdir()
    _run_folder(sweep / "seed1")  # the second element's folder is taken
    rc = cli.main(["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"run.dir={sweep}", "train.seed=0,1", "-m"])
    err = capsys.readouterr().err
    assert rc == 2 and "run.dir: " in err and "seed1" in err, err
    assert sorted(os.listdir(sweep)) == ["seed1"]


def test_a_run_failing_at_step_1_keeps_the_metrics_it_found(tmp_path):
    """train.resume=auto on a folder with metrics but no checkpoint starts at step 1; rank 0 raises
    in step 1. metrics.jsonl was cut to nothing at start-up; now it is only cut back when the first
    new record is written. goodput.json keeps every attempt it held."""
    run = tmp_path / "run"
    _run_folder(run)
    keep = _digest(run / "metrics.jsonl")
    attempts = json.loads((run / "goodput.json").read_text())["attempts"]
    env = fault_env(tmp_path, "raise:0:1")
    data = tmp_path / "d.txt"
    data.write_text("some words to train on\n" * 200)
    res = subprocess.run([sys.executable, str(REPO / "launch.py"), "recipe=tiny", "parallel.tp=1", "parallel.dp=1",
                          "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2",
                          "model.ffn_hidden=64", "model.seq_len=16", "train.global_batch=2", "train.micro_batch=2",
                          "train.steps=2", "train.threads=1", f"run.dir={run}", "train.resume=auto",
                          f"data.path={data}", "data.format=text", "logging.wandb.mode=disabled"],
                         env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert res.returncode == 1, res.stderr[-2000:]
    assert _digest(run / "metrics.jsonl") == keep, res.stderr[-2000:]
    # goodput.json records this attempt too (paralayer/metrics/goodput.py); the ones it found stand
    after = json.loads((run / "goodput.json").read_text())["attempts"]
    # every field they held is unchanged (later accounting may add fields, e.g. lost_s, lost_steps)
    assert [{k: a[k] for k in b} for a, b in zip(after, attempts)] == attempts and len(after) > len(attempts)


@pytest.mark.parametrize("start", [1, 2])
def test_the_metrics_writer_cuts_back_only_when_it_writes(tmp_path, start):
    from paralayer.metrics.jsonl import JsonlWriter, read_records

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    w = JsonlWriter(str(tmp_path), keep_through=start - 1)
    assert [r["step"] for r in read_records(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    w.write({"step": start})
    w.close()
    assert [r["step"] for r in read_records(str(tmp_path / "metrics.jsonl"))] == list(range(1, start)) + [start]
