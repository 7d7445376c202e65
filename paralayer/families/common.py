"""What every family shares when reading config.json (the file, its typed settings, the keys every
decoder has, the refusals that hold for all) and when writing it back: torch-free.

A family module (``paralayer/families/<name>.py``) adds only what its transformers class reads
differently; these helpers keep the shared messages identical across families."""
from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple, Optional

from paralayer.config.layer_pattern import layer_types
from paralayer.families.errors import HFFormatError
from paralayer.families.rope import read_rope
from paralayer.inputs.depth import MAX_JSON_BYTES, check_json_text


# ------------------------------------------------------------------ reading config.json
def read_config(path: str) -> dict:
    """``path``/config.json as a dict; bounded in size and depth before json's decoder sees it."""
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


def int_key(hf: dict, key: str, fp: str, default: Any = _MISSING, minimum: int = 1) -> int:
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


def float_key(hf: dict, key: str, fp: str, default: float) -> float:
    """A finite number setting of config.json (null or absent: ``default``)."""
    v = hf.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise HFFormatError(f"{fp}: '{key}' must be a finite number, got {json.dumps(v)[:40]}")
    return float(v)


def shared_fields(hf: dict, fp: str) -> dict:
    """The keys every family's decoder has (widths, vocab, RoPE, norm eps, tied embeddings), after
    the refusals that hold for every family (biases, attention dropout, an activation not silu)."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFFormatError(f"{fp}: {key}=true is not supported (our layers have no biases)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise HFFormatError(f"{fp}: attention_dropout={json.dumps(hf['attention_dropout'])[:40]} is not supported "
                            "(0: our attention has no dropout)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{fp}: hidden_act {json.dumps(hf.get('hidden_act'))[:40]} is not supported (silu)")
    d, heads = int_key(hf, "hidden_size", fp), int_key(hf, "num_attention_heads", fp)
    theta, rope = read_rope(hf, fp)
    return {
        "d_model": d,
        "n_layers": int_key(hf, "num_hidden_layers", fp),
        "n_heads": heads,
        "n_kv_heads": int_key(hf, "num_key_value_heads", fp, heads) if hf.get("num_key_value_heads") is not None
        else heads,
        "ffn_hidden": int_key(hf, "intermediate_size", fp),
        "vocab_size": int_key(hf, "vocab_size", fp),
        "rope_theta": theta,
        "rope": rope,
        "norm_eps": float_key(hf, "rms_norm_eps", fp, 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def seq_len_field(hf: dict, fp: str) -> dict:
    """``seq_len`` from ``max_position_embeddings`` when given (the recipe's wins unless asked)."""
    return {"seq_len": int_key(hf, "max_position_embeddings", fp)} if hf.get("max_position_embeddings") else {}


def head_dim_field(hd: Any, fp: str, d: int, heads: int) -> Optional[int]:
    """Our ``model.head_dim`` from the head width the family's class uses (``hd``, as that family
    derives it): a whole even number; None when it is d_model / n_heads."""
    hd = int_key({"head_dim": hd}, "head_dim", fp)
    if hd % 2:
        raise HFFormatError(f"{fp}: head_dim={hd} must be even (RoPE rotates pairs)")
    return None if hd * heads == d else hd


def uniform_window(hf: dict, fp: str, mtype: str, head_dim: Optional[int], window: Any) -> dict:
    """The attention fields of a family with one window for every layer (or none): no q/k norms,
    and no ``layer_types`` (refused: only Qwen3 reads a per-layer pattern)."""
    if hf.get("layer_types") is not None:
        raise HFFormatError(f"{fp}: layer_types is not supported for model_type {mtype} (qwen3 only)")
    if window is not None:
        window = int_key({"sliding_window": window}, "sliding_window", fp)
    return {"layer_types": None, "head_dim": head_dim, "qk_norm": False, "sliding_window": window}


def periodic_layer_types(hf: dict, fp: str, key: str, default: int, periodic: str, known: dict) -> list:
    """config.json's ``layer_types`` (each one of ``known``), else every ``key``-th layer (1-based)
    "full_attention" and the rest ``periodic`` (Gemma 3's sliding_window_pattern, Qwen3-Next's
    full_attention_interval): one of their types per layer, as transformers derives them."""
    n = int_key(hf, "num_hidden_layers", fp)
    types = hf.get("layer_types")
    if types is None:
        k = int_key(hf, key, fp, default)
        types = [periodic if (i + 1) % k else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in known for t in types):
        raise HFFormatError(f"{fp}: layer_types={json.dumps(types)[:60]} must list {n} of {', '.join(known)}")
    return types


# ------------------------------------------------------------------ weight names
class ExpertNames(NamedTuple):
    """A MoE family's names under ``model.layers.{i}.``: its router, one expert's weight
    (``{j}`` the expert, ``{w}`` its name in ``w``: ours w1 | w3 | w2 → theirs) and, when it
    has one, the router's selection bias."""
    router: str
    expert: str
    w: dict
    bias: Optional[str] = None


# ------------------------------------------------------------------ export
class Traits(NamedTuple):
    """What decides which family expresses a ModelConfig on export."""
    mla: bool
    moe: bool
    qk_norm: bool
    kinds: frozenset  # the layer kinds present: "full", "sliding"
    gemma: bool = False  # any of Gemma's parts (families/gemma3.py), or linear layers (below)
    oss: bool = False  # any of GPT-OSS's parts (families/gpt_oss.py)
    linear: bool = False  # Gated DeltaNet layers (families/qwen3_next.py): its (1 + w) norms are Gemma's, so
    # gemma is set too, and the families of plain parts (which claim "not gemma") claim none of them
    split: bool = False  # linear layers with Qwen3.5's split projections (model.linear.proj, families/qwen3_5/)


def traits(cfg) -> Traits:
    """``cfg`` (a ModelConfig) as the few facts the families claim it by."""
    gemma = bool(cfg.embed_scale or cfg.norm_offset or cfg.post_norms or cfg.mlp_act != "silu"
                 or cfg.query_pre_attn_scalar is not None or cfg.rope_local_theta is not None)
    m = cfg.moe
    oss = bool(cfg.attn_bias or cfg.attn_sinks or m.router_bias or m.expert_bias or m.swiglu_limit is not None)
    kinds = frozenset(layer_types(cfg))
    linear = "linear" in kinds
    return Traits(cfg.mla.kv_lora_rank > 0, cfg.moe.num_experts > 0, bool(cfg.qk_norm), kinds, gemma or linear,
                  oss, linear, linear and cfg.linear.proj == "split")


def window_of(cfg) -> Optional[int]:
    """The window config.json writes: ``model.sliding_window`` when some layer slides, else None."""
    return cfg.sliding_window if "sliding" in layer_types(cfg) else None


def base_export(cfg, hf_class: str, model_type: str) -> dict:
    """The keys every family's config.json opens with besides the shared shape."""
    return {"architectures": [hf_class], "model_type": model_type, "intermediate_size": cfg.ffn_hidden}
