"""Our parameter names ↔ Hugging Face keys: the shared dense table (Llama's, which every family
starts from) plus what each family adds (its ``NAMES`` and ``EXPERTS``). Torch-free.

    tok_embeddings.weight                       model.embed_tokens.weight
    layers.{i}.attention.wq|wk|wv|wo.weight     model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj.weight
    layers.{i}.attention_norm.weight            model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight                  model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1|w3|w2.weight     model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight   (dense)
    norm.weight                                 model.norm.weight
    output.weight                               lm_head.weight (embed_tokens when tie_word_embeddings)

A family's additions (q/k norms, MLA, shared experts) are read from every checkpoint whatever its
family (the import does not need to know it); the router and stacked experts are named by the
family passed (export) or tried family by family (import, checkpoint/hf.py).
"""
from __future__ import annotations

import re
from typing import Optional

from paralayer.families.common import ExpertNames
from paralayer.families.registry import FAMILIES, family

_family = family  # ours_to_hf's argument of the same name hides it

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
DENSE = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
         "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
         "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
         "feed_forward.w2.weight": "mlp.down_proj.weight"}
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
DEFAULT_EXPERTS = "mixtral"  # a dense family's experts, were it asked: Mixtral's names (ours_to_hf's default)

_ALL = dict(DENSE)
for _fam in FAMILIES.values():
    _ALL.update(_fam.NAMES)
#: every MoE family's experts naming, in the registry's order (the import tries them so)
EXPERT_NAMES: tuple[ExpertNames, ...] = tuple(f.EXPERTS for f in FAMILIES.values() if f.EXPERTS)
_BIAS = [e.bias for e in EXPERT_NAMES if e.bias]
_ROUTER = "feed_forward.gate.weight"

_HF_TOP = {v: k for k, v in TOP.items()}
_HF_ALL = {v: k for k, v in _ALL.items()}
for _e in EXPERT_NAMES:
    _HF_ALL.setdefault(_e.router, _ROUTER)
_HF_EXPERT = [(re.compile("^" + re.escape(e.expert).replace(r"\{j\}", r"(\d+)").replace(
    r"\{w\}", "(" + "|".join(map(re.escape, e.w.values())) + ")") + "$"), {v: k for k, v in e.w.items()})
    for e in EXPERT_NAMES]  # two families naming alike match alike: the first answers


def _experts(name: str) -> ExpertNames:
    return _family(name).EXPERTS or family(DEFAULT_EXPERTS).EXPERTS


def ours_to_hf(name: str, expert: Optional[int] = None, family: str = DEFAULT_EXPERTS) -> str:
    """Our parameter name → the Hugging Face key. Stacked experts (``layers.{i}.feed_forward.w1``)
    need ``expert=j``: ``model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`` (Mixtral), or
    with ``family="qwen3_moe"`` ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` (and the
    router ``mlp.gate.weight``): the names of that family's ``EXPERTS``. A family's ``RENAMES``
    (Gemma 3: ``ffn_norm`` is its ``pre_feedforward_layernorm``) win for that family only."""
    if name in TOP:
        return TOP[name]
    m = _LAYER.match(name)
    if m:
        i, rest = m.groups()
        ex = _experts(family)
        renamed = getattr(_family(family), "RENAMES", {})  # this family's own names first (Gemma's norms)
        if rest in renamed:
            return f"model.layers.{i}.{renamed[rest]}"
        if rest == _ROUTER:
            return f"model.layers.{i}.{ex.router}"
        if rest == "feed_forward.expert_bias" and _BIAS:  # DeepSeek-V3's selection bias (a buffer)
            return f"model.layers.{i}.{ex.bias or _BIAS[0]}"
        if rest in _ALL:
            return f"model.layers.{i}.{_ALL[rest]}"
        ff = re.match(r"^feed_forward\.(w[123])$", rest)
        if ff:
            if expert is None:
                raise KeyError(f"{name}: a stacked expert weight; pass expert=j")
            return f"model.layers.{i}." + ex.expert.format(j=expert, w=ex.w[ff.group(1)])
    raise KeyError(f"{name}: no Hugging Face equivalent")


def hf_to_ours(key: str) -> tuple[str, Optional[int]]:
    """Hugging Face key → (our name, expert index or None)."""
    if key in _HF_TOP:
        return _HF_TOP[key], None
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
    if m:
        i, rest = m.groups()
        if rest in _HF_ALL:
            return f"layers.{i}.{_HF_ALL[rest]}", None
        for pattern, ours in _HF_EXPERT:
            e = pattern.match(rest)
            if e:
                return f"layers.{i}.feed_forward.{ours[e.group(2)]}", int(e.group(1))
    raise KeyError(f"{key}: not a Llama/Mixtral weight we know")


def router_keys(name: str) -> list[str]:
    """The keys our router ``layers.{i}.feed_forward.gate.weight`` may be stored under, one per
    family naming, in the registry's order (the import reads the first its checkpoint has)."""
    i = _LAYER.match(name).group(1)
    return list(dict.fromkeys(f"model.layers.{i}.{e.router}" for e in EXPERT_NAMES))


def expert_keys(layer: str, w: str) -> list[str]:
    """The per-expert keys (``{j}`` left to fill) of our stacked ``w`` (w1 | w3 | w2) in layer
    ``layer``, one per family naming, in the registry's order."""
    return list(dict.fromkeys(f"model.layers.{layer}." + e.expert.format(j="{j}", w=e.w[w]) for e in EXPERT_NAMES))
