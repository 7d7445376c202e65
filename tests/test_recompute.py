"""Recompute options (parallel.recompute = none | swiglu | core_attn | selective | full, and
parallel.recompute_every = k for full recompute of every k-th layer) under tensor + sequence
parallel (the column GEMMs saving their sequence shard, parallel/tensor/sequence_parallel.py).

Parity: every mode at tp 2 and tp 4 (SP on), and split into two pipeline stages, against one
process without recompute — loss and every gradient within 1e-5 at a wide init (std 0.2, so the
loss is far from ln(vocab) and a wrong gradient shows). Memory: the bytes each rank saves for
backward in one layer, per mode, against the resolver's ``act_elems_per_token`` within 5%.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from paralayer.model.transformer import Transformer, init_weights, lm_loss, padded_vocab
from paralayer.runtime.train import apply_recompute
from tests.dist import run_ranks
from tests.test_tensor import B, S, batches, tiny
from tests.test_tensor_memory import _saved_bytes

torch.set_num_threads(1)

MODES = ("none", "swiglu", "core_attn", "selective", "full")
STD = 0.2


def _cfg():
    return tiny(n_layers=2, init_std=STD)


def _reference(cfg, tokens, labels):
    model = Transformer(cfg)
    init_weights(model, cfg, seed=0)
    loss = lm_loss(model(tokens), labels, cfg.vocab_size)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _tp_worker(rank, world, cfg, tokens, labels, split):
    """Per mode: (loss, full grads) of the tp-split model; ``split``: two pipeline stages
    [embedding, layer 0] → [layer 1, norm, head] with the hidden handed over as a pp send would."""
    from torch.distributed.device_mesh import init_device_mesh

    from paralayer.parallel.tensor import apply_tensor_parallel, full_grads, loss_parallel_ctx, tp_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for mode in MODES:
        every = 2 if mode == "full" else 1  # layer 0 recomputed in full, layer 1 keeps its activations
        stages = []
        for keep in (("0", "1"),) if not split else (("0",), ("1",)):
            with torch.device("meta"):
                st = Transformer(cfg, padded_vocab(cfg.vocab_size, world))
            for name in [n for n in st.layers if n not in keep]:
                del st.layers[name]
            if split and keep == ("0",):
                st.norm = st.output = None
            elif split:
                st.tok_embeddings = None
            apply_tensor_parallel(st, mesh["tp"], True)
            apply_recompute(st, mode, every)
            st.to_empty(device="cpu")
            init_weights(st, cfg, seed=0)
            stages.append(st)
        with loss_parallel_ctx(True):
            if split:
                hidden = stages[0](tokens)
                sent = hidden.detach().requires_grad_()
                loss = tp_loss(stages[1](sent), labels, cfg.vocab_size)
                loss.backward()
                hidden.backward(sent.grad)
            else:
                loss = tp_loss(stages[0](tokens), labels, cfg.vocab_size)
                loss.backward()
        out[mode] = (loss.item(), {n: g.numpy().copy() for st in stages for n, g in full_grads(st)})
    return out


@pytest.mark.parametrize("tp,split", [(2, False), (4, False), (2, True), (4, True)],
                         ids=["tp2", "tp4", "tp2-pp2", "tp4-pp2"])
def test_every_mode_matches_one_process(tp, split):
    cfg = _cfg()
    tokens, labels = batches(cfg, 1)[0]
    ref_loss, ref_grads = _reference(cfg, tokens, labels)
    assert ref_loss > 1.3 * torch.log(torch.tensor(float(cfg.vocab_size))).item()  # wide init: far from ln V
    got = run_ranks(_tp_worker, tp, cfg, tokens, labels, split)[0]
    assert set(got) == set(MODES)
    for mode, (loss, grads) in got.items():
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (mode, loss, ref_loss)
        assert set(grads) == set(ref_grads), (mode, sorted(set(ref_grads) ^ set(grads)))
        for name, g_ref in ref_grads.items():
            g = torch.from_numpy(grads[name])[: g_ref.shape[0]]
            err = (g - g_ref).norm() / g_ref.norm()
            assert err <= 1e-5, (mode, name, float(err))


# ------------------------------------------------------------------ saved bytes per mode
def _bytes_worker(rank, world, cfg, tokens, labels):
    from torch.distributed.device_mesh import init_device_mesh

    from paralayer.parallel.tensor import apply_tensor_parallel, loss_parallel_ctx, tp_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for mode in MODES:
        with torch.device("meta"):
            model = Transformer(cfg, padded_vocab(cfg.vocab_size, world))
        apply_tensor_parallel(model, mesh["tp"], True)
        apply_recompute(model, mode)
        model.to_empty(device="cpu")
        init_weights(model, cfg, seed=0)
        with loss_parallel_ctx(True):
            out[mode] = _saved_bytes(model, tokens, labels, lambda lg, lb: tp_loss(lg, lb, cfg.vocab_size))["block"]
    return out


def _plan_bytes(tp: int, mode: str) -> float:
    from paralayer.config import load_config
    from paralayer.resolve import memory, rules

    cfg = load_config(["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
                       "model.ffn_hidden=96", "model.vocab_size=61", f"model.seq_len={S}",
                       f"parallel.tp={tp}", "parallel.dp=1", f"parallel.recompute={mode}",
                       f"train.global_batch={B}", f"train.micro_batch={B}", "train.precision=fp32"])
    lay = rules.check(cfg)
    return memory.act_elems_per_token(cfg, lay, False) * B * S * memory.ACT_BYTES["fp32"]


@pytest.mark.parametrize("tp", [1, 2])
def test_saved_bytes_per_mode_match_the_resolver(tp):
    cfg = _cfg()
    tokens, labels = batches(cfg, 1)[0]
    got = run_ranks(_bytes_worker, tp, cfg, tokens, labels)
    per_mode = {mode: max(r[mode] for r in got) for mode in MODES}
    for mode, measured in per_mode.items():
        pred = _plan_bytes(tp, mode)
        print(f"[tp={tp} {mode}] layer saves {measured} B, plan {pred:.0f} B ({pred / measured - 1:+.1%})")
        assert abs(pred - measured) <= 0.05 * measured, (tp, mode, measured, pred)
    # each option frees memory, and the two halves of selective add up to it
    assert per_mode["none"] > per_mode["swiglu"] > per_mode["selective"] > per_mode["full"]
    assert per_mode["none"] > per_mode["core_attn"] > per_mode["selective"]
    freed = per_mode["none"] - per_mode["selective"]
    assert (per_mode["none"] - per_mode["swiglu"]) + (per_mode["none"] - per_mode["core_attn"]) == freed


def test_recompute_every_picks_the_same_layers_under_any_split():
    """recompute_every=k: global layers i % k == 0, in the runtime and in the resolver."""
    from paralayer.config import load_config
    from paralayer.resolve import memory, rules

    cfg = tiny(n_layers=6)
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_recompute(model, "full", 3)
    assert [i for i, layer in enumerate(model.layers.values()) if layer.recompute_full] == [0, 3]
    for k in (1, 2, 3):
        rcfg = load_config(["model.n_layers=6", "parallel.pp=2", "parallel.tp=1", "parallel.dp=1",
                            "parallel.recompute=full", f"parallel.recompute_every={k}",
                            "train.global_batch=4", "train.micro_batch=1", "train.precision=fp32"])
        lay = rules.check(rcfg)
        assert [i for i in range(6) if memory.layer_recompute(lay, i) == "full"] == list(range(0, 6, k))
    # fewer recomputed layers, more activations, less recompute cost
    acts = {k: memory.memory(rcfg_k, rules.check(rcfg_k)).activations
            for k, rcfg_k in ((k, load_config(["recipe=llama3-70b", "parallel.recompute=full",
                                               f"parallel.recompute_every={k}"])) for k in (1, 2, 4))}
    assert acts[1] < acts[2] < acts[4]


# ------------------------------------------------------------------ bf16: what stays fp32
def _bf16_worker(rank, world, cfg, tokens, labels, cases):
    from torch.distributed.device_mesh import init_device_mesh

    from paralayer.parallel.tensor import apply_tensor_parallel, loss_parallel_ctx, tp_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for kind, mode in cases:
        with torch.device("meta"):
            model = Transformer(cfg, padded_vocab(cfg.vocab_size, world))
        apply_tensor_parallel(model, mesh["tp"], True)
        apply_recompute(model, mode)
        model.to_empty(device="cpu")
        init_weights(model, cfg, seed=0)
        if kind == "bf16-fsdp":  # bf16 weights, no autocast: what FSDP's MixedPrecisionPolicy computes with
            model.to(torch.bfloat16)
        with loss_parallel_ctx(True), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16-autocast"):
            out[(kind, mode)] = _saved_bytes(model, tokens, labels,
                                             lambda lg, lb: tp_loss(lg, lb, cfg.vocab_size))["block"]
    return out


def test_bf16_saved_bytes_match_the_resolver():
    """tp 2 with SP, bf16 weights (ZeRO 2/3) and autocast (ZeRO 0/1): what is kept in fp32
    (1/rms, logsumexp; under autocast the stream the norms save and the column GEMMs' shards) is
    in the resolver's figure (memory.bf16_extra_elems), within 5%."""
    from paralayer.config import load_config
    from paralayer.resolve import memory, rules

    cfg = _cfg()
    tokens, labels = batches(cfg, 1)[0]
    cases = [(k, m) for k in ("bf16-fsdp", "bf16-autocast") for m in ("none", "selective", "full")]
    got = run_ranks(_bf16_worker, 2, cfg, tokens, labels, cases)
    for kind, mode in cases:
        measured = max(r[(kind, mode)] for r in got)
        rcfg = load_config(["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
                            "model.ffn_hidden=96", "model.vocab_size=61", f"model.seq_len={S}",
                            "parallel.tp=2", "parallel.dp=2", f"parallel.zero={2 if kind == 'bf16-fsdp' else 1}",
                            f"parallel.recompute={mode}", f"train.global_batch={2 * B}",
                            f"train.micro_batch={B}", "train.precision=bf16", "cluster.device=cpu"])
        lay = rules.check(rcfg)
        assert memory.precision_mode("bf16", lay.zero, lay.dp * lay.cp) == kind
        pred = memory.act_elems_per_token(rcfg, lay, False) * B * S * memory.ACT_BYTES["bf16"]
        print(f"[{kind} {mode}] layer saves {measured} B, plan {pred:.0f} B ({pred / measured - 1:+.1%})")
        assert abs(pred - measured) <= 0.05 * measured, (kind, mode, measured, pred)


# ------------------------------------------------------------------ paralayer.model.recompute
def _region_and_counter():
    """A two-GEMM region (w1, w2 weights) and a counter of how often its body runs."""
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
    w2 = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
    runs = [0]

    def body(x):
        runs[0] += 1
        return torch.tanh(x @ w1) @ w2

    return w1, w2, body, runs


def _split_backward(out, x, ws):
    """An input pass then a weight pass, two graph tasks as torch's stage_backward_input/_weight."""
    (gx,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
    gw = torch.autograd.grad(out.sum(), ws)
    return gx, gw


@pytest.mark.parametrize("dropped", [False, True])
def test_recompute_reruns_once_across_backward_passes(dropped):
    """The region reruns once for both passes (torch's checkpoint reruns per graph task: twice
    here, the planted comparison), or, when the input pass drops its rerun (split_backward.py),
    once more in the weight pass; the gradients equal the plain forward's to the bit."""
    from torch.utils.checkpoint import checkpoint

    from paralayer.model.recompute import dropped_after, recompute

    x0 = torch.randn(4, 8)
    w1, w2, body, runs = _region_and_counter()
    x = x0.clone().requires_grad_(True)
    ref = _split_backward(body(x), x, [w1, w2])

    runs[0] = 0
    x = x0.clone().requires_grad_(True)
    out = checkpoint(body, x, use_reentrant=False)
    _split_backward(out, x, [w1, w2])
    assert runs[0] == 3  # forward + a rerun in each graph task

    runs[0] = 0
    x = x0.clone().requires_grad_(True)
    out = recompute(body, x)
    with dropped_after() if dropped else contextlib.nullcontext():
        (gx,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
    gw = torch.autograd.grad(out.sum(), [w1, w2])
    assert runs[0] == (3 if dropped else 2)
    assert torch.equal(gx, ref[0]) and all(torch.equal(a, b) for a, b in zip(gw, ref[1]))


def test_recompute_refuses_a_region_that_saves_differently():
    """A rerun that saves another number of tensors than the forward did is named, not used."""
    from paralayer.model.recompute import recompute

    w1, w2, _, _ = _region_and_counter()
    calls = [0]

    def unstable(x):
        calls[0] += 1
        y = x @ w1
        return (torch.tanh(y) if calls[0] == 1 else y) @ w2

    x = torch.randn(4, 8, requires_grad=True)
    out = recompute(unstable, x)
    with pytest.raises(RuntimeError, match="not deterministic"):
        out.sum().backward()
