"""MoE block and expert parallelism: naive reference, EP parity on gloo ranks, forced imbalance with
capacity drops, aux loss by hand."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paralayer.model.moe import MoEFeedForward
from paralayer.parallel.expert import (
    apply_expert_parallel,
    expert_param_names,
    is_expert_param,
)
from tests.dist import run_ranks

D, FFN, E = 8, 12, 4


def make_moe(seed=0, top_k=2, capacity_factor=None, router="softmax", shared=0, num_experts=E):
    torch.manual_seed(seed)
    m = MoEFeedForward(D, FFN, num_experts, top_k, capacity_factor, router=router, shared_ffn_hidden=shared)
    with torch.no_grad():  # our own simple init: every parameter random, full tensors
        for p in m.parameters():
            p.normal_(0, 0.5)
        if router == "sigmoid":
            m.expert_bias.normal_(0, 0.1)
    return m


def naive_reference(m: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token, in token order, with per-expert capacity counters."""
    xf = x.reshape(-1, D)
    T = xf.shape[0]
    cap = math.inf if m.capacity_factor is None else math.ceil(T * m.top_k * m.capacity_factor / m.num_experts)
    used = [0] * m.num_experts
    out = []
    for t in range(T):
        logits = (m.gate.weight @ xf[t]).double()
        if m.router == "softmax":
            scores = logits.softmax(-1)
            chosen = scores.topk(m.top_k).indices.tolist()
        else:
            scores = torch.sigmoid(logits)
            chosen = (scores + m.expert_bias.double()).topk(m.top_k).indices.tolist()
        total = sum(scores[e] for e in chosen)
        y = torch.zeros(D, dtype=torch.float64)
        for e in chosen:
            if used[e] >= cap:
                continue
            used[e] += 1
            xt = xf[t].double()
            h = F.silu(m.w1[e].double() @ xt) * (m.w3[e].double() @ xt)
            y = y + (scores[e] / total) * (m.w2[e].double() @ h)
        if m.shared is not None:
            y = y + m.shared(xf[t]).double()
        out.append(y)
    return torch.stack(out).reshape(x.shape)


# ------------------------------------------------------------------ (a) against a naive loop
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("shared", [0, 6])
def test_forward_matches_naive_loop(router, capacity_factor, shared):
    m = make_moe(router=router, capacity_factor=capacity_factor, shared=shared)
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        y = m(x)
        ref = naive_reference(m, x)
    err = (y.double() - ref).abs().max().item()
    assert err < 1e-5, err
    T = x.shape[0] * x.shape[1]
    assert int(m.stats["tokens_per_expert"].sum()) == T * m.top_k
    if capacity_factor is None:
        assert m.stats["dropped"] == 0


def test_param_names_and_local_slices():
    m = make_moe(shared=6)
    assert m.local_slices == {"w1": (0, 0, E), "w2": (0, 0, E), "w3": (0, 0, E)}
    assert m.w1.shape == (E, FFN, D) and m.w3.shape == (E, FFN, D) and m.w2.shape == (E, D, FFN)
    model = torch.nn.ModuleDict({"moe": m, "ffn": m.shared})
    names = {n for n, _ in model.named_parameters()}
    assert {n for n in names if is_expert_param(n)} == expert_param_names(model) == {"moe.w1", "moe.w2", "moe.w3"}


def test_update_bias_moves_toward_balance():
    m = make_moe(router="sigmoid", top_k=1)
    with torch.no_grad():
        m.expert_bias.zero_()
        m.gate.weight.zero_()
        m.gate.weight[2, 0] = 5.0
    x = torch.randn(3, 4, D)
    x[..., 0] = 1.0
    m(x)
    assert m.stats["tokens_per_expert"].tolist() == [0, 0, 12, 0]
    m.update_bias(0.01)
    assert torch.allclose(m.expert_bias, torch.tensor([0.01, 0.01, -0.01, 0.01]))
    assert m.expert_load.sum() == 0


# ------------------------------------------------------------------ (d) aux loss by hand
def test_aux_loss_by_hand():
    E_, k = 3, 2
    torch.manual_seed(0)
    m = MoEFeedForward(E_, 4, E_, k, None)
    with torch.no_grad():
        m.gate.weight.copy_(torch.eye(E_))  # logits = x
    rows = [[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.5], [0.5, 0.2, 0.1]]
    x = torch.tensor([rows], requires_grad=True)
    m(x)
    probs = []
    for r in rows:
        z = sum(math.exp(v) for v in r)
        probs.append([math.exp(v) / z for v in r])
    counts = [0] * E_
    for p in probs:
        for e in sorted(range(E_), key=lambda i: -p[i])[:k]:
            counts[e] += 1
    f = [c / (len(rows) * k) for c in counts]
    P = [sum(p[i] for p in probs) / len(rows) for i in range(E_)]
    expected = E_ * sum(fi * Pi for fi, Pi in zip(f, P))
    assert abs(m.aux_loss.item() - expected) < 1e-6, (m.aux_loss.item(), expected)
    m.aux_loss.backward()
    assert m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------ (c) forced imbalance, one process
def _forced(m, x):
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.weight[0, 0] = 10.0  # expert 0 always first
        m.gate.weight[1, 0] = 5.0   # expert 1 always second
    x = x.clone()
    x[..., 0] = 1.0
    return x


def test_forced_single_expert_capacity_drops():
    torch.manual_seed(1)
    T = 16
    x = torch.randn(2, 8, D)
    dropless = make_moe(capacity_factor=None)
    xin = _forced(dropless, x)
    y_full = dropless(xin)
    assert dropless.stats["tokens_per_expert"].tolist() == [T, T, 0, 0]
    assert dropless.stats["dropped"] == 0

    m = make_moe(capacity_factor=1.0)
    _forced(m, x)
    y = m(xin)
    cap = math.ceil(T * 2 * 1.0 / E)  # 8
    assert m.stats["tokens_per_expert"].tolist() == [T, T, 0, 0]
    assert m.stats["dropped"] == 2 * (T - cap) == 16
    yf, yff = y.reshape(T, D), y_full.reshape(T, D)
    assert torch.allclose(yf[:cap], yff[:cap], atol=1e-6)       # first tokens kept (token order)
    assert torch.equal(yf[cap:], torch.zeros(T - cap, D))        # the rest dropped: zero output


# ------------------------------------------------------------------ (b) EP parity on gloo ranks
def _ep_parity_rank(rank, world, router, shared):
    torch.manual_seed(123)
    ref = make_moe(seed=7, router=router, shared=shared, num_experts=8)
    xs = torch.randn(world, 2, 5, D)               # rank r's batch is xs[r]
    gs = torch.randn(world, 2, 5, D)               # upstream gradients

    # ep=1 reference on the concatenated batch (every rank computes it; cheap)
    x_ref = xs.reshape(world * 2, 5, D).clone().requires_grad_(True)
    y_ref = ref(x_ref)
    (y_ref * gs.reshape(world * 2, 5, D)).sum().backward()

    m = apply_expert_parallel(copy.deepcopy(ref), dist.group.WORLD)
    m.zero_grad(set_to_none=True)
    n_local = 8 // world
    assert m.w1.shape[0] == n_local and m.local_slices["w2"] == (0, rank * n_local, 8)
    x = xs[rank].clone().requires_grad_(True)
    y = m(x)
    (y * gs[rank]).sum().backward()

    lo, hi = rank * n_local, (rank + 1) * n_local
    errs = {
        "out": (y - y_ref[2 * rank:2 * rank + 2]).abs().max().item(),
        "grad_x": (x.grad - x_ref.grad[2 * rank:2 * rank + 2]).abs().max().item(),
    }
    for name in ("w1", "w2", "w3"):
        assert getattr(m, name).grad.abs().sum() > 0  # not trivially equal
        errs[f"grad_{name}"] = (getattr(m, name).grad - getattr(ref, name).grad[lo:hi]).abs().max().item()
    # non-expert params: gradient summed over ranks equals the ep=1 gradient
    ref_params = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        if is_expert_param(name):
            continue
        g = p.grad.clone()
        dist.all_reduce(g)
        errs[f"grad_{name}"] = (g - ref_params[name].grad).abs().max().item()
    # on the meta device (how the model is built before materialising): shapes and slices only
    with torch.device("meta"):
        meta = MoEFeedForward(D, FFN, 8, 2, None)
    apply_expert_parallel(meta, dist.group.WORLD)
    assert meta.w1.is_meta and meta.w1.shape == (n_local, FFN, D) and meta.w2.shape == (n_local, D, FFN)
    assert meta.local_slices == {k: (0, lo, 8) for k in ("w1", "w2", "w3")}

    tpe = m.stats["tokens_per_expert"].tolist()
    return errs, tpe, ref.stats["tokens_per_expert"].tolist()


@pytest.mark.parametrize("world,router,shared", [(2, "softmax", 6), (4, "sigmoid", 0)])
def test_expert_parallel_parity(world, router, shared):
    results = run_ranks(_ep_parity_rank, world, router, shared)
    worst = {}
    for errs, tpe, ref_tpe in results:
        assert tpe == ref_tpe  # stats summed over the ep group = the ep=1 stats of the whole batch
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print(f"ep={world} router={router} max errors:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert all(v < 1e-5 for v in worst.values()), worst


def _ep_forced_rank(rank, world, capacity_factor):
    torch.manual_seed(5)
    x_all = torch.randn(world, 2, 8, D)
    m = make_moe(capacity_factor=capacity_factor)
    x = _forced(m, x_all[rank]).requires_grad_(True)
    full = copy.deepcopy(m)
    apply_expert_parallel(m, dist.group.WORLD)
    y = m(x)
    y.sum().backward()  # ranks that own no routed expert still take part in both exchanges
    with torch.no_grad():
        y_local = full(x)  # ep=1 on this rank's own tokens: capacity is per rank, so identical
    return (m.stats["tokens_per_expert"].tolist(), m.stats["dropped"],
            (y - y_local).abs().max().item(), m.w1.grad.abs().sum().item())


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_parallel_forced_imbalance(capacity_factor):
    world, T = 2, 16
    results = run_ranks(_ep_forced_rank, world, capacity_factor)
    dropped_per_rank = 0 if capacity_factor is None else 2 * (T - math.ceil(T * 2 * capacity_factor / E))
    for r, (tpe, dropped, err, w1_grad) in enumerate(results):
        assert tpe == [world * T, world * T, 0, 0]
        assert dropped == world * dropped_per_rank
        assert err < 1e-5, err
        assert (w1_grad > 0) == (r == 0)  # experts 0,1 live on rank 0; rank 1's experts get nothing


def _count_reruns(rc, backward) -> int:
    """How many recompute regions ``backward()`` reran."""
    reruns, real = [], rc._Frame._rerun
    rc._Frame._rerun = lambda self: (reruns.append(1), real(self))[1]
    try:
        backward()
    finally:
        rc._Frame._rerun = real
    return len(reruns)


def test_swiglu_recompute_in_the_experts_gives_the_same_gradients():
    """recompute=swiglu in an MoE block (model/moe.py swiglu): the routed experts' and the shared
    expert's output and every gradient are those without it, bit for bit (the same ops rerun), and
    the backward reran the product (one region per expert with rows, one for the shared expert)."""
    from paralayer.model import recompute as rc

    x = torch.randn(2, 6, D)
    out = {}
    for on in (False, True):
        m = make_moe(shared=10)
        m.recompute_expert_act = on
        assert m.shared.recompute_act is on
        xi = x.clone().requires_grad_()
        y = m(xi)
        reruns = _count_reruns(rc, lambda: (y * y).sum().backward())
        out[on] = (y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}, reruns)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    for n, g in out[False][2].items():
        assert torch.equal(out[True][2][n], g), n
    used = int((torch.bincount(make_moe(shared=10).route(x.reshape(-1, D))[0].reshape(-1), minlength=E) > 0).sum())
    assert out[False][3] == 0 and out[True][3] == used + 1
