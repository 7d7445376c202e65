"""paralayer.metrics: peak table / MFU, step records, metrics.jsonl helpers, a real W&B offline run."""
from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

from paralayer import metrics as M


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
    ("NVIDIA A10G", 125.0), ("NVIDIA A10", 125.0), ("NVIDIA A40", 149.7),
    ("NVIDIA GeForce GTX 1080", None), ("Some Future Accelerator", None), ("", None),
])
def test_device_peak_table(name, peak):
    assert M.lookup_device_peak_tflops(name) == peak


def test_unknown_gpu_gets_no_mfu_and_a_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA GeForce GTX 1080")
    with pytest.warns(UserWarning, match=r"no MFU: unknown device 'NVIDIA GeForce GTX 1080'; set cluster.peak_tflops"):
        peak, src = M.resolve_peak_tflops("cuda:0")
    assert peak is None and "unknown" in src
    rec = M.step_record(1, 5.0, 1e-3, 0.5, tokens=4096, step_time_s=0.5, world_size=2,
                        flops_per_token=6e6, peak_tflops=peak)
    assert rec["mfu"] is None and rec["tflops_per_device"] == pytest.approx(6e6 * 8192 / 2 / 1e12)
    # a known name and a configured peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    assert M.resolve_peak_tflops("cuda:0")[0] == 989.0
    assert M.resolve_peak_tflops("cuda:0", configured=500.0) == (500.0, "cluster.peak_tflops")


def test_cpu_peak_measured():
    peak = M.measure_cpu_peak_tflops(threads=1, n=256)
    assert 1e-4 < peak < 100
    p, src = M.resolve_peak_tflops("cpu", threads=1)
    assert p > 0 and "measured" in src


def test_step_record_math():
    rec = M.step_record(3, torch.tensor(2.5), 1e-3, torch.tensor(0.75), tokens=16 * 128,
                        step_time_s=0.25, world_size=4, flops_per_token=1e9, peak_tflops=2.0,
                        extra={"bubble_measured": 0.1})
    keys = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device",
            "tflops_per_device", "mfu", "step_time_s", "peak_memory_bytes"]
    assert all(k in rec for k in keys)
    assert rec["tokens_per_s"] == 8192.0 and rec["tokens_per_s_per_device"] == 2048.0
    assert rec["tflops_per_device"] == pytest.approx(1e9 * 8192 / 4 / 1e12)
    assert rec["mfu"] == pytest.approx(rec["tflops_per_device"] / 2.0)
    assert rec["loss"] == 2.5 and rec["grad_norm"] == 0.75 and rec["bubble_measured"] == 0.1
    assert isinstance(rec["peak_memory_bytes"], int) and rec["peak_memory_bytes"] > 10 * 2**20
    json.dumps(rec)


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_metrics_logger_real_wandb_offline(tmp_path, capsys, monkeypatch):
    for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_SILENT"):
        monkeypatch.delenv(k, raising=False)  # restored after the test; the logger sets them
    run_dir = tmp_path / "run"
    log = M.MetricsLogger(str(run_dir), {"model": {"d_model": 64}}, {"world_size": 2}, True,
                          "offline", "paralayer-test", "g1", total_steps=4, progress=True)
    for s in range(1, 5):
        log.log(s, M.step_record(s, 5.0 - s, 1e-3, 1.0, 2048, 0.1, 2, 1e6, None))
    log.log(5, {"loss": float("nan"), "lr": 0.0})
    summary = log.close()
    log.close()  # idempotent
    recs = _records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[0]["loss"] == 4.0 and recs[3]["loss"] == 1.0 and recs[0]["mfu"] is None
    assert recs[4]["loss"] is None and recs[4]["nonfinite"] == ["loss"]  # strict JSON
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0
    assert summary["first_loss"] == 4.0 and summary["steps_logged"] == 5
    out = capsys.readouterr().out
    assert "paralayer run summary" in out and "tokens/s" in out and "n/a (no peak known)" in out
    for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        assert os.environ[k].startswith(str(run_dir))
    # the run file (protobuf records, strings stored as-is) carries the config and the history
    data = open(runs[0], "rb").read()
    for needle in (b"recipe", b"plan", b"d_model", b"world_size", b"paralayer-test", b"tokens_per_s"):
        assert needle in data, needle


def test_log_every_thins_console_and_wandb_not_the_jsonl(tmp_path, monkeypatch):
    """train.log_every=3 over 7 steps: metrics.jsonl has every step; W&B (a real offline run; the
    spy calls through) and the console get steps 3, 6 and the last one, 7."""
    import io

    from rich.console import Console

    from paralayer.metrics import wandb_log

    for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_SILENT"):
        monkeypatch.delenv(k, raising=False)
    to_wandb = []
    real = wandb_log.log_step
    monkeypatch.setattr(wandb_log, "log_step", lambda run, step, rec: (to_wandb.append(step), real(run, step, rec)))
    out = io.StringIO()
    run_dir = tmp_path / "run"
    log = M.MetricsLogger(str(run_dir), {}, {}, True, "offline", "paralayer-test", None, total_steps=7,
                          progress=True, console=Console(file=out, force_terminal=False, width=200), log_every=3)
    for s in range(1, 8):
        log.log(s, M.step_record(s, 5.0 - 0.1 * s, 1e-3, 1.0, 2048, 0.1, 2, 1e6, None))
    log.close()
    assert [r["step"] for r in _records(run_dir / "metrics.jsonl")] == list(range(1, 8))
    assert to_wandb == [3, 6, 7]
    printed = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert printed == [3, 6, 7], out.getvalue()


def test_non_logging_rank_and_disabled_write_nothing(tmp_path):
    other = M.MetricsLogger(str(tmp_path / "r1"), {}, {}, False, "offline", "p", None, 2, True)
    other.log(1, {"loss": 1.0})
    assert other.close() is None
    assert not os.path.exists(tmp_path / "r1")
    off = M.MetricsLogger(str(tmp_path / "r2"), {}, {}, True, "disabled", "p", None, 2, False)
    off.log(1, {"loss": 1.0})
    off.close()
    assert os.listdir(tmp_path / "r2") == ["metrics.jsonl"]


def test_resume_helpers(tmp_path):
    p = str(tmp_path / "metrics.jsonl")
    assert M.last_logged_step(p) is None and M.truncate_after(p, 3) == 0
    with open(p, "w") as f:
        for s in range(1, 7):
            f.write(json.dumps({"step": s, "loss": 1.0 / s}) + "\n")
        f.write('{"step": 7, "loss": 0.1')  # cut short by a crash
    assert M.last_logged_step(p) == 6
    assert M.truncate_after(p, 4) == 4
    assert [r["step"] for r in _records(p)] == [1, 2, 3, 4]
    # a resumed logger appends after the kept steps, never duplicating one
    log = M.MetricsLogger(str(tmp_path), {}, {}, True, "disabled", "p", None, 6, False)
    for s in (5, 6):
        log.log(s, {"loss": 0.5})
    log.close()
    assert [r["step"] for r in _records(p)] == [1, 2, 3, 4, 5, 6]
    # a file whose last line has no newline still gets clean lines appended
    with open(p, "a") as f:
        f.write('{"step": 7, "lo')
    log = M.MetricsLogger(str(tmp_path), {}, {}, True, "disabled", "p", None, 8, False)
    log.log(7, {"loss": 0.4})
    log.close()
    assert M.last_logged_step(p) == 7 and M.truncate_after(p, 7) == 7
    assert not math.isnan(_records(p)[-1]["loss"])
