"""The forward work recompute=norm_up (DeepSeek-V3's, arXiv 2412.19437 §3.2.3) does again in
backward: what cost.terms adds to a rank's FLOPs and to the step's recompute fraction."""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory.bf16_acts import routed_rows_per_token


def norm_up_gemm_flops(cfg: Config) -> float:
    """The GEMMs of recompute=norm_up's rerun per token: MLA's up-projections q_b and kv_b,
    2·(q_lora·a·d_qk + kv_lora·a·(nope + d_v)); none without MLA. What a rank's FLOPs count, as
    torch's counter does (GEMMs and attention)."""
    if parts.attention_kind(cfg) != "mla":
        return 0.0
    m, ml = cfg.model, cfg.model.mla
    return 2.0 * ((ml.q_lora_rank or 0) * m.n_heads * parts.qk_head_dim(cfg)
                  + ml.kv_lora_rank * m.n_heads * (ml.qk_nope_head_dim + parts.v_head_dim(cfg)))


def norm_up_rerun_flops(cfg: Config, i: int) -> float:
    """recompute=norm_up's forward rerun in layer i per token: :func:`norm_up_gemm_flops`, ~4
    element ops per norm element (the two block norms, the latent ones), and in an MoE block the
    SwiGLU of each routed row and the shared expert (5 per element, as swiglu's)."""
    m = cfg.model
    flops = norm_up_gemm_flops(cfg) + 4.0 * 2 * m.d_model
    if parts.attention_kind(cfg) == "mla":
        flops += 4.0 * ((m.mla.q_lora_rank or 0) + m.mla.kv_lora_rank)
    if parts.is_moe_layer(cfg, i):
        mo = m.moe
        flops += 5.0 * (routed_rows_per_token(cfg) * (mo.ffn_hidden or m.ffn_hidden) + mo.shared_ffn_hidden)
    return flops
