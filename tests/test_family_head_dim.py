"""head_dim from config.json, read per family as transformers derives it (issue #46: a Qwen3-MoE
config.json without ``head_dim`` was read as Qwen3's 128; Qwen3MoeConfig has no such default and
its attention takes hidden_size // num_attention_heads). The oracle is transformers' own attention
module built from the same config.json: the width of its heads, or its error where it cannot be
built. Fast: one tiny attention module per case, no rank started."""
from __future__ import annotations

import importlib
import json
import warnings

import pytest

from paralayer.families import FAMILIES, HFFormatError, load_hf_config

D, HEADS = 64, 4
BASE = {"hidden_size": D, "num_attention_heads": HEADS, "num_key_value_heads": 2, "intermediate_size": 96,
        "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64}
EXTRA = {"mixtral": {"num_local_experts": 4}, "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32}}
GQA = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe")
ABSENT = object()


def _theirs(mtype: str, hf: dict):
    """transformers' head width for config.json ``hf`` (None: its attention cannot be built)."""
    from transformers import CONFIG_MAPPING

    cls = FAMILIES[mtype].HF_CLASS[: -len("ForCausalLM")] + "Attention"
    mod = importlib.import_module(f"transformers.models.{mtype}.modeling_{mtype}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            attn = getattr(mod, cls)(CONFIG_MAPPING[mtype].from_dict(hf), layer_idx=0)
    except Exception:  # noqa: BLE001 - transformers refuses the config (strict) or fails on it
        return None
    return attn.q_proj.out_features // HEADS


def _ours(path) -> int | None:
    try:
        fields = load_hf_config(str(path))
    except HFFormatError:
        return None
    return fields["head_dim"] or fields["d_model"] // fields["n_heads"]


@pytest.mark.parametrize("mtype", GQA)
@pytest.mark.parametrize("head_dim", [ABSENT, None, 24], ids=["absent", "null", "24"])
def test_head_dim_as_transformers_reads_it(mtype, head_dim, tmp_path):
    hf = {**BASE, **EXTRA.get(mtype, {}), "model_type": mtype}
    if head_dim is not ABSENT:
        hf["head_dim"] = head_dim
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert _ours(tmp_path) == _theirs(mtype, hf)


def test_qwen3_moe_without_head_dim_is_not_qwen3s_128(tmp_path):
    """The bug itself, in numbers: 64 / 4 = 16 (the old reading gave 128, a model 8x wider per head)."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **EXTRA["qwen3_moe"], "model_type": "qwen3_moe"}))
    assert load_hf_config(str(tmp_path))["head_dim"] is None  # = d_model / n_heads = 16
    assert _theirs("qwen3_moe", {**BASE, **EXTRA["qwen3_moe"]}) == 16


DSV3 = {**BASE, "num_key_value_heads": 4, "model_type": "deepseek_v3", "n_routed_experts": 4, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def _deepseek_runs(hf: dict) -> bool:
    """Whether transformers' DeepseekV3ForCausalLM builds from ``hf`` and runs a forward pass."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(hf))
            model(torch.arange(6).unsqueeze(0))
    except Exception:  # noqa: BLE001 - the config is refused or the model fails on it
        return False
    return True


@pytest.mark.parametrize("edit", [{}, {"head_dim": 8}, {"head_dim": 6}, {"head_dim": 7}, {"head_dim": None},
                                  {"head_dim": None, "hidden_size": 32}, {"head_dim": 0}],
                         ids=["absent", "rope", "6", "odd", "null", "null-quotient-is-rope", "0"])
def test_deepseek_v3_head_dim_is_its_rope_width(edit, tmp_path):
    """transformers 5.25 takes DeepSeek-V3's RoPE tables ``head_dim or hidden // heads`` wide
    (absent: qk_rope_head_dim): we read the file iff its own model runs on it."""
    hf = {**DSV3, **edit}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    try:
        fields = load_hf_config(str(tmp_path))
    except HFFormatError as exc:
        assert "head_dim" in str(exc)
        fields = None
    assert (fields is not None) == _deepseek_runs(hf)
    if fields is not None:
        assert fields["head_dim"] is None and fields["mla"]["qk_rope_head_dim"] == 8
