"""The model families, one module each (llama, mistral, mixtral, qwen3, qwen3_moe, deepseek_v3, gemma3,
gpt_oss, qwen3_next; Qwen3.5's two in the sub-package qwen3_5/):
what a family is — config.json → our keys (and what is refused), its Hugging Face weight names both
ways, its layer pattern, its export — in one place. Torch-free.

The registry (registry.py) maps config.json's ``model_type`` to its module and picks the family
that expresses a ModelConfig on export; read.py reads config.json through it; names.py holds the
shared weight-name table the families add to. Adding a family: one module here defining
:data:`registry.REQUIRED`, listed in registry.py, plus any new part in paralayer/model/."""
from __future__ import annotations

from paralayer.families.errors import HFFormatError
from paralayer.families.read import apply_hf_config, load_hf_config
from paralayer.families.registry import FAMILIES, MODEL_TYPES, by_type, family, family_for_config

__all__ = ["FAMILIES", "MODEL_TYPES", "HFFormatError", "apply_hf_config", "by_type", "family",
           "family_for_config", "load_hf_config"]
