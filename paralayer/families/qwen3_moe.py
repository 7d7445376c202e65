"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (full only) with softmax top-k experts
and no shared expert; dense layers by ``mlp_only_layers`` / ``decoder_sparse_step``. Torch-free."""
from __future__ import annotations

import json
from typing import Optional

from paralayer.families import qwen3
from paralayer.families.common import ExpertNames, Traits, base_export, float_key, head_dim_field, int_key
from paralayer.families.errors import HFFormatError

NAME = "qwen3_moe"
MODEL_TYPES = ("qwen3_moe",)
HF_CLASS = "Qwen3MoeForCausalLM"
TINY_RECIPE = "tiny-qwen3-moe"
NAMES = qwen3.NAMES  # Qwen3's q/k norms, plus the experts below
EXPERTS = ExpertNames(router="mlp.gate.weight", expert="mlp.experts.{j}.{w}.weight",
                      w={"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
MTP_AS_LAYERS = False
rope_rows = export_rope_rows = None


def read_attention(hf: dict, fp: str, d: int, heads: int) -> dict:
    """head_dim as transformers 5.25 derives it: Qwen3MoeConfig has no head_dim field, and
    Qwen3MoeAttention reads ``getattr(config, "head_dim", hidden_size // num_attention_heads)``:
    absent → the quotient (not Qwen3's 128), null → refused (the class would fail on None).
    q/k norms; full attention only (a window or a layer_types that slides is refused)."""
    hd = head_dim_field(hf.get("head_dim", d // heads), fp, d, heads)
    if hf.get("use_sliding_window", False):
        raise HFFormatError(f"{fp}: use_sliding_window=true is not supported for qwen3_moe (full attention only)")
    types = hf.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise HFFormatError(f"{fp}: layer_types={json.dumps(types)[:60]} is not supported for qwen3_moe "
                            f"(full attention only)")
    return {"layer_types": None, "head_dim": hd, "qk_norm": True, "sliding_window": None}


def read_parts(hf: dict, fp: str, out: dict) -> dict:
    """Qwen3-MoE's experts: softmax top-k, ``norm_topk_prob`` as given (Qwen3MoeConfig's default
    false), no shared expert; its dense layers (``mlp_only_layers``, ``decoder_sparse_step``)
    become first_k_dense + every, which express exactly "the first k dense, then every s-th"."""
    n_layers = out["n_layers"]
    step = int_key(hf, "decoder_sparse_step", fp, 1)
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
    return {"moe": {
        "num_experts": int_key(hf, key, fp), "top_k": int_key(hf, "num_experts_per_tok", fp, 8),
        "ffn_hidden": int_key(hf, "moe_intermediate_size", fp),
        # transformers adds the router loss only with output_router_logits (off in its saved configs)
        "aux_loss_coef": float_key(hf, "router_aux_loss_coef", fp, 0.001) if hf.get("output_router_logits") else 0.0,
        "capacity_factor": None,
        "every": step, "first_k_dense": first, "router": "softmax", "shared_ffn_hidden": 0,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0}}


def claims(t: Traits) -> bool:
    """Export: experts with q/k norms, without MLA."""
    return t.moe and t.qk_norm and not (t.mla or t.gemma or t.oss)


def export_refusal(cfg, t: Traits) -> Optional[str]:
    if t.kinds != {"full"}:
        return ("model.sliding_window: a window with q/k norms and MoE exports as no family "
                "(qwen3_moe: full attention)")
    return None


def export_config(cfg) -> dict:
    """Qwen3-MoE's config.json keys; what its block cannot say is refused (one line, the key)."""
    m = cfg.moe
    for bad, why in ((m.router != "softmax", "model.moe.router: qwen3_moe routes by softmax"),
                     (m.shared_ffn_hidden, "model.moe.shared_ffn_hidden: qwen3_moe has no shared expert"),
                     (m.n_group > 1, "model.moe.n_group: qwen3_moe has no routing by group"),
                     (m.routed_scaling_factor != 1.0, "model.moe.routed_scaling_factor: qwen3_moe scales by 1")):
        if bad:
            raise HFFormatError(why)
    renorm = True if m.norm_topk_prob is None else bool(m.norm_topk_prob)
    return {**base_export(cfg, HF_CLASS, NAME),
            "moe_intermediate_size": m.ffn_hidden or cfg.ffn_hidden, "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "norm_topk_prob": renorm, "decoder_sparse_step": m.every,
            "mlp_only_layers": list(range(m.first_k_dense)), "router_aux_loss_coef": m.aux_loss_coef,
            "output_router_logits": False, "use_sliding_window": False, "sliding_window": None}
