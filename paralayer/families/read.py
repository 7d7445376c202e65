"""config.json → our ModelConfig fields through the family its ``model_type`` names: torch-free,
so the resolver can take a model's shape from ``model.init=hf:PATH`` before any rank starts."""
from __future__ import annotations

import json
import os

from paralayer.families.common import read_config, seq_len_field, shared_fields
from paralayer.families.errors import HFFormatError
from paralayer.families.registry import ALIASES, MODEL_TYPES, REFUSED_TYPES, by_type, check_alias

#: ModelConfig keys only Gemma's family sets, with every other family's value
GEMMA_KEYS = {"embed_scale": False, "norm_offset": False, "post_norms": False, "mlp_act": "silu",
              "query_pre_attn_scalar": None, "rope_local_theta": None}
#: ModelConfig keys only GPT-OSS's family sets (model.*, model.moe.*), with every other family's value
OSS_KEYS = {"attn_bias": False, "attn_sinks": False}
OSS_MOE_KEYS = {"router_bias": False, "expert_bias": False, "swiglu_limit": None, "swiglu_alpha": 1.702}
#: ModelConfig keys only Qwen3-Next's family sets (model.linear is reset beside them)
NEXT_KEYS = {"attn_gate": False, "rotary_fraction": 1.0}


def load_hf_config(path: str) -> dict:
    """``config.json`` of a checkpoint of any family in families/ → ModelConfig fields (a dict;
    ``rope`` is a dict of RopeConfig fields; ``moe`` one of MoEConfig fields, present for the MoE
    families; ``mla`` one of MLAConfig fields for DeepSeek-V3). ``seq_len`` comes from
    ``max_position_embeddings``: use it only if the recipe did not give one. Any malformed
    setting raises HFFormatError naming the file and the setting."""
    hf = read_config(path)
    fp = os.path.join(path, "config.json")
    mtype = hf.get("model_type", "llama")
    fam = by_type(mtype)
    if fam is None:
        why = f"{REFUSED_TYPES[mtype]}; " if isinstance(mtype, str) and mtype in REFUSED_TYPES else ""
        aliases = ", ".join(f"{a} (as {m.NAME})" for a, m in ALIASES.items())
        raise HFFormatError(f"{fp}: model_type={json.dumps(mtype)[:40]} is not supported ({why}{', '.join(MODEL_TYPES)})"
                            + (f"; read as a family: {aliases}" if aliases else ""))
    check_alias(hf, fp)
    if hasattr(fam, "prepare"):  # the family's own spellings and defaults (registry.OPTIONAL)
        hf = fam.prepare(hf, fp)
    out = shared_fields(hf, fp)
    out.update(fam.read_attention(hf, fp, out["d_model"], out["n_heads"]))
    out.update(seq_len_field(hf, fp))
    out.update(fam.read_parts(hf, fp, out))
    return out


def apply_hf_config(model_cfg, path: str, keep_seq_len: bool = True) -> None:
    """Set the shape fields of a ModelConfig from ``path``/config.json, in place. ``seq_len`` is
    replaced by ``max_position_embeddings`` only when ``keep_seq_len`` is False."""
    from paralayer.config.schema import LinearConfig, MLAConfig, RopeConfig

    fields = load_hf_config(path)
    for keys in (GEMMA_KEYS, OSS_KEYS, NEXT_KEYS):  # a family that does not set them takes every other family's
        for key in keys:
            setattr(model_cfg, key, fields.pop(key, keys[key]))
    linear = fields.pop("linear", None)
    model_cfg.linear = LinearConfig(**linear) if linear is not None else LinearConfig()
    moe = fields.pop("moe", None)
    if moe is not None:
        moe = {**OSS_MOE_KEYS, **moe}
    mla = fields.pop("mla", None)
    model_cfg.mla = MLAConfig(**mla) if mla is not None else MLAConfig()
    model_cfg.rope = RopeConfig(**fields.pop("rope"))
    model_cfg.full_attention_every = 0
    seq = fields.pop("seq_len", None)
    for k, v in fields.items():
        setattr(model_cfg, k, v)
    if seq is not None and not keep_seq_len:
        model_cfg.seq_len = seq
    if moe is not None:
        model_cfg.moe.shared_gate = moe.pop("shared_gate", False)
        for k, v in moe.items():
            setattr(model_cfg.moe, k, v)
    else:
        model_cfg.moe.num_experts = 0
