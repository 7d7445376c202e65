"""Qwen3-Next (issue #47 item 1: Gated DeltaNet hybrids) against transformers 5.25's own
Qwen3NextForCausalLM (tests/qwen3_next_ref.py: linear, full, linear, full; MoE with the gated
shared expert; partial RoPE 0.5; init std 0.2), imported by ``model.init=hf:DIR``:

- one rank: logits within 1e-5 and every gradient within 1e-4 relative; planted errors move them
  past 100× those (the delta rule's gate applied after the update, RoPE on the whole head, the
  shared expert's gate dropped, the attention's output gate dropped);
- tp2 (with and without sequence parallel), pp2 (1f1b), dp2·ZeRO-3, ep2, cp2, cp2·tp2, cp2·dp2 with
  full recompute and cp2·pp2 through the runtime's step: loss within 1e-5, every gradient within
  1e-4 of transformers' on the same global batch; under cp2 the conv tail or the recurrent state
  not passed across the cp ranks (planted) moves them past 100× those;
- cp whose zigzag chunks are shorter than the conv's tail is refused by name (exit 2, one line);
- round trip: import → 2 steps → export; transformers loads Qwen3NextForCausalLM from it and its
  logits equal ours within 1e-6."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from paralayer.checkpoint.hf import load_hf_weights
from paralayer.config import ModelConfig
from paralayer.families import apply_hf_config, load_hf_config
from paralayer.families.names import ours_to_hf
from paralayer.model.linear import delta_rule
from paralayer.model.transformer import Transformer
from tests import qwen3_next_ref as q
from tests.families import VOCAB
from tests.qwen3_next_ref import SEQ

LOGITS_TOL, GRAD_TOL, BATCH = 1e-5, 1e-4, 4
# one thread in the test process (transformers' reference and the one-rank oracle run here; its ranks
# take one each): two OpenMP threads of each xdist worker on a loaded 2-core machine spin for nothing
torch.set_num_threads(1)


def _rel(got, want) -> float:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_next") / "hf")
    return path, q.save(path)


def _ours(path: str, edit=None):
    mcfg = ModelConfig()
    apply_hf_config(mcfg, path)
    if edit:
        edit(mcfg)
    with torch.device("meta"):
        model = Transformer(mcfg)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, mcfg)
    return model, mcfg


def hf_grad(hf: dict, name: str, ffn: int) -> torch.Tensor:
    """transformers' gradient for our parameter ``name`` (its experts are stacked as gate_up_proj /
    down_proj in the module, per expert in the checkpoint)."""
    m = re.match(r"^layers\.(\d+)\.feed_forward\.(w[123])$", name)
    if m:
        i, w = m.groups()
        if w == "w2":
            return hf[f"model.layers.{i}.mlp.experts.down_proj"].grad
        gu = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"].grad
        return gu[:, :ffn] if w == "w1" else gu[:, ffn:]
    return hf[ours_to_hf(name, family="qwen3_next")].grad


def _oracle(ref, model, want_grad=None) -> tuple[float, dict]:
    """(logits rel err, {our name: grad rel err}) against ``ref``; ``want_grad(hf params, name)``:
    transformers' gradient of our parameter (default :func:`hf_grad`; Qwen3.5's in tests/test_qwen3_5.py)."""
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=x, labels=x)
    out.loss.backward()
    got = model(x)
    F.cross_entropy(got[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
    hf = dict(ref.named_parameters())
    want = want_grad or (lambda params, n: hf_grad(params, n, q.CONFIG["moe_intermediate_size"]))
    return _rel(got.detach(), out.logits.detach()), {n: _rel(p.grad, want(hf, n)) for n, p in model.named_parameters()}


def test_config_read(saved):
    c = load_hf_config(saved[0])
    assert c["layer_types"] == ["linear", "full", "linear", "full"] and c["head_dim"] is None
    assert c["linear"] == {"k_heads": 2, "v_heads": 4, "head_k_dim": 16, "head_v_dim": 8, "conv_kernel": 4}
    assert c["attn_gate"] and c["norm_offset"] and c["rotary_fraction"] == 0.5 and c["qk_norm"]
    assert c["moe"]["shared_ffn_hidden"] == 48 and c["moe"]["shared_gate"] and c["moe"]["norm_topk_prob"]


def _gate_after_update(state, chunk_decay, k_to_end, v_new):
    return (state + k_to_end.transpose(-1, -2) @ v_new) * chunk_decay


def _no_attn_gate(model):
    for layer in model.layers.values():
        if getattr(layer.attention, "gated", False):
            fwd = layer.attention.forward
            layer.attention.forward = lambda x, cos, sin, f=fwd, a=layer.attention: _ungated(a, f, x, cos, sin)


def _ungated(att, fwd, x, cos, sin):
    """Planted: the gate half of q_proj read, but the output left ungated (sigmoid → 1)."""
    import paralayer.model.attention as attention

    orig = attention.torch.sigmoid
    attention.torch.sigmoid = torch.ones_like
    try:
        return fwd(x, cos, sin)
    finally:
        attention.torch.sigmoid = orig


PLANTS = {"gate_after_update": None, "rope_on_whole_head": lambda c: setattr(c, "rotary_fraction", 1.0),
          "shared_gate_dropped": lambda c: setattr(c.moe, "shared_gate", False), "attn_gate_dropped": None}


def test_one_rank_matches_transformers_and_plants_fail(saved, monkeypatch):
    path, ref = saved
    model, _ = _ours(path)
    logits, grads = _oracle(ref, model)
    print(f"qwen3_next: logits rel err {logits:.1e}, grads max {max(grads.values()):.1e} "
          f"({max(grads, key=grads.get)}) over {len(grads)}")
    assert logits < LOGITS_TOL and max(grads.values()) < GRAD_TOL, grads
    for plant, edit in PLANTS.items():
        with monkeypatch.context() as mp:
            if plant == "gate_after_update":
                mp.setattr(delta_rule, "next_state", _gate_after_update)
            bad, _ = _ours(path, edit)
            if plant == "attn_gate_dropped":
                _no_attn_gate(bad)
            e, g = _oracle(ref, bad)
        print(f"qwen3_next planted {plant}: logits rel err {e:.1e}, grads max {max(g.values()):.1e}")
        assert e > 100 * LOGITS_TOL and max(g.values()) > 100 * GRAD_TOL, (plant, e, max(g.values()))


# ------------------------------------------------------------------ multi-rank, through the runtime
LAYOUTS = {"pp2": ["parallel.pp=2", "parallel.schedule=1f1b"], "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
           "ep2": ["parallel.dp=2", "parallel.ep=2"], "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
           "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"], "cp2": ["parallel.cp=2"]}
#: planted under cp2 (tests/test_linear_cp.py's): the conv tail, or the recurrent state, not passed
CP_PLANTS = ("tail_not_passed", "state_not_passed")


def _overrides(path: str, data: str, layout: list) -> list:
    from tests.test_hf_moe import _overrides as moe_overrides

    return moe_overrides(path, data, list(layout) + [f"model.seq_len={SEQ}"])


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.dist import write_tokens

    return write_tokens(str(tmp_path_factory.mktemp("tok") / "t.jsonl"), 2 * BATCH, SEQ, VOCAB)


def _planted_cp_worker(rank, world, runs):
    """tests/test_families.py's _grads_worker for each (plant, overrides) of ``runs``, the plant (if
    any: "" is none) set in this forked rank for its run only."""
    from paralayer.parallel.context import linear_state
    from tests.test_families import _grads_worker as grads
    from tests.test_linear_cp import _no_state, _no_tail

    out, kept = [], (linear_state._Tails.apply, linear_state.cp_delta_rule)
    for plant, overrides in runs:
        if plant == "tail_not_passed":
            linear_state._Tails.apply = _no_tail
        elif plant == "state_not_passed":
            linear_state.cp_delta_rule = _no_state
        try:
            out += grads(rank, world, [overrides])
        finally:
            linear_state._Tails.apply, linear_state.cp_delta_rule = kept
    return out


@pytest.fixture(scope="module")
def two_rank_results(saved, tokens):
    """{layout or plant: [(loss, grads) per rank]}: every layout, then each planted cp2, in turn in
    ONE forked 2-rank world."""
    from tests.dist import run_ranks

    runs = {k: ("", _overrides(saved[0], tokens, LAYOUTS[k])) for k in LAYOUTS}
    runs.update({p: (p, _overrides(saved[0], tokens, LAYOUTS["cp2"])) for p in CP_PLANTS})
    res = run_ranks(_planted_cp_worker, 2, list(runs.values()), timeout_s=600)
    return {k: [r[i] for r in res] for i, k in enumerate(runs)}


@pytest.fixture(scope="module")
def layout_results(two_rank_results):
    """{layout: [(loss, grads) per rank]}."""
    return {k: two_rank_results[k] for k in LAYOUTS}


@pytest.fixture(scope="module")
def planted_cp_results(two_rank_results):
    """{plant: [(loss, grads) per rank]} under cp2."""
    return {p: two_rank_results[p] for p in CP_PLANTS}


def _check_layout(saved, tokens, results, layout) -> tuple[float, float]:
    """(loss rel err, worst grad rel err) of ``results`` against transformers'; every parameter came back."""
    from tests.test_hf_moe import layout_errors, reference_loss

    path, ref = saved
    want = reference_loss(ref, tokens, BATCH)
    hf, ffn = dict(ref.named_parameters()), q.CONFIG["moe_intermediate_size"]
    loss_err, errs = layout_errors(results, layout, want, lambda n: hf_grad(hf, n, ffn))
    print(f"qwen3_next {layout}: loss {loss_err:.1e}, grads max {max(errs.values()):.1e} ({max(errs, key=errs.get)}) "
          f"over {len(errs)}")
    assert set(errs) == {n for n, _ in _ours(path)[0].named_parameters()}
    return loss_err, max(errs.values())


@pytest.mark.timeout(900)  # the first test of a world runs all of that world's runs
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_transformers(saved, tokens, layout_results, layout, request):
    loss_err, grad_err = _check_layout(saved, tokens, layout_results[layout], layout)
    assert loss_err < LOGITS_TOL and grad_err < GRAD_TOL, (loss_err, grad_err)
    if layout == "cp2":
        for plant, res in request.getfixturevalue("planted_cp_results").items():
            p_loss, p_grad = _check_layout(saved, tokens, res, f"cp2 planted {plant}")
            assert p_loss > 100 * LOGITS_TOL and p_grad > 100 * GRAD_TOL, (plant, p_loss, p_grad)


#: cp2 combined with another axis, in one 4-rank world
CP_COMBINED = {"cp2_tp2": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
               "cp2_dp2_full_recompute": ["parallel.cp=2", "parallel.dp=2", "parallel.recompute=full"],
               "cp2_pp2": ["parallel.cp=2", "parallel.pp=2", "parallel.schedule=1f1b"]}


ROUND_TRIP = ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.schedule=1f1b"]


def _four_rank_worker(rank, world, runs, round_trip, out):
    """The CP_COMBINED runs (tests/test_hf_moe.py's _layouts_worker), then the round trip's 2 steps
    and export under ep2·pp2 (its _round_trip_worker), in one 4-rank world."""
    from tests.test_hf_moe import _layouts_worker, _round_trip_worker

    res = _layouts_worker(rank, world, runs)
    _round_trip_worker(rank, world, round_trip, out)
    return res


@pytest.fixture(scope="module")
def four_rank_results(saved, tokens, tmp_path_factory):
    """({layout: [(loss, grads) per rank]} of CP_COMBINED, the round trip's export folder): each tp
    rank passes its own heads' states; full recompute reruns the state pass; pp2 passes them within
    each stage."""
    from tests.dist import run_ranks

    out = str(tmp_path_factory.mktemp("qwen3_next_round_trip") / "export")
    res = run_ranks(_four_rank_worker, 4, [_overrides(saved[0], tokens, v) for v in CP_COMBINED.values()],
                    _overrides(saved[0], tokens, ROUND_TRIP), out, timeout_s=600)
    return {k: [r[i] for r in res] for i, k in enumerate(CP_COMBINED)}, out


@pytest.fixture(scope="module")
def cp_combined_results(four_rank_results):
    return four_rank_results[0]


@pytest.mark.timeout(900)  # the first test of a world runs all of that world's runs
@pytest.mark.parametrize("layout", list(CP_COMBINED))
def test_cp2_combined_matches_transformers(saved, tokens, cp_combined_results, layout):
    loss_err, grad_err = _check_layout(saved, tokens, cp_combined_results[layout], layout)
    assert loss_err < LOGITS_TOL and grad_err < GRAD_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("layout, words", [
    (["parallel.cp=2", "model.seq_len=8"], "parallel.cp: 2: a zigzag chunk (model.seq_len 8 / 2·cp = 2 tokens) "
                                           "is shorter than the linear layers' conv tail")])
def test_unbuilt_layouts_refused_by_name(layout, words, capsys):
    """launch.py's ``main`` in this process (a launch.py process costs ~3 CPU-s of imports)."""
    from paralayer.cli import main

    rc = main(["recipe=tiny-qwen3-next", "parallel.dp=1", "parallel.ep=1", *layout, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (rc, err)


@pytest.mark.timeout(900)  # the first test of a world runs all of that world's runs
def test_round_trip_under_ep2_pp2(saved, four_rank_results):
    """Import → 2 steps under ep2·pp2 → export: transformers loads Qwen3NextForCausalLM from it and
    its logits equal ours (re-imported) within 1e-5, as at import (the linear layers at this init turn
    fp32 rounding into ~5e-6: transformers against itself with its weights moved by 1e-7 relative
    parts by 1e-5 in logits), and its loss equals ours within 1e-5; the weights moved."""
    import transformers

    out = four_rank_results[1]  # trained and exported in the CP_COMBINED world
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").float().eval()
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    src = json.load(open(os.path.join(saved[0], "config.json")))
    exp = json.load(open(os.path.join(out, "config.json")))
    for key in ("layer_types", "rope_parameters", "linear_num_value_heads", "shared_expert_intermediate_size"):
        assert exp[key] == src[key], key
    ours, _ = _ours(out)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = ours(x), back(input_ids=x, labels=x)
        err = _rel(got, want.logits)
        loss = F.cross_entropy(got[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss_err = abs(loss.item() - want.loss.item()) / want.loss.item()
        moved = max(_rel(p, r) for p, r in zip(back.parameters(), saved[1].parameters()))
    print(f"qwen3_next round trip: logits rel err {err:.1e}, loss {loss_err:.1e}; weights moved {moved:.1e}")
    assert err < LOGITS_TOL and loss_err < LOGITS_TOL and moved > 1e-4


# ------------------------------------------------------------------ the planner's counts
def test_planner_counts_linear_layers():
    """Parameters: the resolver's total equals the model's own count (tiny-qwen3-next: three linear
    layers, one gated full layer, the gated shared expert). FLOPs: each linear layer's core is its
    delta rule's (model_parts.linear_core_fwd_flops), not attention's; the matmuls are 6 per weight
    per token, as torch's counter measures on one layer."""
    from torch.utils.flop_counter import FlopCounterMode

    from paralayer.config import load_config
    from paralayer.model.linear.gated_deltanet import GatedDeltaNet
    from paralayer.resolve import model_parts as parts
    from paralayer.resolve.cost.terms import layer_core_flops
    from paralayer.resolve.memory import parameter_counts

    cfg = load_config(recipe="tiny-qwen3-next")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assert parameter_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())
    li, h, s = cfg.model.linear, cfg.model.d_model, cfg.model.seq_len
    assert [parts.is_linear_layer(cfg, i) for i in range(4)] == [True, True, True, False]
    assert layer_core_flops(cfg, 0) == 3 * parts.linear_core_fwd_flops(cfg) != layer_core_flops(cfg, 3)
    layer = GatedDeltaNet(h, li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim, li.conv_kernel, li.chunk)
    x = torch.randn(1, s, h, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        layer(x).sum().backward()
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    assert counts["aten.mm"] == 6 * parts.linear_weights(cfg) * s


def test_rehearse_states_exact():
    """The rehearsal of tiny-qwen3-next (rank 0, dp2·ep2, and tp2): params, grads and optimizer bytes equal
    the plan's. Rehearsed from this process, as the next test (its rank still runs in a process of the
    rehearsal's fork server): a launch.py process per layout cost ~3 CPU-s of imports and a fork server."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve

    for layout in ([], ["parallel.tp=2", "parallel.dp=1", "parallel.ep=1"]):
        cfg = config_mod.load_config(["recipe=tiny-qwen3-next", *layout])
        plan = resolve(cfg).to_dict()
        assert not plan["errors"], plan["errors"]
        rank = R.rehearse(cfg, plan, [0])["ranks"][0]
        got, plan = rank["memory_bytes"], rank["plan_memory_bytes"]
        print(f"tiny-qwen3-next {layout} rehearsed: {got}; plan {plan}")
        assert all(got[k] == plan[k] for k in ("params", "grads", "optimizer")), (got, plan)
        if layout:  # tp2 with SP (7 Dec): the fused in_proj_qkvz's layers move ½ pair less than attention's
            # plus their conv/norm grads' all-reduces, and keep the gathered input (tp read 0.908, activations 1.013)
            ratios = rank["ratios"]
            assert abs(ratios["comm"]["tp"] - 1) < 1e-3 and abs(ratios["activations"] - 1) < 1e-3, ratios


def test_rehearse_counts_the_cp_state_passes(monkeypatch):
    """--rehearse of tiny-qwen3-next under cp2 (rank 0, in this process): the cp bytes the runtime
    sent (the full layer's ring, the linear layers' states and conv tails) equal the plan's; the
    states are (micro_batch, 4, 16, 16) in fp32, one per linear layer, microbatch and direction (rank
    0 has one neighbour). Planted: the plan without the linear layers' sends (resolve/cost/cp_sends.py)
    falls short."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve
    from paralayer.resolve.cost import cp_ring

    cfg = config_mod.load_config(["recipe=tiny-qwen3-next", "parallel.dp=1", "parallel.ep=1", "parallel.cp=2"])
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    out = R.rehearse(cfg, plan, [0])
    assert out["ok"], out.get("errors")
    rank = out["ranks"][0]
    states = [c for c in rank["collectives"] if c["axis"] == "cp" and c["kind"] == "send" and
              c["message_bytes"] == cfg.train.micro_batch * 4 * 16 * 16 * 4]
    print(f"tiny-qwen3-next cp2 rehearsed: cp ratio {rank['ratios']['comm']['cp']:.6f}, state sends {states}")
    assert sum(c["count"] for c in states) == 3 * 2 * out["microbatches"]
    assert rank["ratios"]["comm"]["cp"] == pytest.approx(1.0, abs=1e-9), rank["ratios"]
    assert all(rank["ratios"][k] == 1.0 for k in ("params", "grads", "optimizer")), rank["ratios"]
    monkeypatch.setattr(cp_ring, "linear_cp_traffic", lambda *a, **k: (0, 0))
    planted = R.driver.beside_the_plan(R.rehearsal_config(cfg, plan)[0], plan, rank)
    print(f"planted (no state/tail sends in the plan): cp ratio {planted['ratios']['comm']['cp']:.3f}")
    assert planted["ratios"]["comm"]["cp"] > 1.2, planted["ratios"]
    # activations (issue 47): the linear layers keep the snake rule's inputs and states (0.9988; 0.989
    # while the gated full layer's ring output counted twice); planted: the plan counting the chunked
    # rule's whole set under cp, as it did (0.716; the old plan read 0.711)
    import copy
    import dataclasses

    from paralayer.resolve.memory import linear_acts

    assert abs(rank["ratios"]["activations"] - 1) < 0.005, rank["ratios"]
    real = linear_acts._parts

    def chunked(cfg, lay):
        one = copy.deepcopy(cfg)
        one.model.seq_len //= lay.cp
        return real(one, dataclasses.replace(lay, cp=1))

    monkeypatch.setattr(linear_acts, "_parts", chunked)
    planted = R.driver.beside_the_plan(R.rehearsal_config(cfg, plan)[0], plan, rank)
    print(f"planted (the chunked rule's set under cp): activations {planted['ratios']['activations']:.3f}")
    assert planted["ratios"]["activations"] < 0.8, planted["ratios"]
