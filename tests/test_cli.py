"""launch.py's front door: every rule broken once → exit 2, the field named, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paralayer.cli import device_label, main

ROOT = Path(__file__).resolve().parent.parent
MOE = ["model.moe.num_experts=4", "model.moe.ffn_hidden=128"]

# (overrides, the field the error must name). Each breaks exactly one rule of REFERENCE.md "Rules".
BROKEN = [
    # world = tp·pp·cp·dp against the cluster
    (["cluster=h100-80gb-8x", "parallel.dp=3"], "parallel.dp"),
    # dp=auto: tp·pp·cp must divide the world
    (["recipe=llama3-70b", "cluster.nodes=3"], "parallel.dp"),
    # n_heads % tp
    (["model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden=384", "parallel.tp=3", "parallel.dp=1",
      "model.d_model=96", "model.seq_len=96"], "parallel.tp"),
    # n_kv_heads < tp (rejected, never replicated)
    (["parallel.tp=4", "parallel.dp=1"], "parallel.tp"),
    # n_kv_heads % tp with n_kv_heads >= tp
    (["model.d_model=192", "model.n_heads=12", "model.n_kv_heads=6", "parallel.tp=4", "parallel.dp=1"], "parallel.tp"),
    # ffn % tp
    (["model.ffn_hidden=351", "parallel.tp=2", "parallel.dp=1"], "parallel.tp"),
    # (no expert ffn % tp rule: experts are replicated over tp, split only by ep — tests/test_moe_e2e.py)
    # n_heads must divide d_model; GQA groups
    (["model.n_heads=3", "model.n_kv_heads=3"], "model.n_heads"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
    # layers into pp·vpp chunks
    (["parallel.pp=3", "parallel.dp=1"], "parallel.pp"),
    (["parallel.pp=2", "parallel.pp_layout=[1,2]", "parallel.dp=1"], "parallel.pp_layout"),
    (["parallel.pp=2", "parallel.pp_layout=[1,1,2]", "parallel.dp=1"], "parallel.pp_layout"),
    # an empty middle chunk (only the embedding's and the head's chunks may hold 0 layers)
    (["parallel.pp=2", "parallel.schedule=zbv", "parallel.pp_layout=[2,0,2,0]", "parallel.dp=1"], "parallel.pp_layout"),
    (["parallel.pp=2", "parallel.pp_layout=[-1,5]", "parallel.dp=1"], "parallel.pp_layout"),
    # vpp with the schedule
    (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.dp=1"], "parallel.vpp"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=1f1b", "parallel.dp=1"], "parallel.vpp"),
    (["parallel.pp=2", "parallel.vpp=4", "model.n_layers=8", "parallel.schedule=zbv", "parallel.dp=1"], "parallel.vpp"),
    (["parallel.schedule=dualpipev", "parallel.dp=1"], "parallel.pp"),
    # seq % 2·cp (zigzag)
    (["model.seq_len=100", "parallel.cp=4", "parallel.dp=1"], "parallel.cp"),
    # tokens per microbatch divisible by tp with SP
    (["model.seq_len=129", "parallel.tp=2", "parallel.dp=1"], "model.seq_len"),
    # experts
    (["model.moe.num_experts=6", "parallel.ep=4", "parallel.dp=4"], "parallel.ep"),
    (["model.moe.num_experts=2", "model.moe.top_k=3"], "model.moe.top_k"),
    (MOE + ["parallel.ep=4", "parallel.dp=2"], "parallel.ep"),
    (["parallel.ep=2", "parallel.dp=2"], "parallel.ep"),
    (MOE + ["model.moe.every=9"], "model.moe.every"),
    # batch
    (["train.global_batch=10", "train.micro_batch=4"], "train.global_batch"),
    (["parallel.pp=4", "parallel.dp=1", "train.global_batch=2", "train.micro_batch=1"], "train.global_batch"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "parallel.dp=1", "train.global_batch=3",
      "train.micro_batch=1"], "train.global_batch"),
    (["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.dp=1", "train.global_batch=3", "train.micro_batch=1"],
     "train.global_batch"),
    # values checked by the schema
    (["parallel.zero=4"], "parallel.zero"),
    (["parallel.tp=abc"], "parallel.tp"),
    (["parallel.tpp=2"], "parallel.tpp"),
    (["parallel.recompute=most"], "parallel.recompute"),
    (["recipe=nope"], "recipe"),
    # does not fit
    (["recipe=llama3-70b", "parallel.pp=1", "cluster.nodes=16"], "memory"),
]


@pytest.mark.parametrize("ovs,field", BROKEN, ids=[f"{f}:{' '.join(o)}" for o, f in BROKEN])
def test_broken_rule_exits_2_naming_the_field(ovs, field, capsys):
    rc = main(ovs + ["--dry-run", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "Traceback" not in err and "Traceback" not in out
    assert f"{field}:" in err, err
    if out.strip():  # a resolvable recipe still prints its plan, with the errors in it
        d = json.loads(out)
        assert field in {e["field"] for e in d["errors"]} or field == "memory"


def test_error_message_names_valid_values(capsys):
    assert main(["model.n_heads=32", "model.n_kv_heads=8", "model.d_model=256", "model.ffn_hidden=512",
                 "parallel.tp=3", "parallel.dp=1", "cluster.devices_per_node=8", "cluster.nodes=1",
                 "parallel.dp=auto", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp=3 does not divide model.n_heads=32; valid tp for this model within a node of 8: 1, 2, 4, 8" \
        in err
    assert main(["parallel.tp=4", "parallel.dp=1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "n_kv_heads=2" in err and "valid tp for this model: 1, 2" in err


def test_warnings_do_not_fail(capsys):
    # tp across nodes and m < 4p are warnings, the run is still valid
    rc = main(["cluster=h100-80gb-8x", "cluster.devices_per_node=1", "cluster.nodes=4", "parallel.tp=2",
               "parallel.pp=2", "parallel.dp=auto", "train.global_batch=4", "train.micro_batch=1",
               "--dry-run", "--json"])
    out = capsys.readouterr().out
    d = json.loads(out)
    assert rc == 0, d["errors"]
    wf = {w["field"] for w in d["warnings"]}
    assert {"parallel.tp", "train.global_batch"} <= wf


def test_dry_run_tables(capsys):
    assert main(["recipe=mixtral-8x7b", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for text in ("Parallel degrees", "inter-node", "Memory per device", "capacity", "bubble",
                 "Communication", "all-to-all", "one expert per rank"):
        assert text in out, text


def test_device_hours_are_hours_of_the_profiles_gpu(capsys):
    """DeepSeek-V3's recipe runs on H800s: its hours are H800-hours, though the planner's time
    constants are the H100's (cluster/profiles/h800-80gb-8x.yaml)."""
    assert main(["recipe=deepseek-v3", "--dry-run"]) in (0, 2)
    out = capsys.readouterr().out
    assert "H800-hours" in out and "H100-hours" not in out, out[-2000:]
    assert [device_label(p, k) for p, k in (("h800-80gb-8x", "h100"), ("b200-180gb-8x", "b200"),
                                            ("my-slurm", "h100"), ("local", None))] == ["H800", "B200", "H100", "DEVICE"]


def test_dry_run_json_valid(capsys):
    assert main(["recipe=tiny", "--dry-run", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["valid"] and d["errors"] == [] and d["world_size"] == 4 and d["degrees"]["tp"] == 2


def test_multirun_reports_every_invalid_combination(capsys, monkeypatch):
    import paralayer.dispatch as dispatch

    monkeypatch.setattr(dispatch, "launch_sweep", lambda *a, **k: pytest.fail("dispatched an invalid sweep"))
    rc = main(["parallel.tp=1,3,5", "parallel.dp=1", "-m"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "parallel.tp=3" in err and "parallel.tp=5" in err and "nothing was started" in err


def test_multirun_valid_sweep_dispatches_all(capsys, monkeypatch):
    import paralayer.dispatch as dispatch

    seen = {}
    monkeypatch.setattr(dispatch, "launch_sweep", lambda cfgs, plans, args: seen.setdefault("n", len(plans)) and 0)
    assert main(["parallel.tp=1,2", "train.micro_batch=2,4", "-m"]) == 0
    assert seen["n"] == 4


def test_run_dispatches_valid_plan(monkeypatch):
    import paralayer.dispatch as dispatch

    got = {}
    monkeypatch.setattr(dispatch, "launch", lambda cfg, plan, args: got.update(plan=plan) or 7)
    assert main(["recipe=tiny"]) == 7
    assert got["plan"].valid
    monkeypatch.setattr(dispatch, "launch", lambda *a: pytest.fail("dispatched an invalid plan"))
    assert main(["parallel.tp=3"]) == 2


def test_help_lists_recipes_and_profiles(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "llama3-70b" in out and "h100-80gb-8x" in out and "--dry-run" in out


def test_bad_flag_exits_2(capsys):
    assert main(["--nope"]) == 2
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------ a few real processes
def _run(*args: str, timeout: float = 60):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_launch_py_json_is_fast_and_valid():
    """Well under a second of work. Measured as the child's CPU time (user + sys), which a busy CI
    machine does not inflate; wall time only gets a loose bound."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = _run("launch.py", "recipe=llama3-70b", "--dry-run", "--json")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["degrees"]["dp"] == 16 and d["world_size"] == 512
    assert cpu < 0.8, f"{cpu:.2f} s of CPU"
    assert wall < 5.0, f"{wall:.2f} s wall"


@pytest.mark.parametrize("ovs,field", [
    (["parallel.tp=3"], "parallel.tp"),
    (["parallel.tpp=3"], "parallel.tpp"),
    (["recipe=llama3-70b", "cluster.nodes=3"], "parallel.dp"),
])
def test_launch_py_errors_without_traceback(ovs, field):
    r = _run("launch.py", *ovs, "--dry-run")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and f"{field}:" in r.stderr


def test_resolving_imports_no_torch():
    code = ("import sys; from paralayer.config import load_config; from paralayer.resolve import resolve; "
            "from paralayer.cli import main; "
            "p = resolve(load_config(['recipe=mixtral-8x7b'])); assert p.valid; "
            "main(['recipe=llama3-70b', '--dry-run']); main(['recipe=llama3-70b', '--dry-run', '--json']); "
            "print('torch' in sys.modules)")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


# ------------------------------------------------------------------ issue 16: the front door
def _strict_json(text: str):
    def refuse(c):
        raise ValueError(f"bare {c} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_even_for_invalid_plans(capsys):
    assert main(["parallel.tp=3", "--dry-run", "--json"]) == 2
    d = _strict_json(capsys.readouterr().out)
    assert d["errors"] and not d["valid"]
    from paralayer.inputs.strict_json import dumps
    assert dumps({"a": float("nan"), "b": [float("inf"), 1.5]}) == '{"a": null, "b": [null, 1.5]}'


def test_plan_with_nothing_that_fits_names_the_closest_layouts(capsys):
    """70B on one node of 8 A100s at tp=2 fits nowhere: stderr says so, names the closest layouts
    (their overrides) and why each fails, exit 2; --json still prints the (empty) list."""
    assert main(["recipe=llama3-70b", "cluster=a100-80gb-8x", "parallel.tp=2", "--plan", "--json"]) == 2
    cap = capsys.readouterr()
    assert _strict_json(cap.out) == []
    lines = cap.err.strip().splitlines()
    assert lines[0].startswith("error: parallel.tp=2: no layout with tp = 2 of llama3-70b fits a100-80gb-8x "
                               "(cluster.nodes=1 × cluster.devices_per_node=8 = 8 devices)")
    closest = [ln for ln in lines if ln.startswith("error: closest: ")]
    assert 1 <= len(closest) <= 3
    for ln in closest:
        assert "parallel.tp=2" in ln and "GiB per device" in ln and "cluster.device_memory_gib=80" in ln


def test_cuda_plan_without_a_cuda_device_stops_before_any_rank(tmp_path, capsys):
    """No silent CPU fallback: exit 2, one line, nothing written, no rank started."""
    run = tmp_path / "run"
    assert main(["cluster.device=cuda", "parallel.tp=1", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cluster.device: the plan runs 2 rank(s) on cuda but 0 CUDA")
    assert not run.exists()
    # planning for a GPU cluster from this CPU machine stays allowed
    assert main(["recipe=llama3-70b", "--dry-run"]) == 0


def test_device_auto_is_one_rule_everywhere():
    from paralayer.config import load_config
    from paralayer.dispatch import _slurm_settings
    from paralayer.dispatch.slurm import executor_parameters
    from paralayer.resolve import resolve
    from paralayer.resolve.rules import auto_device

    assert auto_device("auto", None) == "cpu" and auto_device("auto", 989.0) == "cuda"
    assert auto_device("cpu", 989.0) == "cpu" and auto_device("cuda", None) == "cuda"
    # the SLURM submitter asks the same rule (it used to look at gpus_per_node)
    assert "gpus_per_node" not in executor_parameters({"device": "auto", "gpus_per_node": 0})
    assert executor_parameters({"device": "auto", "peak_tflops": 989, "devices_per_node": 8})["gpus_per_node"] == 8
    assert "gpus_per_node" not in executor_parameters({"device": "auto", "peak_tflops": None, "devices_per_node": 2})
    # dispatch passes the plan's device (resolved by that rule), not its own reading of the profile
    cfg = load_config(["cluster=local-slurm", "cluster.device=auto", "cluster.peak_tflops=100", "parallel.tp=1"])
    plan = resolve(cfg)
    assert plan.device == "cuda" and _slurm_settings(cfg, [plan])["device"] == "cuda"


def _files_holding(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_planted_secret_reaches_no_file_and_no_console(tmp_path):
    """A real tiny training run (1 rank, 2 steps, W&B offline) with WANDB_API_KEY planted: no file
    of the run (resolved.yaml, plan.json, metrics.jsonl, W&B config and files) and nothing printed
    holds it; a recipe that tries to read it is refused without echoing it."""
    secret = "sk_PLANTED_c0ffee1234"
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_API_KEY=secret)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "launch.py", "parallel.tp=1", "parallel.dp=1", "train.steps=2",
                        "train.warmup_steps=1", "logging.wandb.mode=offline", f"run.dir={run}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert list(run.glob("wandb/offline-run-*/run-*.wandb")), "W&B offline files were written"
    assert secret not in r.stdout + r.stderr
    assert _files_holding(tmp_path, secret) == []
    for ov in ("run.name=${oc.env:WANDB_API_KEY}", "logging.wandb.project=${oc.env:WANDB_API_KEY}"):
        bad = subprocess.run([sys.executable, "launch.py", ov, "--dry-run"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=env)
        assert bad.returncode == 2 and secret not in bad.stdout + bad.stderr
        assert bad.stderr.startswith(f"error: {ov.split('=')[0]}: ") and "reads the environment" in bad.stderr
