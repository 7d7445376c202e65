"""Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``; transformers 5.25
models/qwen3_next): a hybrid of Gated DeltaNet layers and gated full-attention layers, each with
Qwen3-Next's MoE. What it reads, each a ModelConfig key:

    layer_types (or full_attention_interval, 4: layer i full when (i + 1) % 4 == 0)
        "linear_attention" → "linear", "full_attention" → "full"         model.layer_types
    linear_num_key_heads / linear_num_value_heads / linear_key_head_dim /
    linear_value_head_dim / linear_conv_kernel_dim                       model.linear.*
    the full layers' q_proj making [q | gate] per head, output × sigmoid  model.attn_gate
    rope_parameters.partial_rotary_factor (0.25): RoPE on a quarter head  model.rotary_fraction
    RMSNorm with gain (1 + w), in fp32 (block, final and q/k norms)      model.norm_offset
    experts: softmax top-k, norm_topk_prob (its class default true), a
    shared expert (shared_expert_intermediate_size) × sigmoid(shared_expert_gate · x)
                                                                          model.moe.*, model.moe.shared_gate

The linear layers' gated RMSNorm has a plain gain w (init 1), transformers' Qwen3NextRMSNormGated.

Qwen3.5 (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, and their vision-language wrappers) is
the same model with its linear layers' projections stored split: paralayer/families/qwen3_5/, which
reuses the reader and the export pieces here. Torch-free."""
from __future__ import annotations

import json
from typing import Optional

from paralayer.config.layer_pattern import layer_types
from paralayer.families import qwen3, qwen3_moe
from paralayer.families.common import Traits, base_export, head_dim_field, int_key, periodic_layer_types
from paralayer.families.errors import HFFormatError
from paralayer.families.rope import rope_parameters

NAME = "qwen3_next"
MODEL_TYPES = ("qwen3_next",)
HF_CLASS = "Qwen3NextForCausalLM"
TINY_RECIPE = "tiny-qwen3-next"
_LIN = "linear_attn."
NAMES = {**qwen3.NAMES, **{f"attention.{w}": _LIN + w for w in (
    "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
    "out_proj.weight")}}
#: its shared expert is singular (DeepSeek-V3's table says shared_experts) and gated
RENAMES = {"feed_forward.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
           "feed_forward.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
           "feed_forward.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
           "feed_forward.shared.gate.weight": "mlp.shared_expert_gate.weight"}
EXPERTS = qwen3_moe.EXPERTS
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None
# Qwen3NextConfig's defaults (transformers 5.25) where config.json leaves a key out
HEAD_DIM_DEFAULT, INTERVAL_DEFAULT, ROTARY_DEFAULT = 256, 4, 0.25
LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_HF_LAYER = {"linear_attention": "linear", "full_attention": "full"}
_HF_TYPES = {v: k for k, v in _HF_LAYER.items()}


def prepare(hf: dict, fp: str) -> dict:
    """The partial rotary factor taken out of the RoPE (the shared reader refuses it), and the
    class defaults the shared readers would get wrong (norm_topk_prob true)."""
    out = dict(hf)
    rp = out.get("rope_parameters")
    prf = out.pop("partial_rotary_factor", ROTARY_DEFAULT)
    if isinstance(rp, dict):
        rp = dict(rp)
        prf = rp.pop("partial_rotary_factor", prf)
        out["rope_parameters"] = rp
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        raise HFFormatError(f"{fp}: partial_rotary_factor={json.dumps(prf)[:40]} must be a number in (0, 1]")
    out["_rotary_fraction"] = float(prf)
    out.setdefault("norm_topk_prob", True)
    out.setdefault("head_dim", HEAD_DIM_DEFAULT)
    return out


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim (Qwen3NextConfig ``head_dim: int = 256``); q/k norms; the pattern from
    ``layer_types``, else ``full_attention_interval``; no window (refused)."""
    if hf.get("sliding_window") is not None or hf.get("use_sliding_window"):
        raise HFFormatError(f"{fp}: sliding_window is not supported for qwen3_next (its full layers attend to all)")
    types = periodic_layer_types(hf, fp, "full_attention_interval", INTERVAL_DEFAULT, "linear_attention", _HF_LAYER)
    if "linear_attention" not in types:
        raise HFFormatError(f"{fp}: layer_types has no linear_attention layer (a qwen3_next without linear "
                            "layers: import it as qwen3)")
    hd = head_dim_field(hf["head_dim"], fp, d, heads)
    return {"layer_types": [_HF_LAYER[t] for t in types], "head_dim": hd, "qk_norm": True, "sliding_window": None}


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """The linear layers' widths, the gated attention, (1 + w) norms, the partial RoPE and the MoE."""
    lin = {k: int_key(hf, k, fp, v) for k, v in LINEAR_DEFAULTS.items()}
    if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise HFFormatError(f"{fp}: linear_num_value_heads={lin['linear_num_value_heads']} must be a multiple of "
                            f"linear_num_key_heads={lin['linear_num_key_heads']}")
    parts = {"attn_gate": True, "norm_offset": True, "rotary_fraction": hf["_rotary_fraction"],
             "linear": {"k_heads": lin["linear_num_key_heads"], "v_heads": lin["linear_num_value_heads"],
                        "head_k_dim": lin["linear_key_head_dim"], "head_v_dim": lin["linear_value_head_dim"],
                        "conv_kernel": lin["linear_conv_kernel_dim"]}}
    if int_key(hf, "num_experts", fp, 512, minimum=0) == 0:
        return parts
    moe = qwen3_moe.read_parts(hf, fp, out)["moe"]
    moe.update(shared_ffn_hidden=int_key(hf, "shared_expert_intermediate_size", fp, 512), shared_gate=True)
    return {**parts, "moe": moe}


def claims(t: Traits) -> bool:
    """Export: any linear-attention layer (the other families claim none) with the projections
    fused (model.linear.proj; split: Qwen3.5), without GPT-OSS's parts."""
    return t.linear and not t.oss and not t.split


#: the keys a config with linear layers must set for Qwen3-Next (and Qwen3.5) to express it, with the
#: value it needs
LINEAR_NEEDS = (("norm_offset", True), ("qk_norm", True), ("attn_gate", True), ("embed_scale", False),
                ("post_norms", False), ("mlp_act", "silu"), ("query_pre_attn_scalar", None),
                ("rope_local_theta", None))


def linear_refusal(cfg, t: Traits, name: str, needs: tuple = LINEAR_NEEDS) -> Optional[str]:
    """Why a config with linear layers does not export as family ``name``, or None: MLA or sliding
    layers, or a key of ``needs`` set otherwise."""
    if t.mla or "sliding" in t.kinds:
        return (f"model.{'mla.kv_lora_rank' if t.mla else 'sliding_window'}: linear layers with "
                f"{'MLA' if t.mla else 'sliding layers'} export as no family ({name}: linear and full layers)")
    for key, want in needs:
        if getattr(cfg, key) != want:
            return (f"model.{key}={getattr(cfg, key)!r}: a config with linear layers exports as {name}, which "
                    f"needs {key}={want!r}")
    return None


def export_refusal(cfg, t: Traits) -> Optional[str]:
    why = linear_refusal(cfg, t, NAME, LINEAR_NEEDS + (("tie_embeddings", False),))
    if why:
        return why
    m = cfg.moe
    if t.moe and not (m.shared_ffn_hidden and m.shared_gate and m.router == "softmax" and m.n_group == 1
                      and m.routed_scaling_factor == 1.0):
        return ("model.moe: qwen3_next's experts route by softmax with one gated shared expert "
                "(shared_ffn_hidden > 0, shared_gate true, n_group 1, routed_scaling_factor 1)")
    return None


def linear_export(cfg, hf_class: str, name: str) -> dict:
    """The keys Qwen3-Next and Qwen3.5 write alike: the pattern as layer_types, the partial RoPE in
    rope_parameters, the linear layers' widths."""
    li = cfg.linear
    return {**base_export(cfg, hf_class, name), "layer_types": [_HF_TYPES[t] for t in layer_types(cfg)],
            "rope_parameters": {**rope_parameters(cfg), "partial_rotary_factor": cfg.rotary_fraction},
            "linear_num_key_heads": li.k_heads, "linear_num_value_heads": li.v_heads,
            "linear_key_head_dim": li.head_k_dim, "linear_value_head_dim": li.head_v_dim,
            "linear_conv_kernel_dim": li.conv_kernel}


def export_config(cfg) -> dict:
    """Qwen3NextConfig's keys: the pattern as layer_types, the linear widths, the partial RoPE in
    rope_parameters, the experts (num_experts 0: dense MLPs)."""
    m = cfg.moe
    out = {**linear_export(cfg, HF_CLASS, NAME), "num_experts": m.num_experts, "sliding_window": None}
    if m.num_experts:
        renorm = True if m.norm_topk_prob is None else bool(m.norm_topk_prob)
        out.update(moe_intermediate_size=m.ffn_hidden or cfg.ffn_hidden, num_experts_per_tok=m.top_k,
                   norm_topk_prob=renorm, decoder_sparse_step=m.every, mlp_only_layers=list(range(m.first_k_dense)),
                   shared_expert_intermediate_size=m.shared_ffn_hidden, router_aux_loss_coef=m.aux_loss_coef,
                   output_router_logits=False)
    return out
