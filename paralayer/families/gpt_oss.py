"""GPT-OSS (``GptOssForCausalLM``, model_type ``gpt_oss``): a GQA decoder whose every layer is MoE,
with its own parts, each a ModelConfig key (transformers 5.25, models/gpt_oss/modeling_gpt_oss.py):

    q/k/v/o projections with biases (attention_bias, true by default)           model.attn_bias
    a learned logit per head in every softmax, value 0 ("sinks")               model.attn_sinks
    sliding (window 128) and full layers alternating (layer_types)              model.layer_types
    YaRN RoPE without truncating the correction range (truncate: false)         model.rope.truncate
    a router with a bias; top-k of the logits, softmax over the k chosen        model.moe.router_bias
      (= our softmax router renormalised over the k: norm_topk_prob)
    experts with biases on gate, up and down                                   model.moe.expert_bias
    the clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1)·gate·σ(α·gate)   model.moe.swiglu_limit / _alpha

Weights: its experts are stored fused for all experts of a layer, ``mlp.experts.gate_up_proj``
(E, d, 2F) with gate and up INTERLEAVED in the last dim (gate = [..., ::2]), ``gate_up_proj_bias``
(E, 2F), ``down_proj`` (E, F, d), ``down_proj_bias`` (E, d); the router ``mlp.router.{weight,bias}``
(checkpoint/hf_fused.py reads and writes them: ``FUSED_EXPERTS``).

Refused by name: ``quantization_config`` (the published checkpoints keep the experts in MXFP4 blocks
and scales: dequantize to bf16 first), attention dropout, a RoPE that is not one we build exactly.
transformers' router aux loss is added only with ``output_router_logits`` (false in the releases),
so the import sets model.moe.aux_loss_coef to 0 unless it is true. Torch-free."""
from __future__ import annotations

import json
from typing import Optional

from paralayer.config.layer_pattern import layer_types
from paralayer.families.common import Traits, base_export, float_key, head_dim_field, int_key
from paralayer.families.errors import HFFormatError

NAME = "gpt_oss"
MODEL_TYPES = ("gpt_oss",)
HF_CLASS = "GptOssForCausalLM"
TINY_RECIPE = "tiny-gpt-oss"
#: added to the shared table (no other family has them)
NAMES = {"attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
         "attention.wv.bias": "self_attn.v_proj.bias", "attention.wo.bias": "self_attn.o_proj.bias",
         "attention.sinks": "self_attn.sinks", "feed_forward.gate.bias": "mlp.router.bias"}
#: its router's weight, named for this family only
RENAMES = {"feed_forward.gate.weight": "mlp.router.weight"}
EXPERTS = None  # not per expert: fused tensors (FUSED_EXPERTS)
#: the stacked experts' keys under ``model.layers.{i}.`` (checkpoint/hf_fused.py)
FUSED_EXPERTS = {"gate_up": "mlp.experts.gate_up_proj", "gate_up_bias": "mlp.experts.gate_up_proj_bias",
                 "down": "mlp.experts.down_proj", "down_bias": "mlp.experts.down_proj_bias"}
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None  # rotate-half (its _apply_rotary_emb chunks the head in halves)
# GptOssConfig's defaults (transformers 5.25) where config.json leaves a key out
DEFAULTS = {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "num_local_experts": 128, "num_experts_per_tok": 4,
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
THETA = 150_000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
_HF_LAYER = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_TYPES = {v: k for k, v in _HF_LAYER.items()}


def prepare(hf: dict, fp: str) -> dict:
    """config.json as the shared reader takes it: GptOssConfig's defaults where keys are absent,
    its attention bias kept aside (the shared reader refuses biases), its unused hidden_act dropped
    (the experts' activation is the clamped SwiGLU whatever it says)."""
    if hf.get("quantization_config") is not None:
        q = hf["quantization_config"]
        how = q.get("quant_method") if isinstance(q, dict) else q
        raise HFFormatError(f"{fp}: quantization_config (quant_method {json.dumps(how)[:20]}) is not supported "
                            "(the experts in MXFP4 blocks and scales: dequantize to bf16 and save first)")
    out = {k: v for k, v in hf.items() if k not in ("attention_bias", "hidden_act")}
    for k, v in DEFAULTS.items():
        out.setdefault(k, v)
    bias = hf.get("attention_bias", True)
    if not isinstance(bias, bool):
        raise HFFormatError(f"{fp}: attention_bias={json.dumps(bias)[:20]} must be true or false")
    out["_attn_bias"] = bias
    if out.get("rope_parameters") is None and out.get("rope_scaling") is None:
        out["rope_parameters"] = dict(DEFAULT_ROPE)
    rp = out.get("rope_parameters") or {}
    if "rope_theta" not in out and not (isinstance(rp, dict) and "rope_theta" in rp):
        out["rope_theta"] = THETA
    return out


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it (GptOssConfig ``head_dim: int = 64``, null → hidden
    / heads in its __post_init__); no q/k norms; the window per layer from ``layer_types``, else
    GptOssConfig's default: sliding, full, sliding, full, ..."""
    n = int_key(hf, "num_hidden_layers", fp)
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _HF_LAYER for t in types):
        raise HFFormatError(f"{fp}: layer_types={json.dumps(types)[:60]} must list {n} of {', '.join(_HF_LAYER)}")
    ours = [_HF_LAYER[t] for t in types]
    window = None
    if "sliding" in ours:
        if hf.get("sliding_window") is None:
            raise HFFormatError(f"{fp}: sliding_window=null with sliding layers in layer_types (a whole number)")
        window = int_key(hf, "sliding_window", fp)
    hd = hf.get("head_dim")
    hd = head_dim_field(d // heads if hd is None else hd, fp, d, heads)
    return {"layer_types": ours if window is not None else None, "head_dim": hd, "qk_norm": False,
            "sliding_window": window}


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """The attention's biases and sinks; the experts (every layer MoE, softmax top-k renormalised,
    biases, clamped SwiGLU)."""
    return {"attn_bias": hf["_attn_bias"], "attn_sinks": True, "moe": {
        "num_experts": int_key(hf, "num_local_experts", fp), "top_k": int_key(hf, "num_experts_per_tok", fp),
        "ffn_hidden": out["ffn_hidden"],
        "aux_loss_coef": float_key(hf, "router_aux_loss_coef", fp, 0.001) if hf.get("output_router_logits") else 0.0,
        "capacity_factor": None, "every": 1, "first_k_dense": 0, "router": "softmax", "shared_ffn_hidden": 0,
        "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "router_bias": True, "expert_bias": True, "swiglu_limit": float_key(hf, "swiglu_limit", fp, 7.0),
        "swiglu_alpha": float_key(hf, "swiglu_alpha", fp, 1.702)}}


def claims(t: Traits) -> bool:
    """Export: any of GPT-OSS's parts (the other families claim none of them)."""
    return t.oss


#: what a config with GPT-OSS's parts must also be for GptOssForCausalLM to express it
def export_refusal(cfg, t: Traits) -> Optional[str]:
    m = cfg.moe
    needs = (("attn_sinks", cfg.attn_sinks, True), ("moe.router_bias", m.router_bias, True),
             ("moe.expert_bias", m.expert_bias, True), ("moe.router", m.router, "softmax"),
             ("moe.every", m.every, 1), ("moe.first_k_dense", m.first_k_dense, 0),
             ("moe.shared_ffn_hidden", m.shared_ffn_hidden, 0), ("moe.n_group", m.n_group, 1),
             ("moe.routed_scaling_factor", m.routed_scaling_factor, 1.0), ("qk_norm", cfg.qk_norm, False))
    if t.gemma or t.mla or not t.moe:
        what = "Gemma's parts" if t.gemma else "MLA" if t.mla else "a dense MLP"
        return f"model.attn_sinks: GPT-OSS's parts with {what} export as no family (gpt_oss: GQA, every layer MoE)"
    for key, got, want in needs:
        if got != want:
            return f"model.{key}={got!r}: GptOssForCausalLM needs {key}={want!r} (a config with GPT-OSS's parts)"
    if m.swiglu_limit is None:
        return "model.moe.swiglu_limit=None: GptOssForCausalLM's experts clamp (a number, 7.0 in the releases)"
    if m.norm_topk_prob is False:
        return "model.moe.norm_topk_prob=false: GPT-OSS's router softmaxes over the k chosen (true)"
    if (m.ffn_hidden or cfg.ffn_hidden) != cfg.ffn_hidden:
        return f"model.moe.ffn_hidden={m.ffn_hidden}: GptOssConfig has one width (intermediate_size = model.ffn_hidden)"
    return None


def export_config(cfg) -> dict:
    """GptOssConfig's keys: the pattern as layer_types, the experts' settings."""
    m = cfg.moe
    return {**base_export(cfg, HF_CLASS, NAME), "attention_bias": bool(cfg.attn_bias),
            "sliding_window": cfg.sliding_window, "layer_types": [_HF_TYPES[t] for t in layer_types(cfg)],
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k, "swiglu_limit": m.swiglu_limit,
            "swiglu_alpha": m.swiglu_alpha, "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False}
