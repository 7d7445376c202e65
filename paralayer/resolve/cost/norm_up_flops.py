"""The forward work recompute=norm_up (DeepSeek-V3's, arXiv 2412.19437 §3.2.3) does again in
backward: what cost.terms adds to a rank's FLOPs and to the step's recompute fraction."""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory.bf16_acts import routed_rows_per_token


def norm_up_rerun_flops(cfg: Config, i: int, gemm_only: bool = False) -> float:
    """recompute=norm_up's forward rerun in layer i per token: MLA's up-projections q_b and kv_b
    (2·(q_lora·a·d_qk + kv_lora·a·(nope + d_v))), ~4 element ops per norm element (the two block
    norms, the latent ones), and in an MoE block the SwiGLU of each routed row and the shared
    expert (5 per element, as swiglu's). ``gemm_only``: the up-projections alone (what a rank's
    FLOPs count, as torch's counter does: GEMMs and attention)."""
    m = cfg.model
    h, a = m.d_model, m.n_heads
    flops = 0.0 if gemm_only else 4.0 * 2 * h
    if parts.attention_kind(cfg) == "mla":
        ml = m.mla
        ql = ml.q_lora_rank or 0
        flops += 2.0 * (ql * a * parts.qk_head_dim(cfg) + ml.kv_lora_rank * a * (ml.qk_nope_head_dim
                                                                                 + parts.v_head_dim(cfg)))
        if gemm_only:
            return flops
        flops += 4.0 * (ql + ml.kv_lora_rank)
    if gemm_only:
        return flops
    if parts.is_moe_layer(cfg, i):
        mo = m.moe
        flops += 5.0 * (routed_rows_per_token(cfg) * (mo.ffn_hidden or m.ffn_hidden) + mo.shared_ffn_hidden)
    return flops
