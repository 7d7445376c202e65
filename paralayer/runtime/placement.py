"""Placement checked, not assumed: where every rank really runs, against where the plan put it.

The plan decides from ``cluster.devices_per_node`` which axes stay inside a node (plan.json
``spans``): ranks ``0..dpn-1`` on the first node, the next ``dpn`` on the second, tp fastest.
The scheduler decides where tasks really land: SLURM's cyclic distribution, a hostfile, or a
``devices_per_node`` that is not the node's task count put consecutive ranks on different hosts,
and tp (planned on the fast intra-node links) silently crosses the network. At start-up every
rank gathers (hostname, local rank) of every rank once; an axis the plan calls intra-node whose
group spans hosts stops the job before step 1 with one line naming the axis, the hosts and the fix.
Every axis the plan places is checked: the world mesh's (tp, cp, pp, dp) and the expert grid's ep
(issue #37: a cyclic placement put every expert-parallel group across two nodes, unrefused).
Rank 0 writes ``run.dir/placement.json`` ({rank: {host, local_rank}}).
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Optional

import torch.distributed as dist

from paralayer.parallel.mesh import Meshes
from paralayer.resolve.plan import plan_field


class PlacementError(RuntimeError):
    """An axis planned inside a node spans hosts (one line)."""


def gather(world_size: int) -> dict[int, dict]:
    """{rank: {host, local_rank}} of every rank (one all_gather_object on the default group)."""
    me = {"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", dist.get_rank()))}
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, me)
    return {r: out[r] for r in range(world_size)}


def _grids(meshes: Meshes) -> list:
    """The device meshes whose axes the plan places: the world mesh, and the expert grid under ep."""
    return [meshes.world] + ([meshes.expert] if meshes.expert is not None else [])


def axis_groups(meshes: Meshes, axis: str) -> list[list[int]]:
    """Every group (global ranks) of ``axis``: of the world mesh (pp, dp, cp, tp) or, for ep and
    edp, of the expert grid (pp, edp, ep, tp)."""
    grid = next(g for g in _grids(meshes) if axis in g.mesh_dim_names)
    mesh = grid.mesh
    dim = grid.mesh_dim_names.index(axis)
    moved = mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim])
    return [row.tolist() for row in moved]


def real_spans(meshes: Meshes, where: dict[int, dict]) -> dict[str, dict]:
    """Per mesh axis (the world's and the expert grid's): 'intra-node' when every one of its groups
    lies on one host, else 'inter-node', with the hosts of the first group that spans (``hosts``)."""
    out = {}
    axes = [a for g in _grids(meshes) for a in g.mesh_dim_names]
    for axis in dict.fromkeys(axes):
        spans = {"spans": "intra-node", "hosts": []}
        for group in axis_groups(meshes, axis):
            hosts = sorted({where[r]["host"] for r in group})
            if len(hosts) > 1:
                spans = {"spans": "inter-node", "hosts": hosts, "ranks": group}
                break
        out[axis] = spans
    return out


def refusal(plan: Any, real: dict[str, dict]) -> Optional[str]:
    """The one line for the first axis the plan keeps inside a node that really spans hosts (every
    axis of plan.json ``spans``, tp first)."""
    planned = plan_field(plan, "spans")
    degrees = plan_field(plan, "degrees")
    for axis in dict.fromkeys(("tp", "cp", "ep", "pp", "dp", *planned)):
        r = real.get(axis)
        if not r or int(degrees.get(axis, 1)) <= 1:
            continue
        if planned.get(axis) == "intra-node" and r["spans"] == "inter-node":
            return (f"placement: {axis} (degree {degrees[axis]}) is planned inside a node but its ranks "
                    f"{r['ranks']} run on hosts {', '.join(r['hosts'])}; give each node consecutive ranks "
                    f"(SLURM's default block distribution: drop --distribution=cyclic from cluster.slurm.srun_args) "
                    f"and set cluster.devices_per_node to the tasks each node runs")
    return None


def check(plan: Any, meshes: Meshes, run_dir: Optional[str]) -> dict[int, dict]:
    """Gather the placement, write placement.json (rank 0), refuse a plan the placement breaks."""
    where = gather(dist.get_world_size())
    if run_dir is not None and dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "placement.json")
        with open(path + ".tmp", "w") as f:
            json.dump({str(r): where[r] for r in sorted(where)}, f, indent=1)
        os.replace(path + ".tmp", path)
    why = refusal(plan, real_spans(meshes, where))
    if why:
        raise PlacementError(why)
    return where
