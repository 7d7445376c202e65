"""The family registry (paralayer/families/): every family is one module holding its reader, its
name table, its export and its tiny recipe; a module missing a piece is refused when the registry
is built; export's claims pick exactly one family for any config. Fast: no rank is started."""
from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType

import pytest

from paralayer.config import load_config
from paralayer.families import FAMILIES, MODEL_TYPES, by_type, family, family_for_config, registry
from paralayer.families.common import ExpertNames, Traits
from paralayer.families.names import hf_to_ours, ours_to_hf

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
#: the families with no CPU recipe of their own (each says why beside its TINY_RECIPE)
NO_TINY: set[str] = set()  # every family has its tiny recipe


def test_the_families_listed():
    assert MODEL_TYPES == ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3", "gemma3_text",
                           "gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
    assert [by_type(t).NAME for t in MODEL_TYPES] == list(MODEL_TYPES)
    # the aliases read as a family: Kimi K2's, and Qwen3.5's vision-language wrappers
    assert {t: by_type(t).NAME for t in registry.ALIASES} == {"kimi_k2": "deepseek_v3", "qwen3_5": "qwen3_5_text",
                                                            "qwen3_5_moe": "qwen3_5_moe_text"}
    assert by_type("olmo3") is None and by_type(["llama"]) is None and by_type(None) is None
    with pytest.raises(KeyError, match="olmo3"):
        family("olmo3")


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_each_family_has_its_pieces(name):
    fam = FAMILIES[name]
    registry.check_family(fam)
    for fn in ("read_attention", "read_parts", "claims", "export_refusal", "export_config"):
        assert callable(getattr(fam, fn)), fn
    assert fam.HF_CLASS.endswith("ForCausalLM")
    assert isinstance(fam.NAMES, dict)
    if fam.EXPERTS is not None:
        assert isinstance(fam.EXPERTS, ExpertNames) and set(fam.EXPERTS.w) == {"w1", "w2", "w3"}
    for ours in fam.NAMES:  # its table both ways
        theirs = ours_to_hf(f"layers.2.{ours}", family=name)
        assert hf_to_ours(theirs) == (f"layers.2.{ours}", None)
    if fam.EXPERTS is not None:
        for w in ("w1", "w2", "w3"):
            theirs = ours_to_hf(f"layers.2.feed_forward.{w}", expert=5, family=name)
            assert hf_to_ours(theirs) == (f"layers.2.feed_forward.{w}", 5)


def test_hf_class_is_transformers_class_for_the_model_type():
    """The outside oracle: transformers' own causal-LM table names the same class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as table

    assert {t: FAMILIES[t].HF_CLASS for t in MODEL_TYPES} == {t: table[t] for t in MODEL_TYPES}


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_each_family_has_its_tiny_recipe(name):
    fam = FAMILIES[name]
    if name in NO_TINY:
        assert fam.TINY_RECIPE is None
        return
    assert (RECIPES / f"{fam.TINY_RECIPE}.yaml").is_file(), fam.TINY_RECIPE
    cfg = load_config(recipe=fam.TINY_RECIPE)
    assert family_for_config(cfg.model) is fam  # the recipe exercises this family, not another


def test_a_planted_missing_piece_is_refused():
    for key in registry.REQUIRED:
        planted = ModuleType("planted")
        planted.__dict__.update({k: v for k, v in vars(FAMILIES["llama"]).items()
                                 if k != key and not k.startswith("__")})
        with pytest.raises(ValueError, match=f"planted: family module lacks {key} "):
            registry.check_family(planted)
    renamed = ModuleType("renamed")
    renamed.__dict__.update({k: v for k, v in vars(FAMILIES["llama"]).items() if not k.startswith("__")},
                            NAME="llama2")
    with pytest.raises(ValueError, match="must be its first model_type"):
        registry.check_family(renamed)
    with pytest.raises(ValueError, match="'llama' is claimed by"):
        registry._build((FAMILIES["llama"], FAMILIES["llama"]))


def test_export_claims_partition_every_config():
    """Exactly one family claims each combination of the traits export decides by (128 of them)."""
    kinds = [frozenset(), frozenset({"full"}), frozenset({"sliding"}), frozenset({"full", "sliding"})]
    seen = 0
    for mla, moe, qk, k, gemma, oss in itertools.product([False, True], [False, True], [False, True], kinds,
                                                         [False, True], [False, True]):
        t = Traits(mla, moe, qk, k, gemma, oss)
        claimed = [f.NAME for f in FAMILIES.values() if f.claims(t)]
        assert len(claimed) == 1, (t, claimed)
        seen += 1
    assert seen == 128
    for mla, moe, qk, k, oss, split in itertools.product([False, True], [False, True], [False, True], kinds,
                                                         [False, True], [False, True]):
        t = Traits(mla, moe, qk, k | {"linear"}, True, oss, True, split)  # linear: gemma is set with them (traits)
        want = ["gpt_oss"] if oss else [("qwen3_5_moe_text" if moe else "qwen3_5_text") if split else "qwen3_next"]
        assert [f.NAME for f in FAMILIES.values() if f.claims(t)] == want, t


def test_gemma_names_its_norms_its_own_way():
    """Gemma 3's post_attention_layernorm is the norm AFTER attention (transformers'
    Gemma3DecoderLayer); Llama's is the one before the MLP. The family's RENAMES win for it only."""
    assert ours_to_hf("layers.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    g = "gemma3_text"
    assert ours_to_hf("layers.3.ffn_norm.weight", family=g) == "model.layers.3.pre_feedforward_layernorm.weight"
    assert ours_to_hf("layers.3.post_attention_norm.weight", family=g) == \
        "model.layers.3.post_attention_layernorm.weight"
    assert ours_to_hf("layers.3.post_ffn_norm.weight", family=g) == "model.layers.3.post_feedforward_layernorm.weight"
    assert ours_to_hf("layers.3.attention_norm.weight", family=g) == "model.layers.3.input_layernorm.weight"
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    layer = Gemma3DecoderLayer(Gemma3TextConfig(hidden_size=16, intermediate_size=8, num_attention_heads=2,
                                                num_key_value_heads=1, head_dim=8, num_hidden_layers=1), 0)
    ours = ["attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"]
    theirs = {n for n, _ in layer.named_parameters() if "layernorm" in n}
    assert {ours_to_hf(f"layers.0.{o}.weight", family=g)[len("model.layers.0."):] for o in ours} == theirs


@pytest.mark.parametrize("mtype, words", [("gemma4", "Gemma 4 (per-layer input embeddings"),
                                          ("gemma4_text", "Gemma 4"), ("gemma2", "softcapping"),
                                          ("gemma3", "import a gemma3_text checkpoint")])
def test_related_model_types_refused_by_name(tmp_path, mtype, words):
    import json

    from paralayer.families import HFFormatError, load_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": mtype, "hidden_size": 64}))
    with pytest.raises(HFFormatError) as exc:
        load_hf_config(str(tmp_path))
    msg = str(exc.value)
    assert f'model_type="{mtype}" is not supported' in msg and words in msg and "\n" not in msg, msg


def test_families_never_reach_torch():
    from tests.test_imports import _graph

    graph = _graph()
    starts = [m for m in graph if m.startswith("paralayer.families")]
    assert len(starts) >= len(MODEL_TYPES) + 1
    seen, todo = set(starts), list(starts)
    while todo:
        for d in graph.get(todo.pop(), ()):
            assert d != "torch", "paralayer.families reaches torch"
            if d in graph and d not in seen:
                seen.add(d)
                todo.append(d)
