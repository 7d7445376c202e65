"""Export a checkpoint written under tp=2 to the Hugging Face format; transformers reproduces our logits."""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist import run_ranks


def _train_tp2(rank, world, run_dir, extra=()):
    from paralayer import config as config_mod
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve
    from paralayer.runtime.train import train

    cfg = load_config(["recipe=tiny", "parallel.dp=1", "parallel.tp=2", "model.n_layers=2", "model.seq_len=32",
                       "train.steps=2", "train.global_batch=4", "train.micro_batch=2", "checkpoint.every=2",
                       "logging.wandb.mode=disabled", f"run.dir={run_dir}", *extra])
    plan = resolve(cfg).to_dict()
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "resolved.yaml"), "w") as f:
            f.write(config_mod.to_yaml(cfg))
    train(cfg, plan, run_dir)
    return True


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_matches_transformers(tmp_path, tie):
    """Tied: the two trained copies are still one matrix, so dropping lm_head loses nothing."""
    from transformers import AutoModelForCausalLM

    from paralayer.checkpoint import dcp as ckpt
    from paralayer.checkpoint.export import export_run
    from paralayer.config import from_yaml_file
    from paralayer.model.transformer import Transformer

    run_dir = str(tmp_path / "run")
    run_ranks(_train_tp2, 2, run_dir, ["model.tie_embeddings=true"] if tie else [])
    out = export_run(run_dir, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    cfg = from_yaml_file(os.path.join(run_dir, "resolved.yaml"))
    ours = Transformer(cfg.model)
    import datetime
    import tempfile

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        ckpt.load_checkpoint(ckpt.find_latest(os.path.join(run_dir, "checkpoints")), [ours], [])
    finally:
        dist.destroy_process_group()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(x)
        b = hf(input_ids=x).logits
    assert (a - b).abs().max().item() < 1e-4
    assert hf.config.tie_word_embeddings == tie
    if tie:
        assert torch.equal(ours.output.weight, ours.tok_embeddings.weight)
