"""Qwen3.5 dense (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``; its vision-language wrapper
``qwen3_5`` read for its text tower): Qwen3-Next's layers with a dense MLP on every layer and the
linear layers' projections stored split (paralayer/families/qwen3_5/). Torch-free."""
from __future__ import annotations

from typing import Optional

from paralayer.families import qwen3_next
from paralayer.families.common import Traits
from paralayer.families.qwen3_5 import text_config

NAME = "qwen3_5_text"
MODEL_TYPES = ("qwen3_5_text",)
#: its vision-language wrapper, read for its text model (checkpoint/hf_split.py reads its text tower)
ALIASES = {"qwen3_5": "the vision-language Qwen3_5ForConditionalGeneration: its text tower"}
ALIAS_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration"}
HF_CLASS = "Qwen3_5ForCausalLM"
TINY_RECIPE = "tiny-qwen3.5"
#: the linear layers' names but the two fused projections (checkpoint/hf_split.py writes theirs)
SPLIT = ("attention.in_proj_qkvz.weight", "attention.in_proj_ba.weight")
NAMES = {k: v for k, v in qwen3_next.NAMES.items() if k not in SPLIT}
EXPERTS = None
MTP_AS_LAYERS = False  # its MTP block (mtp.*) is not read: Qwen3_5ForCausalLM ignores it too
rope_rows = export_rope_rows = None
SPLIT_PROJ = True
TEXT_PREFIX = {"qwen3_5": text_config.TEXT_PREFIX}
#: what Qwen3_5ForCausalLM ignores, with what it builds instead
IGNORED = {"num_experts": 0}
read_attention = qwen3_next.read_attention


def prepare(hf: dict, fp: str) -> dict:
    return text_config.prepare(hf, fp, NAME, text_config.DENSE_DEFAULTS, IGNORED, HF_CLASS)


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """Qwen3-Next's parts (no experts), the projections split."""
    parts = qwen3_next.read_parts(hf, fp, out)
    return {**parts, "linear": {**parts["linear"], "proj": "split"}}


def claims(t: Traits) -> bool:
    """Export: linear layers with split projections, dense."""
    return t.linear and t.split and not t.oss and not t.moe


def export_refusal(cfg, t: Traits) -> Optional[str]:
    return qwen3_next.linear_refusal(cfg, t, NAME)


def export_config(cfg) -> dict:
    """Qwen3_5TextConfig's keys (the MRoPE sections left to its default: text positions reduce
    them to plain partial RoPE whatever they are)."""
    return qwen3_next.linear_export(cfg, HF_CLASS, NAME)
