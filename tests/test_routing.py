"""The routers against transformers' own: DeepSeek-V3's group routing (DeepseekV3TopkRouter /
DeepseekV3MoE) and Qwen3-MoE's softmax top-k (Qwen3MoeSparseMoeBlock); the sequence-wise balance
loss against a plain rewrite of the report's eq. 17–20; first_k_dense against both families'
layer rules. Planted errors (groups by max, no routed scaling) must fail the same comparisons."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from paralayer.config.schema import ModelConfig, MoEConfig
from paralayer.model import routing
from paralayer.model.moe import MoEFeedForward
from paralayer.model.transformer import is_moe_layer

D, FFN, E, K = 16, 8, 16, 4
TOL = 1e-5


def ds_config(**kw) -> DeepseekV3Config:
    base = dict(hidden_size=D, moe_intermediate_size=FFN, n_routed_experts=E, num_experts_per_tok=K,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)
    base.update(kw)
    return DeepseekV3Config(**base)


def ds_spec(c: DeepseekV3Config) -> routing.RouterSpec:
    return routing.RouterSpec(kind="sigmoid", top_k=c.num_experts_per_tok, n_group=c.n_group,
                              topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                              norm_topk_prob=c.norm_topk_prob)


def _x(seed=1, b=3, s=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, D, generator=g)


def _fill(module: torch.nn.Module, seed=0, std=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _ours_from_hf(hf, spec: routing.RouterSpec, shared: int) -> MoEFeedForward:
    """Our block with the HF block's weights (gate_up_proj = [w1; w3], down_proj = w2)."""
    m = MoEFeedForward(D, FFN, E, spec.top_k, None, router=spec.kind, shared_ffn_hidden=shared, spec=spec)
    with torch.no_grad():
        m.gate.weight.copy_(hf.gate.weight)
        m.w1.copy_(hf.experts.gate_up_proj[:, :FFN])
        m.w3.copy_(hf.experts.gate_up_proj[:, FFN:])
        m.w2.copy_(hf.experts.down_proj)
        if shared:
            m.shared.w1.weight.copy_(hf.shared_experts.gate_proj.weight)
            m.shared.w3.weight.copy_(hf.shared_experts.up_proj.weight)
            m.shared.w2.weight.copy_(hf.shared_experts.down_proj.weight)
        if spec.kind == "sigmoid":
            m.expert_bias.copy_(hf.gate.e_score_correction_bias)
    return m


def _block_error(hf, ours, x) -> float:
    """Max relative error of the outputs and of the input's and the gate's gradients."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = hf(xa), ours(xb)
    w = torch.randn(ya.shape, generator=torch.Generator().manual_seed(5))
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    pairs = [(ya, yb), (xa.grad, xb.grad), (hf.gate.weight.grad, ours.gate.weight.grad),
             (hf.experts.down_proj.grad, ours.w2.grad)]
    return max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in pairs)


def _ds_pair(seed=0):
    c = ds_config()
    hf = DeepseekV3MoE(c).float()
    _fill(hf, seed)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(9)) * 0.1)
    return c, hf, _ours_from_hf(hf, ds_spec(c), FFN * c.n_shared_experts)


def test_router_matches_deepseek_v3_topk_router():
    c = ds_config()
    hf = DeepseekV3TopkRouter(c)
    _fill(hf, 3)
    with torch.no_grad():
        hf.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(4)) * 0.1)
    x = _x().reshape(-1, D)
    logits, w_hf, i_hf = hf(x)
    i_us, w_us, _ = routing.route(logits.float(), ds_spec(c), hf.e_score_correction_bias)
    a, b = i_hf.sort(-1), i_us.sort(-1)
    assert torch.equal(a.values, b.values)
    assert torch.allclose(w_hf.gather(-1, a.indices), w_us.gather(-1, b.indices), rtol=0, atol=1e-6)
    # the choice stays inside topk_group groups
    groups = (i_us // (E // c.n_group))
    assert max(len(set(r.tolist())) for r in groups) <= c.topk_group


def test_deepseek_v3_moe_block_matches():
    _, hf, ours = _ds_pair()
    assert _block_error(hf, ours, _x()) < TOL


def _groups_by_max(choice, n_group, topk_group):
    T, E_ = choice.shape
    group_scores = choice.view(T, n_group, E_ // n_group).max(dim=-1).values
    keep = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand(T, n_group, E_ // n_group).reshape(T, E_)


def test_planted_group_pick_by_max_fails(monkeypatch):
    monkeypatch.setattr(routing, "group_mask", _groups_by_max)
    _, hf, ours = _ds_pair()
    assert _block_error(hf, ours, _x()) > 1e-3


def test_planted_no_routed_scaling_fails():
    c, hf, _ = _ds_pair()
    spec = routing.RouterSpec(kind="sigmoid", top_k=K, n_group=c.n_group, topk_group=c.topk_group,
                              routed_scaling_factor=1.0, norm_topk_prob=True)
    ours = _ours_from_hf(hf, spec, FFN)
    assert _block_error(hf, ours, _x()) > 1e-3


@pytest.mark.parametrize("norm", [False, True])
def test_qwen3_moe_block_matches(norm):
    c = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=FFN, num_experts=E, num_experts_per_tok=K,
                       norm_topk_prob=norm)
    hf = Qwen3MoeSparseMoeBlock(c).float()
    _fill(hf, 2)
    spec = routing.RouterSpec(kind="softmax", top_k=K, norm_topk_prob=norm)
    assert _block_error(hf, _ours_from_hf(hf, spec, 0), _x(7)) < TOL
    # and the other setting of norm_topk_prob is told apart
    other = routing.RouterSpec(kind="softmax", top_k=K, norm_topk_prob=not norm)
    assert _block_error(hf, _ours_from_hf(hf, other, 0), _x(7)) > 1e-3


def _seq_loss_by_hand(experts, probs_scores, B, T, k, Nr):
    """Eq. 17–20 token by token: s' = s / Σ_j s_j; f_i = Nr/(Kr·T)·Σ_t 1[i ∈ topk_t]; P_i = mean s'."""
    total = 0.0
    for b in range(B):
        f = [0.0] * Nr
        P = [0.0] * Nr
        for t in range(T):
            row = b * T + t
            s = probs_scores[row].double()
            sp = s / s.sum()
            for e in experts[row].tolist():
                f[e] += Nr / (k * T)
            for i in range(Nr):
                P[i] += float(sp[i]) / T
        total += sum(fi * pi for fi, pi in zip(f, P))
    return total / B


def test_sequence_loss_matches_the_report_equations():
    c, hf, ours = _ds_pair()
    ours.seq_aux = True
    x = _x(b=3, s=8)
    ours(x)
    logits = ours.gate(x.reshape(-1, D)).float()
    experts, _, _ = routing.route(logits, ours.spec, ours.expert_bias)
    want = _seq_loss_by_hand(experts, torch.sigmoid(logits), 3, 8, K, E)
    assert abs(float(ours.seq_aux_loss) - want) < 1e-6 * max(1.0, abs(want))
    # it differs from the batch-wide switch loss (a planted "per batch" version fails)
    assert abs(float(ours.aux_loss) - want) > 1e-4
    ours.seq_aux_loss.backward()
    assert ours.gate.weight.grad is not None and float(ours.gate.weight.grad.abs().sum()) > 0


def test_first_k_dense_matches_both_families():
    ds = ds_config(num_hidden_layers=6, first_k_dense_replace=2)
    ours = ModelConfig(n_layers=6, moe=MoEConfig(num_experts=E, first_k_dense=2))
    hf_moe = [i >= ds.first_k_dense_replace for i in range(6)]
    assert [is_moe_layer(ours, i) for i in range(6)] == hf_moe == [False, False, True, True, True, True]
    q = Qwen3MoeConfig(num_hidden_layers=6, num_experts=E, mlp_only_layers=[0], decoder_sparse_step=2)
    ours_q = ModelConfig(n_layers=6, moe=MoEConfig(num_experts=E, first_k_dense=1, every=2))
    hf_q = [(i not in q.mlp_only_layers) and (i + 1) % q.decoder_sparse_step == 0 for i in range(6)]
    assert [is_moe_layer(ours_q, i) for i in range(6)] == hf_q == [False, True, False, True, False, True]


@pytest.mark.parametrize("kw, field", [(dict(n_group=3), "n_group"), (dict(n_group=4, topk_group=5), "topk_group"),
                                       (dict(kind="softmax", n_group=2), "n_group")])
def test_bad_router_specs_are_refused(kw, field):
    spec = routing.RouterSpec(**{"kind": "sigmoid", "top_k": 2, **kw})
    with pytest.raises(ValueError, match=field):
        spec.check(E)


def test_defaults_are_todays_routers():
    """n_group 1, scaling 1, norm_topk_prob None: the same numbers as before this change."""
    torch.manual_seed(0)
    for kind in ("softmax", "sigmoid"):
        logits = torch.randn(40, E)
        bias = torch.randn(E) * 0.1 if kind == "sigmoid" else None
        ids, w, p = routing.route(logits, routing.RouterSpec(kind=kind, top_k=K), bias)
        if kind == "softmax":
            probs = logits.softmax(-1)
            w0, i0 = probs.topk(K, dim=-1)
        else:
            s = torch.sigmoid(logits)
            i0 = (s + bias).topk(K, dim=-1).indices
            w0 = s.gather(-1, i0)
            probs = s / s.sum(-1, keepdim=True)
        assert torch.equal(ids, i0) and torch.equal(w, w0 / w0.sum(-1, keepdim=True)) and torch.equal(p, probs)
    assert F is not None
