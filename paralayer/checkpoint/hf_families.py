"""The Hugging Face families we import and export, each with its name table and its config.json.

Names: every dense family shares Llama's table (``paralayer.checkpoint.hf``: ``_DENSE``, ``_TOP``);
a family adds only what its block has more:

    family    transformers class       adds to Llama's names
    llama     LlamaForCausalLM         -
    mistral   MistralForCausalLM       - (sliding_window, uniform)
    qwen3     Qwen3ForCausalLM         self_attn.q_norm.weight, self_attn.k_norm.weight (per head)
    mixtral   MixtralForCausalLM       block_sparse_moe.gate / experts.{j}.w1|w2|w3

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
    if cfg.moe.num_experts > 0:
        if cfg.qk_norm:
            raise HFFormatError("model.qk_norm: q/k norms with MoE export as no family here (mixtral has none)")
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
