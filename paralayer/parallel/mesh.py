"""The device mesh with named axes, built from the plan; groups are handed out explicitly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paralayer.compat import flatten_mesh
from paralayer.resolve.plan import plan_field

AXES = ("pp", "dp", "cp", "tp")


@dataclass
class Meshes:
    """The world mesh (pp, dp, cp, tp), tp fastest, and the expert grid (pp, edp, ep, tp).

    The expert grid is carved out of dp·cp: the flattened (dp, cp) index j sits at
    edp = j // ep, ep = j % ep, so each expert group spans neighbouring data ranks.
    """

    world: DeviceMesh
    dp_cp: DeviceMesh  # gradients and the loss are averaged over data and context ranks
    expert: Optional[DeviceMesh]

    def __getitem__(self, axis: str) -> DeviceMesh:
        if axis == "dp_cp":
            return self.dp_cp
        if axis in ("ep", "edp"):
            assert self.expert is not None, "no expert grid in this plan"
            return self.expert[axis]
        return self.world[axis]

    def size(self, axis: str) -> int:
        if axis in ("ep", "edp") and self.expert is None:
            return 1
        return self[axis].size()

    def local_rank(self, axis: str) -> int:
        if axis in ("ep", "edp") and self.expert is None:
            return 0
        return self[axis].get_local_rank()


def build_mesh(plan: Any, device_type: str) -> Meshes:
    """The meshes of a :class:`~paralayer.resolve.plan.Plan` (or its JSON dict)."""
    d = plan_field(plan, "degrees")
    shape = tuple(int(d[a]) for a in AXES)
    world = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
    dp_cp = flatten_mesh(world["dp", "cp"], "dp_cp")
    expert = None
    ep = int(d["ep"])
    if ep > 1:
        pp, dp, cp, tp = shape
        ranks = torch.arange(pp * dp * cp * tp).view(pp, dp * cp // ep, ep, tp)
        expert = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "tp"))
    return Meshes(world=world, dp_cp=dp_cp, expert=expert)
