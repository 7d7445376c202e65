"""The README's command table, every row run: `paralayer`, `python launch.py` and `python -m
paralayer` take the same arguments; the subcommands reach the modules that own them; the old
module paths still work; recipes and profiles are found in the user's folders before the shipped.

Fast by construction: the resolver-only rows run in this process (no torch); one 1-rank tiny run
(2 steps, a checkpoint) feeds the report and export rows; SLURM is never started (--dry-run).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paralayer import cli, commands
from paralayer.config import recipes

REPO = Path(__file__).resolve().parent.parent
TINY1 = ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", "model.n_layers=2", "model.seq_len=32",
         "train.global_batch=2", "train.micro_batch=1", "logging.wandb.mode=disabled"]
#: README row -> the test below that runs it
ROWS: dict[str, str] = {}


def row(name: str):
    def mark(fn):
        ROWS[name] = fn.__name__
        return fn
    return mark


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PARALAYER_RECIPES", None)
    env.pop("PARALAYER_PROFILES", None)
    return env


def _run(args: list, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _main(argv: list, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _readme_rows() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- commands -->", 1)[1].split("<!-- /commands -->", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| ([a-z-]+) \|", block, re.M) if m.group(1) != "action"]


def test_every_readme_row_has_its_test():
    names = _readme_rows()
    assert len(names) == len(set(names)) >= 10
    assert set(names) == set(ROWS), f"README rows without a test: {set(names) - set(ROWS)}; " \
                                    f"tests without a row: {set(ROWS) - set(names)}"
    assert set(commands.COMMANDS) <= set(names)  # every subcommand has its row


# ------------------------------------------------------------------ rows without torch (in process)
@row("dry-run")
def test_dry_run_is_the_same_from_all_three_spellings(tmp_path):
    """launch.py, python -m paralayer and the console script's entry point: one plan, byte for byte."""
    args = ["recipe=tiny", "parallel.tp=1", "--dry-run", "--json"]
    outs = [_run([str(REPO / "launch.py"), *args], tmp_path), _run(["-m", "paralayer", *args], tmp_path),
            _run(["-c", "import sys; from paralayer.cli import entry; sys.argv[0] = 'paralayer'; entry()", *args],
                 tmp_path)]
    assert [r.returncode for r in outs] == [0, 0, 0], [r.stderr for r in outs]
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout
    assert json.loads(outs[0].stdout)["degrees"]["dp"] == 2
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'paralayer = "paralayer.cli:entry"' in pyproject
    bad = _run(["-m", "paralayer", "recipe=tiny", "parallel.tpp=2", "--dry-run"], tmp_path)
    assert bad.returncode == 2 and "parallel.tp" in bad.stderr and "Traceback" not in bad.stderr


@row("plan")
def test_plan_top(capsys):
    rc, out, _ = _main(["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=8", "--plan", "--top", "2",
                        "--json"], capsys)
    rows = json.loads(out)
    assert rc == 0 and len(rows) == 2 and rows[0]["step_time_s"] <= rows[1]["step_time_s"]


@row("sweep")
def test_sweep_dry_run(capsys):
    rc, out, _ = _main(["recipe=tiny", "-m", "parallel.tp=1,2", "--dry-run", "--json"], capsys)
    plans = json.loads(out)
    assert rc == 0 and [p["degrees"]["tp"] for p in plans] == [1, 2]


@row("slurm")
def test_slurm_runs_the_shipped_script_dry(capsys):
    assert commands.run(["slurm", "--dry-run", "start", "--nodes", "2"]) == 0
    line = capsys.readouterr().out.strip()
    script = recipes.shipped_script("local_slurm.sh")
    assert line == f"bash {script} start --nodes 2" and script.is_file()
    assert commands.run(["slurm", "stop", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == f"bash {script} stop"
    assert commands.run(["slurm", "--dry-run", "install-deps"]) == 0
    deps = recipes.shipped_script("install_slurm_deps.sh")
    assert capsys.readouterr().out.strip() == f"bash {deps}" and deps.is_file()
    assert commands.run(["slurm", "--help"]) == 0 and "start [--nodes N]" in capsys.readouterr().out
    assert cli.main(["slurm", "begin"]) == 2
    assert capsys.readouterr().err.strip() == ("error: slurm: unknown action 'begin'; valid: start, stop, restart, "
                                               "status, env, install-deps")


@row("prepare")
def test_prepare_reaches_the_data_module(capsys):
    """paralayer prepare is paralayer.data.prepare's main (its --help), or one line saying it is missing."""
    rc = cli.main(["prepare", "--help"])
    out, err = capsys.readouterr()
    if importlib.util.find_spec("paralayer.data.prepare") is not None:
        assert rc == 0 and "--out" in out
    else:
        assert rc == 2 and err.strip() == "error: prepare: paralayer.data.prepare is not part of this paralayer install"


@row("resubmit")
def test_resubmit_reaches_the_slurm_dispatch(tmp_path, capsys):
    assert cli.main(["resubmit", "--help"]) == 0 and "--profile" in capsys.readouterr().out
    rc = cli.main(["resubmit", str(tmp_path), "--profile", "no-such-profile"])
    assert rc == 2 and "no-such-profile" in capsys.readouterr().err
    # a profile NAME is looked up as cluster=NAME is
    assert commands._profile_paths(["x", "--profile", "local-slurm"])[2] == str(recipes.find("profiles", "local-slurm"))


def test_help_lists_each_recipe_with_its_folder(tmp_path, monkeypatch, capsys):
    mine, extra = tmp_path / "recipes", tmp_path / "more"
    mine.mkdir()
    extra.mkdir()
    (mine / "tiny.yaml").write_text("base: base\ntrain: {steps: 3}\n")  # shadows the shipped tiny
    (extra / "other.yaml").write_text("base: tiny\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALAYER_RECIPES", f"{extra}{os.pathsep}/no/such/folder")
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert f"  ./recipes ({mine}): tiny\n" in out and f"  $PARALAYER_RECIPES ({extra}): other\n" in out
    shipped = next(ln for ln in out.splitlines() if ln.startswith("  shipped (") and "llama3-70b" in ln)
    assert " tiny," not in shipped and "tiny-pp" in shipped  # listed under the folder that wins
    assert "report" in out and "slurm" in out  # the subcommands
    # the lookup itself: ./recipes first (its tiny's base is the shipped base), then the variable
    assert recipes.find("recipes", "tiny") == mine / "tiny.yaml"
    rc, js, _ = _main(["recipe=other", "--dry-run", "--json"], capsys)
    assert rc == 0 and json.loads(js)["recipe"] == "other"
    from paralayer.config import load_config

    assert load_config(["recipe=tiny"]).train.steps == 3 and load_config(["recipe=tiny-pp"]).train.steps != 3
    monkeypatch.delenv("PARALAYER_RECIPES")
    rc, _, err = _main(["recipe=other", "--dry-run"], capsys)
    assert rc == 2 and "no recipe 'other'" in err


# ------------------------------------------------------------------ rows with ranks: one tiny run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`paralayer train ...`: one rank, 2 steps, a checkpoint at step 2 (for report and export)."""
    base = tmp_path_factory.mktemp("cmd")
    run_dir = base / "run"
    r = _run([str(REPO / "launch.py"), "train", *TINY1, "train.steps=2", "checkpoint.every=2", f"run.dir={run_dir}"],
             base)
    return base, run_dir, r


@row("train")
def test_train(tiny_run):
    _, run_dir, r = tiny_run
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [x["step"] for x in recs if "loss" in x] == [1, 2]
    assert 4.5 < recs[0]["loss"] < 6.5  # ln 256 = 5.55 at init


@row("report")
def test_report(tiny_run, capsys):
    base, run_dir, r = tiny_run
    assert r.returncode == 0, r.stderr[-2000:]
    assert cli.main(["report", str(run_dir), "--out", str(base / "rep")]) == 0
    rows = list(csv.DictReader(open(base / "rep" / "report.csv")))
    assert len(rows) == 1 and rows[0]["state"] == "completed" and rows[0]["steps_logged"] == "2"
    assert (base / "rep" / "report.png").stat().st_size > 10_000
    assert cli.main(["report", str(base / "nothing-here")]) == 2


@row("export")
def test_export_and_its_old_spelling(tiny_run, capsys):
    """The old `python -m paralayer.export` prints the new spelling once and exports."""
    base, run_dir, r = tiny_run
    assert r.returncode == 0, r.stderr[-2000:]
    old = _run(["-m", "paralayer.export", str(run_dir), "--out", str(base / "hf")], base)
    assert old.returncode == 0, old.stderr[-2000:]
    notes = [ln for ln in old.stderr.splitlines() if ln.startswith("note:")]
    assert notes == ["note: `python -m paralayer.export` is now `paralayer export` (or `python -m paralayer export`)"]
    cfg = json.loads((base / "hf" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and (base / "hf" / "model.safetensors").stat().st_size > 100_000
    assert cli.main(["export", "--help"]) == 0 and "--checkpoint" in capsys.readouterr().out
    rc = cli.main(["export", str(base / "no-run"), "--out", str(base / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: RUN_DIR: ") and "no-run" in err


@row("rehearse")
def test_rehearse(capsys):
    rc, out, _ = _main([*TINY1, "--rehearse", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["ok"] and d["world_size"] == 1 and d["ranks"][0]["memory_bytes"]["params"] > 0
