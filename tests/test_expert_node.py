"""The node-limited (two-stage) expert dispatch (parallel/expert_node.py) against the flat all-to-all.

deepseek-v3-tiny (sigmoid routing by group: 8 experts in 4 groups, top-2 of 2 groups) at init std 0.2
on 4 gloo ranks, ep = 4, with 2 ranks per "node": the same tokens through the flat all-to-all and
through the two-stage dispatch give the same loss and the same gradients (tolerance below), and the
rows each rank sends, by destination, are what the routing says they must be. A planted error (the
rows that cross to the other node shifted by one token) must break the match.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks

WORLD, PER_NODE, B, S = 4, 2, 2, 32
#: flat vs two-stage: the sums of the combine run in another order (per node first), so fp32
#: rounding differs; max |difference| / max |flat value|, per tensor
RTOL = 1e-5


def _model():
    from paralayer.config import load_config
    from paralayer.model.transformer import Transformer, init_weights

    cfg = load_config(["model.init_std=0.2", "model.mtp.depth=0"], recipe="deepseek-v3-tiny")
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=3)
    return cfg, model


def _step(model, ids):
    from paralayer.model.transformer import lm_loss

    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _routed_rows(model, ids, rank, node_of):
    """From the routing alone (an independent count): per MoE layer, the rows this rank's tokens
    send in one forward dispatch, flat (one per slot off the rank) and two-stage (one per remote
    node reached), by destination."""
    from paralayer.model.moe import MoEFeedForward

    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: seen.append((mod, a[0].reshape(-1, a[0].shape[-1]))))
             for m in model.modules() if isinstance(m, MoEFeedForward)]
    with torch.no_grad():
        model(ids[:, :-1])
    for h in hooks:
        h.remove()
    n_local = 8 // WORLD
    flat = {"local": 0, "intra_node": 0, "inter_node": 0}
    remote_nodes = own_node = 0
    for mod, x in seen:
        experts = mod.route(x)[0]
        owner = experts // n_local
        for row in owner.tolist():
            for o in row:
                flat["local" if o == rank else "intra_node" if node_of[o] == node_of[rank] else "inter_node"] += 1
            remote_nodes += len({node_of[o] for o in row} - {node_of[rank]})
            own_node += node_of[rank] in {node_of[o] for o in row}
    return flat, remote_nodes, own_node


def _rank(rank, world, plant):
    from paralayer.parallel import expert_node
    from paralayer.parallel.expert import apply_expert_parallel

    cfg, model = _model()
    torch.manual_seed(100 + rank)
    ids = torch.randint(0, cfg.model.vocab_size, (B, S + 1))
    node_of = [r // PER_NODE for r in range(world)]

    flat = copy.deepcopy(model)
    for layer in flat.layers.values():
        apply_expert_parallel(layer, dist.group.WORLD)
    for m in flat.modules():
        if getattr(m, "ep_group", None) is not None:
            expert_node.set_node_map(m, node_of)  # counts the flat path's rows too
    node = copy.deepcopy(model)
    for layer in node.layers.values():
        apply_expert_parallel(layer, dist.group.WORLD)
    expert_node.apply_node_dispatch(node, node_of)

    if plant:  # rows that crossed to the other node arrive shifted by one token
        real = expert_node.all_to_all
        calls = []

        def shifted(x, out_splits, in_splits, group, *a, **k):
            out = real(x, out_splits, in_splits, group, *a, **k)
            calls.append(1)
            if len(calls) % 4 == 1:  # each layer's first exchange: stage 1's rows
                other = [r for r in range(world) if node_of[r] != node_of[rank]]
                for r in other:
                    lo = sum(out_splits[:r])
                    if out_splits[r] > 1:
                        out = torch.cat([out[:lo], out[lo:lo + out_splits[r]].roll(1, 0), out[lo + out_splits[r]:]])
            return out
        expert_node.all_to_all = shifted

    loss_f, grads_f = _step(flat, ids)
    loss_n, grads_n = _step(node, ids)
    errs = {"loss": abs(loss_n - loss_f) / abs(loss_f)}
    for name, g in grads_f.items():
        errs[name] = ((grads_n[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
    assert set(grads_n) == set(grads_f)

    def sent(mdl):
        tot = {"local": 0, "intra_node": 0, "inter_node": 0}
        for m in mdl.modules():
            for k, v in getattr(m, "ep_bytes_sent", {}).items():
                tot[k] += v
        return tot
    routed, remote_nodes, own_node = _routed_rows(model, ids, rank, node_of)
    return errs, sent(flat), sent(node), routed, remote_nodes, own_node


def test_node_dispatch_matches_flat_and_sends_once_per_node():
    results = run_ranks(_rank, WORLD, False)
    worst = {}
    for errs, *_ in results:
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("node vs flat, worst relative error:", max(worst.values()), max(worst, key=worst.get))
    assert max(worst.values()) < RTOL, worst
    assert len(worst) > 20  # every parameter's gradient was compared, experts included
    row = 64 * 4  # d_model fp32
    # summed over the ranks (a rank's combine sends back the rows it RECEIVED, so per rank the
    # sends mix its own routing and its peers'): each routed row is sent 4 times (dispatch and
    # combine, forward and backward), by the class of (token's rank, expert's rank)
    total = {k: sum(r[1][k] for r in results) for k in results[0][1]}
    assert total == {k: 4 * row * sum(r[3][k] for r in results) for k in total}
    # two-stage: one row per (token, remote node reached) crosses the network, 4 times
    node_inter = sum(r[2]["inter_node"] for r in results)
    assert node_inter == 4 * row * sum(r[4] for r in results)
    assert node_inter < total["inter_node"]
    # across the ranks: every slot is fanned out once inside its node (to its owner: itself or over
    # NVLink), and a token whose own node holds one of its experts goes there without the network
    total_slots = sum(sum(r[3].values()) for r in results)
    in_node = sum(r[2]["local"] + r[2]["intra_node"] for r in results)
    assert in_node == 4 * row * (total_slots + sum(r[5] for r in results))


def test_a_token_sent_to_the_wrong_node_breaks_the_match():
    results = run_ranks(_rank, WORLD, True)
    worst = max(max(r[0].values()) for r in results)
    assert worst > 1e-3, worst
