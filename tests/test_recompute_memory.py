"""Full recompute's activation peak, measured by the rehearsal's ``SavedPeak`` on a real model
(one process, fp32, tiny shapes) against the plan's ``memory.rank_activations``.

paralayer.model.recompute keeps the recomputed layer's tensors behind its own saved-tensor hooks
and reports them to ``SavedPeak``, which counts them live from the rerun until they are freed
(``recompute_bytes``: their peak), on top of the other live bytes. The plan's transient is the layer's "none" set less its input (saved already), and it is
never live beside the same microbatch's logits and head (freed before the first layer's backward)."""
from __future__ import annotations

import pytest
import torch

from paralayer.config import load_config
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from paralayer.rehearse.memory import SavedPeak
from paralayer.resolve import memory, rules
from paralayer.runtime.train import apply_recompute

torch.set_num_threads(1)

B, S = 2, 32


def _cfg(vocab: int, recompute: str):
    return load_config(["model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
                        "model.ffn_hidden=96", f"model.vocab_size={vocab}", f"model.seq_len={S}",
                        "parallel.tp=1", "parallel.dp=1", f"parallel.recompute={recompute}",
                        f"train.global_batch={B}", f"train.micro_batch={B}", "train.precision=fp32",
                        "cluster.device=cpu"])


def _measure(cfg) -> SavedPeak:
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=0)
    apply_recompute(model, cfg.parallel.recompute)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=g)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    with SavedPeak([*model.parameters(), tokens, labels]) as saved:
        lm_loss(model(tokens), labels, cfg.model.vocab_size).backward()
    assert saved.live == 0
    return saved


# vocab 61: the recomputed layer is the peak; vocab 2048: the fp32 logits and the head are
@pytest.mark.parametrize("vocab", [61, 2048])
def test_full_recompute_peak_matches_plan(vocab):
    cfg = _cfg(vocab, "full")
    lay = rules.check(cfg)
    saved = _measure(cfg)
    transient = memory.recompute_transient(cfg, lay, 0)
    peak, _ = memory.rank_activations(cfg, lay, 0)
    print(f"[vocab {vocab}] recomputed {saved.recompute_bytes} B vs plan {transient}; "
          f"peak {saved.peak_bytes} B vs plan {peak}")
    assert abs(saved.recompute_bytes - transient) <= 0.05 * transient, (saved.recompute_bytes, transient)
    assert abs(saved.peak_bytes - peak) <= 0.05 * saved.peak_bytes, (saved.peak_bytes, peak)
    assert memory.rank_memory(cfg, lay, 0)[3] == peak


def test_no_recompute_peak_unchanged_by_the_recompute_count():
    """Without recompute nothing is recomputed; the peak is the forward's saved set (plan within 5%)."""
    cfg = _cfg(61, "none")
    saved = _measure(cfg)
    peak, kept = memory.rank_activations(cfg, rules.check(cfg), 0)
    assert saved.recompute_bytes == 0 and peak == kept
    assert abs(saved.peak_bytes - peak) <= 0.05 * saved.peak_bytes, (saved.peak_bytes, peak)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_bf16_autocast_peak_matches_plan(recompute):
    """Under autocast (bf16, ZeRO 0/1) the final norm keeps its fp32 input and 1/rms: the plan
    counts them twice in bf16 units (memory.head_saved_elems); weight copies count with the weights."""
    cfg = _cfg(256, recompute)
    cfg.train.precision = "bf16"
    lay = rules.check(cfg)
    assert memory.precision_mode("bf16", lay.zero, 1) == "bf16-autocast"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = _measure(cfg)
    peak, _ = memory.rank_activations(cfg, lay, 0)
    print(f"[bf16 {recompute}] peak {saved.peak_bytes} B vs plan {peak} ({peak / saved.peak_bytes - 1:+.2%})")
    assert abs(saved.peak_bytes - peak) <= 0.01 * saved.peak_bytes, (saved.peak_bytes, peak)


def test_received_stage_input_cast_is_an_activation_not_a_weight_copy():
    """A pipeline stage's received input (a bf16 leaf that requires grad) cast back to fp32 and
    saved counts as an activation; only a cast of a Parameter is a weight copy (405b's last stage
    under bf16 rehearsed 0.933 of the plan while it counted with the weights)."""
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)  # as received from the previous stage
    with SavedPeak([w]) as saved:
        z = x.float() @ w.to(torch.bfloat16).float()  # saves the input's cast and the weight's
        torch.tanh(z).sum().backward()  # saves its output
    assert saved.peak_bytes == 2 * 4 * 16 * 4  # the input's fp32 cast and tanh's output
    assert saved.weight_copy_bytes == 16 * 16 * 4
