"""A chunk's windowed layers share one window mask (model/attention.py window_bias): SDPA saves the
mask it is given for backward, and a bool one it converts into a float copy per call, s² elements
per layer and microbatch. Counted on a real forward's saved tensors, in fp32 and under bf16
autocast, in every recompute mode; the outputs and gradients equal the per-layer bool masks'."""
from __future__ import annotations

import pytest
import torch

from paralayer import config as config_mod
from paralayer.model import attention as attn_mod
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from paralayer.runtime.build import apply_recompute

S = 40  # no other saved tensor is (S, S): RoPE tables are (S, 32)
OV = ["recipe=tiny", "model.n_layers=4", f"model.seq_len={S}", "model.sliding_window=8", "model.full_attention_every=4",
      "parallel.tp=1", "parallel.dp=1", "model.init_std=0.2"]


def _model(recompute: str = "none"):
    cfg = config_mod.load_config(OV)
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=0)
    apply_recompute(model, recompute, 1)
    return cfg, model


def _masks_saved(model, cfg, autocast: bool) -> tuple[int, torch.Tensor, list]:
    """(distinct (S, S) storages saved, loss, grads) of one forward and backward."""
    tokens = torch.randint(0, cfg.model.vocab_size, (2, S), generator=torch.Generator().manual_seed(0))
    seen: dict = {}

    def pack(t):
        if tuple(t.shape) == (S, S):
            seen[t.untyped_storage().data_ptr()] = t.dtype
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(tokens), tokens, cfg.model.vocab_size)
    loss.backward()
    return len(seen), loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recompute", ["none", "core_attn", "full"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_one_mask_per_chunk_and_the_same_numbers(recompute, autocast, monkeypatch):
    cfg, model = _model(recompute)
    n, loss, grads = _masks_saved(model, cfg, autocast)
    assert n == 1, n  # three windowed layers, one mask
    # planted: every layer builds its own (the per-call bool mask SDPA converts): one per windowed layer
    cfg2, planted = _model(recompute)
    real = attn_mod.Attention.shared_mask_window
    monkeypatch.setattr(attn_mod.Attention, "shared_mask_window", property(lambda self: None))
    n_old, loss_old, grads_old = _masks_saved(planted, cfg2, autocast)
    monkeypatch.setattr(attn_mod.Attention, "shared_mask_window", real)
    # (under recompute the per-call mask is made inside the recomputed region: made again, not kept)
    assert n_old == (3 if recompute == "none" else 0), n_old
    assert torch.equal(loss, loss_old)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_old))


def test_the_mask_is_in_the_cores_dtype():
    m = attn_mod.window_bias(6, 2, torch.device("cpu"), torch.bfloat16)
    assert m.dtype == torch.bfloat16 and m.shape == (6, 6)
    keep = m == 0
    assert keep.tolist() == [[j <= i and i - j < 2 for j in range(6)] for i in range(6)]
    assert torch.isinf(m[~keep]).all()
