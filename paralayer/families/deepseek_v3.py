"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): latent attention (MLA), a sigmoid router by groups
with routed scaling and shared experts, the first ``first_k_dense_replace`` layers dense, and MTP
depths stored as decoder layers ``model.layers.{n_layers+k}``. Its checkpoints may lay q's and the
shared key's rope dims out in interleaved pairs (``rope_interleave``). Torch-free."""
from __future__ import annotations

import json
from typing import Optional

from paralayer.families.common import ExpertNames, Traits, float_key, int_key
from paralayer.families.errors import HFFormatError

NAME = "deepseek_v3"
MODEL_TYPES = ("deepseek_v3",)
#: Kimi K2 (Moonshot AI, arXiv:2507.20534): its config.json says model_type kimi_k2 and architectures
#: [DeepseekV3ForCausalLM] (trust_remote_code's configuration_deepseek.py / modeling_deepseek.py, V3's
#: class), every other key V3's; transformers 5.25 itself reads a kimi_k2 text_config as deepseek_v3
#: (models/kimi_k25/configuration_kimi_k25.py). Exports as deepseek_v3 (transformers has no kimi_k2).
ALIASES = {"kimi_k2": "Kimi K2: DeepSeek-V3's class (384 experts, 64 heads, 1 dense layer)"}
HF_CLASS = "DeepseekV3ForCausalLM"
TINY_RECIPE = "deepseek-v3-tiny"
NAMES = {"attention.q_a.weight": "self_attn.q_a_proj.weight",
         "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
         "attention.q_b.weight": "self_attn.q_b_proj.weight",
         "attention.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
         "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
         "attention.kv_b.weight": "self_attn.kv_b_proj.weight",
         "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
         "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
         "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight"}
EXPERTS = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{j}.{w}.weight",
                      w={"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
                      bias="mlp.gate.e_score_correction_bias")
MTP_AS_LAYERS = True  # MTP depth k is model.layers.{n_layers+k} (checkpoint/hf_moe.py's names)


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """MLA: its widths go to model.mla (:func:`read_parts`, which also checks head_dim). No q/k
    norms (MLA's norms are on the latents), no window."""
    return {"layer_types": None, "head_dim": None, "qk_norm": False, "sliding_window": None}


def _check_rope_width(hf: dict, fp: str, d: int, heads: int, rope: int) -> None:
    """config.json's head_dim as transformers 5.25 reads it: DeepseekV3Config.__post_init__ sets
    head_dim = qk_rope_head_dim, but a head_dim in the file is set after it, and the rotary
    embedding takes ``head_dim or hidden_size // num_attention_heads`` as the width of its
    cos/sin tables. Our decoupled RoPE key is qk_rope_head_dim wide: any other width is refused
    (transformers' own model cannot apply it to its rope dims)."""
    hd = hf["head_dim"] if "head_dim" in hf else rope
    width = hd or d // heads
    if width != rope:
        raise HFFormatError(f"{fp}: head_dim={json.dumps(hd)[:40]} makes transformers' RoPE tables {width} wide; "
                            f"deepseek_v3 rotates qk_rope_head_dim={rope} (leave head_dim out or set it to {rope})")


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """DeepSeek-V3's MoE (sigmoid router by groups, routed scaling, shared experts, the first
    ``first_k_dense_replace`` layers dense) and MLA widths. ``num_nextn_predict_layers`` (MTP) is
    checked (a whole number >= 0) but does not set model.mtp.depth: like Megatron's
    ``--mtp-num-layers`` that is the run's choice (the import reads the depths the safetensors
    carry, checkpoint/hf_moe.py), and a recipe's ``model.mtp.depth=0`` must not be overwritten."""
    int_key(hf, "num_nextn_predict_layers", fp, 0, minimum=0)
    experts = int_key(hf, "n_routed_experts", fp)
    ffn = int_key(hf, "moe_intermediate_size", fp)
    n_group, topk_group = int_key(hf, "n_group", fp, 1), int_key(hf, "topk_group", fp, 1)
    if experts % n_group or topk_group > n_group:
        raise HFFormatError(f"{fp}: n_group={n_group}, topk_group={topk_group} must divide n_routed_experts="
                            f"{experts} and not exceed n_group")
    moe = {"num_experts": experts, "top_k": int_key(hf, "num_experts_per_tok", fp, 8), "ffn_hidden": ffn,
           "aux_loss_coef": 0.0, "capacity_factor": None, "every": 1,
           "first_k_dense": int_key(hf, "first_k_dense_replace", fp, 0, minimum=0), "router": "sigmoid",
           "shared_ffn_hidden": ffn * int_key(hf, "n_shared_experts", fp, 0, minimum=0),
           "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "n_group": n_group, "topk_group": topk_group,
           "routed_scaling_factor": float_key(hf, "routed_scaling_factor", fp, 1.0)}
    q_lora = hf.get("q_lora_rank")
    mla = {"q_lora_rank": None if q_lora is None else int_key(hf, "q_lora_rank", fp),
           "kv_lora_rank": int_key(hf, "kv_lora_rank", fp), "qk_nope_head_dim": int_key(hf, "qk_nope_head_dim", fp),
           "qk_rope_head_dim": int_key(hf, "qk_rope_head_dim", fp), "v_head_dim": int_key(hf, "v_head_dim", fp)}
    if mla["qk_rope_head_dim"] % 2:
        raise HFFormatError(f"{fp}: qk_rope_head_dim={mla['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    _check_rope_width(hf, fp, out["d_model"], out["n_heads"], mla["qk_rope_head_dim"])
    return {"moe": moe, "mla": mla}


def _rows(nope: int, rope: int, rank: int) -> dict:
    """{our name: (row offset in a head, rope dims, head width)} of the interleaved rope rows."""
    return {"attention.wq.weight": (nope, rope, nope + rope), "attention.q_b.weight": (nope, rope, nope + rope),
            "attention.kv_a.weight": (rank, rope, rank + rope)}


def rope_rows(hf: dict) -> Optional[dict]:
    """The rows to reorder on import (config.json ``hf``; None when ``rope_interleave`` is false):
    DeepSeek's interleaved pairs into our rotate-half."""
    if not hf.get("rope_interleave", True):
        return None
    return _rows(hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["kv_lora_rank"])


def export_rope_rows(cfg) -> dict:
    """The same rows for export (``cfg``: the ModelConfig; the export writes rope_interleave true)."""
    a = cfg.mla
    return _rows(a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank)


def claims(t: Traits) -> bool:
    """Export: latent attention."""
    return t.mla and not (t.gemma or t.oss)


def export_refusal(cfg, t: Traits) -> Optional[str]:
    m = cfg.moe
    for bad, why in ((cfg.qk_norm, "model.qk_norm: deepseek_v3 has no q/k norms"),
                     (t.kinds != {"full"}, "model.sliding_window: deepseek_v3 attends in full"),
                     (m.num_experts > 0 and m.router != "sigmoid", "model.moe.router: deepseek_v3 routes by sigmoid"),
                     (m.num_experts > 0 and m.every != 1, "model.moe.every: deepseek_v3 has MoE on every layer "
                                                          "past first_k_dense")):
        if bad:
            return why
    return None


def export_config(cfg) -> dict:
    """DeepSeek-V3's config.json keys (MLA, routing by group, shared experts, the dense first layers)."""
    m, a = cfg.moe, cfg.mla
    ffn = m.ffn_hidden or cfg.ffn_hidden
    if m.shared_ffn_hidden % ffn:
        raise HFFormatError(f"model.moe.shared_ffn_hidden={m.shared_ffn_hidden}: deepseek_v3 counts shared experts "
                            f"of moe_intermediate_size={ffn}")
    renorm = True if m.norm_topk_prob is None else bool(m.norm_topk_prob)
    return {"architectures": [HF_CLASS], "model_type": NAME,
            "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": ffn,
            "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.shared_ffn_hidden // ffn, "n_group": m.n_group, "topk_group": m.topk_group,
            "routed_scaling_factor": m.routed_scaling_factor, "norm_topk_prob": renorm,
            "first_k_dense_replace": m.first_k_dense if m.num_experts > 0 else cfg.n_layers,
            "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "head_dim": a.qk_rope_head_dim,
            "num_key_value_heads": cfg.n_heads, "rope_interleave": True,
            "num_nextn_predict_layers": cfg.mtp.depth}
