"""Qwen3.5 MoE (``Qwen3_5MoeForCausalLM``, model_type ``qwen3_5_moe_text``; its vision-language
wrapper ``qwen3_5_moe`` read for its text tower): Qwen3-Next's layers with its MoE on every layer
(softmax top-k always renormalised, the gated shared expert) and the linear layers' projections
stored split (paralayer/families/qwen3_5/). Torch-free."""
from __future__ import annotations

from typing import Optional

from paralayer.families import qwen3_moe, qwen3_next
from paralayer.families.common import Traits
from paralayer.families.qwen3_5 import text, text_config

NAME = "qwen3_5_moe_text"
MODEL_TYPES = ("qwen3_5_moe_text",)
#: its vision-language wrapper, read for its text model (checkpoint/hf_split.py reads its text tower)
ALIASES = {"qwen3_5_moe": "the vision-language Qwen3_5MoeForConditionalGeneration: its text tower"}
ALIAS_CLASSES = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
HF_CLASS = "Qwen3_5MoeForCausalLM"
TINY_RECIPE = "tiny-qwen3.5-moe"
NAMES = text.NAMES
RENAMES = qwen3_next.RENAMES  # the gated shared expert, singular
EXPERTS = qwen3_moe.EXPERTS  # per expert, as its save_pretrained writes (fused gate_up_proj is read too)
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None
SPLIT_PROJ = True
TEXT_PREFIX = {"qwen3_5_moe": text_config.TEXT_PREFIX}
#: Qwen3-Next's keys Qwen3_5MoeTextConfig dropped, with what its block does instead
IGNORED = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
read_attention = qwen3_next.read_attention


def prepare(hf: dict, fp: str) -> dict:
    """Its text model with the class defaults; ``intermediate_size`` (not a key of the class: every
    layer is MoE) the experts' width when absent."""
    out = text_config.prepare(hf, fp, NAME, text_config.MOE_DEFAULTS, IGNORED, HF_CLASS)
    out.setdefault("intermediate_size", out["moe_intermediate_size"])
    return out


read_parts = text.read_parts


def claims(t: Traits) -> bool:
    """Export: linear layers with split projections, with experts."""
    return t.linear and t.split and not t.oss and t.moe


def export_refusal(cfg, t: Traits) -> Optional[str]:
    why = qwen3_next.linear_refusal(cfg, t, NAME)
    if why:
        return why
    m = cfg.moe
    if not (m.shared_ffn_hidden and m.shared_gate and m.router == "softmax" and m.n_group == 1
            and m.routed_scaling_factor == 1.0 and m.norm_topk_prob is not False and m.every == 1
            and m.first_k_dense == 0):
        return ("model.moe: qwen3_5_moe_text has experts on every layer routed by softmax, the top-k renormalised, "
                "with one gated shared expert (shared_ffn_hidden > 0, shared_gate true, norm_topk_prob true, every 1, "
                "first_k_dense 0, n_group 1, routed_scaling_factor 1)")
    return None


def export_config(cfg) -> dict:
    """Qwen3_5MoeTextConfig's keys: Qwen3-Next's but the ones it dropped (every layer MoE, the top-k
    renormalised)."""
    m = cfg.moe
    return {**qwen3_next.linear_export(cfg, HF_CLASS, NAME), "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.ffn_hidden or cfg.ffn_hidden,
            "shared_expert_intermediate_size": m.shared_ffn_hidden, "router_aux_loss_coef": m.aux_loss_coef,
            "output_router_logits": False}
