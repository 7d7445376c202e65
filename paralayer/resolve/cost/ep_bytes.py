"""Where the expert all-to-all's bytes go: the rank itself, its node, the network.

Why its own file: the ep entry of ``cost.comm`` (terms.py) splits its payload by destination as
the runtime's flat all-to-all sends it, and bounds what node-limited routing would send; both
read only the layout's mesh and the model's routing keys. Torch-free.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve.rules import Layout


def ep_node_split(lay: Layout, payload: float) -> dict:
    """Where the flat all-to-all's rows go (parallel/expert.py sends each routed row to its expert's
    rank, one copy per row, no per-node dedup): with the experts spread evenly over the ep group and
    the routing balanced, 1/ep of the payload stays on the rank (``local``), the group's other ranks
    on this rank's node (consecutive ranks of the flattened dp·cp grid, tp innermost: the mesh order)
    get their share over NVLink (``intra_node``), the rest crosses the network (``inter_node``).
    The three add up to ``bytes_per_step``; the wire time counts intra and inter apart."""
    ep, dpn = lay.ep, max(lay.devices_per_node, 1)
    ep_cp = min(ep, lay.cp) if ep % max(min(ep, lay.cp), 1) == 0 else lay.cp
    ep_dp = max(ep // max(ep_cp, 1), 1)
    group = [i_cp * lay.tp + i_dp * lay.tp * lay.cp for i_dp in range(ep_dp) for i_cp in range(ep_cp)]
    on_node = sum(1 for r in group if r // dpn == 0)  # the group through rank 0, rank 0 among them
    return {"local_bytes_per_step": int(payload / ep), "intra_node_bytes_per_step": int(payload * (on_node - 1) / ep),
            "inter_node_bytes_per_step": int(payload * (ep - on_node) / ep), "ep_ranks_per_node": on_node}


def group_routing_bound(cfg: Config, lay: Layout, tokens: float, ab: float, count: float) -> dict:
    """Node-limited routing (model.moe.n_group, topk_group; DeepSeek-V3 §2.1.2): the experts are
    in n_group groups, and with the ep group spread over N nodes each node holds n_group/N whole
    groups when N divides n_group. A token then reaches at most min(topk_group, N) nodes, and
    inter-node dispatch is bounded by one copy of its row per node reached (DeepSeek's dispatch
    sends a token once per node and forwards it over NVLink); without groups that bound is
    min(top_k, N) nodes. ``inter_node_bytes_per_step_bound`` is that bound on this rank's
    inter-node all-to-all payload (dispatch, combine, forward, backward: ``count`` as the entry's);
    our all-to-all sends each of the top_k rows (``bytes_per_step``), so the bound is what a
    deduplicating dispatch would move, and ``nodes_per_token_max`` the figure routing by group
    guarantees. Empty when the ep group stays inside one node."""
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
