"""Reading a Hugging Face config.json into our model fields — torch-free, so the resolver can
take a model's shape from ``model.init=hf:PATH`` before any rank starts."""
from __future__ import annotations

import json
import math
import os
from typing import Any

from paralayer.inputs.depth import MAX_JSON_BYTES, check_json_text
from paralayer.config.hf_errors import HFFormatError
from paralayer.config.hf_rope import read_rope




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
    return read_rope(hf, fp)[0]


MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3")
# transformers' class defaults where config.json may leave a key out (they differ per family)
_HEAD_DIM_DEFAULT = {"qwen3": 128, "qwen3_moe": 128}
_WINDOW_DEFAULT = {"mistral": 4096}
_HF_LAYER = {"full_attention": "full", "sliding_attention": "sliding"}


def _attention_fields(hf: dict, fp: str, mtype: str, d: int, heads: int) -> dict:
    """head_dim, qk_norm and the sliding window / layer pattern, as the family's class reads them."""
    out: dict[str, Any] = {"layer_types": None}
    hd = hf.get("head_dim")
    if hd is None:
        hd = _HEAD_DIM_DEFAULT.get(mtype, d // heads)
    hd = _int({"head_dim": hd}, "head_dim", fp)
    if hd % 2:
        raise HFFormatError(f"{fp}: head_dim={hd} must be even (RoPE rotates pairs)")
    out["head_dim"] = None if hd * heads == d else hd
    out["qk_norm"] = mtype in ("qwen3", "qwen3_moe")
    if mtype == "deepseek_v3":  # MLA: its widths are in model.mla; head_dim is the rope part's
        return {"layer_types": None, "head_dim": None, "qk_norm": False, "sliding_window": None}
    if mtype == "qwen3_moe":
        if hf.get("use_sliding_window", False):
            raise HFFormatError(f"{fp}: use_sliding_window=true is not supported for qwen3_moe (full attention only)")
        types = hf.get("layer_types")
        if types is not None and any(t != "full_attention" for t in types):
            raise HFFormatError(f"{fp}: layer_types={json.dumps(types)[:60]} is not supported for qwen3_moe "
                                f"(full attention only)")
        out.update(head_dim=None if hd * heads == d else hd, sliding_window=None)
        return out
    n = _int(hf, "num_hidden_layers", fp)
    window = hf.get("sliding_window", _WINDOW_DEFAULT.get(mtype))
    if mtype == "qwen3" and not hf.get("use_sliding_window", False):
        window = None  # Qwen3Config drops the window unless use_sliding_window
    if mtype == "llama":
        window = None  # LlamaForCausalLM reads no window
    types = hf.get("layer_types")
    if types is not None and mtype != "qwen3":
        raise HFFormatError(f"{fp}: layer_types is not supported for model_type {mtype} (qwen3 only)")
    if window is not None:
        window = _int({"sliding_window": window}, "sliding_window", fp)
    if mtype == "qwen3":
        if types is None:
            mwl = _int(hf, "max_window_layers", fp, 28, minimum=0)
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


def load_hf_config(path: str) -> dict:
    """``config.json`` of a Llama, Mistral, Mixtral or Qwen3 checkpoint → ModelConfig fields (a dict;
    ``rope`` is a dict of RopeConfig fields; ``moe`` one of MoEConfig fields, present for Mixtral). ``seq_len`` comes from
    ``max_position_embeddings``: use it only if the recipe did not give one. Any malformed
    setting raises HFFormatError naming the file and the setting."""
    hf = _read_config(path)
    fp = os.path.join(path, "config.json")
    mtype = hf.get("model_type", "llama")
    if mtype not in MODEL_TYPES:
        raise HFFormatError(f"{fp}: model_type={json.dumps(mtype)[:40]} is not supported ({', '.join(MODEL_TYPES)})")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFFormatError(f"{fp}: {key}=true is not supported (our layers have no biases)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise HFFormatError(f"{fp}: attention_dropout={json.dumps(hf['attention_dropout'])[:40]} is not supported "
                            "(0: our attention has no dropout)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{fp}: hidden_act {json.dumps(hf.get('hidden_act'))[:40]} is not supported (silu)")
    d, heads = _int(hf, "hidden_size", fp), _int(hf, "num_attention_heads", fp)
    theta, rope = read_rope(hf, fp)
    out: dict[str, Any] = {
        "d_model": d,
        "n_layers": _int(hf, "num_hidden_layers", fp),
        "n_heads": heads,
        "n_kv_heads": _int(hf, "num_key_value_heads", fp, heads) if hf.get("num_key_value_heads") is not None
        else heads,
        "ffn_hidden": _int(hf, "intermediate_size", fp),
        "vocab_size": _int(hf, "vocab_size", fp),
        "rope_theta": theta,
        "rope": rope,
        "norm_eps": _float(hf, "rms_norm_eps", fp, 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_attention_fields(hf, fp, mtype, d, heads),
    }
    if hf.get("max_position_embeddings"):
        out["seq_len"] = _int(hf, "max_position_embeddings", fp)
    if mtype == "qwen3_moe":
        out["moe"] = _qwen3_moe_fields(hf, fp, out["n_layers"])
    elif mtype == "deepseek_v3":
        out["moe"], out["mla"] = _deepseek_v3_fields(hf, fp, out["n_layers"])
    elif mtype == "mixtral" or hf.get("num_local_experts"):
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


def _deepseek_v3_fields(hf: dict, fp: str, n_layers: int) -> tuple[dict, dict]:
    """DeepSeek-V3's MoE (sigmoid router by groups, routed scaling, shared experts, the first
    ``first_k_dense_replace`` layers dense) and MLA widths. ``num_nextn_predict_layers`` (MTP) is
    checked (a whole number >= 0) but does not set model.mtp.depth: like Megatron's
    ``--mtp-num-layers`` that is the run's choice (the import reads the depths the safetensors
    carry, checkpoint/hf_moe.py), and a recipe's ``model.mtp.depth=0`` must not be overwritten."""
    _int(hf, "num_nextn_predict_layers", fp, 0, minimum=0)
    experts = _int(hf, "n_routed_experts", fp)
    ffn = _int(hf, "moe_intermediate_size", fp)
    n_group, topk_group = _int(hf, "n_group", fp, 1), _int(hf, "topk_group", fp, 1)
    if experts % n_group or topk_group > n_group:
        raise HFFormatError(f"{fp}: n_group={n_group}, topk_group={topk_group} must divide n_routed_experts="
                            f"{experts} and not exceed n_group")
    moe = {"num_experts": experts, "top_k": _int(hf, "num_experts_per_tok", fp, 8), "ffn_hidden": ffn,
           "aux_loss_coef": 0.0, "capacity_factor": None, "every": 1,
           "first_k_dense": _int(hf, "first_k_dense_replace", fp, 0, minimum=0), "router": "sigmoid",
           "shared_ffn_hidden": ffn * _int(hf, "n_shared_experts", fp, 0, minimum=0),
           "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "n_group": n_group, "topk_group": topk_group,
           "routed_scaling_factor": _float(hf, "routed_scaling_factor", fp, 1.0)}
    q_lora = hf.get("q_lora_rank")
    mla = {"q_lora_rank": None if q_lora is None else _int(hf, "q_lora_rank", fp),
           "kv_lora_rank": _int(hf, "kv_lora_rank", fp), "qk_nope_head_dim": _int(hf, "qk_nope_head_dim", fp),
           "qk_rope_head_dim": _int(hf, "qk_rope_head_dim", fp), "v_head_dim": _int(hf, "v_head_dim", fp)}
    if mla["qk_rope_head_dim"] % 2:
        raise HFFormatError(f"{fp}: qk_rope_head_dim={mla['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    return moe, mla


def _qwen3_moe_fields(hf: dict, fp: str, n_layers: int) -> dict:
    """Qwen3-MoE's experts: softmax top-k, ``norm_topk_prob`` as given (Qwen3MoeConfig's default
    false), no shared expert; its dense layers (``mlp_only_layers``, ``decoder_sparse_step``)
    become first_k_dense + every, which express exactly "the first k dense, then every s-th"."""
    step = _int(hf, "decoder_sparse_step", fp, 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise HFFormatError(f"{fp}: mlp_only_layers={json.dumps(only)[:60]} must be a list of layer indices")
    theirs = [i not in only and (i + 1) % step == 0 for i in range(n_layers)]
    first = next((k for k in range(n_layers + 1)
                  if [i >= k and (i + 1) % step == 0 for i in range(n_layers)] == theirs), None)
    if first is None:
        raise HFFormatError(f"{fp}: mlp_only_layers={json.dumps(only)[:60]} is not supported: only the first k "
                            f"layers may be dense (model.moe.first_k_dense), with decoder_sparse_step={step}")
    key = "num_experts" if "num_experts" in hf else "num_local_experts"  # transformers 5 writes the latter
    return {"num_experts": _int(hf, key, fp), "top_k": _int(hf, "num_experts_per_tok", fp, 8),
            "ffn_hidden": _int(hf, "moe_intermediate_size", fp),
            # transformers adds the router loss only with output_router_logits (off in its saved configs)
            "aux_loss_coef": _float(hf, "router_aux_loss_coef", fp, 0.001) if hf.get("output_router_logits") else 0.0,
            "capacity_factor": None,
            "every": step, "first_k_dense": first, "router": "softmax", "shared_ffn_hidden": 0,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0}


def apply_hf_config(model_cfg, path: str, keep_seq_len: bool = True) -> None:
    """Set the shape fields of a ModelConfig from ``path``/config.json, in place. ``seq_len`` is
    replaced by ``max_position_embeddings`` only when ``keep_seq_len`` is False."""
    fields = load_hf_config(path)
    moe = fields.pop("moe", None)
    mla = fields.pop("mla", None)
    from paralayer.config.schema import MLAConfig

    model_cfg.mla = MLAConfig(**mla) if mla is not None else MLAConfig()
    from paralayer.config.schema import RopeConfig

    model_cfg.rope = RopeConfig(**fields.pop("rope"))
    model_cfg.full_attention_every = 0
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
