"""The sweep report (issue 22): real local sweeps through launch.py, then the report's rows, ratios,
CSV, markdown and picture checked against the runs' own plan.json and metrics.jsonl; a failed
element is a row with its error; the pieces (names, error lines, states) on hand-made run folders.

Shapes are tiny (d_model 32, 2 layers, seq 32, 3 steps): each sweep costs the start of its ranks.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from paralayer.dispatch.sweep import run_names
from paralayer.metrics import report as R

REPO = Path(__file__).resolve().parents[1]
LAUNCH = str(REPO / "launch.py")
TINY = ["recipe=tiny", "cluster=local", "parallel.dp=1", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "model.n_kv_heads=2", "model.ffn_hidden=64", "model.seq_len=32", "train.global_batch=4",
        "train.micro_batch=2", "train.steps=3", "train.warmup_steps=1"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("PARALAYER_RESUME", "PARALAYER_FAULT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "WANDB_DIR", "WANDB_MODE"):
        env.pop(k, None)
    return env


def _run(args: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _csv(path: Path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _png_size(path: Path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def _medians(run_dir: Path) -> dict:
    """What the report must say a run measured, computed here from metrics.jsonl directly."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = recs[1:] if len(recs) >= 3 else recs
    return {"steps": len(recs), "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "memory_bytes": max(r["peak_memory_bytes"] for r in recs), "final_loss": recs[-1]["loss"]}


def test_local_sweep_report(tmp_path):
    sweep = tmp_path / "sweep"
    r = _run([LAUNCH, *TINY, "-m", "parallel.tp=1,2", f"run.dir={sweep}", "logging.wandb.mode=offline"], tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    # runs named by what differs, each with its own summary, the index in sweep.json
    assert sorted(p.name for p in sweep.iterdir() if (p / "plan.json").exists()) == ["tp1", "tp2"]
    assert r.stdout.count("paralayer run summary") == 2
    for i, tp in enumerate((1, 2)):
        meta = json.loads((sweep / f"tp{tp}" / "sweep.json").read_text())
        assert (meta["index"], meta["count"], meta["overrides"]) == (i, 2, [f"parallel.tp={tp}"])
    # the report was printed when the last run ended, and written beside the runs
    assert "paralayer sweep report" in r.stdout and r.stdout.rindex("paralayer sweep report") > \
        r.stdout.rindex("paralayer run summary")
    rows = _csv(sweep / "report.csv")
    assert [(x["index"], x["name"], x["overrides"], x["state"]) for x in rows] == [
        ("0", "tp1", "parallel.tp=1", "completed"), ("1", "tp2", "parallel.tp=2", "completed")]
    for x, tp in zip(rows, (1, 2)):
        rd = sweep / f"tp{tp}"
        plan = json.loads((rd / "plan.json").read_text())
        got = _medians(rd)
        assert plan["degrees"]["tp"] == tp and int(x["steps_logged"]) == got["steps"] == 3
        assert float(x["measured_step_time_s"]) == pytest.approx(got["step_time_s"], rel=1e-12)
        assert float(x["measured_tokens_per_s"]) == pytest.approx(got["tokens_per_s"], rel=1e-12)
        assert int(x["measured_memory_bytes"]) == got["memory_bytes"]
        assert float(x["final_loss"]) == pytest.approx(got["final_loss"], rel=1e-12)
        assert int(x["predicted_memory_bytes"]) == plan["memory_per_device_bytes"]["total"]
        assert float(x["predicted_bubble"]) == plan["bubble_fraction"] == 0.0 and x["ratio_bubble"] == ""
        for key in ("step_time_s", "tokens_per_s", "mfu", "memory_bytes"):
            p, m = float(x[f"predicted_{key}"]), float(x[f"measured_{key}"])
            assert p > 0 and m > 0, key
            assert float(x[f"ratio_{key}"]) == pytest.approx(m / p, rel=1e-9), key
        # the prediction's tokens/s is its tokens per step over its step time
        assert float(x["predicted_tokens_per_s"]) * float(x["predicted_step_time_s"]) == \
            pytest.approx(plan["tokens_per_step"], rel=1e-9)
    # the planner times tp=2 differently from tp=1: two layouts, two predictions
    assert rows[0]["predicted_step_time_s"] != rows[1]["predicted_step_time_s"]
    md = (sweep / "report.md").read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("| tp")]
    assert len(lines) == 2 and "![report](report.png)" in md and "step time m/p" in md
    for ln, x in zip(lines, rows):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert cells[:3] == [x["name"], x["overrides"], "completed"]
        assert cells[5] == f"{float(x['ratio_step_time_s']):.2f}" and cells[-1] == f"{float(x['final_loss']):.4f}"
    w, h = _png_size(sweep / "report.png")
    assert (w, h) == (1320, 594) and (sweep / "report.png").stat().st_size > 20_000
    # W&B: both runs in one group, the report logged to a summary run of that group
    group = json.loads((sweep / "sweep.json").read_text())["group"]
    for tp in (1, 2):
        files = glob.glob(str(sweep / f"tp{tp}" / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(files) == 1 and group.encode() in Path(files[0]).read_bytes()
    summary = glob.glob(str(sweep / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(summary) == 1
    data = Path(summary[0]).read_bytes()
    assert group.encode() in data and b"sweep-report" in data and b"report_plot" in data
    # the same report again from the command line, elsewhere: same rows
    out = tmp_path / "again"
    r2 = _run(["-m", "paralayer.report", str(sweep), "--out", str(out)], tmp_path, timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert "tp1" in r2.stdout and "tp2" in r2.stdout
    assert [{k: v for k, v in x.items()} for x in _csv(out / "report.csv")] == rows
    # run folders given one by one, out of order: sweep order, the report beside them (launch.py's
    # main in this process: the command line's spelling is r2 above; a process costs ~1-3 CPU-s)
    from paralayer.cli import main

    assert main(["--report", str(sweep / "tp2"), "--report", str(sweep / "tp1")]) == 0
    assert [x["overrides"] for x in _csv(sweep / "report.csv")] == ["parallel.tp=1", "parallel.tp=2"]


def test_failed_element_is_a_row(tmp_path):
    """data.format=tokens lines of 32 ids: the seq_len=16 element fails in its rank (the resolver
    cannot know), the seq_len=32 one trains; the report has both, the failure with its error."""
    data = tmp_path / "tok32.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 256 for j in range(32)]}) + "\n"
                            for i in range(32)))
    sweep = tmp_path / "sweep"
    r = _run([LAUNCH, *TINY, "parallel.tp=1", f"data.path={data}", "data.format=tokens", "-m",
              "model.seq_len=32,16", f"run.dir={sweep}", "logging.wandb.mode=disabled"], tmp_path)
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-3000:])  # bad data: exit 2 (issue #15)
    rows = {x["name"]: x for x in _csv(sweep / "report.csv")}
    assert set(rows) == {"seq_len32", "seq_len16"}
    ok, bad = rows["seq_len32"], rows["seq_len16"]
    assert ok["state"] == "completed" and float(ok["ratio_step_time_s"]) > 0
    assert bad["state"] == "failed" and bad["steps_logged"] == "0" and bad["measured_step_time_s"] == ""
    assert "32 ids, model.seq_len is 16" in bad["error"] and bad["error"].startswith("rank 0 failed")
    assert float(bad["predicted_step_time_s"]) > 0  # the prediction is still shown
    md = (sweep / "report.md").read_text()
    assert "## Runs that did not complete" in md and "32 ids, model.seq_len is 16" in md
    assert "seq_len16: failed: rank 0 failed" in r.stdout.replace("\n", " ")
    # a run did not complete (in this process: test_local_sweep_report runs the command line's)
    assert R.main([str(sweep)]) == 1


# ------------------------------------------------------------------ the pieces, on hand-made folders
def test_run_names():
    assert run_names([["parallel.tp=1"], ["parallel.tp=2"]]) == ["tp1", "tp2"]
    assert run_names([["parallel.tp=2", "parallel.pp=2", "parallel.zero=1"]]) == ["tp2-pp2-zero1"]
    assert run_names([["parallel.schedule=gpipe"], ["parallel.schedule=1f1b"]]) == ["schedule_gpipe", "schedule_1f1b"]
    assert run_names([["model.ffn_hidden=64", "model.moe.ffn_hidden=32"]]) == \
        ["model_ffn_hidden64-model_moe_ffn_hidden32"]
    assert run_names([["parallel.pp_layout=[1,3]"], ["parallel.pp_layout=null"]]) == \
        ["pp_layout_1x3", "pp_layout_null"]
    assert run_names([[], []]) == ["run0", "run1"]
    assert run_names([["data.path=/a/b c"], ["data.path=/a/b?c"]]) == ["path__a_b_c-run0", "path__a_b_c-run1"]


def test_last_error_line():
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad thing: 3\n"
          "srun: error: node1: task 0: Exited with exit code 1\n")
    assert R.last_error_line(tb) == "ValueError: bad thing: 3"
    assert R.last_error_line("torch.distributed.DistBackendError: gloo: timeout\n\n") == \
        "torch.distributed.DistBackendError: gloo: timeout"
    assert R.last_error_line("just words\nlast words\n") == "last words"
    assert R.last_error_line("[rank1]:   raise X\n[rank1]: KeyError: 'k'\nsrun: error: Terminating\n") == \
        "[rank1]: KeyError: 'k'"
    assert R.last_error_line("step 1\nerror: data.path: no such file\nsrun: error: task 0: Exited\n") == \
        "error: data.path: no such file"
    assert R.last_error_line("") == ""


def _fake_run(d: Path, steps_planned: int, steps_logged: int, meta: dict = None, tp: int = 1) -> Path:
    d.mkdir(parents=True)
    (d / "resolved.yaml").write_text(f"recipe: x\ntrain:\n  steps: {steps_planned}\nparallel:\n  tp: {tp}\n")
    (d / "plan.json").write_text(json.dumps({"memory_per_device_bytes": {"total": 1000}, "bubble_fraction": 0.25,
                                             "step_time_s": 2.0, "tokens_per_s": 50.0, "mfu": 0.5}))
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, steps_logged + 1):
            f.write(json.dumps({"step": s, "loss": 5.0 - s, "step_time_s": float(s), "tokens_per_s": 100.0 / s,
                                "mfu": 0.1 * s, "peak_memory_bytes": 1000 * s, "bubble_measured": 0.1 * s}) + "\n")
        if steps_logged:
            f.write('{"step": 99, "loss"')  # a line cut short by a crash is not a step
    if meta is not None:
        (d / "sweep.json").write_text(json.dumps(meta))
    return d


def test_states_and_ratios_from_files(tmp_path):
    done = _fake_run(tmp_path / "a", 4, 4, tp=1)
    part = _fake_run(tmp_path / "b", 4, 2, tp=2)
    none = _fake_run(tmp_path / "c", 4, 0, tp=4)
    log = tmp_path / "task.err"
    log.write_text("Traceback ...\nRuntimeError: CUDA out of memory\nsrun: error: task 0: Exited with exit code 1\n")
    slurm = _fake_run(tmp_path / "d", 4, 1, {"index": 3, "name": "d", "overrides": ["x=1"],
                                            "slurm": {"stderr": [str(log)], "state": "FAILED"}}, tp=8)
    log2 = tmp_path / "task2.err"
    log2.write_text("error: data.path: 32 ids, model.seq_len is 16\n")  # a rank that returned 2: COMPLETED
    short = _fake_run(tmp_path / "e", 4, 0, {"index": 4, "name": "e", "overrides": ["x=2"],
                                            "slurm": {"stderr": [str(log2)], "state": "COMPLETED"}}, tp=8)
    rows = R.build([str(done), str(part), str(none), str(slurm), str(short)])
    assert [(r.state, r.error) for r in rows] == [("completed", ""), ("incomplete", ""), ("not started", ""),
                                                   ("failed", "RuntimeError: CUDA out of memory"),
                                                   ("failed", "error: data.path: 32 ids, model.seq_len is 16")]
    a = rows[0]
    # medians of steps 2..4 (the first left out), max memory, the last loss
    assert a.measured == {"step_time_s": 3.0, "tokens_per_s": pytest.approx(100 / 3), "mfu": pytest.approx(0.3),
                          "memory_bytes": 4000, "bubble": pytest.approx(0.3)}
    assert a.ratio("step_time_s") == 1.5 and a.ratio("memory_bytes") == 4.0 and a.ratio("bubble") == pytest.approx(1.2)
    assert a.final_loss == 1.0 and a.predicted_by == "plan.json"
    assert [r.overrides for r in rows] == [["parallel.tp=1"], ["parallel.tp=2"], ["parallel.tp=4"], ["x=1"], ["x=2"]]
    rep = R.write([str(tmp_path)], str(tmp_path / "out"), show=False)
    assert len(rep.rows) == 5 and len(rep.failed) == 4
    assert _png_size(tmp_path / "out" / "report.png")[0] == 1320
    assert R.main([str(tmp_path / "nothing-here")]) == 2
