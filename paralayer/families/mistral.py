"""Mistral (``MistralForCausalLM``): Llama's block and names with one sliding window for every
layer. Torch-free."""
from __future__ import annotations

from typing import Optional

from paralayer.families import mixtral
from paralayer.families.common import Traits, base_export, head_dim_field, uniform_window, window_of

NAME = "mistral"
MODEL_TYPES = ("mistral",)
HF_CLASS = "MistralForCausalLM"
TINY_RECIPE = "tiny-mistral"
NAMES: dict = {}  # the shared table only
EXPERTS = None
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None
WINDOW_DEFAULT = 4096  # MistralConfig's sliding_window when config.json leaves it out


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it (MistralAttention: ``config.head_dim or
    hidden_size // num_attention_heads``: absent, null and 0 all give the quotient); the window
    for every layer (absent: 4096)."""
    hd = hf.get("head_dim") or d // heads
    return uniform_window(hf, fp, NAME, head_dim_field(hd, fp, d, heads), hf.get("sliding_window", WINDOW_DEFAULT))


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """No parts beyond Llama's; ``num_local_experts`` reads as Mixtral's experts (as before)."""
    return {"moe": mixtral.experts(hf, fp, out["ffn_hidden"])} if hf.get("num_local_experts") else {}


def claims(t: Traits) -> bool:
    """Export: no MLA, no experts, no q/k norms, some layer slides."""
    return not (t.mla or t.moe or t.qk_norm or t.gemma or t.oss) and "sliding" in t.kinds


def export_refusal(cfg, t: Traits) -> Optional[str]:
    if t.kinds == {"full", "sliding"}:
        return ("model.layer_types: an interleaved window without model.qk_norm exports as no "
                "family (qwen3 has q/k norms; mistral one window for every layer)")
    return None


def export_config(cfg) -> dict:
    return {**base_export(cfg, HF_CLASS, NAME), "sliding_window": window_of(cfg)}
