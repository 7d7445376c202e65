"""Kimi K2's config.json through the deepseek_v3 family (registry ALIASES): a tiny Kimi-K2-shaped
DeepseekV3ForCausalLM (384 experts scaled to 12, 64 heads to 2, top-8, one shared expert, one dense
layer, no groups, routed scaling 2.827, YaRN with beta_fast = beta_slow = 1) saved by transformers,
its config.json then given Kimi's model_type kimi_k2 and auto_map, is imported by model.init's
reader and held to transformers at init std 0.2 (logits and every gradient within 1e-5, one rank);
V3's routed scaling 2.5 planted fails it. And the full-size config.json: transformers' own class
built on the meta device counts the parameters the plan counts."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from paralayer.model import routing
from tests.test_hf_deepseek import SEQ, TOL, VOCAB, _errors, _ours, save_deepseek
from tests.test_kimi_k2 import KIMI_K2_CONFIG

#: Kimi K2's traits at CPU size; rope dims 6 over an original context of 8: YaRN's step (low = high)
#: falls inside the rope dims, so positions past 8 see Kimi's interpolated frequencies
TINY = dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, n_routed_experts=12, num_experts_per_tok=8, n_group=1, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.827, norm_topk_prob=True,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
            vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=8,
                                 beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kimi") / "src")
    model = save_deepseek(path, TINY, 2, 11)
    fp = os.path.join(path, "config.json")
    with open(fp) as f:
        hf = json.load(f)
    hf.update(model_type="kimi_k2", architectures=KIMI_K2_CONFIG["architectures"], auto_map=KIMI_K2_CONFIG["auto_map"])
    with open(fp, "w") as f:
        json.dump(hf, f)
    return path, model


def test_one_rank_matches_transformers_and_routed_scaling_planted_fails(saved):
    path, ref = saved
    model, mcfg = _ours(path)
    m = mcfg.moe
    assert (m.num_experts, m.top_k, m.n_group, m.first_k_dense, m.routed_scaling_factor) == (12, 8, 1, 1, 2.827)
    assert mcfg.rope.beta_fast == mcfg.rope.beta_slow == 1.0 and mcfg.rope_theta == 50000.0
    err, grads = _errors(ref, model, mcfg, path)
    print(f"kimi_k2 (tiny): logits {err:.1e}, grads max {max(grads.values()):.1e} over {len(grads)}")
    assert err < TOL and max(grads.values()) < TOL, (err, grads)
    planted = 0
    for mod in model.modules():  # planted: DeepSeek-V3's routed scaling in place of Kimi's
        spec = getattr(mod, "spec", None)
        if isinstance(spec, routing.RouterSpec) and spec.routed_scaling_factor == 2.827:
            mod.spec, planted = dataclasses.replace(spec, routed_scaling_factor=2.5), planted + 1
    assert planted == 2  # the two MoE layers
    model.zero_grad(set_to_none=True)
    assert _errors(ref, model, mcfg, path)[0] > 100 * TOL


def test_full_size_count_is_transformers_own(tmp_path):
    import transformers

    from paralayer.config import load_config
    from paralayer.resolve import memory

    keep = {k: v for k, v in KIMI_K2_CONFIG.items()
            if k not in ("architectures", "auto_map", "model_type", "torch_dtype", "transformers_version")}
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**keep))
    theirs = sum(p.numel() for p in model.parameters())
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2_CONFIG))
    ours = memory.parameter_counts(load_config(["recipe=kimi-k2", f"model.init=hf:{tmp_path}"]))
    assert ours["total"] == theirs == memory.parameter_counts(load_config(["recipe=kimi-k2"]))["total"]
