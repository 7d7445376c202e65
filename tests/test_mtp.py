"""Multi-token prediction against a plain torch rewrite of the DeepSeek-V3 report's equations
(§2.2, written here with shrinking sequences: depth k sees positions 0 … s−k−1), one process;
our runtime's ``loss``, ``mtp_loss`` and every parameter's gradient must match it within 1e-5 on
one rank, under tp2 (+SP), pp2 (1f1b, dualpipev), dp2·ZeRO-2 with full recompute and dp2·ZeRO-1
(ZeRO-3, cp and tied embeddings under pp are refused with MTP: tests/test_mtp.py::test_refused). A planted error (the concatenation
[h; e] instead of [e; h], the embedding of t_{i+k+1} instead of t_{i+k}) must fail it."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.dist import TINY_SMALL, cfg_and_plan, run_ranks

LAMBDA, DEPTH = 0.3, 2
MTP = TINY_SMALL + ["model.n_layers=2", "model.seq_len=32", "model.d_model=64", "model.n_heads=4",
                    "model.n_kv_heads=2", "model.ffn_hidden=96", "train.global_batch=4",
                    "train.micro_batch=2", "train.grad_clip=1e9", "train.precision=fp32", "train.threads=1",
                    f"model.mtp.depth={DEPTH}", f"model.mtp.loss_weight={LAMBDA}"]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _oracle(model, tokens, cfg):
    """CE_main, L_MTP and the full gradients of CE_main + L_MTP, by the report's equations."""
    from paralayer.model.positions import rope_cos_sin

    b, s = tokens.shape
    eps = cfg.norm_eps
    W_emb, W_head = model.tok_embeddings.weight, model.output.weight
    cos, sin = rope_cos_sin(torch.arange(s), model.head_dim, cfg.rope_theta, torch.float32, cfg.rope)
    h = W_emb[tokens]
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    h = _rms(h, model.norm.weight, eps)  # h^0
    ce_main = F.cross_entropy(F.linear(h, W_head)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    ces = []
    for k, depth in enumerate(model.mtp.layers.values(), start=1):
        n = s - k  # positions i = 0 … s−k−1 carry t_{i+k}
        e = W_emb[tokens[:, k:]]  # Emb(t_{i+k})
        x = F.linear(torch.cat([_rms(e, depth.enorm.weight, eps), _rms(h[:, :n], depth.hnorm.weight, eps)], -1),
                     depth.eh_proj.weight)
        h = _rms(depth.block(x, cos[:n], sin[:n]), depth.norm.weight, eps)  # h^k, length s−k
        logits = F.linear(h[:, :n - 1], W_head)  # predicts t_{i+k+1}, i ≤ s−k−2
        ces.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1:].flatten()))
    l_mtp = LAMBDA / DEPTH * sum(ces)
    (ce_main + l_mtp).backward()
    return float(ce_main), float(l_mtp), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _step(run, tokens_labels):
    from paralayer.runtime import mtp_step
    from paralayer.runtime.train import forward_backward, reduce_and_clip_tensors

    tokens, labels = tokens_labels
    run.opt.zero_grad(set_to_none=True)
    mtp_step.reset(run.built.chunks)
    loss, _ = reduce_and_clip_tensors(run, forward_backward(run, tokens, labels))
    rec = mtp_step.step_loss(run.built.chunks, run.meshes, run.degree["pp"], DEPTH, run.device)
    return float(loss), rec["mtp_loss"]


def _worker(rank, world, overrides, plant):
    from paralayer.model import mtp as mtp_mod
    from paralayer.parallel.tensor import full_grads
    from paralayer.runtime.train import as_plan, setup, step_batch

    if plant == "concat_order":
        def fwd(self, h, e, cos, sin):
            return self.norm(self.block(self.eh_proj(torch.cat([self.hnorm(h), self.enorm(e)], -1)), cos, sin))
        mtp_mod.MTPLayer.forward = fwd
    elif plant == "embedding_shift":
        mtp_mod.MultiTokenPrediction.forward = _planted_forward
    cfg, plan = cfg_and_plan(MTP + list(overrides))
    run = setup(cfg, as_plan(plan), None)
    out = {}
    if world == 1:  # the oracle on the same initial weights and the global batch
        from paralayer.model.transformer import Transformer, init_weights

        ref = Transformer(cfg.model)
        init_weights(ref, cfg.model, cfg.train.seed)
        tokens = run.dataset.get_batch(1, 0, 1, cfg.train.global_batch)
        out["oracle"] = _oracle(ref, tokens, cfg.model)
    loss, mtp_loss = _step(run, step_batch(run, 1))
    grads = {}
    for chunk in run.built.chunks:
        for name, g in full_grads(chunk):
            # numpy: pickled by value (a tensor would travel as shared memory the child must outlive)
            grads[name.replace("_checkpoint_wrapped_module.", "")] = None if g is None else g.detach().numpy().copy()
    out.update(loss=loss, mtp_loss=mtp_loss, grads=grads)
    return out


def _planted_forward(self, h0, labels, cos, sin, embedding, head):
    """MultiTokenPrediction.forward reading Emb(t_{i+k+1}): one place too far."""
    from paralayer.model import mtp as mtp_mod

    out, h = [], h0
    for k, layer in enumerate(self.layers.values(), start=1):
        ids = mtp_mod._shift(labels, k).clamp(min=0)  # should be k − 1
        h = layer(h, embedding(ids), cos, sin)
        out.append((head(h), mtp_mod._shift(labels, k)))
    return out


@pytest.fixture(scope="module")
def oracle():
    return run_ranks(_worker, 1, ["parallel.dp=1"], None)[0]


def _errors(got: list[dict], want) -> tuple[float, float, float]:
    ce_main, l_mtp, grads = want
    merged = {}
    for r in got:
        for n, g in r["grads"].items():
            if g is not None:
                merged.setdefault(n, torch.from_numpy(g))
    gerr = 0.0
    grads = {n: torch.from_numpy(g) for n, g in grads.items()}
    for n, g in grads.items():
        ours = merged[n]
        gerr = max(gerr, float((ours - g).abs().max() / g.abs().max().clamp(min=1e-12)))
    # the last stage's embedding copy carries the summed gradient too
    if "mtp.embed.weight" in merged:
        e = grads["tok_embeddings.weight"]
        gerr = max(gerr, float((merged["mtp.embed.weight"][: e.shape[0]] - e).abs().max() / e.abs().max()))
    return abs(got[0]["loss"] - ce_main) / ce_main, abs(got[0]["mtp_loss"] - l_mtp) / l_mtp, gerr


def test_one_rank_matches_the_equations(oracle):
    assert set(oracle["oracle"][2]) == set(oracle["grads"])
    assert any(n.startswith("mtp.layers.1.") for n in oracle["grads"])
    errs = _errors([oracle], oracle["oracle"])
    assert max(errs) < 1e-5, errs
    assert oracle["oracle"][1] > 0.1 and math.isfinite(oracle["mtp_loss"])


LAYOUTS = {
    "tp2": (2, ["parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2_1f1b": (2, ["parallel.dp=1", "parallel.pp=2", "parallel.schedule=1f1b"]),
    "pp2_dualpipev": (2, ["parallel.dp=1", "parallel.pp=2", "parallel.schedule=dualpipev", "model.n_layers=4",
                          "train.global_batch=8"]),
    # issue 45's balanced V: rank 0 holds the embedding alone and the head + MTP alone
    "pp2_dualpipev_empty_ends": (2, ["parallel.dp=1", "parallel.pp=2", "parallel.schedule=dualpipev",
                                     "model.n_layers=4", "train.global_batch=8", "parallel.pp_layout=[0,2,2,0]"]),
    "dp2_zero2_recompute": (2, ["parallel.dp=2", "parallel.zero=2", "parallel.recompute=full"]),
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero=1"]),
}


_ORACLE4: dict = {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_the_equations(oracle, name):
    world, overrides = LAYOUTS[name]
    want = oracle["oracle"]
    if "model.n_layers=4" in overrides:  # one 4-layer oracle for the dualpipev layouts
        if "four" not in _ORACLE4:
            _ORACLE4["four"] = run_ranks(_worker, 1, ["parallel.dp=1", "model.n_layers=4", "train.global_batch=8"],
                                         None)[0]["oracle"]
        want = _ORACLE4["four"]
    got = run_ranks(_worker, world, overrides, None)
    errs = _errors(got, want)
    print(name, "loss, mtp_loss, grad errors:", errs)
    assert max(errs) < 1e-5, (name, errs)


@pytest.mark.parametrize("plant", ["concat_order", "embedding_shift"])
def test_planted_errors_fail(oracle, plant):
    got = run_ranks(_worker, 1, ["parallel.dp=1"], plant)[0]
    errs = _errors([got], oracle["oracle"])
    assert errs[1] > 1e-4 or errs[2] > 1e-3, (plant, errs)


@pytest.mark.parametrize("extra", [["parallel.dp=2", "parallel.zero=3"], ["parallel.dp=1", "parallel.cp=2"],
                                   ["parallel.dp=1", "parallel.pp=2", "model.tie_embeddings=true"]])
def test_refused(extra):
    """The resolver refuses them naming the field (before any rank starts), and build_model too."""
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve
    from paralayer.runtime.build import build_model

    cfg = load_config(MTP + extra)
    plan = resolve(cfg).to_dict()
    assert [e["field"] for e in plan["errors"]] == ["model.mtp.depth"], plan["errors"]
    plan["errors"] = []
    with pytest.raises(ValueError, match="model.mtp.depth"):
        build_model(cfg, plan, None, torch.device("cpu"))


def _records(rank, world, overrides):
    from tests.dist import train_records

    return [(r["loss"], r["mtp_loss"]) for r in train_records(MTP + list(overrides))]


def test_mtp_loss_with_moe_under_pp_counts_only_real_microbatches():
    """With MoE blocks (and so the stages' forward wrapper of runtime/moe_step.py), the pipeline's
    first-step shape inference once fed the loss a garbage MTP pass: step 1's mtp_loss was NaN
    under 1f1b. Every step's mtp_loss must equal one rank's."""
    moe = ["train.steps=2", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=32",
           "model.moe.router=sigmoid", "model.moe.aux_loss_coef=0"]
    ref = run_ranks(_records, 1, moe + ["parallel.dp=1"])[0]
    got = run_ranks(_records, 2, moe + ["parallel.dp=1", "parallel.pp=2", "parallel.schedule=1f1b"])[0]
    assert len(got) == len(ref) == 2
    for (l1, m1), (l0, m0) in zip(got, ref):
        assert m1 is not None and math.isfinite(m1), got
        assert abs(l1 - l0) / l0 < 1e-5 and abs(m1 - m0) / m0 < 1e-5, (got, ref)
