"""Mixtral (``MixtralForCausalLM``): Llama's attention (one window for every layer, or none) with
a softmax-routed MoE on every layer; its experts one key per expert. Torch-free."""
from __future__ import annotations

from typing import Optional

from paralayer.families.common import (
    ExpertNames,
    Traits,
    base_export,
    float_key,
    head_dim_field,
    int_key,
    uniform_window,
    window_of,
)
from paralayer.families.errors import HFFormatError

NAME = "mixtral"
MODEL_TYPES = ("mixtral",)
HF_CLASS = "MixtralForCausalLM"
TINY_RECIPE = "tiny-moe"
NAMES: dict = {}  # the shared table, plus the experts below
EXPERTS = ExpertNames(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{j}.{w}.weight",
                      w={"w1": "w1", "w3": "w3", "w2": "w2"})
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it (MixtralAttention: ``config.head_dim or
    hidden_size // num_attention_heads``: absent, null and 0 all give the quotient); the window for
    every layer (MixtralConfig's default: none)."""
    hd = hf.get("head_dim") or d // heads
    return uniform_window(hf, fp, NAME, head_dim_field(hd, fp, d, heads), hf.get("sliding_window"))


def experts(hf: dict, fp: str, ffn_hidden: int) -> dict:
    """Mixtral's MoE: ``num_local_experts`` of the dense width, top-k softmax, on every layer."""
    return {
        "num_experts": int_key(hf, "num_local_experts", fp),
        "top_k": int_key(hf, "num_experts_per_tok", fp, 2),
        "ffn_hidden": ffn_hidden,
        "aux_loss_coef": float_key(hf, "router_aux_loss_coef", fp, 0.01),
        "capacity_factor": None,
        "every": 1,
        "router": "softmax",
        "shared_ffn_hidden": 0,
    }


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    return {"moe": experts(hf, fp, out["ffn_hidden"])}


def claims(t: Traits) -> bool:
    """Export: experts without MLA or q/k norms."""
    return t.moe and not (t.mla or t.qk_norm or t.gemma or t.oss)


def export_refusal(cfg, t: Traits) -> Optional[str]:
    if t.kinds == {"full", "sliding"}:
        return ("model.layer_types: an interleaved window with MoE exports as no family "
                "(mixtral: one window for every layer)")
    return None


def export_config(cfg) -> dict:
    m = cfg.moe
    if m.every != 1 or m.shared_ffn_hidden or m.router != "softmax" or m.first_k_dense:
        raise HFFormatError("model.moe: only Mixtral-style MoE exports (every=1, router=softmax, no shared "
                            f"expert); got every={m.every}, router={m.router}, "
                            f"shared_ffn_hidden={m.shared_ffn_hidden}")
    return {**base_export(cfg, HF_CLASS, NAME), "intermediate_size": m.ffn_hidden or cfg.ffn_hidden,
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coef, "router_jitter_noise": 0.0, "output_router_logits": False,
            "sliding_window": cfg.sliding_window if window_of(cfg) else None}
