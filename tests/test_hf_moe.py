"""Qwen3-MoE both ways against transformers' own Qwen3MoeForCausalLM (init std 0.2, norm gains in
U[0.5, 1.5), fp32): import from its save_pretrained (first layer dense by mlp_only_layers, softmax
top-2 without renormalisation, q/k norms, head_dim 24 != 64/4), logits and every gradient within
1e-5 on one rank and under ep2, pp2 (1f1b and dualpipev), tp2 (with and without SP), cp2 and
dp2·ZeRO-3 (every layout in one forked world); a planted error (renormalising the top-k) fails; a round
trip (2 steps under ep2·pp2, export) loads in transformers with logits within 1e-6; and the
config.json we cannot express is refused naming the key."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from paralayer.checkpoint.hf import load_hf_weights
from paralayer.config.schema import ModelConfig
from paralayer.families import HFFormatError, apply_hf_config, load_hf_config
from paralayer.model.transformer import Transformer
from tests.dist import run_ranks, write_tokens
from tests.families import widen

SEQ, BATCH, TOL = 32, 4, 1e-5
VOCAB = 61  # tests.families.VOCAB: the shared grads worker trims padded vocab rows by it
CFG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
           vocab_size=VOCAB, max_position_embeddings=SEQ, mlp_only_layers=[0], decoder_sparse_step=1,
           norm_topk_prob=False, tie_word_embeddings=False, rms_norm_eps=1e-6)


def _save(path: str, **kw):
    import transformers

    c = transformers.Qwen3MoeConfig(**{**CFG, **kw})
    torch.manual_seed(0)
    model = widen(transformers.Qwen3MoeForCausalLM(c), 1).float().eval()
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3moe") / "src")
    return path, _save(path)


def _ours(path: str, plant: str | None = None):
    mcfg = ModelConfig()
    apply_hf_config(mcfg, path)
    if plant == "renormalise":
        mcfg.moe.norm_topk_prob = True
    with torch.device("meta"):
        model = Transformer(mcfg)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, mcfg)
    return model, mcfg


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _hf_grad(hf: dict, name: str, ffn: int) -> torch.Tensor:
    """transformers 5 keeps a layer's experts fused in memory (gate_up_proj = [w1; w3], down_proj)."""
    import re

    m = re.match(r"^layers\.(\d+)\.feed_forward\.(w[123]|gate\.weight)$", name)
    if m and m.group(2) != "gate.weight":
        i, w = m.groups()
        if f"model.layers.{i}.mlp.experts.down_proj" in hf:
            if w == "w2":
                return hf[f"model.layers.{i}.mlp.experts.down_proj"].grad
            gu = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"].grad
            return gu[:, :ffn] if w == "w1" else gu[:, ffn:]
    if m:
        return hf[f"model.layers.{m.group(1)}.mlp.gate.weight"].grad
    from paralayer.families.names import ours_to_hf

    return hf[ours_to_hf(name)].grad


def _batch():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _oracle(ref, model, mcfg) -> tuple[float, dict]:
    x = _batch()
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=x, labels=x)
    out.loss.backward()
    got = model(x)
    F.cross_entropy(got[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
    hf = dict(ref.named_parameters())
    return _rel(got.detach(), out.logits.detach()), {
        n: _rel(p.grad, _hf_grad(hf, n, mcfg.moe.ffn_hidden)) for n, p in model.named_parameters()}


def test_one_rank_matches_transformers_and_the_plant_fails(saved):
    path, ref = saved
    model, mcfg = _ours(path)
    assert mcfg.moe.first_k_dense == 1 and mcfg.moe.every == 1 and mcfg.moe.norm_topk_prob is False
    assert mcfg.qk_norm and mcfg.head_dim == 24 and not model.layers["0"].is_moe and model.layers["1"].is_moe
    err, grads = _oracle(ref, model, mcfg)
    print(f"qwen3_moe: logits {err:.1e}, grads max {max(grads.values()):.1e} over {len(grads)}")
    assert err < TOL and max(grads.values()) < TOL, (err, grads)
    bad, bcfg = _ours(path, "renormalise")
    e, g = _oracle(ref, bad, bcfg)
    assert e > 1e-3, e


@pytest.mark.parametrize("edit, key", [({"mlp_only_layers": [1]}, "mlp_only_layers"),
                                       ({"use_sliding_window": True}, "use_sliding_window")])
def test_what_we_cannot_express_is_refused(saved, tmp_path, edit, key):
    src = json.load(open(os.path.join(saved[0], "config.json")))
    src.update(edit)
    d = tmp_path / "edited"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(src))
    with pytest.raises(HFFormatError, match=key):
        load_hf_config(str(d))


def _overrides(path: str, data: str, layout: list) -> list:
    return ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"model.init=hf:{path}", f"model.seq_len={SEQ}",
            f"data.path={data}", "data.format=tokens", "data.shuffle=false", f"train.global_batch={BATCH}",
            "train.micro_batch=1", "train.steps=2", "train.precision=fp32", "train.grad_clip=1e9",
            "model.moe.aux_loss_coef=0", "train.threads=1", "logging.wandb.mode=disabled"] + list(layout)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(str(tmp_path_factory.mktemp("tok") / "t.jsonl"), 2 * BATCH, SEQ, VOCAB)


def _grads_worker(rank, world, overrides):
    from tests.test_families import _grads_worker as grads

    return grads(rank, world, [overrides])[0]


LAYOUTS = {"ep2": ["parallel.dp=2", "parallel.ep=2"], "pp2": ["parallel.pp=2", "parallel.schedule=1f1b"],
           "pp2_dualpipev": ["parallel.pp=2", "parallel.schedule=dualpipev"],  # 4 layers: 4 one-layer chunks
           "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
           "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "cp2": ["parallel.cp=2"], "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"]}


def _layouts_worker(rank, world, runs):
    from tests.test_families import _grads_worker as grads

    return grads(rank, world, runs)


PLANT = "tp2_sp"  # the renormalised top-k (config.json edited) also runs under this layout: it must fail


@pytest.fixture(scope="module")
def layout_results(saved, tokens, tmp_path_factory):
    """{layout: [(loss, grads) per rank]}: every layout in turn in one forked 2-rank world, then the
    planted copy under PLANT (keyed "planted")."""
    import shutil

    bad = str(tmp_path_factory.mktemp("planted") / "renormalise")
    shutil.copytree(saved[0], bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["norm_topk_prob"] = True
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    runs = {k: _overrides(saved[0], tokens, LAYOUTS[k]) for k in LAYOUTS}
    return run_layouts({**runs, "planted": _overrides(bad, tokens, LAYOUTS[PLANT])}, timeout_s=300)


def run_layouts(runs: dict, timeout_s: float) -> dict:
    """{layout: [(loss, grads) per rank]}: each layout's overrides in ``runs`` in turn, in one forked
    2-rank world (the MoE and hybrid families' layout tests share it)."""
    res = run_ranks(_layouts_worker, 2, list(runs.values()), timeout_s=timeout_s)
    return {k: [r[i] for r in res] for i, k in enumerate(runs)}


def reference_loss(ref, tokens: str, rows: int) -> float:
    """transformers' loss on the first ``rows`` sequences of ``tokens``, backward run: its grads are on ``ref``."""
    x = torch.tensor([json.loads(line)["input_ids"] for line in open(tokens)][:rows])
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=x, labels=x)
    out.loss.backward()
    return out.loss.item()


def layout_errors(res, layout: str, want_loss: float, want_grad) -> tuple[float, dict]:
    """(loss rel err, {our name: grad rel err}) of the ranks' results; ``want_grad(name)`` is
    transformers' gradient. Under ep each rank holds half of the experts: stacked back in rank order;
    every other layout hands back full gradients (the same on every rank that holds the parameter)."""
    grads = {}
    for _, g in res:
        for n, v in g.items():
            grads.setdefault(n, []).append(torch.from_numpy(v))
    errs = {}
    for n, gs in grads.items():
        g = torch.cat(gs) if layout == "ep2" and n.split(".")[-1] in ("w1", "w2", "w3") else gs[0]
        errs[n] = _rel(g, want_grad(n))
        if layout != "ep2":
            errs[n] = max(errs[n], *(_rel(h, want_grad(n)) for h in gs))
    return max(abs(r[0] - want_loss) / want_loss for r in res), errs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_transformers(saved, tokens, layout_results, layout):
    path, ref = saved
    want = reference_loss(ref, tokens, BATCH)
    hf = dict(ref.named_parameters())
    ffn = CFG["moe_intermediate_size"]
    loss_err, errs = layout_errors(layout_results[layout], layout, want, lambda n: _hf_grad(hf, n, ffn))
    names = {n for n, _ in _ours(path)[0].named_parameters()}
    print(f"qwen3_moe {layout}: loss {loss_err:.1e}, grads max {max(errs.values()):.1e} ({max(errs, key=errs.get)}) "
          f"over {len(errs)}")
    assert set(errs) == names, sorted(names ^ set(errs))  # every parameter came back
    if layout == "pp2_dualpipev":  # the V: rank 0 holds the first and the last layer, rank 1 the middle two
        held = [{n.split(".")[1] for n in g if n.startswith("layers.")} for _, g in layout_results[layout]]
        assert held == [{"0", "3"}, {"1", "2"}], held
    if layout == PLANT:
        p_loss, p_errs = layout_errors(layout_results["planted"], layout, want, lambda n: _hf_grad(hf, n, ffn))
        print(f"qwen3_moe {layout} planted renormalise: loss {p_loss:.1e}, grads max {max(p_errs.values()):.1e}")
        assert p_loss > 100 * TOL and max(p_errs.values()) > 100 * TOL, (p_loss, p_errs)
    assert loss_err < TOL and max(errs.values()) < TOL, errs


def _round_trip_worker(rank, world, overrides, out):
    from tests.test_families import _round_trip_worker as rt

    return rt(rank, world, [(overrides, out)])


def test_round_trip_under_ep2_pp2(saved, tokens, tmp_path):
    import transformers

    out = str(tmp_path / "export")
    run_ranks(_round_trip_worker, 4, _overrides(saved[0], tokens, ["parallel.dp=2", "parallel.ep=2",
                                                                      "parallel.pp=2", "parallel.schedule=1f1b"]),
              out, timeout_s=300)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").float().eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    assert back.config.mlp_only_layers == [0] and back.config.norm_topk_prob is False
    ours, _ = _ours(out)
    x = _batch()
    with torch.no_grad():
        err = _rel(ours(x), back(input_ids=x).logits)
        moved = max(_rel(p, q) for p, q in zip(back.parameters(), saved[1].parameters()))
    print(f"qwen3_moe round trip: logits rel err {err:.1e}; weights moved {moved:.1e}")
    assert err < 1e-6 and moved > 1e-4
