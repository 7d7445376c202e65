"""Qwen3 (``Qwen3ForCausalLM``): Llama's block with a free head_dim and per-head q/k RMSNorm
before RoPE; windows per layer through ``layer_types`` (or ``max_window_layers``). Torch-free."""
from __future__ import annotations

import json
from typing import Optional

from paralayer.config.layer_pattern import layer_types
from paralayer.families import mixtral
from paralayer.families.common import Traits, base_export, head_dim_field, int_key, window_of
from paralayer.families.errors import HFFormatError

NAME = "qwen3"
MODEL_TYPES = ("qwen3",)
HF_CLASS = "Qwen3ForCausalLM"
TINY_RECIPE = "tiny-swa"  # Qwen3's parts with an interleaved window (cp2)
NAMES = {"attention.q_norm.weight": "self_attn.q_norm.weight",
         "attention.k_norm.weight": "self_attn.k_norm.weight"}
EXPERTS = None
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None
HEAD_DIM_DEFAULT = 128  # Qwen3Config's head_dim when config.json leaves it out (transformers 5.25)
_HF_LAYER = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_TYPES = {v: k for k, v in _HF_LAYER.items()}


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it (Qwen3Config: ``head_dim: int = 128``; a null is
    refused by its strict validation, and here); q/k norms; the window only with
    ``use_sliding_window``, per layer from ``layer_types`` or else ``max_window_layers``."""
    out = {"layer_types": None, "head_dim": head_dim_field(hf.get("head_dim", HEAD_DIM_DEFAULT), fp, d, heads),
           "qk_norm": True}
    n = int_key(hf, "num_hidden_layers", fp)
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window", False):
        window = None  # Qwen3Config drops the window unless use_sliding_window
    types = hf.get("layer_types")
    if window is not None:
        window = int_key({"sliding_window": window}, "sliding_window", fp)
    if types is None:
        mwl = int_key(hf, "max_window_layers", fp, 28, minimum=0)
        types = ["sliding_attention" if window is not None and i >= mwl else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _HF_LAYER for t in types):
        raise HFFormatError(f"{fp}: layer_types={json.dumps(types)[:60]} must list {n} of "
                            f"{', '.join(_HF_LAYER)}")
    ours = [_HF_LAYER[t] for t in types]
    if window is None or "sliding" not in ours:
        window, ours = None, None  # no layer slides
    out["layer_types"] = ours
    out["sliding_window"] = window
    return out


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """No parts beyond the attention's; ``num_local_experts`` reads as Mixtral's experts (as before)."""
    return {"moe": mixtral.experts(hf, fp, out["ffn_hidden"])} if hf.get("num_local_experts") else {}


def claims(t: Traits) -> bool:
    """Export: q/k norms without experts or MLA (its layer_types carry any window pattern)."""
    return t.qk_norm and not (t.moe or t.mla or t.gemma or t.oss)


def export_refusal(cfg, t: Traits) -> Optional[str]:
    return None


def export_config(cfg) -> dict:
    window = window_of(cfg)
    return {**base_export(cfg, HF_CLASS, NAME), "use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": cfg.n_layers, "layer_types": [_HF_TYPES[t] for t in layer_types(cfg)]}
