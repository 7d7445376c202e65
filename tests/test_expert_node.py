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

    seen_sources = {"flat": [], "node": []}  # the rows per token rank each expert GEMM runs apart (FP8)
    for name, mdl in (("flat", flat), ("node", node)):
        for m in mdl.modules():
            if getattr(m, "ep_group", None) is not None:
                def record(xs, counts, sources=None, _run=m.experts_forward, _into=seen_sources[name]):
                    _into.append([sorted(c for c in per if c) for per in sources])
                    return _run(xs, counts, sources=sources)
                m.experts_forward = record

    if plant:  # rows that crossed to the other node arrive shifted by one token
        real = expert_node.all_to_all
        calls = []

        def shifted(x, out_splits, in_splits, group, *a, **k):
            out = real(x, out_splits, in_splits, group, *a, **k)
            calls.append(1)
            if len(calls) % 5 == 1:  # each layer's 5 (rows, weights, fan-out, back, back): stage 1's rows
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
    if not plant:  # (planted, the next layers route other tokens)
        assert seen_sources["node"] == seen_sources["flat"] and seen_sources["flat"]

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
    print("planted: worst relative error", worst)
    assert worst > 1e-3, worst  # 100 times the tolerance the match is held to


# ------------------------------------------------------------------ the plan, and the rehearsal against it
def _plan(overrides):
    from paralayer.config import load_config
    from paralayer.resolve import resolve

    cfg = load_config(overrides)
    return cfg, resolve(cfg)


def test_the_plan_counts_a_token_once_per_node_at_the_published_layout():
    """deepseek-v3 (ep 64 over 8 nodes, a group of 32 experts per node, top-8 of 4 groups): the
    router reaches 4 nodes per token (its own code on iid scores: within 2%), so 3.5 of the flat
    path's 7 network rows per token remain; the fan-out inside the node is the 7/8 of the 8 slots
    that leave the forwarding rank; each priced on its link, in sequence."""
    from paralayer.model.block import router_spec
    from paralayer.model.routing import route
    from paralayer.resolve.cost.machine import comm_seconds, machine_for

    cfg, plan = _plan(["recipe=deepseek-v3"])
    node = plan.comm["ep"]
    flat = _plan(["recipe=deepseek-v3", "parallel.ep_dispatch=flat"])[1].comm["ep"]
    assert node["dispatch"] == "node" and flat["dispatch"] == "flat"
    assert node["nodes_per_token"] == 4.0 and node["ep_ranks_per_node"] == 8

    torch.manual_seed(0)
    experts = route(torch.randn(4096, 256), router_spec(cfg.model))[0]
    reached = torch.tensor([len(set(row)) for row in (experts // 32).tolist()], dtype=torch.float64).mean().item()
    assert abs(reached / node["nodes_per_token"] - 1) < 0.02, reached

    row = flat["bytes_per_step"] / 8  # one row per token per exchange, a step's worth
    assert node["inter_node_bytes_per_step"] == pytest.approx(row * 0.5 * 7, rel=1e-9)   # 4/8 of 7 other nodes
    assert node["intra_node_bytes_per_step"] == pytest.approx(row * 8 * 7 / 8, rel=1e-9)
    assert node["local_bytes_per_step"] == pytest.approx(row * (0.5 + 1), rel=1e-9)
    assert node["bytes_per_step"] == node["local_bytes_per_step"] + node["intra_node_bytes_per_step"] + \
        node["inter_node_bytes_per_step"]
    assert node["count_per_step"] == 2 * flat["count_per_step"]  # a network and an NVLink stage
    mach = machine_for(cfg)
    t_node, t_flat = comm_seconds(node, "inter-node", mach, "ep"), comm_seconds(flat, "inter-node", mach, "ep")
    lat = node["count_per_step"] * mach.latency("inter-node")
    assert t_node == pytest.approx(lat + node["inter_node_bytes_per_step"] / mach.bandwidth("inter-node")
                                   + node["intra_node_bytes_per_step"] / mach.bandwidth("intra-node"))
    assert t_node < t_flat
    print(f"deepseek-v3 ep seconds: flat {t_flat:.2f}, by node {t_node:.2f}; nodes per token: router {reached:.3f}")


TINY_2_NODES = ["recipe=deepseek-v3-tiny", "parallel.dp=4", "parallel.ep=4", "cluster.devices_per_node=2",
                "cluster.nodes=2", "train.precision=fp32", "model.n_layers=2", "model.mtp.depth=0"]


@pytest.mark.parametrize("dispatch", ["node"])
def test_the_rehearsal_sends_what_the_plan_counts_by_destination(dispatch):
    """deepseek-v3-tiny, ep 4 over 2 nodes of 2: the rehearsal (the runtime's exchanges on fake
    tensors, the even router) sends the rows the plan's comm.ep counts, local / NVLink / network,
    and its ep bytes (sizes and ids included) within 5%."""
    from paralayer import rehearse as R

    cfg, plan = _plan(TINY_2_NODES + [f"parallel.ep_dispatch={dispatch}"])
    ep = plan.comm["ep"]
    assert ep["dispatch"] == dispatch and ep["ep_ranks_per_node"] == 2
    out = R.rehearse(cfg, plan.to_dict(), [3])  # the last rank, on the second node
    assert out["ok"], out.get("errors")
    for r in out["ranks"]:
        sent = r["ep_bytes_by_destination"]
        for k in ("local", "intra_node", "inter_node"):
            want = ep[f"{k}_bytes_per_step"]
            # by node: each node gets round(T · reach) of a rank's T tokens, the plan T · reach
            assert sent[k] == pytest.approx(want, rel=0.01 if dispatch == "node" else 1e-9), (r["rank"], k, sent, want)
        assert abs(r["ratios"]["comm"]["ep"] - 1) < 0.05, r["ratios"]["comm"]


TRAIN = ["recipe=deepseek-v3-tiny", "train.precision=fp32", "model.init_std=0.2", "train.steps=2",
         "train.grad_clip=1e9", "train.threads=1", "logging.wandb.mode=disabled"]
LAYOUTS = {
    # ep 4 over 2 nodes of 2: both stages cross something. top_k 4 = 2·topk_group, where the plan's
    # nodes per token (cost/ep_bytes.reach: the chosen groups' nodes) is the router's own, 5/3
    "ep4-2x2": ["parallel.dp=4", "parallel.ep=4", "cluster.devices_per_node=2", "cluster.nodes=2",
                "train.global_batch=8", "train.micro_batch=2", "model.moe.top_k=4"],
    # DeepSeek's schedule: dualpipev with the overlapped pairs (the other half runs while each exchange
    # is in flight), ep 2 over 2 one-rank nodes
    "dualpipev-overlap": ["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.dp=2", "parallel.ep=2",
                          "cluster.devices_per_node=1", "cluster.nodes=4", "train.global_batch=16",
                          "train.micro_batch=2"],
}


def _train(rank, world, layout, dispatch):
    from paralayer.runtime.train import as_plan, setup, train_step
    from tests.dist import cfg_and_plan

    cfg, plan = cfg_and_plan(TRAIN + LAYOUTS[layout] + [f"parallel.ep_dispatch={dispatch}"])
    run = setup(cfg, as_plan(plan), None)
    blocks = [m for c in run.built.chunks for m in c.modules() if getattr(m, "ep_group", None) is not None]
    on = {getattr(m, "ep_node_dispatch", None) is not None for m in blocks}
    recs = [train_step(run, s) for s in range(1, cfg.train.steps + 1)]
    return recs, on, plan["comm"]["ep"]["dispatch"], bool(plan["pp_overlap"]), dict(run.comm.bytes_sent), \
        {k: plan["comm"]["ep"][f"{k}_bytes_per_step"] * cfg.train.steps for k in ("local", "intra_node", "inter_node")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_trainer_runs_the_plans_dispatch_with_the_flat_paths_losses(layout):
    """launch's path (plan → build → train_step, MTP on): the plan's dispatch is applied to every
    MoE block, and the steps' loss, mtp_loss and grad_norm equal the flat all-to-all's within 1e-5
    (relative), also inside dualpipev's overlapped pairs."""
    node = run_ranks(_train, 4, layout, "node")
    flat = run_ranks(_train, 4, layout, "flat")
    assert node[0][1:3] == ({True}, "node") and flat[0][1:3] == ({False}, "flat")
    assert node[0][3] == (layout == "dualpipev-overlap")
    for name, out in (("node", node), ("flat", flat)):  # the comm trace's ep rows against the plan's
        if layout != "ep4-2x2":  # (under pp the plan's comm is pipeline rank 0's, not every rank's)
            continue
        sent = {k: sum(r[4].get(f"ep.{k}", 0) for r in out) for k in ("local", "intra_node", "inter_node")}
        plan = {k: sum(r[5][k] for r in out) for k in sent}
        print(layout, name, "trace / plan:", {k: round(sent[k] / plan[k], 4) for k in sent if plan[k]})
        # the real router at init, 4 ranks × 2 steps × 256 tokens: within 5%
        assert all(abs(sent[k] / plan[k] - 1) < 0.05 for k in sent), (name, sent, plan)
    last = -1  # the loss is the last pipeline rank's, reported on every rank
    for got, want in zip(node[last][0], flat[last][0]):
        for k in ("loss", "mtp_loss", "grad_norm"):
            assert abs(got[k] - want[k]) <= 1e-5 * abs(want[k]), (k, got, want)
