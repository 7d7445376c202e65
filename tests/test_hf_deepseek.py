"""DeepSeek-V3 imported from transformers' own save_pretrained and held to DeepseekV3ForCausalLM
(4 layers, n_group 4 > 1, topk_group 2 < 4, the first layer dense, q_lora_rank set, YaRN factor 4
with mscale_all_dim, a shared expert, routed scaling 2.5, a random selection bias), init std 0.2
with norm gains in U[0.5, 1.5), fp32: logits and every gradient within 1e-5 on one rank and under
ep2, pp2 (1f1b uneven 3+1, and dualpipev: 4 one-layer chunks), dp2·ZeRO-3, tp2, tp2+SP and cp2
(every layout in one forked world). The planted group pick by max fails it; a round trip under
ep2·pp2 loads back in transformers."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from paralayer.checkpoint import hf as hfmod
from paralayer.config.schema import ModelConfig
from paralayer.families import apply_hf_config
from paralayer.families.names import ours_to_hf
from paralayer.model import routing
from paralayer.model.transformer import Transformer
from tests.families import widen

SEQ, VOCAB, TOL = 32, 61, 1e-5
CFG = dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
           q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
           vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-6, tie_word_embeddings=False,
           rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=8,
                                beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


def save_deepseek(path: str, cfg: dict, seed: int, bias_seed: int):
    """transformers' DeepseekV3ForCausalLM of ``cfg`` widened (tests/families.py), a random selection
    bias, fp32, eval, sdpa, saved by its own save_pretrained into ``path``: the model."""
    import transformers

    model = widen(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg)), seed).float().eval()
    g = torch.Generator().manual_seed(bias_seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape, generator=g) * 0.1)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dsv3") / "src")
    return path, save_deepseek(path, CFG, 1, 9)


def _ours(path, mtp_depth: int = 0, init_std=None, seed: int = 0):
    """Our model with the weights of ``path`` (MTP depths and a fresh depth's init: test_hf_mtp)."""
    mcfg = ModelConfig()
    apply_hf_config(mcfg, path)
    mcfg.mtp.depth = mtp_depth
    if init_std is not None:
        mcfg.init_std = init_std
    with torch.device("meta"):
        model = Transformer(mcfg)
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    hfmod.load_hf_weights(model, path, mcfg, seed=seed)
    return model, mcfg


def _hf_grad(hf: dict, name: str, mcfg, rows) -> torch.Tensor:
    m = re.match(r"^layers\.(\d+)\.feed_forward\.(w[123])$", name)
    if m:
        i, w = m.groups()
        f = mcfg.moe.ffn_hidden
        if w == "w2":
            return hf[f"model.layers.{i}.mlp.experts.down_proj"].grad
        gu = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"].grad
        return gu[:, :f] if w == "w1" else gu[:, f:]
    key = ours_to_hf(name, family="qwen3_moe")  # mlp.gate.weight for the router
    return hfmod._deinterleave_rope(hf[key].grad, name, rows)


def _errors(ref, model, mcfg, path) -> tuple[float, dict]:
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=x, labels=x)
    out.loss.backward()
    got = model(x)
    F.cross_entropy(got[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
    hf, rows = dict(ref.named_parameters()), hfmod._rope_rows(path)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))  # noqa: E731
    return rel(got.detach(), out.logits.detach()), {n: rel(p.grad, _hf_grad(hf, n, mcfg, rows))
                                                    for n, p in model.named_parameters()}


def test_one_rank_matches_deepseek_v3(saved):
    path, ref = saved
    model, mcfg = _ours(path)
    assert mcfg.moe.n_group == 4 and mcfg.moe.topk_group == 2 and mcfg.moe.first_k_dense == 1
    assert mcfg.mla.q_lora_rank == 16 and mcfg.rope.type == "yarn" and mcfg.rope.factor == 4.0
    assert not model.layers["0"].is_moe and model.layers["1"].is_moe
    assert float(model.layers["1"].feed_forward.expert_bias.abs().sum()) > 0  # the bias was read
    err, grads = _errors(ref, model, mcfg, path)
    print(f"deepseek_v3: logits {err:.1e}, grads max {max(grads.values()):.1e} over {len(grads)}")
    assert err < TOL and max(grads.values()) < TOL, (err, grads)


def test_planted_group_pick_by_max_fails(saved, monkeypatch):
    from tests.test_routing import _groups_by_max

    monkeypatch.setattr(routing, "group_mask", _groups_by_max)
    path, ref = saved
    model, mcfg = _ours(path)
    err, _ = _errors(ref, model, mcfg, path)
    assert err > 1e-3, err


LAYOUTS = {"ep2": ["parallel.dp=2", "parallel.ep=2"],
           "pp2": ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.pp_layout=[3,1]"],
           "pp2_dualpipev": ["parallel.pp=2", "parallel.schedule=dualpipev"],  # 4 layers: 4 one-layer chunks
           "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
           "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
           "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "cp2": ["parallel.cp=2"]}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.dist import write_tokens

    return write_tokens(str(tmp_path_factory.mktemp("tok") / "t.jsonl"), 8, SEQ, VOCAB)


@pytest.fixture(scope="module")
def layout_results(saved, tokens):
    """{layout: [(loss, grads) per rank]}: every layout in turn in one forked 2-rank world."""
    from tests.test_hf_moe import _overrides, run_layouts

    return run_layouts({k: _overrides(saved[0], tokens, LAYOUTS[k]) for k in LAYOUTS}, timeout_s=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_deepseek_v3(saved, tokens, layout_results, layout):
    from tests.test_hf_moe import layout_errors, reference_loss

    path, ref = saved
    want = reference_loss(ref, tokens, 4)
    hf, rows = dict(ref.named_parameters()), hfmod._rope_rows(path)
    ours, mcfg = _ours(path)
    loss_err, errs = layout_errors(layout_results[layout], layout, want, lambda n: _hf_grad(hf, n, mcfg, rows))
    print(f"deepseek_v3 {layout}: loss {loss_err:.1e}, grads max {max(errs.values()):.1e} "
          f"({max(errs, key=errs.get)}) over {len(errs)}")
    names = {n for n, _ in ours.named_parameters()}
    assert set(errs) == names, sorted(names ^ set(errs))  # every parameter came back
    if layout == "pp2_dualpipev":  # the V: rank 0 holds the dense first layer and the last, rank 1 the middle
        held = [{n.split(".")[1] for n in g if n.startswith("layers.")} for _, g in layout_results[layout]]
        assert held == [{"0", "3"}, {"1", "2"}], held
    assert loss_err < TOL and max(errs.values()) < TOL, errs


def test_round_trip_under_ep2_pp2(saved, tokens, tmp_path):
    """Import → 2 steps under ep2·pp2 → export: transformers loads DeepseekV3ForCausalLM from it,
    its logits equal ours (re-imported) within 1e-6, and the trained router bias travels too."""
    import transformers

    from tests.dist import run_ranks
    from tests.test_hf_moe import _overrides, _round_trip_worker

    out = str(tmp_path / "export")
    run_ranks(_round_trip_worker, 4, _overrides(saved[0], tokens, [
        "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.pp_layout=[3,1]",
        "model.moe.bias_update_rate=0.01"]), out, timeout_s=300)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").float().eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert (back.config.n_group, back.config.topk_group, back.config.first_k_dense_replace) == (4, 2, 1)
    ours, _ = _ours(out)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = ours(x), back(input_ids=x).logits
    err = float((got - want).abs().max() / want.abs().max())
    src_bias = saved[1].model.layers[1].mlp.gate.e_score_correction_bias
    new_bias = back.model.layers[1].mlp.gate.e_score_correction_bias
    print(f"deepseek_v3 round trip: logits rel err {err:.1e}; bias moved {float((new_bias - src_bias).abs().max()):.1e}")
    assert err < 1e-6
    assert float((new_bias - src_bias).abs().max()) > 1e-3  # 2 steps of ±0.01 updates, exported
