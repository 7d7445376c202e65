"""Node-limited expert dispatch: a token's row crosses the network once per node it reaches.

Why: DeepSeek-V3 routes a token to at most ``topk_group`` nodes and sends it once per node, then
forwards it over NVLink to the experts there (arXiv 2412.19437 §3.2.2). The flat all-to-all of
parallel/expert.py sends one row per routed expert, so a token with three experts on one remote
node crosses the network three times. This file is the two-stage exchange, an option beside the
flat one (``apply_node_dispatch``); the numbers are the flat path's up to the order of the sums.

Forward, on ep rank r (node ``a``, position ``p`` among its node's ranks):
  stage 1 (network)  each (token, destination node) pair once: the token's row goes to the rank
                     of that node at position p (r's "rail" peer; to r itself for r's own node),
                     with the (expert, weight) of each of the token's slots on that node
  stage 2 (NVLink)   the peer fans each slot's row out to the rank owning its expert
  experts            each owner runs its local experts on the rows it received
  combine            reversed: owners send the outputs back to the peer (stage 2 reversed); the
                     peer sums weight·output per pair, one row per (token, node); that row goes
                     back to the token's rank (stage 1 reversed), which adds its nodes' rows.
Every exchange is ``expert.all_to_all`` (autograd; backward = the exchange reversed) or a plain
all_to_all_single of sizes/ids, on the ep group, whose process group carries the run's timeout.
The router weights travel with the slots (autograd), so their gradient comes back the same way.

``ep_bytes_sent`` on the module counts the token rows this rank sends (dispatch and combine,
forward and backward) by destination: ``local`` (itself), ``intra_node``, ``inter_node`` — what
the plan's ``comm.ep`` splits (resolve/cost/ep_bytes.py); the flat path counts the same way, and a
run's comm trace (parallel/comm_trace.py) holds the sums as ``bytes_sent["ep.<where>"]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from paralayer.parallel import expert
from paralayer.parallel.expert import _wire_dtype, all_to_all
from paralayer.parallel.expert_bytes import byte_counter, set_node_map  # noqa: F401 - build.py's

if TYPE_CHECKING:
    from paralayer.model.moe import MoEFeedForward


def nodes_of_group(group, devices_per_node: int) -> list[int]:
    """The node of each ep rank: its global rank // devices_per_node (ranks fill nodes in order)."""
    return [dist.get_global_rank(group, i) // max(devices_per_node, 1) for i in range(dist.get_world_size(group))]


def apply_node_dispatch(module, node_of: list[int]):
    """Switch every expert-parallel MoE block in ``module`` to the two-stage dispatch; ``node_of``:
    the node of each ep rank (:func:`nodes_of_group`). Returns ``module``."""
    from paralayer.model.moe import MoEFeedForward
    mods = [module] if isinstance(module, MoEFeedForward) else \
        [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    for m in mods:
        if m.ep_group is None:
            raise RuntimeError("apply_expert_parallel first: the node dispatch splits the ep group")
        if any(b < a for a, b in zip(node_of, node_of[1:])):
            raise ValueError(f"ep ranks must fill nodes in order, got nodes {node_of}")
        sizes = {n: list(node_of).count(n) for n in node_of}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"every node must hold as many ep ranks, got {sizes}")
        if getattr(m, "ep_node_of", None) != list(node_of):
            set_node_map(m, node_of)
        m.ep_node_dispatch = node_dispatch_forward
    return module


def _exchange(t: Tensor, splits: Optional[list[int]], out_splits: Optional[list[int]], group, overlap=None,
              label: str = "") -> Tensor:
    """A plain (no autograd) all_to_all_single of sizes or ids (``overlap``: see expert.finish)."""
    out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:])) if out_splits is not None else torch.empty_like(t)
    # through expert.start_all_to_all, as every expert all-to-all (benchmarks/ep_overlap.py delays them there)
    expert.finish(expert.start_all_to_all(out, t.contiguous(), out_splits, splits, group), overlap, label)
    return out


class _AddRows(torch.autograd.Function):
    """``n`` zero rows, ``src[i]`` added into row ``index[i]``; backward reads ``grad[index]``. Plain
    index_add would keep ``src`` for its backward too: a row per (token, node) that the flat path
    does not keep (the plan's activations count the flat path's, resolve/memory/activations.py)."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, n: int) -> Tensor:
        ctx.save_for_backward(index)
        return src.new_zeros((n,) + tuple(src.shape[1:])).index_add_(0, index, src)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def _sources(experts: Tensor, src: Tensor, n_local: int, ep: int) -> list[list[int]]:
    """Rows per token rank of each local expert, in row order (``experts``, ``src``: each row's local
    expert and token rank, grouped by expert): what ``experts_forward`` runs an FP8 GEMM over apart,
    as the flat path does (model/moe.py ``sources``)."""
    out: list[list[int]] = [[] for _ in range(n_local)]
    runs, sizes = torch.unique_consecutive(experts * ep + src, return_counts=True)
    for key, n in zip(runs.tolist(), sizes.tolist()):
        out[key // ep].append(n)
    return out


def node_dispatch_forward(m: MoEFeedForward, x: Tensor, tokens: Tensor, weights: Tensor, counts: Tensor) -> Tensor:
    """``x`` (T, d) this rank's tokens; ``tokens`` (S,) the token of each routed slot, slots sorted
    by global expert; ``weights`` (S,) their combine weights; ``counts`` (E,) slots per expert.
    Returns Σ over each token's slots of weight · expert output, (T, d) in ``x``'s dtype."""
    if isinstance(counts, list):  # the rehearsal's even routing: sizes without data
        return _even_node_forward(m, x, weights, counts)
    group, ep, n_local = m.ep_group, m.ep_size, m.num_local_experts
    node_of, me, dev = m.ep_node_of, m.ep_rank, x.device
    nodes = sorted(set(node_of))
    per_node = ep // len(nodes)
    node_idx = torch.tensor([nodes.index(n) for n in node_of], device=dev)  # ep rank -> node index
    pos = me % per_node                       # this rank's position inside its node
    peers = [i * per_node + pos for i in range(len(nodes))]  # node index -> this rank's rail peer
    count = byte_counter(m)
    ov = getattr(m, "ep_overlap", None)  # dualpipev's overlapped pairs: the other half runs meanwhile
    T, N = x.shape[0], len(nodes)

    # which node each slot goes to; the (token, node) pairs, sorted by node then token
    slot_expert = torch.repeat_interleave(torch.arange(m.num_experts, device=dev), counts.to(torch.long))
    slot_node = node_idx[slot_expert // n_local]
    pairs, slot_pair = torch.unique(slot_node * T + tokens, return_inverse=True)
    pair_node, pair_token = pairs // T, pairs % T
    pairs_per_node = torch.bincount(pair_node, minlength=N)
    slots_per_node = torch.bincount(slot_node, minlength=N)
    by_node = torch.argsort(slot_node, stable=True)  # slots in node order (expert order inside)
    pair_start = torch.cumsum(pairs_per_node, 0) - pairs_per_node

    # sizes: to my rail peer in node n, [pairs, slots]; zero to every other rank
    sizes = torch.zeros(ep, 2, dtype=torch.long, device=dev)
    sizes[peers, 0], sizes[peers, 1] = pairs_per_node, slots_per_node
    got = _exchange(sizes, None, None, group, ov, "sizes")
    in1, out1 = sizes[:, 0].tolist(), got[:, 0].tolist()
    in_s, out_s = sizes[:, 1].tolist(), got[:, 1].tolist()

    # stage 1: one row per (token, node); each slot's (row in its pair message, expert) and weight
    rows = all_to_all(_wire_dtype(x.index_select(0, pair_token)), out1, in1, group, ov, "node dispatch", count)
    meta = torch.stack([slot_pair[by_node] - pair_start[slot_node[by_node]], slot_expert[by_node]], 1)
    meta = _exchange(meta, in_s, out_s, group, ov, "slots")
    w_in = all_to_all(weights[by_node].contiguous(), out_s, in_s, group, ov, "weights")
    src = torch.repeat_interleave(torch.arange(ep, device=dev), torch.tensor(out_s, device=dev))
    row_start = torch.tensor(out1, device=dev).cumsum(0) - torch.tensor(out1, device=dev)
    slot_row = meta[:, 0] + row_start[src]    # each received slot's row in ``rows``
    slot_exp = meta[:, 1]

    # stage 2: fan out inside the node, one row per slot, to the expert's owner (expert order)
    order2 = torch.argsort(slot_exp, stable=True)
    in2 = torch.bincount(slot_exp[order2] // n_local, minlength=ep).tolist()
    out2 = _exchange(torch.tensor(in2, device=dev), None, None, group, ov, "fan-out sizes").tolist()
    xs = all_to_all(rows.index_select(0, slot_row[order2]), out2, in2, group, ov, "fan-out", count)
    meta2 = _exchange(torch.stack([slot_exp, src], 1)[order2].contiguous(), in2, out2, group, ov, "experts")
    exp2, src2 = meta2[:, 0] - m.expert_offset, meta2[:, 1]

    # the local experts on rows grouped by local expert (stable: arrival order inside an expert, so
    # each token rank's rows stay together: they all came through its one peer in this node)
    perm = torch.argsort(exp2, stable=True)
    per_expert = torch.bincount(exp2, minlength=n_local).tolist()
    ys = m.experts_forward(xs.index_select(0, perm), per_expert, sources=_sources(exp2[perm], src2[perm], n_local, ep))
    ys = ys.index_select(0, torch.argsort(perm))

    # combine: back to the peer, weighted sum per (token, node), back to the token's rank
    back = all_to_all(ys, in2, out2, group, ov, "fan-in", count)
    weighted = back * w_in.index_select(0, order2).to(back.dtype).unsqueeze(1)
    node_rows = torch.zeros(rows.shape[0], x.shape[1], dtype=back.dtype, device=dev)
    node_rows = node_rows.index_add(0, slot_row[order2], weighted)
    mine = all_to_all(node_rows, in1, out1, group, ov, "node combine", count)
    out = _AddRows.apply(mine, pair_token, T)  # each token's nodes' rows summed
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _even_node_forward(m: MoEFeedForward, x: Tensor, weights: Tensor, counts: list[int]) -> Tensor:
    """:func:`node_dispatch_forward` under the rehearsal's even router (fake tensors; every rank
    routes the same ``counts``): the same exchanges with sizes known in Python. Which tokens reach a
    node is data the rehearsal does not have: each node gets round(T · reach) of a rank's tokens,
    ``reach`` the balanced share the plan counts (resolve/cost/ep_bytes.py); the rows it moves are
    therefore sizes, not the router's tokens, and it refuses real tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    from paralayer.resolve.cost.ep_bytes import reach
    if not isinstance(x, FakeTensor):
        raise RuntimeError("the even node dispatch moves sizes, not tokens: it runs in the rehearsal only")
    group, ep, n_local, node_of, me = m.ep_group, m.ep_size, m.num_local_experts, m.ep_node_of, m.ep_rank
    nodes = sorted(set(node_of))
    N, R, T, dev = len(nodes), ep // len(nodes), x.shape[0], x.device
    a, pos = nodes.index(node_of[me]), me % (ep // len(nodes))
    peers = [i * R + pos for i in range(N)]
    spec = m.spec
    pairs = round(T * reach(m.num_experts, m.top_k, spec.n_group, spec.topk_group, N))
    node_slots = [sum(counts[i * R * n_local:(i + 1) * R * n_local]) for i in range(N)]
    rank_slots = [sum(counts[j * n_local:(j + 1) * n_local]) for j in range(ep)]
    count = byte_counter(m)

    def on_peers(values: list[int]) -> list[int]:
        out = [0] * ep
        for i, v in enumerate(values):
            out[peers[i]] = v
        return out
    in1 = out1 = on_peers([pairs] * N)
    in_s, out_s = on_peers(node_slots), on_peers([node_slots[a]] * N)
    in2 = [N * rank_slots[j] if j // R == a else 0 for j in range(ep)]
    out2 = [N * rank_slots[me] if j // R == a else 0 for j in range(ep)]
    _exchange(torch.zeros(ep, 2, dtype=torch.long, device=dev), None, None, group)   # the sizes, as training
    rows = all_to_all(_wire_dtype(x.index_select(0, torch.arange(sum(in1), device=dev) % T)), out1, in1, group,
                      on_send=count)
    _exchange(torch.zeros(sum(in_s), 2, dtype=torch.long, device=dev), in_s, out_s, group)
    w_in = all_to_all(weights.contiguous(), out_s, in_s, group)  # one weight per slot
    _exchange(torch.zeros(ep, dtype=torch.long, device=dev), None, None, group)
    held = torch.arange(sum(in2), device=dev) % max(sum(out1), 1)  # each held slot's row in ``rows``
    xs = all_to_all(rows.index_select(0, held), out2, in2, group, on_send=count)
    _exchange(torch.zeros(sum(in2), 2, dtype=torch.long, device=dev), in2, out2, group)  # (expert, token rank)
    mine = counts[m.expert_offset: m.expert_offset + n_local]
    ys = m.experts_forward(xs, [c * ep for c in mine], sources=[[c] * ep for c in mine])
    back = all_to_all(ys, in2, out2, group, on_send=count)
    weighted = back * w_in.to(back.dtype).unsqueeze(1)
    node_rows = torch.zeros(rows.shape[0], x.shape[1], dtype=back.dtype, device=dev).index_add(0, held, weighted)
    got = all_to_all(node_rows, in1, out1, group, on_send=count)
    out = _AddRows.apply(got, torch.arange(sum(out1), device=dev) % T, T)
    return out if out.dtype == x.dtype else out.to(x.dtype)
