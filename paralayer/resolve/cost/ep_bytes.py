"""Where the expert all-to-all's bytes go: the rank itself, its node, the network.

Why its own file: the ep entry of ``cost.comm`` (terms.py) splits its payload by destination as
the runtime sends it: the flat all-to-all (one row per routed expert) or the two-stage dispatch by
node (parallel/expert_node.py: one row per node a token reaches over the network, the fan-out inside
the node over NVLink); both read only the layout's mesh and the model's routing keys. Torch-free.
"""
from __future__ import annotations

from functools import lru_cache
from math import comb

from paralayer.config import Config
from paralayer.resolve.memory.bf16_acts import routed_rows_per_token
from paralayer.resolve.rules import Layout


def ep_node_split(lay: Layout, payload: float) -> dict:
    """Where the flat all-to-all's rows go (parallel/expert.py sends each routed row to its expert's
    rank, one copy per row, no per-node dedup): with the experts spread evenly over the ep group and
    the routing balanced, 1/ep of the payload stays on the rank (``local``), the group's other ranks
    on this rank's node (consecutive ranks of the flattened dp·cp grid, tp innermost: the mesh order)
    get their share over NVLink (``intra_node``), the rest crosses the network (``inter_node``).
    The three add up to ``bytes_per_step``; the wire time counts intra and inter apart."""
    ep = lay.ep
    on_node = _ranks_on_node(ep, lay.cp, lay.tp, max(lay.devices_per_node, 1))
    return {"local_bytes_per_step": int(payload / ep), "intra_node_bytes_per_step": int(payload * (on_node - 1) / ep),
            "inter_node_bytes_per_step": int(payload * (ep - on_node) / ep), "ep_ranks_per_node": on_node}


@lru_cache(maxsize=4096)
def _ranks_on_node(ep: int, cp: int, tp: int, dpn: int) -> int:
    """The ranks of the ep group through rank 0 on its node, rank 0 among them (:func:`ep_node_split`;
    a function of these four numbers alone, so cached: the planner asks ~10⁴ times per plan)."""
    ep_cp = min(ep, cp) if ep % max(min(ep, cp), 1) == 0 else cp
    ep_dp = max(ep // max(ep_cp, 1), 1)
    group = [i_cp * tp + i_dp * tp * cp for i_dp in range(ep_dp) for i_cp in range(ep_cp)]
    return sum(1 for r in group if r // dpn == 0)


def group_routing_bound(cfg: Config, lay: Layout, tokens: float, ab: float, count: float) -> dict:
    """Node-limited routing (model.moe.n_group, topk_group; DeepSeek-V3 §2.1.2): the experts are
    in n_group groups, and with the ep group spread over N nodes each node holds n_group/N whole
    groups when N divides n_group. A token then reaches at most min(topk_group, N) nodes, and
    inter-node dispatch is bounded by one copy of its row per node reached (DeepSeek's dispatch
    sends a token once per node and forwards it over NVLink); without groups that bound is
    min(top_k, N) nodes. ``inter_node_bytes_per_step_bound`` is that bound on this rank's
    inter-node all-to-all payload (dispatch, combine, forward, backward: ``count`` as the entry's);
    the flat all-to-all sends each of the top_k rows, so the bound is what a deduplicating dispatch
    would move at most (parallel.ep_dispatch=node moves :func:`node_dispatch_split`'s expected
    share), and ``nodes_per_token_max`` the figure routing by group guarantees. Empty when the ep
    group stays inside one node."""
    m = cfg.model
    mo = m.moe
    nodes = -(-lay.ep // max(lay.devices_per_node, 1))
    if nodes <= 1:
        return {}
    grouped = mo.n_group > 1 and mo.n_group % nodes == 0
    reach = min(mo.topk_group if grouped else mo.top_k, nodes)
    return {"ep_nodes": nodes, "nodes_per_token_max": reach,
            "inter_node_message_bytes_bound": int(tokens * reach * m.d_model * ab),
            "inter_node_bytes_per_step_bound": int(tokens * reach * m.d_model * ab * count)}


def node_dispatch_on(cfg: Config, lay: Layout) -> bool:
    """Whether the runtime sends the ep rows by node (parallel/expert_node.py): ``parallel.ep_dispatch``
    node, or unset (null) with node-limited routing (model.moe.n_group > 1) and an ep group over
    more than one node, as DeepSeek-V3 ran; flat otherwise."""
    ask = getattr(cfg.parallel, "ep_dispatch", None)
    if lay.ep <= 1 or cfg.model.moe.num_experts == 0 or ask == "flat":
        return False
    if ask == "node":
        return True
    per_node = ep_node_split(lay, 0.0)["ep_ranks_per_node"]
    return cfg.model.moe.n_group > 1 and per_node < lay.ep


def node_reach(cfg: Config, nodes: int) -> float:
    """:func:`reach` of ``model.moe`` (top_k: the routed rows per token, rounded up)."""
    mo = cfg.model.moe
    return reach(mo.num_experts, int(routed_rows_per_token(cfg) + 0.999999), mo.n_group, mo.topk_group, nodes)


def reach(E: int, k: int, n_group: int, topk_group: int, nodes: int) -> float:
    """P(a token's k experts include one on a given node), the ep group over ``nodes`` nodes of
    E/nodes experts each, with the routing balanced: the router picks topk_group of the n_group
    groups alike (when the nodes hold whole groups), then k experts among theirs: one at least in
    each chosen group when k ≥ 2·topk_group (below), else alike (hypergeometric). ``nodes`` × this
    is the expected number of distinct nodes per token; the rehearsal's router
    (parallel/expert_node.py) sends a rank's tokens to each node in this share."""
    if nodes <= 1:
        return 1.0
    if not (n_group > 1 and n_group % nodes == 0):  # k experts alike among all E
        return 1.0 - comb(E - E // nodes, k) / comb(E, k)
    n, m, g, eg = n_group, topk_group, n_group // nodes, E // n_group
    if k >= 2 * m:
        # a group is chosen for the sum of its best two scores, so with top_k ≥ 2·topk_group the
        # top-k keeps one of each chosen group (DeepSeek-V3, 8 = 2·4: its router on iid scores
        # reaches 3.96 of the 4 groups, tests/test_expert_node.py): the node is reached when one
        # of its g groups is chosen
        return 1.0 - comb(n - g, m) / comb(n, m)
    total = 0.0
    for j in range(1, min(g, m) + 1):  # j of this node's g groups among the m chosen
        p_j = comb(g, j) * comb(n - g, m - j) / comb(n, m)
        total += p_j * (1.0 - comb((m - j) * eg, k) / comb(m * eg, k))
    return total


def node_dispatch_split(cfg: Config, lay: Layout, tokens: float, ab: float, count: float) -> dict:
    """The two-stage exchange's rows per step (parallel/expert_node.py), by destination, balanced
    routing. ``count``: the flat entry's all-to-all count (dispatch, combine; forward, backward).
    Stage 1: one row per (token, node reached): to itself for its own node (local), to a peer over
    the network for each other node (inter). Stage 2: the forwarding rank sends each slot's row to
    its expert's owner inside the node: 1/R of them stay (local), (R−1)/R go over NVLink (intra).
    Per rank and exchange, in rows per token: local reach + k/R, intra k·(R−1)/R, inter
    reach·(N−1)."""
    per_node = ep_node_split(lay, 0.0)["ep_ranks_per_node"]
    nodes = max(lay.ep // max(per_node, 1), 1)
    reach, k = node_reach(cfg, nodes), routed_rows_per_token(cfg)
    row = tokens * cfg.model.d_model * ab * count
    local, intra, inter = row * (reach + k / per_node), row * k * (per_node - 1) / per_node, row * reach * (nodes - 1)
    return {"dispatch": "node", "local_bytes_per_step": int(local), "intra_node_bytes_per_step": int(intra),
            "inter_node_bytes_per_step": int(inter), "ep_ranks_per_node": per_node,
            "nodes_per_token": round(reach * nodes, 4), "bytes_per_step": int(local) + int(intra) + int(inter)}
