"""What Qwen3.5's two families share when reading config.json (torch-free): the text model out of the
vision-language wrapper, its class defaults, the multimodal RoPE reduced to plain partial RoPE, and
the keys the class ignores refused when they ask for something else.

mrope: Qwen3_5TextRotaryEmbedding takes position rows (T, H, W) and, for the frequency pairs of
``mrope_section`` (interleaved: pair j from row j mod 3 within the sections), the angle of that
row's position. A text token's three rows are its one position (transformers' own forward expands
plain position ids so), so every pair gets that position: plain RoPE on the first
partial_rotary_factor of each head, whatever the sections. Only image and video tokens make the
rows differ; the training data here is text, so nothing in config.json is left to refuse but a
section that is not three whole numbers (transformers would index it as three)."""
from __future__ import annotations

import json

from paralayer.families import qwen3_next
from paralayer.families.errors import HFFormatError

#: the vision-language wrapper → the model_type of its text_config
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
#: where a wrapper's checkpoint keeps the text model's ``model.`` (checkpoint/hf_split.py)
TEXT_PREFIX = "model.language_model."
#: Qwen3_5TextConfig's defaults (transformers 5.25), then Qwen3_5MoeTextConfig's where they differ
DENSE_DEFAULTS = {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **qwen3_next.LINEAR_DEFAULTS}
MOE_DEFAULTS = {**{k: v for k, v in DENSE_DEFAULTS.items() if k != "intermediate_size"}, "hidden_size": 2048,
                "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
_MROPE = ("mrope_section", "mrope_interleaved")


def text_model(hf: dict, fp: str, text_type: str) -> dict:
    """config.json's text model: itself, or the wrapper's ``text_config`` (absent: the class's default
    text model), its ``tie_word_embeddings`` the wrapper's: the vision-language class ties by the
    wrapper's key and Qwen3_5ForCausalLM by the text config's, so the two must agree."""
    mtype = hf.get("model_type")
    if mtype not in WRAPPERS:
        return dict(hf)
    text = hf.get("text_config") or {}
    if not isinstance(text, dict):
        raise HFFormatError(f"{fp}: text_config must be an object, got {json.dumps(text)[:40]}")
    inner = text.get("model_type", text_type)
    if inner != text_type:
        raise HFFormatError(f"{fp}: text_config.model_type={json.dumps(inner)[:40]} in a {mtype} config; "
                            f"{mtype} wraps {text_type}")
    outer_tie, inner_tie = bool(hf.get("tie_word_embeddings", False)), bool(text.get("tie_word_embeddings", False))
    if outer_tie != inner_tie:
        raise HFFormatError(f"{fp}: tie_word_embeddings={json.dumps(outer_tie)} but text_config.tie_word_embeddings="
                            f"{json.dumps(inner_tie)} (the vision-language class ties by the first, "
                            "Qwen3_5ForCausalLM by the second: set both alike)")
    return {**text, "model_type": text_type}


def without_mrope(hf: dict, fp: str) -> dict:
    """The RoPE dicts without mrope_section / mrope_interleaved (plain partial RoPE on text: above),
    after checking what transformers reads of them."""
    out = dict(hf)
    for where in ("rope_parameters", "rope_scaling"):
        rp = out.get(where)
        if not isinstance(rp, dict):
            continue
        sec = rp.get("mrope_section")
        if sec is not None and not (isinstance(sec, list) and len(sec) == 3 and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sec)):
            raise HFFormatError(f"{fp}: {where}.mrope_section={json.dumps(sec)[:40]} must be three whole numbers "
                                "(the T, H and W sections)")
        if rp.get("mrope_interleaved") not in (None, True, False):
            raise HFFormatError(f"{fp}: {where}.mrope_interleaved={json.dumps(rp['mrope_interleaved'])[:40]} "
                                "must be true or false")
        out[where] = {k: v for k, v in rp.items() if k not in _MROPE}
    return out


def check_ignored(hf: dict, fp: str, ignored: dict, cls: str) -> None:
    """Keys the class ignores (``ignored``: key → the value it acts as if set to): any other value is
    refused by name, since the class would not build what it asks."""
    for key, acts_as in ignored.items():
        if key in hf and hf[key] is not None and hf[key] != acts_as:
            raise HFFormatError(f"{fp}: {key}={json.dumps(hf[key])[:40]} is not supported: {cls} ignores it and "
                                f"builds {key}={json.dumps(acts_as)}")


def prepare(hf: dict, fp: str, text_type: str, defaults: dict, ignored: dict, cls: str) -> dict:
    """config.json as Qwen3-Next's reader takes it: the text model, the class defaults, mrope
    reduced, the ignored keys checked and set to what the class acts as, then Qwen3-Next's prepare
    (the partial rotary factor)."""
    out = {**defaults, **without_mrope(text_model(hf, fp, text_type), fp)}
    check_ignored(out, fp, {"attn_output_gate": True, **ignored}, cls)
    out.pop("attn_output_gate", None)
    out.update(ignored)
    return qwen3_next.prepare(out, fp)
