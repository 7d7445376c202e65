"""The issue's named cases for report, resubmit and slurm (issue 35), each as one test: one line,
exit 2, nothing printed or written that the input did not earn."""
from __future__ import annotations

import json
import os

import pytest

from paralayer import cli

SECRET = "sk_INPUTS_5d1e"


def _run(argv, capsys):
    rc = cli.main(argv)
    c = capsys.readouterr()
    return rc, c.out, c.err


def _run_folder(d):
    d.mkdir()
    (d / "plan.json").write_text(json.dumps({"world_size": 1}))
    (d / "resolved.yaml").write_text("train:\n  steps: 2\n")


@pytest.mark.parametrize("where", ["error", "slurm-log"])
def test_report_never_reads_a_link_to_the_environment(tmp_path, capsys, monkeypatch, where):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    run = tmp_path / "run"
    _run_folder(run)
    if where == "error":
        os.symlink("/proc/self/environ", run / "error.txt")
    else:
        os.symlink("/proc/self/environ", tmp_path / "log")
        (run / "sweep.json").write_text(json.dumps({"slurm": {"job_id": "7", "state": "FAILED",
                                                              "stderr": [str(tmp_path / "log")]}}))
    rc, out, err = _run(["report", str(run), "--out", str(tmp_path / "rep")], capsys)
    assert rc == 2 and err.startswith("error: DIR: ") and "lies under /proc" in err, err
    assert SECRET not in out + err and not (tmp_path / "rep").exists()


def test_report_on_a_fifo_log_does_not_hang(tmp_path, capsys):
    run = tmp_path / "run"
    _run_folder(run)
    os.mkfifo(run / "error.txt")
    rc, out, err = _run(["report", str(run), "--out", str(tmp_path / "rep")], capsys)
    assert rc == 2 and "not a regular file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text,says", [
    ('{"step": 1, "loss": "five"}\n', "line 1: loss must be a number"), (b"\xff\xfe{\x00\n", "not UTF-8"),
    ('{"step": 1, "a": ' + "[" * 50000 + "]" * 50000 + "}\n", "nested 50001 levels")])
def test_report_names_the_bad_metrics_line(tmp_path, capsys, text, says):
    run = tmp_path / "run"
    _run_folder(run)
    (run / "metrics.jsonl").write_bytes(text if isinstance(text, bytes) else text.encode())
    rc, out, err = _run(["report", str(run), "--out", str(tmp_path / "rep")], capsys)
    assert rc == 2 and says in err and "metrics.jsonl" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("profile,says", [
    ("garbage: [\n", "not valid YAML"), ("[1, 2]\n", "must hold a mapping"), ("nodes: many\n", "cluster.nodes"),
    ("nodez: 1\n", "cluster.nodez: unknown key"), ("/dev/zero", "lies under /dev"),
    ("../../../../etc/passwd", "must hold a mapping")])
def test_resubmit_reads_the_profile_as_untrusted_input(tmp_path, capsys, profile, says):
    run = tmp_path / "run"
    _run_folder(run)
    path = profile
    if not profile.startswith(("/", "..")):
        path = str(tmp_path / "p.yaml")
        open(path, "w").write(profile)
    rc, out, err = _run(["resubmit", str(run), "--profile", path], capsys)
    assert rc == 2 and err.startswith("error: --profile: ") and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,says", [
    (["stop", "--nodes"], "got nothing"), (["start", "--nodes", "9" * 20], "from 1 to 12"),
    (["status", "extra"], "unknown argument"), (["start", "--nodes=0"], "from 1 to 12")])
def test_slurm_arguments_are_checked_before_bash(capsys, args, says):
    """``slurm stop --nodes`` looped forever in the script; a huge --nodes was bash's overflow."""
    rc, out, err = _run(["slurm", *args], capsys)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1 and out == "", err
