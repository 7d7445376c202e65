"""Gemma 3, text (``Gemma3ForCausalLM``, config ``Gemma3TextConfig``, model_type ``gemma3_text``):
Qwen3's attention (free head_dim, per-head q/k norms before RoPE, a window per layer) with Gemma's
own parts, each a ModelConfig key (transformers 5.25, models/gemma3/modeling_gemma3.py):

    embedding × sqrt(hidden_size), the factor cast to the embedding's dtype   model.embed_scale
    RMSNorm with gain (1 + w), in fp32 (every norm, q/k norms included)        model.norm_offset
    norms after attention and after the MLP too (4 per block)                 model.post_norms
    GeGLU: gelu_pytorch_tanh(gate) * up                                       model.mlp_act=gelu_tanh
    softmax scale query_pre_attn_scalar^-0.5 (not head_dim^-0.5)              model.query_pre_attn_scalar
    5 sliding : 1 full (sliding_window_pattern 6, or layer_types)            model.layer_types
    the sliding layers' own plain RoPE (rope_local_base_freq, 10 000), the
    full layers' rope_theta (1 000 000) with rope_scaling (linear ×8 in 4B+)  model.rope_local_theta, model.rope

Refused by name: ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2's; null in every
Gemma 3 config: not built), ``use_bidirectional_attention`` (EmbeddingGemma), a sliding layer RoPE
that is not plain, and the multimodal ``gemma3`` config (its text tower's weights sit under
``model.language_model.``; import a text-only ``gemma3_text`` checkpoint).

Gemma 4 (transformers 5.25 ``models/gemma4``, model_type ``gemma4`` / ``gemma4_text``) is refused by
name: its block differs in parts we do not build (configuration_gemma4.py, modeling_gemma4.py) —
a second, per-layer input embedding added inside every block (``hidden_size_per_layer_input``,
``vocab_size_per_layer_input``); full layers with their own head width and K/V heads
(``global_head_dim`` 512, ``num_global_key_value_heads``) and K = V (``attention_k_eq_v``); the last
``num_kv_shared_layers`` layers reusing earlier layers' K/V; a "proportional" RoPE on a quarter of the
full layers' head (``partial_rotary_factor`` 0.25); attention scaling 1.0 (the q/k norms set the
scale; no query_pre_attn_scalar), a gain-less RMSNorm on v, norm gains w (not 1 + w); a per-layer
output scale (``layer_scalar``); double-wide MLPs on the KV-shared layers (``use_double_wide_mlp``);
and experts beside the dense MLP (``enable_moe_block``, 26B-A4B).
Torch-free."""
from __future__ import annotations

import json
from typing import Optional

from paralayer.config.layer_pattern import layer_types
from paralayer.families.common import Traits, base_export, head_dim_field, int_key, periodic_layer_types
from paralayer.families.errors import HFFormatError
from paralayer.families.rope import rope_parameters

NAME = "gemma3_text"
MODEL_TYPES = ("gemma3_text",)
HF_CLASS = "Gemma3ForCausalLM"
TINY_RECIPE = "tiny-gemma3"
#: added to the shared table (no other family has them)
NAMES = {"post_ffn_norm.weight": "post_feedforward_layernorm.weight"}
#: what Gemma names differently from the shared table, for this family only (names.ours_to_hf):
#: its ``post_attention_layernorm`` is the norm AFTER attention, not the one before the MLP
RENAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
           "post_attention_norm.weight": "post_attention_layernorm.weight"}
EXPERTS = None
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None  # rotate-half, as ours
# Gemma3TextConfig's defaults (transformers 5.25) where config.json leaves a key out
HEAD_DIM_DEFAULT, WINDOW_DEFAULT, PATTERN_DEFAULT, QPAS_DEFAULT = 256, 4096, 6, 256
THETA_GLOBAL, THETA_LOCAL = 1_000_000.0, 10_000.0
ACT = "gelu_pytorch_tanh"
_HF_LAYER = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_TYPES = {v: k for k, v in _HF_LAYER.items()}
#: Gemma 4's model_types, refused by name (read.py asks REFUSED before the registry's list)
REFUSED = {"gemma4": "Gemma 4 (per-layer input embeddings, K=V global layers, KV sharing, partial RoPE: "
                     "not built; see paralayer/families/gemma3.py)",
           "gemma4_text": "Gemma 4 (per-layer input embeddings, K=V global layers, KV sharing, partial RoPE: "
                          "not built; see paralayer/families/gemma3.py)",
           "gemma3": "the multimodal Gemma 3 (its text tower under model.language_model.: import a "
                     "gemma3_text checkpoint)",
           "gemma2": "Gemma 2 (attention and final logit softcapping: not built)"}


def _rope_dicts(hf: dict, fp: str) -> tuple[dict, dict]:
    """(full layers' rope dict with its rope_theta, sliding layers' one) from either spelling:
    transformers 5's nested ``rope_parameters`` or 4's rope_theta + rope_scaling + rope_local_base_freq."""
    rp = hf.get("rope_parameters")
    if rp is not None and not isinstance(rp, dict):
        raise HFFormatError(f"{fp}: 'rope_parameters' must be an object (or null), got {json.dumps(rp)[:40]}")
    rp = rp or {}
    if any(isinstance(v, dict) for v in rp.values()):
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        other = sorted(set(rp) - {"full_attention", "sliding_attention"})
        if other or not isinstance(full, dict) or not isinstance(local, dict):
            raise HFFormatError(f"{fp}: rope_parameters must hold full_attention and sliding_attention "
                                f"(got {', '.join(sorted(rp))})")
    else:
        full = {**(hf.get("rope_scaling") or {}), **rp}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", THETA_LOCAL)}
    full = {"rope_type": "default", **full}
    full.setdefault("rope_theta", hf.get("rope_theta", THETA_GLOBAL))
    local = {"rope_type": "default", **local}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", THETA_LOCAL))
    return full, local


def prepare(hf: dict, fp: str) -> dict:
    """config.json as the shared reader takes it: the full layers' RoPE flattened into
    ``rope_parameters``, the sliding layers' base kept aside, Gemma's activation and class defaults
    (tied embeddings, 4 K/V heads) read here; what we do not build refused, naming the key."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise HFFormatError(f"{fp}: {key}={json.dumps(hf[key])[:40]} is not supported (null: softcapping is "
                                "not built)")
    if hf.get("use_bidirectional_attention"):
        raise HFFormatError(f"{fp}: use_bidirectional_attention=true is not supported (false: causal)")
    for key in ("hidden_activation", "hidden_act"):
        if key in hf and hf[key] != ACT:
            raise HFFormatError(f"{fp}: {key}={json.dumps(hf[key])[:40]} is not supported ({ACT})")
    full, local = _rope_dicts(hf, fp)
    if local != full and (set(local) - {"rope_type", "rope_theta"} or local["rope_type"] != "default"):
        raise HFFormatError(f"{fp}: rope_parameters.sliding_attention={json.dumps(local)[:80]} is not supported "
                            "(a plain RoPE: rope_type default with its rope_theta, or the full layers' own)")
    out = {k: v for k, v in hf.items() if k not in ("hidden_activation", "hidden_act", "rope_scaling")}
    out["rope_parameters"] = full
    out["_local_rope"] = None if local == full else local["rope_theta"]
    out.setdefault("tie_word_embeddings", True)
    out.setdefault("num_key_value_heads", 4)
    return out


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it (Gemma3TextConfig ``head_dim: int = 256``, read by
    Gemma3Attention whatever hidden_size / heads is); q/k norms; the window per layer from
    ``layer_types``, else ``sliding_window_pattern`` (6: layer i full when (i + 1) % 6 == 0)."""
    types = periodic_layer_types(hf, fp, "sliding_window_pattern", PATTERN_DEFAULT, "sliding_attention", _HF_LAYER)
    ours = [_HF_LAYER[t] for t in types]
    window = None
    if "sliding" in ours:
        if hf.get("sliding_window", WINDOW_DEFAULT) is None:
            raise HFFormatError(f"{fp}: sliding_window=null with sliding layers in layer_types (a whole number)")
        window = int_key(hf, "sliding_window", fp, WINDOW_DEFAULT)
    hd = head_dim_field(hf.get("head_dim", HEAD_DIM_DEFAULT), fp, d, heads)
    return {"layer_types": ours if window is not None else None, "head_dim": hd, "qk_norm": True,
            "sliding_window": window}


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """Gemma's parts: embedding scale, (1 + w) norms, post norms, GeGLU, the attention scalar and
    the sliding layers' RoPE base."""
    qpas = hf.get("query_pre_attn_scalar", QPAS_DEFAULT)
    if isinstance(qpas, bool) or not isinstance(qpas, (int, float)) or not qpas > 0:
        raise HFFormatError(f"{fp}: query_pre_attn_scalar must be a positive number, got {json.dumps(qpas)[:40]}")
    local = hf.get("_local_rope")
    return {"embed_scale": True, "norm_offset": True, "post_norms": True, "mlp_act": "gelu_tanh",
            "query_pre_attn_scalar": float(qpas),
            "rope_local_theta": float(local) if local is not None and out.get("layer_types") else None}


def claims(t: Traits) -> bool:
    """Export: any of Gemma's parts (the other families claim none of them), without linear layers or
    GPT-OSS's parts."""
    return t.gemma and not t.oss and not t.linear


#: the keys a config must set for Gemma 3 to express it, with the value it needs
_NEEDS = (("embed_scale", True), ("norm_offset", True), ("post_norms", True), ("qk_norm", True),
          ("mlp_act", "gelu_tanh"))


def export_refusal(cfg, t: Traits) -> Optional[str]:
    if t.moe or t.mla:
        return f"model.{'moe.num_experts' if t.moe else 'mla.kv_lora_rank'}: Gemma's parts with " \
               f"{'experts' if t.moe else 'MLA'} export as no family (gemma3_text is dense GQA)"
    qpas = cfg.query_pre_attn_scalar
    if qpas is not None and not float(qpas).is_integer():
        return f"model.query_pre_attn_scalar={qpas}: Gemma3TextConfig takes a whole number"
    for key, want in _NEEDS:
        if getattr(cfg, key) != want:
            return (f"model.{key}={getattr(cfg, key)!r}: a config with Gemma's parts exports as gemma3_text, which "
                    f"needs {key}={want!r} (and {', '.join(f'{k}={v!r}' for k, v in _NEEDS if k != key)})")
    return None


def export_config(cfg) -> dict:
    """Gemma3TextConfig's keys: the pattern as layer_types, both RoPEs nested by layer type (the
    sliding layers': model.rope_local_theta's plain RoPE, or the full layers' own when null)."""
    full = rope_parameters(cfg)
    local = full if cfg.rope_local_theta is None else {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
    hd = int(cfg.head_dim) if cfg.head_dim else cfg.d_model // cfg.n_heads
    qpas = int(cfg.query_pre_attn_scalar) if cfg.query_pre_attn_scalar is not None else hd  # an int in its class
    return {**base_export(cfg, HF_CLASS, NAME), "hidden_act": ACT, "hidden_activation": ACT,
            "query_pre_attn_scalar": qpas, "sliding_window": cfg.sliding_window,
            "layer_types": [_HF_TYPES[t] for t in layer_types(cfg)],
            "rope_parameters": {"full_attention": full, "sliding_attention": dict(local)},
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "use_bidirectional_attention": False}
