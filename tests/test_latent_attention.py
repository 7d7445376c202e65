"""Multi-head latent attention against transformers' own DeepseekV3Attention (q_lora_rank set and
not, YaRN factor 4 with mscale_all_dim, DeepSeek's interleaved rope layout), init std 0.2 with
norm gains in U[0.5, 1.5), fp32: the output and every gradient within 1e-5, one process.
Planted errors must fail: RoPE on the nope part too, the softmax scale without YaRN's mscale."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from paralayer.config.schema import MLAConfig, ModelConfig, RopeConfig
from paralayer.model import latent_attention as la
from paralayer.model.positions import apply_rope, rope_cos_sin
from tests.families import widen

D, H, NOPE, ROPE, V, RANK, QRANK, SEQ = 48, 4, 8, 6, 10, 12, 16, 24
YARN = dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def _configs(q_lora: int | None):
    hf = DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora,
                          kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                          rope_parameters=dict(YARN), max_position_embeddings=SEQ, rope_interleave=True)
    hf._attn_implementation = "sdpa"
    ours = ModelConfig(d_model=D, n_heads=H, n_kv_heads=H, rope_theta=YARN["rope_theta"], seq_len=SEQ,
                       rope=RopeConfig(type="yarn", factor=4.0, original_max_position=8, beta_fast=32.0,
                                       beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                       mla=MLAConfig(q_lora_rank=q_lora, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                                     qk_rope_head_dim=ROPE, v_head_dim=V))
    return hf, ours


def _deinterleave(rows: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows [start, start+n) reordered even-first: DeepSeek's interleaved rope pairs → rotate-half."""
    perm = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]) + start
    out = rows.clone()
    out[start:start + n] = rows[perm]
    return out


def _pair(q_lora):
    hf_cfg, cfg = _configs(q_lora)
    hf = widen(DeepseekV3Attention(hf_cfg, 0), 2).float()
    ours = la.LatentAttention(cfg)
    qk = NOPE + ROPE
    with torch.no_grad():
        qw = (hf.q_proj if q_lora is None else hf.q_b_proj).weight.view(H, qk, -1)
        qw = torch.stack([_deinterleave(qw[h], NOPE, ROPE) for h in range(H)]).reshape(H * qk, -1)
        (ours.wq if q_lora is None else ours.q_b).weight.copy_(qw)
        if q_lora is not None:
            ours.q_a.weight.copy_(hf.q_a_proj.weight)
            ours.q_a_norm.weight.copy_(hf.q_a_layernorm.weight)
        ours.kv_a.weight.copy_(_deinterleave(hf.kv_a_proj_with_mqa.weight, RANK, ROPE))
        ours.kv_a_norm.weight.copy_(hf.kv_a_layernorm.weight)
        ours.kv_b.weight.copy_(hf.kv_b_proj.weight)
        ours.wo.weight.copy_(hf.o_proj.weight)
    return hf_cfg, cfg, hf, ours


def _errors(hf_cfg, cfg, hf, ours) -> float:
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(SEQ)[None].expand(2, -1)
    cos_h, sin_h = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
    cos, sin = rope_cos_sin(torch.arange(SEQ), ROPE, cfg.rope_theta, torch.float32, cfg.rope)
    assert torch.allclose(cos, cos_h[0], atol=1e-6) and torch.allclose(sin, sin_h[0], atol=1e-6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = hf(xa, (cos_h, sin_h), None)[0]
    yb = ours(xb, cos, sin)
    w = torch.randn(ya.shape, generator=torch.Generator().manual_seed(5))
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    pairs = [(yb, ya), (xb.grad, xa.grad), (ours.kv_b.weight.grad, hf.kv_b_proj.weight.grad),
             (ours.wo.weight.grad, hf.o_proj.weight.grad), (ours.kv_a_norm.weight.grad, hf.kv_a_layernorm.weight.grad),
             (ours.kv_a.weight.grad, _deinterleave(hf.kv_a_proj_with_mqa.weight.grad, RANK, ROPE))]
    if ours.q_a is not None:
        pairs += [(ours.q_a.weight.grad, hf.q_a_proj.weight.grad)]
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)


@pytest.mark.parametrize("q_lora", [QRANK, None])
def test_matches_deepseek_v3_attention(q_lora):
    assert _errors(*_pair(q_lora)) < 1e-5


def test_softmax_scale_has_yarn_mscale():
    _, cfg = _configs(QRANK)
    m = 0.1 * math.log(4.0) + 1.0
    assert la.softmax_scale(cfg) == pytest.approx((NOPE + ROPE) ** -0.5 * m * m, rel=1e-12)


def test_planted_rope_on_the_nope_part_fails(monkeypatch):
    def core(self, q, k_nope, k_rot, v, cos, sin):  # RoPE over the whole q and k (nope included)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        full_cos, full_sin = rope_cos_sin(torch.arange(q.shape[2]), q.shape[-1], 5000.0, q.dtype)
        return F.scaled_dot_product_attention(apply_rope(q, full_cos, full_sin), apply_rope(k, full_cos, full_sin), v,
                                              is_causal=True, scale=self.scale)

    monkeypatch.setattr(la.LatentAttention, "_core", core)
    assert _errors(*_pair(QRANK)) > 1e-3


def test_planted_scale_without_mscale_fails():
    hf_cfg, cfg, hf, ours = _pair(QRANK)
    ours.scale = (NOPE + ROPE) ** -0.5  # YaRN's mscale² left out
    assert _errors(hf_cfg, cfg, hf, ours) > 1e-3
