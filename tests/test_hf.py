"""Hugging Face as the oracle of our forward and backward, and our import/export.

Llama and Mixtral from ``transformers`` at a wide random init (std 0.2, norm gains uniform in
[0.5, 1.5), sequences of 64 tokens so RoPE's angles turn), loaded into ours through our import
path (paralayer/checkpoint/hf.py): logits within 1e-5 relative, every parameter's gradient within
1e-5 relative, and the Hugging Face name of every parameter asserted against a literal table
written here (not our map). A RoPE base off by 2× or norm gains replaced by ones fails the check.
Also: config mapping, bitwise export round trip, sharded safetensors, and import/export under
tensor and expert parallel (the latter through ``model.init=hf:`` and build_model) on 2 gloo ranks."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from paralayer.checkpoint.hf import export_hf, load_hf_weights
from paralayer.config import ModelConfig
from paralayer.families import apply_hf_config, load_hf_config
from paralayer.families.names import hf_to_ours, ours_to_hf
from paralayer.model.transformer import Transformer, padded_vocab
from tests.dist import cfg_and_plan, run_ranks


class _LazyTransformers:
    """Import transformers on first use, not at collection: importing it in the pytest process
    before other test files fork their gloo ranks can deadlock those children."""

    def __getattr__(self, name):
        import transformers as mod  # a dev dependency (pyproject): never skipped

        return getattr(mod, name)


transformers = _LazyTransformers()

SEQ, VOCAB, THETA, E, F_HID = 64, 61, 5000.0, 4, 48
SMALL = dict(hidden_size=32, intermediate_size=F_HID, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-6, max_position_embeddings=SEQ)
LOGITS_TOL = GRAD_TOL = 1e-5  # relative to the largest |value| of the tensor compared

# Our name -> the Hugging Face name, written out here (not derived from paralayer's map).
_LAYER_NAMES = [("attention.wq.weight", "self_attn.q_proj.weight"), ("attention.wk.weight", "self_attn.k_proj.weight"),
                ("attention.wv.weight", "self_attn.v_proj.weight"), ("attention.wo.weight", "self_attn.o_proj.weight"),
                ("attention_norm.weight", "input_layernorm.weight"),
                ("ffn_norm.weight", "post_attention_layernorm.weight")]
_DENSE_NAMES = [("feed_forward.w1.weight", "mlp.gate_proj.weight"), ("feed_forward.w3.weight", "mlp.up_proj.weight"),
                ("feed_forward.w2.weight", "mlp.down_proj.weight")]
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
LLAMA_NAMES = {**_TOP_NAMES, **{f"layers.{i}.{o}": f"model.layers.{i}.{h}"
                                for i in range(2) for o, h in _LAYER_NAMES + _DENSE_NAMES}}
# Mixtral: the router, and experts stacked (E, ...) on our side; per-expert keys in the file
_ROUTER = [("feed_forward.gate.weight", "block_sparse_moe.gate.weight")]
MIXTRAL_NAMES = {**_TOP_NAMES, **{f"layers.{i}.{o}": f"model.layers.{i}.{h}"
                                  for i in range(2) for o, h in _LAYER_NAMES + _ROUTER}}
MIXTRAL_EXPERT_KEYS = {f"layers.{i}.feed_forward.{w}": [f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight"
                                                        for j in range(E)]
                       for i in range(2) for w in ("w1", "w2", "w3")}


def _widen(model, seed: int):
    """Hugging Face's init (std 0.02, norm gains 1) hides errors: std 0.2, gains in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _save_llama(path, tie=False, shard=None):
    cfg = transformers.LlamaConfig(**SMALL, rope_theta=THETA, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = _widen(transformers.LlamaForCausalLM(cfg).float().eval(), 0)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return model


def _save_mixtral(path):
    cfg = transformers.MixtralConfig(**SMALL, num_local_experts=E, num_experts_per_tok=2, rope_theta=THETA,
                                     router_aux_loss_coef=0.02)
    torch.manual_seed(1)
    model = _widen(transformers.MixtralForCausalLM(cfg).float().eval(), 1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _ours(path, vocab_padded=None, plant=None):
    """Our model from the checkpoint at ``path`` through our import path; ``plant``: an error put
    into our side ("rope_x2": RoPE base doubled; "norms_to_one": every norm gain set to 1)."""
    mcfg = ModelConfig()
    apply_hf_config(mcfg, path)
    assert mcfg.rope_theta == THETA or not os.path.isfile(os.path.join(path, "config.json"))
    if plant == "rope_x2":
        mcfg.rope_theta *= 2
    with torch.device("meta"):
        model = Transformer(mcfg, vocab_padded)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, mcfg)
    if plant == "norms_to_one":
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.fill_(1.0)
    return model.eval(), mcfg


def _hf_tensors(path):
    out = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _logits_hf(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _fwd_bwd(model, x, y, hf: bool):
    """(logits, {name: grad}) for the mean cross-entropy of the logits against ``y``."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=x).logits if hf else model(x)[..., :VOCAB]
    F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _hf_grad_for(ours_name: str, hf_grads: dict, moe: bool) -> torch.Tensor:
    """The Hugging Face gradient of our parameter: by the literal tables above; transformers 5
    keeps Mixtral's experts fused in memory (gate_up_proj (E, 2F, d): gate rows, then up rows)."""
    if moe and ours_name.startswith("layers.") and ".feed_forward." in ours_name:
        i, leaf = ours_name.split(".")[1], ours_name.split(".", 3)[3]
        if leaf == "gate.weight":
            return hf_grads[f"model.layers.{i}.mlp.gate.weight"]
        if leaf == "w2":
            return hf_grads[f"model.layers.{i}.mlp.experts.down_proj"]
        gu = hf_grads[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        return gu[:, :F_HID] if leaf == "w1" else gu[:, F_HID:]
    return hf_grads[(MIXTRAL_NAMES if moe else LLAMA_NAMES)[ours_name]]


def _oracle_errors(ref, model, moe: bool) -> tuple[float, dict]:
    """(logits rel err, {our param: grad rel err}) of ours against the Hugging Face model."""
    x, y = _tokens()
    want, hf_grads = _fwd_bwd(ref, x, y, hf=True)
    got, grads = _fwd_bwd(model, x, y, hf=False)
    return _rel(got, want), {n: _rel(g, _hf_grad_for(n, hf_grads, moe)) for n, g in grads.items()}


def _check_names(model, src: str, moe: bool) -> None:
    """Every parameter's Hugging Face name is the literal one; the file holds exactly those keys."""
    names, experts = (MIXTRAL_NAMES, MIXTRAL_EXPERT_KEYS) if moe else (LLAMA_NAMES, {})
    ours = [n for n, _ in model.named_parameters()]
    assert sorted(ours) == sorted(list(names) + list(experts))
    for n in ours:
        if n in experts:
            for j, key in enumerate(experts[n]):
                assert ours_to_hf(n, expert=j) == key and hf_to_ours(key) == (n, j), (n, j)
        else:
            assert ours_to_hf(n) == names[n] and hf_to_ours(names[n]) == (n, None), n
    assert sorted(_hf_tensors(src)) == sorted(list(names.values()) + [k for ks in experts.values() for k in ks])


def _oracle_and_round_trip(tmp_path, save, moe: bool):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    ref = save(src)
    model, mcfg = _ours(src)
    _check_names(model, src, moe)
    logits_err, grad_errs = _oracle_errors(ref, model, moe)
    worst = max(grad_errs, key=grad_errs.get)
    print(f"{'mixtral' if moe else 'llama'}: logits rel err {logits_err:.1e}; grads max rel err "
          f"{grad_errs[worst]:.1e} ({worst}) over {len(grad_errs)} parameters")
    assert logits_err < LOGITS_TOL, logits_err
    assert all(e < GRAD_TOL for e in grad_errs.values()), grad_errs
    x, _ = _tokens()
    want = _logits_hf(ref, x)
    export_hf([model], mcfg, out)
    a, b = _hf_tensors(src), _hf_tensors(out)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert torch.equal(_logits_hf(back, x), want)
    return mcfg


def test_config_and_names(tmp_path):
    _save_llama(tmp_path)
    c = load_hf_config(str(tmp_path))
    assert c["d_model"] == 32 and c["n_layers"] == 2 and c["n_heads"] == 4 and c["n_kv_heads"] == 2
    assert c["ffn_hidden"] == 48 and c["vocab_size"] == 61 and c["rope_theta"] == 5000.0
    assert c["norm_eps"] == 1e-6 and c["seq_len"] == 64 and "moe" not in c
    mcfg = ModelConfig(seq_len=16)
    apply_hf_config(mcfg, str(tmp_path))
    assert mcfg.seq_len == 16 and mcfg.d_model == 32 and mcfg.rope_theta == 5000.0
    # the map, directly (the round trip alone passes a map wrong the same way both ways)
    assert ours_to_hf("layers.1.attention.wk.weight") == "model.layers.1.self_attn.k_proj.weight"
    assert ours_to_hf("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert ours_to_hf("layers.0.feed_forward.w3.weight") == "model.layers.0.mlp.up_proj.weight"
    assert ours_to_hf("layers.1.feed_forward.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    assert hf_to_ours("model.layers.1.mlp.gate.weight") == ("layers.1.feed_forward.gate.weight", None)
    assert ours_to_hf("layers.1.feed_forward.w2", expert=3) == "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert hf_to_ours("model.layers.1.block_sparse_moe.experts.3.w2.weight") == ("layers.1.feed_forward.w2", 3)


def test_llama_forward_backward_and_bitwise_round_trip(tmp_path):
    _oracle_and_round_trip(tmp_path, _save_llama, moe=False)


def test_mixtral_forward_backward_and_round_trip(tmp_path):
    mcfg = _oracle_and_round_trip(tmp_path, _save_mixtral, moe=True)
    assert mcfg.moe.num_experts == 4 and mcfg.moe.top_k == 2 and mcfg.moe.aux_loss_coef == 0.02


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_planted_errors_fail_the_hf_oracle(tmp_path, kind):
    """The oracle can fail: RoPE base 10000 for 5000, or the norm gains replaced by ones (both
    invisible at Hugging Face's own init, which the old check used), move logits and grads by
    orders of magnitude more than the tolerance."""
    ref = (_save_mixtral if kind == "mixtral" else _save_llama)(str(tmp_path))
    for plant in ("rope_x2", "norms_to_one"):
        model, _ = _ours(str(tmp_path), plant=plant)
        logits_err, grad_errs = _oracle_errors(ref, model, kind == "mixtral")
        print(f"{kind} planted {plant}: logits rel err {logits_err:.1e}, grads max rel err "
              f"{max(grad_errs.values()):.1e}")
        assert logits_err > 100 * LOGITS_TOL and max(grad_errs.values()) > 100 * GRAD_TOL, (plant, logits_err)


def test_sharded_and_tied(tmp_path):
    src = str(tmp_path / "src")
    ref = _save_llama(src, tie=True, shard="20KB")
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    model, mcfg = _ours(src)
    assert mcfg.tie_embeddings
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    x, _ = _tokens()
    with torch.no_grad():
        assert _rel(model(x), _logits_hf(ref, x)) < LOGITS_TOL
    out = str(tmp_path / "out")
    export_hf([model], mcfg, out)
    assert "lm_head.weight" not in _hf_tensors(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert torch.equal(_logits_hf(back, x), _logits_hf(ref, x))


def test_unsupported_is_clear(tmp_path):
    _save_llama(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 5e5}  # llama3 and yarn: tests/test_families.py
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match='rope_type="longrope" is not supported'):
        load_hf_config(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_weights(torch.nn.Linear(1, 1), str(tmp_path), ModelConfig())


# ------------------------------------------------------------------ 2 ranks: tp=2 (llama), ep=2 (mixtral)
def _import_export_parallel(rank, world, src, out, kind, tokens):
    """tp: apply_tensor_parallel + load_hf_weights; ep: the recipe path (``model.init=hf:`` through
    build_model, dp 2 × ep 2), whose logits are returned too."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "ep":
        from paralayer.parallel.mesh import build_mesh
        from paralayer.runtime.build import build_model

        cfg, plan = cfg_and_plan(["recipe=tiny", "parallel.tp=1", "parallel.dp=2", "parallel.ep=2",
                                  f"model.init=hf:{src}", "train.precision=fp32", "logging.wandb.mode=disabled"])
        assert cfg.model.moe.num_experts == 4 and cfg.model.moe.top_k == 2 and cfg.model.d_model == 32
        built = build_model(cfg, plan, build_mesh(plan, "cpu"), torch.device("cpu"))
        export_hf(built.chunks, cfg.model, out)
        with torch.no_grad():
            return built.chunks[0].eval()(torch.tensor(tokens))[..., :VOCAB].tolist()
    mcfg = ModelConfig()
    apply_hf_config(mcfg, src)
    with torch.device("meta"):
        model = Transformer(mcfg, padded_vocab(mcfg.vocab_size, world))
    from paralayer.parallel.tensor import apply_tensor_parallel
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), False)
    model.to_empty(device="cpu")
    load_hf_weights(model, src, mcfg)
    export_hf([model], mcfg, out)
    return None


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_parallel_import_export_bitwise(tmp_path, kind):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    ref = _save_llama(src) if kind == "tp" else _save_mixtral(src)
    x, _ = _tokens()
    res = run_ranks(_import_export_parallel, 2, src, out, kind, x.tolist())
    a, b = _hf_tensors(src), _hf_tensors(out)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if kind == "ep":  # each rank's logits (its 2 of the 4 experts) against transformers, wide init
        want = _logits_hf(ref, x)
        for got in res:
            err = _rel(torch.tensor(got), want)
            print(f"ep=2 via model.init=hf: logits rel err {err:.1e}")
            assert err < LOGITS_TOL, err


# ------------------------------------------------------------------ sliced import: bytes each rank reads
def _sliced_import(rank, world, src, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mcfg = ModelConfig()
    apply_hf_config(mcfg, src)
    with torch.device("meta"):
        model = Transformer(mcfg, padded_vocab(mcfg.vocab_size, world))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    if kind == "tp":
        from paralayer.parallel.tensor import apply_tensor_parallel
        apply_tensor_parallel(model, mesh, False)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    read = load_hf_weights(model, src, mcfg)
    share = replicated = 0
    for name, p in model.named_parameters():
        rows = mcfg.vocab_size if name.startswith(("tok_embeddings", "output")) else p.shape[0]
        full = rows * p[0].numel() * 4  # fp32 in the file, padded vocab rows not stored
        if isinstance(p, DTensor) and not all(isinstance(pl, Replicate) for pl in p.placements):
            share += full / world
        else:
            replicated += full
    full_state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().tolist()
                  for n, p in model.named_parameters()}
    return {"read": read, "share": share, "replicated": replicated, "state": full_state}


@pytest.mark.parametrize("kind", ["tp", "fsdp"])
def test_sliced_import_reads_only_the_rank_share(tmp_path, kind):
    """Each of 2 ranks reads at most 1.1× its share of the sharded weights plus what it holds
    replicated (the old import read every tensor whole on every rank: 2× the file between them),
    and the imported weights equal a one-process import."""
    src = str(tmp_path / "src")
    _save_llama(src, shard="20KB")
    res = run_ranks(_sliced_import, 2, src, kind)
    total = sum(t.numel() * t.element_size() for t in _hf_tensors(src).values())
    ref, _ = _ours(src)
    for r in res:
        assert 0 < r["read"] <= 1.1 * r["share"] + r["replicated"], (r["read"], r["share"], r["replicated"])
        assert r["read"] < 0.75 * total, (r["read"], total)
        for n, p in ref.named_parameters():
            want = p.detach()[: len(r["state"][n])]
            got = torch.tensor(r["state"][n])[: want.shape[0]]
            assert torch.equal(got, want), n
