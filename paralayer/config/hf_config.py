"""Reading a Hugging Face config.json into our model fields — torch-free, so the resolver can
take a model's shape from ``model.init=hf:PATH`` before any rank starts."""
from __future__ import annotations

import json
import os
from typing import Any


class HFFormatError(ValueError):
    """A Hugging Face checkpoint we cannot represent or read; the message names the file/field."""


# ------------------------------------------------------------------ config
def _read_config(path: str) -> dict:
    fp = os.path.join(path, "config.json")
    if not os.path.isfile(fp):
        raise HFFormatError(f"{fp}: not found (model.init=hf:PATH needs a Hugging Face directory)")
    with open(fp) as f:
        return json.load(f)


def _rope_theta(hf: dict, fp: str) -> float:
    rp = hf.get("rope_parameters") or {}
    rs = hf.get("rope_scaling") or {}
    rtype = rp.get("rope_type") or rp.get("type") or rs.get("rope_type") or rs.get("type") or "default"
    if rtype != "default":
        raise HFFormatError(f"{fp}: rope type '{rtype}' is not supported (only the default RoPE)")
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def load_hf_config(path: str) -> dict:
    """``config.json`` of a Llama or Mixtral checkpoint → ModelConfig fields (a dict; ``moe`` is a
    dict of MoEConfig fields, present for Mixtral). ``seq_len`` comes from
    ``max_position_embeddings``: use it only if the recipe did not give one."""
    hf = _read_config(path)
    fp = os.path.join(path, "config.json")
    mtype = hf.get("model_type", "llama")
    if mtype not in ("llama", "mixtral", "mistral"):
        raise HFFormatError(f"{fp}: model_type '{mtype}' is not supported (llama, mistral, mixtral)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFFormatError(f"{fp}: {key}=true is not supported (our layers have no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{fp}: hidden_act '{hf.get('hidden_act')}' is not supported (silu)")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim not in (None, d // heads):
        raise HFFormatError(f"{fp}: head_dim={head_dim} differs from hidden_size/num_attention_heads={d // heads}")
    out: dict[str, Any] = {
        "d_model": d,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "ffn_hidden": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "rope_theta": _rope_theta(hf, fp),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    if hf.get("max_position_embeddings"):
        out["seq_len"] = int(hf["max_position_embeddings"])
    if mtype == "mixtral" or hf.get("num_local_experts"):
        out["moe"] = {
            "num_experts": int(hf["num_local_experts"]),
            "top_k": int(hf.get("num_experts_per_tok", 2)),
            "ffn_hidden": int(hf["intermediate_size"]),
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.01)),
            "capacity_factor": None,
            "every": 1,
            "router": "softmax",
            "shared_ffn_hidden": 0,
        }
    return out


def apply_hf_config(model_cfg, path: str, keep_seq_len: bool = True) -> None:
    """Set the shape fields of a ModelConfig from ``path``/config.json, in place. ``seq_len`` is
    replaced by ``max_position_embeddings`` only when ``keep_seq_len`` is False."""
    fields = load_hf_config(path)
    moe = fields.pop("moe", None)
    seq = fields.pop("seq_len", None)
    for k, v in fields.items():
        setattr(model_cfg, k, v)
    if seq is not None and not keep_seq_len:
        model_cfg.seq_len = seq
    if moe is not None:
        for k, v in moe.items():
            setattr(model_cfg.moe, k, v)
    else:
        model_cfg.moe.num_experts = 0
