"""Gated DeltaNet (issue #47 item 1, paralayer/model/linear/) against transformers 5.25's own
Qwen3NextGatedDeltaNet (its torch fallback) at init std 0.2:

- the chunked delta rule equals the token-by-token definition (two chunk sizes, a carried state);
- one layer's output and every weight's gradient equal transformers' within 1e-5 relative
  (sequence 80: a whole chunk of 64 and a padded one; 2 k-heads serving 4 v-heads);
- planted errors fail by over 100× the tolerance: the gate applied after the update instead of
  before it; the conv reading one position too few (its tail dropped)."""
from __future__ import annotations

import pytest
import torch

from paralayer.model.linear import delta_rule, short_conv
from paralayer.model.linear.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from paralayer.model.linear.gated_deltanet import GatedDeltaNet

TOL = 1e-5
D, HK, HV, DK, DV, KERNEL, SEQ = 64, 2, 4, 16, 8, 4, 80


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def hf_layer(seed: int = 0):
    """transformers' layer at std 0.2 (A_log, dt_bias and the norm's gain drawn too)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
                          linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL,
                          num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    ref = Qwen3NextGatedDeltaNet(cfg, 0).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in ("norm.weight", "dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif n == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return ref


def ours_from(ref) -> GatedDeltaNet:
    ours = GatedDeltaNet(D, HK, HV, DK, DV, KERNEL, chunk=64, eps=1e-6)
    ours.load_state_dict(ref.state_dict())
    return ours


def _run(layer, x):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.pow(2).mean().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def test_chunked_equals_the_recurrence():
    g = torch.Generator().manual_seed(1)
    b, s = 2, 37
    q = delta_rule.l2norm(torch.randn(b, s, HK, DK, generator=g))
    k = delta_rule.l2norm(torch.randn(b, s, HK, DK, generator=g))
    v = torch.randn(b, s, HV, DV, generator=g)
    gate = -torch.rand(b, s, HV, generator=g)
    beta = torch.rand(b, s, HV, generator=g)
    s0 = torch.randn(b, HV, DK, DV, generator=g)
    want, want_state = recurrent_gated_delta_rule(q, k, v, gate, beta, initial_state=s0)
    for chunk in (8, 64):
        got, state = chunk_gated_delta_rule(q, k, v, gate, beta, chunk, initial_state=s0)
        assert _rel(got, want) < TOL and _rel(state, want_state) < TOL, chunk
    # two halves with the state carried equal the whole (what context parallel relies on)
    o1, s1 = chunk_gated_delta_rule(q[:, :20], k[:, :20], v[:, :20], gate[:, :20], beta[:, :20], 8, s0)
    o2, s2 = chunk_gated_delta_rule(q[:, 20:], k[:, 20:], v[:, 20:], gate[:, 20:], beta[:, 20:], 8, s1)
    assert _rel(torch.cat([o1, o2], 1), want) < TOL and _rel(s2, want_state) < TOL


@pytest.fixture(scope="module")
def reference():
    ref = hf_layer()
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(2))
    return ref, x, _run(ref, x)


def test_layer_matches_transformers(reference):
    ref, x, (y_ref, gx_ref, g_ref) = reference
    y, gx, grads = _run(ours_from(ref), x)
    errs = {n: _rel(grads[n], g_ref[n]) for n in g_ref}
    print(f"gated deltanet: out rel err {_rel(y, y_ref):.1e}, dx {_rel(gx, gx_ref):.1e}, "
          f"grads max {max(errs.values()):.1e} over {len(errs)}")
    assert _rel(y, y_ref) < TOL and _rel(gx, gx_ref) < TOL and max(errs.values()) < TOL, errs


def _gate_after_update(state, chunk_decay, k_to_end, v_new):
    """Planted: the update written first, then the whole chunk's decay applied to it as well."""
    return (state + k_to_end.transpose(-1, -2) @ v_new) * chunk_decay


def _conv_without_tail(x, weight, tail=None):
    """Planted: each output reads one input fewer (the oldest of its window dropped)."""
    y, t = _orig_conv(x, weight.clone().index_fill_(-1, torch.tensor([0]), 0.0), tail)
    return y, t


_orig_conv = short_conv.causal_conv


@pytest.mark.parametrize("plant", ["gate_after_update", "conv_tail_dropped"])
def test_planted_errors_fail(reference, monkeypatch, plant):
    ref, x, (y_ref, _, g_ref) = reference
    if plant == "gate_after_update":
        monkeypatch.setattr(delta_rule, "next_state", _gate_after_update)
    else:
        from paralayer.model.linear import gated_deltanet
        monkeypatch.setattr(gated_deltanet, "causal_conv", _conv_without_tail)
    y, _, grads = _run(ours_from(ref), x)
    worst = max(_rel(grads[n], g_ref[n]) for n in g_ref)
    print(f"planted {plant}: out rel err {_rel(y, y_ref):.1e}, grads max {worst:.1e}")
    assert _rel(y, y_ref) > 100 * TOL and worst > 100 * TOL


@pytest.mark.parametrize("seq", [128, 300])
def test_the_rehearsal_counts_the_layer_flops_the_plan_counts(seq, monkeypatch):
    """One layer's forward and backward under the rehearsal's counter (rehearse/flops.py) equal the
    plan's (cost/terms.py: 3 × its projections' 2·N, and cost/linear_flops.py), exactly, at a
    sequence of whole chunks and at a padded one. Planted: torch's own conv-backward formula (it
    counts the depthwise conv's weight gradient once per channel) and the solves left uncounted
    (torch has no formula) each move the count off the plan's."""
    from paralayer import config as config_mod
    from paralayer.rehearse import flops as rflops
    from paralayer.resolve import model_parts, rules
    from paralayer.resolve.cost.linear_flops import linear_core_rank_flops

    cfg = config_mod.load_config(["recipe=tiny-qwen3.5", f"model.seq_len={seq}"])
    lay, li = rules.check(cfg), cfg.model.linear
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg.model.d_model, li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim, li.conv_kernel)
    x = torch.randn(2, seq, cfg.model.d_model, requires_grad=True)

    def count() -> float:
        with rflops.LocalFlopCounter() as f:
            layer(x).sum().backward()
        return sum(f.get_flop_counts()["Global"].values())

    plan = (3 * 2.0 * model_parts.linear_weights(cfg) / lay.tp + linear_core_rank_flops(cfg, lay)[1]) * 2 * seq
    assert count() == pytest.approx(plan, rel=1e-12)
    stock = rflops._cpu_attention_mapping()
    monkeypatch.setattr(rflops, "_cpu_attention_mapping",
                        lambda: {k: v for k, v in stock.items() if k is not torch.ops.aten.convolution_backward})
    assert count() > 1.2 * plan  # torch 2.13's formula: the conv's weight gradient × its 128 channels
    monkeypatch.setattr(rflops, "_cpu_attention_mapping",
                        lambda: {k: v for k, v in stock.items() if k is not torch.ops.aten.linalg_solve_triangular})
    assert count() < 0.97 * plan
