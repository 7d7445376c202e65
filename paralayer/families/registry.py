"""The families we import and export, by config.json ``model_type``, and the one that expresses a
ModelConfig on export. Torch-free.

A family is one module of this package; what it must define is :data:`REQUIRED` (checked when the
package is imported, so a module missing a piece fails at once, naming it). A module may also
define ``ALIASES``: {model_type: what it is} for the other model_type values whose config.json
names the family's own class in ``architectures`` (Kimi K2's ``kimi_k2`` is DeepSeek-V3's class), or
the class ``ALIAS_CLASSES`` gives for it (Qwen3.5's vision-language wrapper ``qwen3_5`` names
Qwen3_5ForConditionalGeneration, and is read for its text model); they are read as the family,
refused when ``architectures`` names another class, never exported."""
from __future__ import annotations

import json
from types import ModuleType
from typing import Any, Optional

from paralayer.families import deepseek_v3, gemma3, gpt_oss, llama, mistral, mixtral, qwen3, qwen3_moe, qwen3_next
from paralayer.families.common import traits
from paralayer.families.errors import HFFormatError
from paralayer.families.qwen3_5 import moe as qwen3_5_moe
from paralayer.families.qwen3_5 import text as qwen3_5_text

#: What each family module defines (name → what it is).
REQUIRED = {
    "NAME": "its name (= its first model_type)",
    "MODEL_TYPES": "the config.json model_type values it reads",
    "HF_CLASS": "the transformers class its export loads as",
    "TINY_RECIPE": "the recipes/*.yaml that exercises it on a CPU, or None (say why beside it)",
    "NAMES": "what it adds to the shared weight-name table (families/names.py): ours → theirs",
    "EXPERTS": "its experts' names (common.ExpertNames), or None for a dense family",
    "MTP_AS_LAYERS": "whether its MTP depths are stored as decoder layers n_layers+k",
    "rope_rows": "import: config.json → rows to reorder into rotate-half, or None",
    "export_rope_rows": "export: ModelConfig → the same rows, or None",
    "read_attention": "(hf, fp, d, heads) → layer_types, head_dim, qk_norm, sliding_window",
    "read_parts": "(hf, fp, fields) → its further parts (moe, mla), or {}",
    "claims": "(Traits) → True when it is the family that expresses the config on export",
    "export_refusal": "(cfg, Traits) → why a config it claims exports as no family, or None",
    "export_config": "(cfg) → its keys of config.json (raises HFFormatError for what it cannot say)",
}

#: What a family module may define besides :data:`REQUIRED`.
OPTIONAL = {
    "prepare": "(hf, fp) → config.json as the shared reader takes it (its own spellings and defaults)",
    "RENAMES": "ours → theirs where it names a weight unlike the shared table (for this family only)",
    "REFUSED": "model_type → why (a related model_type it names and refuses)",
    "FUSED_EXPERTS": "its experts' keys when stored fused for all experts of a layer (checkpoint/hf_fused.py)",
    "ALIAS_CLASSES": "alias model_type → the class its config.json names, when not the family's own",
    "SPLIT_PROJ": "True when its linear layers store in_proj_qkv / _z / _b / _a split (checkpoint/hf_split.py)",
    "TEXT_PREFIX": "model_type → where that wrapper's checkpoints keep the text model's model. (hf_split.py)",
}

_MODULES = (llama, mistral, mixtral, qwen3, qwen3_moe, deepseek_v3, gemma3, gpt_oss, qwen3_next, qwen3_5_text,
            qwen3_5_moe)


def check_family(mod: ModuleType) -> None:
    """Raise ValueError naming the first piece of :data:`REQUIRED` that ``mod`` lacks."""
    for key, what in REQUIRED.items():
        if not hasattr(mod, key):
            raise ValueError(f"{mod.__name__}: family module lacks {key} ({what})")
    if mod.NAME != mod.MODEL_TYPES[0]:
        raise ValueError(f"{mod.__name__}: NAME={mod.NAME!r} must be its first model_type {mod.MODEL_TYPES}")


def _build(modules: tuple, aliases: bool = False) -> dict[str, ModuleType]:
    """model_type → module over ``modules``' MODEL_TYPES (or, with ``aliases``, their ALIASES)."""
    out: dict[str, ModuleType] = {}
    for mod in modules:
        if not aliases:
            check_family(mod)
        for t in (getattr(mod, "ALIASES", {}) if aliases else mod.MODEL_TYPES):
            if t in out:
                raise ValueError(f"model_type {t!r} is claimed by {out[t].__name__} and {mod.__name__}")
            out[t] = mod
    return out


#: model_type → family module, in the order the refusals list them.
FAMILIES: dict[str, ModuleType] = _build(_MODULES)
MODEL_TYPES = tuple(FAMILIES)
#: model_type → why it is refused (the families' REFUSED)
REFUSED_TYPES: dict[str, str] = {t: why for m in _MODULES for t, why in getattr(m, "REFUSED", {}).items()}
#: another model_type → the family whose class its config.json names (read only, never exported).
ALIASES: dict[str, ModuleType] = _build(_MODULES, aliases=True)
if set(ALIASES) & set(FAMILIES):
    raise ValueError(f"model_type {sorted(set(ALIASES) & set(FAMILIES))} is both a family and an alias")


def by_type(model_type: Any) -> Optional[ModuleType]:
    """The family reading config.json's ``model_type`` (any JSON value; an alias too), or None."""
    if not isinstance(model_type, str):
        return None
    return FAMILIES.get(model_type) or ALIASES.get(model_type)


def check_alias(hf: dict, fp: str) -> None:
    """An alias model_type is read as its family only when ``architectures`` (if given) names the
    family's class: HFFormatError naming both otherwise."""
    mtype, archs = hf.get("model_type"), hf.get("architectures")
    fam = ALIASES.get(mtype) if isinstance(mtype, str) else None
    cls = getattr(fam, "ALIAS_CLASSES", {}).get(mtype, getattr(fam, "HF_CLASS", None))
    if fam is not None and archs is not None and archs != [cls]:
        raise HFFormatError(f"{fp}: model_type {mtype} is read as {fam.NAME} only when architectures is "
                            f"[{cls!r}], got {json.dumps(archs)[:80]}")


def family(name: str) -> ModuleType:
    """The family module called ``name`` (KeyError naming the known ones)."""
    if name not in FAMILIES:
        raise KeyError(f"{name!r}: not a family ({', '.join(MODEL_TYPES)})")
    return FAMILIES[name]


def family_for_config(cfg) -> ModuleType:
    """The family whose config.json expresses ``cfg`` (a ModelConfig) exactly, for export: the one
    family that claims its traits; HFFormatError (naming the key) when that family cannot."""
    t = traits(cfg)
    claimed = [m for m in _MODULES if m.claims(t)]
    if len(claimed) != 1:  # the claims partition every config: a new family must keep them so
        raise AssertionError(f"{t}: claimed by {[m.NAME for m in claimed]}, not by exactly one family")
    why = claimed[0].export_refusal(cfg, t)
    if why:
        raise HFFormatError(why)
    return claimed[0]
