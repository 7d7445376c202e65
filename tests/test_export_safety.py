"""export as untrusted input (issue 35): it falls back as ``train.resume=auto`` does, to the newest
checkpoint that verifies, naming the damaged one, and moves nothing in the run folder; bad input is
one line, exit 2."""
from __future__ import annotations

import datetime
import hashlib
import os
import tempfile

import pytest
import torch

from paralayer import cli

SMALL = ["recipe=tiny", "parallel.dp=1", "parallel.tp=1", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
         "model.n_kv_heads=2", "model.ffn_hidden=64", "model.seq_len=16", "logging.wandb.mode=disabled"]


def _digest(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture()
def run(tmp_path):
    """A run folder with checkpoints at steps 1 and 2 of different weights; the weights of each."""
    import torch.distributed as dist

    from paralayer import config as config_mod
    from paralayer.checkpoint.dcp import save_checkpoint
    from paralayer.config import load_config
    from paralayer.model.transformer import Transformer

    run = tmp_path / "run"
    cfg = load_config(SMALL + [f"run.dir={run}"])
    run.mkdir()
    (run / "resolved.yaml").write_text(config_mod.to_yaml(cfg))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    weights = {}
    try:
        for step in (1, 2):
            torch.manual_seed(step)
            model = Transformer(cfg.model)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.2)
            weights[step] = model.state_dict()["tok_emb.weight"].clone() if "tok_emb.weight" in model.state_dict() \
                else next(iter(model.state_dict().values())).clone()
            save_checkpoint(str(run / "checkpoints"), step, [model], [])
    finally:
        dist.destroy_process_group()
    return run, weights


def _export(argv, capsys):
    rc = cli.main(["export", *argv])
    c = capsys.readouterr()
    return rc, c.out, c.err


def _exported_first_tensor(out):
    from safetensors.torch import load_file

    t = load_file(os.path.join(out, "model.safetensors"))
    return t["model.embed_tokens.weight"]


def _damage(ckpt_dir):
    shard = next(os.path.join(ckpt_dir, n) for n in sorted(os.listdir(ckpt_dir)) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.seek(0)
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_export_falls_back_past_a_damaged_checkpoint(run, tmp_path, capsys):
    run, weights = run
    ck = run / "checkpoints"
    newest = sorted(os.listdir(ck))[-1]
    _damage(str(ck / newest))
    before = _digest(str(run))
    rc, out, err = _export([str(run), "--out", str(tmp_path / "hf")], capsys)
    assert rc == 0, err
    warn = [ln for ln in err.splitlines() if ln.strip()]
    assert len(warn) == 1 and warn[0].startswith("warning: export: skipping checkpoint ") and newest in warn[0], err
    assert torch.equal(_exported_first_tensor(tmp_path / "hf"), weights[1])
    assert _digest(str(run)) == before  # nothing set aside, nothing written in the run folder
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]  # no temporary folder left


def test_export_with_no_checkpoint_that_loads_is_one_line(run, tmp_path, capsys):
    run, _ = run
    for n in os.listdir(run / "checkpoints"):
        _damage(str(run / "checkpoints" / n))
    rc, out, err = _export([str(run), "--out", str(tmp_path / "hf")], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("error: checkpoint.dir: no checkpoint loads: "), err
    assert all(ln.startswith(("error:", "warning:")) for ln in err.splitlines() if ln.strip())
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv,field", [
    (["{run}", "--out", ""], "--out"), (["{run}", "--out", "{run}"], "--out"), (["{tmp}/nope", "--out", "{tmp}/o"], "RUN_DIR"),
    (["{run}", "--out", "/proc/x"], "--out"), (["{run}", "--out", "{tmp}/o", "--checkpoint", "{tmp}/none"], "--checkpoint"),
    (["{run}"], "--out"), (["/proc/self", "--out", "{tmp}/o"], "RUN_DIR")])
def test_export_bad_input_names_the_argument(run, tmp_path, capsys, argv, field):
    run, _ = run
    argv = [a.format(run=run, tmp=tmp_path) for a in argv]
    rc, out, err = _export(argv, capsys)
    assert rc == 2 and err.startswith(f"error: {field}: ") and len(err.strip().splitlines()) == 1, err


def test_export_of_a_checkpoint_of_another_shape_is_one_line(run, tmp_path, capsys):
    """resolved.yaml now says d_model=64: neither checkpoint fits; both are named, exit 2."""
    from paralayer import config as config_mod
    from paralayer.config import load_config

    run, _ = run
    (run / "resolved.yaml").write_text(config_mod.to_yaml(load_config(SMALL + ["model.d_model=64"])))
    rc, out, err = _export([str(run), "--out", str(tmp_path / "hf")], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("error: checkpoint.dir: no checkpoint loads: "), err
    assert "step-00000001" in errors[0] and "step-00000002" in errors[0], err
