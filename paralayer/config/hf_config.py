"""Reading a Hugging Face config.json into our model fields — torch-free, so the resolver can
take a model's shape from ``model.init=hf:PATH`` before any rank starts."""
from __future__ import annotations

import json
import math
import os
from typing import Any

from paralayer.config.depth import MAX_JSON_BYTES, check_json_text


class HFFormatError(ValueError):
    """A Hugging Face checkpoint we cannot represent or read; the message names the file/field."""


# ------------------------------------------------------------------ config
def _read_config(path: str) -> dict:
    fp = os.path.join(path, "config.json")
    try:
        if not os.path.isfile(fp):
            raise HFFormatError(f"{fp}: not found (model.init=hf:PATH needs a Hugging Face directory)")
        if os.path.getsize(fp) > MAX_JSON_BYTES:
            raise HFFormatError(f"{fp}: {os.path.getsize(fp):,} bytes; at most {MAX_JSON_BYTES:,}")
        with open(fp, encoding="utf-8") as f:
            text = f.read()
        problem = check_json_text(text, fp)  # before json's recursive decoder sees it
        if problem:
            raise HFFormatError(problem)
        hf = json.loads(text)
    except HFFormatError:
        raise
    except json.JSONDecodeError as exc:
        raise HFFormatError(f"{fp}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise HFFormatError(f"{fp}: cannot be read ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(hf, dict):
        raise HFFormatError(f"{fp}: must hold a JSON object of settings, not a {type(hf).__name__}")
    return hf


_MISSING = object()


def _int(hf: dict, key: str, fp: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """An integer setting of config.json: present (or defaulted), a whole number, >= minimum."""
    v = hf.get(key, default)
    if v is _MISSING:
        raise HFFormatError(f"{fp}: '{key}' is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise HFFormatError(f"{fp}: '{key}' must be a whole number, got {json.dumps(v)[:40]}")
    v = int(v)
    if v < minimum:
        raise HFFormatError(f"{fp}: '{key}' must be >= {minimum}, got {v}")
    return v


def _float(hf: dict, key: str, fp: str, default: float) -> float:
    v = hf.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise HFFormatError(f"{fp}: '{key}' must be a finite number, got {json.dumps(v)[:40]}")
    return float(v)


def _rope_theta(hf: dict, fp: str) -> float:
    rp = hf.get("rope_parameters") or {}
    rs = hf.get("rope_scaling") or {}
    for key, val in (("rope_parameters", rp), ("rope_scaling", rs)):
        if not isinstance(val, dict):
            raise HFFormatError(f"{fp}: '{key}' must be an object (or null), got {json.dumps(val)[:40]}")
    rtype = rp.get("rope_type") or rp.get("type") or rs.get("rope_type") or rs.get("type") or "default"
    if rtype != "default":
        raise HFFormatError(f"{fp}: rope type '{rtype}' is not supported (only the default RoPE)")
    theta = _float(rp if "rope_theta" in rp else hf, "rope_theta", fp, 10000.0)
    if theta <= 0:
        raise HFFormatError(f"{fp}: 'rope_theta' must be > 0, got {theta}")
    return theta


def load_hf_config(path: str) -> dict:
    """``config.json`` of a Llama or Mixtral checkpoint → ModelConfig fields (a dict; ``moe`` is a
    dict of MoEConfig fields, present for Mixtral). ``seq_len`` comes from
    ``max_position_embeddings``: use it only if the recipe did not give one. Any malformed
    setting raises HFFormatError naming the file and the setting."""
    hf = _read_config(path)
    fp = os.path.join(path, "config.json")
    mtype = hf.get("model_type", "llama")
    if mtype not in ("llama", "mixtral", "mistral"):
        raise HFFormatError(f"{fp}: model_type {json.dumps(mtype)[:40]} is not supported (llama, mistral, mixtral)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFFormatError(f"{fp}: {key}=true is not supported (our layers have no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{fp}: hidden_act {json.dumps(hf.get('hidden_act'))[:40]} is not supported (silu)")
    d, heads = _int(hf, "hidden_size", fp), _int(hf, "num_attention_heads", fp)
    head_dim = hf.get("head_dim")
    if head_dim is not None and (isinstance(head_dim, bool) or head_dim != d // heads):
        raise HFFormatError(f"{fp}: head_dim={json.dumps(head_dim)[:40]} differs from "
                            f"hidden_size/num_attention_heads={d // heads}")
    out: dict[str, Any] = {
        "d_model": d,
        "n_layers": _int(hf, "num_hidden_layers", fp),
        "n_heads": heads,
        "n_kv_heads": _int(hf, "num_key_value_heads", fp, heads) if hf.get("num_key_value_heads") is not None
        else heads,
        "ffn_hidden": _int(hf, "intermediate_size", fp),
        "vocab_size": _int(hf, "vocab_size", fp),
        "rope_theta": _rope_theta(hf, fp),
        "norm_eps": _float(hf, "rms_norm_eps", fp, 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    if hf.get("max_position_embeddings"):
        out["seq_len"] = _int(hf, "max_position_embeddings", fp)
    if mtype == "mixtral" or hf.get("num_local_experts"):
        out["moe"] = {
            "num_experts": _int(hf, "num_local_experts", fp),
            "top_k": _int(hf, "num_experts_per_tok", fp, 2),
            "ffn_hidden": out["ffn_hidden"],
            "aux_loss_coef": _float(hf, "router_aux_loss_coef", fp, 0.01),
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
