"""The Hugging Face families we import and export, each with its name table and its config.json.

Names: every dense family shares Llama's table (``paralayer.checkpoint.hf``: ``_DENSE``, ``_TOP``);
a family adds only what its block has more:

    family    transformers class       adds to Llama's names
    llama     LlamaForCausalLM         -
    mistral   MistralForCausalLM       - (sliding_window, uniform)
    qwen3     Qwen3ForCausalLM         self_attn.q_norm.weight, self_attn.k_norm.weight (per head)
    mixtral   MixtralForCausalLM       block_sparse_moe.gate / experts.{j}.w1|w2|w3
    qwen3_moe Qwen3MoeForCausalLM      qwen3's + mlp.gate / mlp.experts.{j}.gate_proj|up_proj|down_proj
    deepseek_v3 (import only)          self_attn.q_a_proj … kv_b_proj (MLA), mlp.gate(.e_score_correction_bias),
                                       mlp.experts.{j}.*, mlp.shared_experts.*

Export picks the family from the config: MoE → mixtral; qk_norm → qwen3 (its layer_types carry
any window pattern); a uniform window → mistral; else llama. A config no family expresses
exactly (an interleaved window without Qwen3's q/k norms, q/k norms with MoE) is refused.
"""
from __future__ import annotations

from typing import Any

from paralayer.config.hf_config import HFFormatError
from paralayer.config.layer_pattern import layer_types

QWEN3_NAMES = {"attention.q_norm.weight": "self_attn.q_norm.weight",
               "attention.k_norm.weight": "self_attn.k_norm.weight"}
DEEPSEEK_V3_NAMES = {"attention.q_a.weight": "self_attn.q_a_proj.weight",
                     "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                     "attention.q_b.weight": "self_attn.q_b_proj.weight",
                     "attention.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
                     "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                     "attention.kv_b.weight": "self_attn.kv_b_proj.weight",
                     "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
                     "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
                     "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight"}
FAMILY_NAMES = {"llama": {}, "mistral": {}, "qwen3": QWEN3_NAMES}
_HF_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}


def rope_parameters(cfg) -> dict:
    """Our RoPE as transformers 5's ``rope_parameters``."""
    r = cfg.rope
    out: dict[str, Any] = {"rope_type": r.type, "rope_theta": cfg.rope_theta}
    if r.type == "llama3":
        out.update(factor=r.factor, low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                   original_max_position_embeddings=r.original_max_position)
    elif r.type == "yarn":
        out.update(factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                   original_max_position_embeddings=r.original_max_position)
        if r.attention_factor is not None:
            out["attention_factor"] = r.attention_factor
        if r.mscale and r.mscale_all_dim:
            out.update(mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
    return out


def family_of(cfg) -> str:
    """llama | mistral | qwen3 | mixtral for export; HFFormatError when none expresses ``cfg``."""
    kinds = set(layer_types(cfg))
    if cfg.mla.kv_lora_rank > 0:
        m = cfg.moe
        for bad, why in ((cfg.qk_norm, "model.qk_norm: deepseek_v3 has no q/k norms"),
                         (kinds != {"full"}, "model.sliding_window: deepseek_v3 attends in full"),
                         (m.num_experts > 0 and m.router != "sigmoid", "model.moe.router: deepseek_v3 routes by sigmoid"),
                         (m.num_experts > 0 and m.every != 1, "model.moe.every: deepseek_v3 has MoE on every layer "
                                                              "past first_k_dense")):
            if bad:
                raise HFFormatError(why)
        return "deepseek_v3"
    if cfg.moe.num_experts > 0:
        if cfg.qk_norm:
            if kinds != {"full"}:
                raise HFFormatError("model.sliding_window: a window with q/k norms and MoE exports as no family "
                                    "(qwen3_moe: full attention)")
            return "qwen3_moe"
        if kinds == {"full", "sliding"}:
            raise HFFormatError("model.layer_types: an interleaved window with MoE exports as no family "
                                "(mixtral: one window for every layer)")
        return "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if kinds == {"full", "sliding"}:
        raise HFFormatError("model.layer_types: an interleaved window without model.qk_norm exports as no "
                            "family (qwen3 has q/k norms; mistral one window for every layer)")
    return "mistral" if kinds == {"sliding"} else "llama"


def deepseek_v3_config(cfg) -> dict:
    """DeepSeek-V3's config.json keys (MLA, routing by group, shared experts, the dense first layers)."""
    m, a = cfg.moe, cfg.mla
    ffn = m.ffn_hidden or cfg.ffn_hidden
    if m.shared_ffn_hidden % ffn:
        raise HFFormatError(f"model.moe.shared_ffn_hidden={m.shared_ffn_hidden}: deepseek_v3 counts shared experts "
                            f"of moe_intermediate_size={ffn}")
    renorm = True if m.norm_topk_prob is None else bool(m.norm_topk_prob)
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": ffn,
            "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.shared_ffn_hidden // ffn, "n_group": m.n_group, "topk_group": m.topk_group,
            "routed_scaling_factor": m.routed_scaling_factor, "norm_topk_prob": renorm,
            "first_k_dense_replace": m.first_k_dense if m.num_experts > 0 else cfg.n_layers,
            "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "head_dim": a.qk_rope_head_dim,
            "num_key_value_heads": cfg.n_heads, "rope_interleave": True,
            "num_nextn_predict_layers": cfg.mtp.depth}


def qwen3_moe_config(cfg) -> dict:
    """Qwen3-MoE's config.json keys; what its block cannot say is refused (one line, the key)."""
    m = cfg.moe
    for bad, why in ((m.router != "softmax", "model.moe.router: qwen3_moe routes by softmax"),
                     (m.shared_ffn_hidden, "model.moe.shared_ffn_hidden: qwen3_moe has no shared expert"),
                     (m.n_group > 1, "model.moe.n_group: qwen3_moe has no routing by group"),
                     (m.routed_scaling_factor != 1.0, "model.moe.routed_scaling_factor: qwen3_moe scales by 1")):
        if bad:
            raise HFFormatError(why)
    renorm = True if m.norm_topk_prob is None else bool(m.norm_topk_prob)
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": cfg.ffn_hidden,
            "moe_intermediate_size": m.ffn_hidden or cfg.ffn_hidden, "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "norm_topk_prob": renorm, "decoder_sparse_step": m.every,
            "mlp_only_layers": list(range(m.first_k_dense)), "router_aux_loss_coef": m.aux_loss_coef,
            "output_router_logits": False, "use_sliding_window": False, "sliding_window": None}


def family_config(cfg, family: str) -> dict:
    """The family's keys of config.json (architecture, model_type, attention pattern)."""
    window = cfg.sliding_window if "sliding" in layer_types(cfg) else None
    if family == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": cfg.ffn_hidden,
                "use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": cfg.n_layers, "layer_types": [_HF_TYPES[t] for t in layer_types(cfg)]}
    if family == "mistral":
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "intermediate_size": cfg.ffn_hidden,
                "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": cfg.ffn_hidden,
            "mlp_bias": False, "pretraining_tp": 1}
