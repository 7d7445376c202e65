"""Tensor parallel + sequence parallel: parity with one rank, the wrong split, parameter bytes,
collective counts per layer, and end-to-end parity through ``train()`` (the activations each rank
saves: test_tensor_memory.py).

Every comparison is against a one-process reference built from the same seed: ``init_weights``
draws each full parameter from (seed, name), so any tp layout starts from identical weights.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paralayer.config import ModelConfig, MoEConfig
from paralayer.model.transformer import Transformer, init_weights, lm_loss, padded_vocab
from tests.dist import max_rel_err, paired, run_ranks

torch.set_num_threads(1)

SHARDED = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight",
           "tok_embeddings.weight", "output.weight")
B, S, STEPS = 2, 16, 5

# Warm the lazy imports once here (building on meta pulls in torch._dynamo, ~3 s): the forked
# ranks inherit them instead of each paying for them on 2 shared cores.
import torch.distributed.tensor.debug  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401

with torch.device("meta"):
    Transformer(ModelConfig(d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=8, vocab_size=8))


def tiny(**kw) -> ModelConfig:
    # a wide init (std 0.2): at 0.02 every model's loss is ~ln(vocab), and a wrong split can match it
    c = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=96, vocab_size=61, seq_len=S, init_std=0.2)
    c.update(kw)
    return ModelConfig(**c)


def tp_model(tp_mesh, cfg: ModelConfig, sp: bool, overlap: bool = False):
    """The model split over a 1-D tp mesh (vocab padded for it), its weights drawn as on one rank."""
    from paralayer.parallel.tensor import apply_tensor_parallel

    with torch.device("meta"):
        model = Transformer(cfg, padded_vocab(cfg.vocab_size, tp_mesh.size()))
    apply_tensor_parallel(model, tp_mesh, sp, overlap=overlap)
    model.to_empty(device="cpu")
    init_weights(model, cfg, seed=0)
    return model


def batches(cfg: ModelConfig, n: int = STEPS):
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(n):
        toks = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g)
        labels = toks[:, 1:].clone()
        labels[0, -3:] = -100  # some ignored positions, as the data pipeline makes
        out.append((toks[:, :-1].contiguous(), labels))
    return out


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def reference(cfg: ModelConfig, data):
    """One process, unpadded vocab: losses of STEPS AdamW steps and the first step's grads."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model, cfg, seed=0)
    opt = _adamw(model.parameters())
    losses, grads = [], None
    for tokens, labels in data:
        opt.zero_grad()
        loss = lm_loss(model(tokens), labels, cfg.vocab_size)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
    return losses, grads


def _tp_worker(rank, world, cfg, sp, data, overlap=False):
    from torch.distributed.device_mesh import init_device_mesh

    from paralayer.parallel.tensor import (
        full_grads,
        local_param_bytes,
        loss_parallel_ctx,
        tp_loss,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tp_model(mesh["tp"], cfg, sp, overlap)
    local_numel = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in model.named_parameters()}
    opt = _adamw(model.parameters())
    losses, grads = [], None
    for tokens, labels in data:
        opt.zero_grad()
        with loss_parallel_ctx(True):
            loss = tp_loss(model(tokens), labels, cfg.vocab_size)
            loss.backward()
        if grads is None:
            grads = {n: g.numpy().copy() for n, g in full_grads(model)}
        losses.append(loss.item())
        opt.step()
    return {"losses": losses, "grads": grads if rank == 0 else None, "local_numel": local_numel,
            "param_bytes": local_param_bytes(model)}


PARITY = {
    "tp2_sp": (tiny(), 2, True),
    "tp4_sp": (tiny(), 4, True),
    "tp2_nosp": (tiny(), 2, False),
    "tp2_gqa": (tiny(n_kv_heads=2), 2, True),
    # vocab 5 -> 8 over 4 ranks of 2 columns: rank 2 holds one padded column, rank 3 only padding
    "tp4_gqa_nosp_vocab5": (tiny(n_heads=8, n_kv_heads=4, vocab_size=5), 4, False),
    # MoE blocks run replicated on the full sequence (experts are split by ep, not tp)
    "tp2_moe": (tiny(moe=MoEConfig(num_experts=4, top_k=2)), 2, True),
}
# (vocab 61 elsewhere: 62 under tp=2, 64 under tp=4, never divisible)


@pytest.mark.parametrize("case", list(PARITY))
def test_model_parity(case):
    cfg, tp, sp = PARITY[case]
    data = batches(cfg)
    ref_losses, ref_grads = reference(cfg, data)
    out = run_ranks(_tp_worker, tp, cfg, sp, data)
    r0 = out[0]
    for r in out[1:]:
        assert r["losses"] == r0["losses"], "tp ranks disagree on the loss"
    # the first step: loss and every gradient
    assert abs(r0["losses"][0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0])
    vpad = padded_vocab(cfg.vocab_size, tp)
    assert vpad % tp == 0
    worst = 0.0
    for name, g_ref in ref_grads.items():
        g = torch.from_numpy(r0["grads"][name])
        if name.startswith(("tok_embeddings.", "output.")):
            assert g.shape[0] == vpad
            assert torch.all(g[cfg.vocab_size:] == 0), f"{name}: padded vocab rows got gradient"
            g = g[: cfg.vocab_size]
        err = (g - g_ref).abs().max().item()
        worst = max(worst, err / g_ref.abs().max().item())
        assert err <= 1e-5 * g_ref.abs().max().item(), f"{name}: max |Δgrad| {err:.3g}"
    step_errs = [abs(a - b) / abs(b) for a, b in paired(r0["losses"], ref_losses)]
    print(f"[{case}] loss rel err step 1 {step_errs[0]:.1e}, max over {STEPS} AdamW steps "
          f"{max(step_errs):.1e}; max grad err / grad scale {worst:.1e}")
    # five AdamW steps: 1e-4, not 1e-5 — at init std 0.2 AdamW's normalised updates carry the first
    # step's last-bit differences on (measured up to 3e-5 by step 5, tp2_moe; step 1 above is 1e-5)
    for a, b in paired(r0["losses"], ref_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (r0["losses"], ref_losses)
    # parameter bytes per rank: sharded matrices hold exactly full/tp, norms are whole
    full = {n: math.prod(s) for n, s in _full_shapes(cfg, vpad).items()}
    for name, n_local in r0["local_numel"].items():
        if name.endswith(SHARDED):
            assert n_local * tp == full[name], name
        else:
            assert n_local == full[name], name
    n_sharded = sum(v for k, v in full.items() if k.endswith(SHARDED))
    n_whole = sum(v for k, v in full.items() if not k.endswith(SHARDED))
    assert r0["param_bytes"] == 4 * (n_sharded // tp + n_whole)


def _full_shapes(cfg, vpad):
    with torch.device("meta"):
        m = Transformer(cfg, vpad)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


# ------------------------------------------------------------------ the wrong split (the seeds' lesson)
def _mlp_split_worker(rank, world, x, w1, w3, w2):
    """The same SwiGLU MLP split two ways over real ranks; returns (right, wrong) outputs."""
    f, d = w1.shape
    fs, ds = f // world, d // world
    # right: w1/w3 by columns of A = W^T (rows of nn.Linear's weight), act locally, w2 by rows
    c = slice(rank * fs, (rank + 1) * fs)
    part = F.linear(F.silu(F.linear(x, w1[c])) * F.linear(x, w3[c]), w2[:, c])
    dist.all_reduce(part)
    # wrong: the first matrices split by rows of A (the input dim): the activation sees a partial sum
    r = slice(rank * ds, (rank + 1) * ds)
    gate_partial = F.linear(x[:, r], w1[:, r])
    up_partial = F.linear(x[:, r], w3[:, r])
    wrong = F.linear(F.silu(gate_partial) * up_partial, w2)
    dist.all_reduce(wrong)
    return part.numpy(), wrong.numpy()


def test_wrong_split_does_not_match():
    g = torch.Generator().manual_seed(7)
    d, f = 32, 64
    x = torch.randn(8, d, generator=g)
    w1, w3 = torch.randn(f, d, generator=g) / d**0.5, torch.randn(f, d, generator=g) / d**0.5
    w2 = torch.randn(d, f, generator=g) / f**0.5
    ref = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    right, wrong = run_ranks(_mlp_split_worker, 2, x, w1, w3, w2)[0]
    scale = ref.abs().max().item()
    right_err = np.abs(right - ref.numpy()).max() / scale
    wrong_err = np.abs(wrong - ref.numpy()).max() / scale
    assert right_err < 1e-5
    assert wrong_err > 0.1, f"the wrong split should not match (relative error {wrong_err:.3g})"


# ------------------------------------------------------------------ collectives per layer
def _comm_worker(rank, world, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from paralayer.parallel.tensor import loss_parallel_ctx, tp_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    name = lambda op: str(op).split(".")[-1]  # noqa: E731
    counts = []
    for n_layers in (1, 2):
        cfg = tiny(n_layers=n_layers)
        tokens, labels = batches(cfg, 1)[0]
        model = tp_model(mesh["tp"], cfg, sp)
        with loss_parallel_ctx(True):
            fwd, bwd = CommDebugMode(), CommDebugMode()
            with fwd:
                loss = tp_loss(model(tokens), labels, cfg.vocab_size)
            with bwd:
                loss.backward()
        counts.append([{name(k): v for k, v in m.get_comm_counts().items()} for m in (fwd, bwd)])
    return counts


def measure_tp_collectives_per_layer(tp: int, sp: bool) -> tuple[dict, dict]:
    """(forward, backward) collective counts per transformer layer: L=2 minus L=1."""
    counts = run_ranks(_comm_worker, tp, sp)[0]
    per = []
    for phase in (0, 1):
        a, b = counts[0][phase], counts[1][phase]
        per.append({k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) - a.get(k, 0)})
    return per[0], per[1]


@pytest.mark.parametrize("sp", [False, True])
def test_collectives_per_layer_match_plan(sp):
    fwd, bwd = measure_tp_collectives_per_layer(2, sp)
    print(f"[sp={sp}] per layer: forward {fwd}, backward {bwd}")
    if sp:
        assert fwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, fwd
        # + 2 all-reduces of the two norms' weight grads (h elements each, Partial -> Replicate);
        # + 2 all-gathers: the column GEMMs saved their input's shard and re-gather it (Megatron)
        assert bwd == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2, "all_reduce": 2}, bwd
        # one all-gather + one reduce-scatter move what one all-reduce moves
        measured_pairs = (fwd["all_gather_into_tensor"] + fwd["reduce_scatter_tensor"]
                          + bwd["all_gather_into_tensor"] + bwd["reduce_scatter_tensor"]) // 2
    else:
        assert fwd == {"all_reduce": 2}, fwd
        assert bwd == {"all_reduce": 2}, bwd
        measured_pairs = fwd["all_reduce"] + bwd["all_reduce"]
    # the resolver's count for the same shapes: collectives per layer per microbatch
    from paralayer.config import load_config
    from paralayer.resolve import plan as resolve

    def tp_comm_for(layers: int) -> tuple[dict, int]:
        cfg = load_config(["model.d_model=64", f"model.n_layers={layers}", "model.n_heads=4",
                           "model.n_kv_heads=4", "model.ffn_hidden=96", "model.vocab_size=61",
                           f"model.seq_len={S}", "parallel.tp=2", "parallel.dp=1",
                           f"parallel.sequence_parallel={str(sp).lower()}",
                           "train.global_batch=2", "train.micro_batch=2"])
        plan = resolve.resolve(cfg).to_dict()
        return plan["comm"]["tp"], plan["microbatches"]

    # per layer: the plan's count with 2 layers minus its count with 1 (the embedding, head and loss
    # collectives, counted once per microbatch, cancel); under SP the two norm-grad all-reduces count
    # one unit each, as a pair does
    tp_comm, m = tp_comm_for(2)
    per_layer = (tp_comm["count_per_step"] - tp_comm_for(1)[0]["count_per_step"]) / m
    assert per_layer == measured_pairs + (bwd.get("all_reduce", 0) if sp else 0), (per_layer, tp_comm)
    assert ("reduce-scatter" in tp_comm["collective"]) == sp, tp_comm
    assert tp_comm["message_bytes"] == pytest.approx(2 * S * 64 * 4, rel=0.1), tp_comm


# ------------------------------------------------------------------ end to end through train()
def _train_worker(rank, world, cfg, plan):
    from paralayer.runtime.train import train

    return [(r["loss"], r["grad_norm"]) for r in train(cfg, plan)]


def _e2e_cfg(tp: int, dp: int, *extra: str, n_kv_heads: int = 4):
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    cfg = load_config(["model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                       f"model.n_kv_heads={n_kv_heads}", "model.ffn_hidden=96",
                       "model.vocab_size=258",  # byte tokens; 258 is not a multiple of 4
                       f"model.seq_len={S}", f"parallel.tp={tp}", f"parallel.dp={dp}",
                       "train.global_batch=4", "train.micro_batch=2", f"train.steps={STEPS}",
                       "train.precision=fp32", "train.lr=1e-2", "train.warmup_steps=1",
                       "cluster.device=cpu", "cluster.peak_tflops=1.0", "model.init_std=0.2", *extra])
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    return cfg, plan


_REF_CACHE: dict = {}


def _e2e_reference(n_kv_heads: int):
    if n_kv_heads not in _REF_CACHE:
        cfg, plan = _e2e_cfg(1, 1, n_kv_heads=n_kv_heads)
        _REF_CACHE[n_kv_heads] = run_ranks(_train_worker, 1, cfg, plan)[0]
    return _REF_CACHE[n_kv_heads]


E2E = {
    "tp2": (2, 1, (), 4),
    "tp4": (4, 1, (), 4),
    "tp2_nosp": (2, 1, ("parallel.sequence_parallel=false",), 4),
    "tp2_dp2": (2, 2, (), 4),
    "tp2_dp2_zero3": (2, 2, ("parallel.zero=3",), 4),
    "tp2_gqa": (2, 1, (), 2),
}


@pytest.mark.parametrize("case", list(E2E))
def test_train_parity(case):
    tp, dp, extra, kv = E2E[case]
    ref = _e2e_reference(kv)
    cfg, plan = _e2e_cfg(tp, dp, *extra, n_kv_heads=kv)
    assert plan["degrees"]["tp"] == tp and plan["degrees"]["dp"] == dp
    assert plan["sequence_parallel"] == ("parallel.sequence_parallel=false" not in extra)
    out = run_ranks(_train_worker, tp * dp, cfg, plan)
    assert all(o == out[0] for o in out), "ranks disagree on the metrics"
    assert len(out[0]) == STEPS
    loss_err = max_rel_err([a[0] for a in out[0]], [b[0] for b in ref])
    gn_err = max_rel_err([a[1] for a in out[0]], [b[1] for b in ref])
    print(f"[{case}] max rel loss err {loss_err:.2e}, max rel grad_norm err {gn_err:.2e}")
    assert loss_err <= 1e-5, (out[0], ref)
    assert gn_err <= 1e-5, (out[0], ref)


# ------------------------------------------------------------------ shapes and pipeline stages
def test_rejects_shapes_tp_cannot_split():
    from paralayer.parallel.tensor import check_tp_shapes

    with torch.device("meta"):
        check_tp_shapes(Transformer(tiny(n_kv_heads=4), padded_vocab(61, 4)), 4)
        with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by parallel.tp=4"):
            check_tp_shapes(Transformer(tiny(n_kv_heads=2), padded_vocab(61, 4)), 4)
        with pytest.raises(ValueError, match="padded vocab 61"):
            check_tp_shapes(Transformer(tiny()), 2)


def _stage_worker(rank, world, cfg, sp, tokens, labels):
    """Two pipeline stages on the same tp ranks: [embeddings, layer 0] then [layer 1, norm, output]."""
    from torch.distributed.device_mesh import init_device_mesh

    from paralayer.parallel.tensor import apply_tensor_parallel, full_grads, loss_parallel_ctx, tp_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    stages = []
    for keep in ("0", "1"):
        with torch.device("meta"):
            st = Transformer(cfg, padded_vocab(cfg.vocab_size, world))
        del st.layers["1" if keep == "0" else "0"]
        if keep == "0":
            st.norm = st.output = None
        else:
            st.tok_embeddings = None
        apply_tensor_parallel(st, mesh["tp"], sp)
        st.to_empty(device="cpu")
        init_weights(st, cfg, seed=0)
        stages.append(st)
    with loss_parallel_ctx(True):
        hidden = stages[0](tokens)
        sent = hidden.detach().requires_grad_()  # what a pipeline send/recv would carry
        loss = tp_loss(stages[1](sent), labels, cfg.vocab_size)
        loss.backward()
        hidden.backward(sent.grad)
    grads = {n: g.numpy() for st in stages for n, g in full_grads(st)}
    return loss.item(), tuple(hidden.shape), grads


@pytest.mark.parametrize("sp", [True, False])
def test_pipeline_stages(sp):
    cfg = tiny()
    data = batches(cfg, 1)
    ref_losses, ref_grads = reference(cfg, data)
    loss, shape, grads = run_ranks(_stage_worker, 2, cfg, sp, *data[0])[0]
    assert shape == ((B, S // 2, cfg.d_model) if sp else (B, S, cfg.d_model))
    assert abs(loss - ref_losses[0]) <= 1e-5 * abs(ref_losses[0])
    assert set(grads) == set(ref_grads)
    for name, g_ref in ref_grads.items():
        g = torch.from_numpy(grads[name])[: g_ref.shape[0]]
        assert (g - g_ref).abs().max().item() <= 1e-5 * g_ref.abs().max().item(), name
