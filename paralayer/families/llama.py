"""Llama (``LlamaForCausalLM``): the plain decoder every other family extends; its weight names
are the shared table (paralayer/families/names.py). Torch-free."""
from __future__ import annotations

from typing import Optional

from paralayer.families import mixtral
from paralayer.families.common import Traits, base_export, head_dim_field, uniform_window

NAME = "llama"
MODEL_TYPES = ("llama",)
HF_CLASS = "LlamaForCausalLM"
TINY_RECIPE = "tiny"
NAMES: dict = {}  # the shared table only
EXPERTS = None
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None  # rotate-half, as ours


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it (LlamaConfig.__post_init__: null or absent →
    hidden_size // num_attention_heads; LlamaAttention reads config.head_dim); no window (the class
    reads none, whatever sliding_window says)."""
    hd = hf.get("head_dim")
    return uniform_window(hf, fp, NAME, head_dim_field(d // heads if hd is None else hd, fp, d, heads), None)


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """No parts beyond the shared decoder; ``num_local_experts`` reads as Mixtral's experts (as
    before families/ existed: kept so that no import changes behaviour)."""
    return {"moe": mixtral.experts(hf, fp, out["ffn_hidden"])} if hf.get("num_local_experts") else {}


def claims(t: Traits) -> bool:
    """Export: no MLA, no experts, no q/k norms, every layer full."""
    return not (t.mla or t.moe or t.qk_norm or t.gemma or t.oss) and "sliding" not in t.kinds


def export_refusal(cfg, t: Traits) -> Optional[str]:
    return None


def export_config(cfg) -> dict:
    return {**base_export(cfg, HF_CLASS, NAME), "mlp_bias": False, "pretraining_tp": 1}
