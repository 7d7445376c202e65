"""Data parallelism: replicated (ZeRO-0), sharded optimizer states (ZeRO-1), FSDP2 (ZeRO-2/3).

Gradients are averaged over the flattened (dp, cp) group; expert weights under expert parallel
over the expert-data group only. Who divides by what: paralayer/parallel/grad_scaling.py (the
gradient-scaling contract).
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from paralayer.compat import private
from paralayer.model.norms import wide_dtype
from paralayer.parallel.grad_sync import GradReducer  # noqa: F401 - ZeRO-0/1 gradient averaging lives there
from paralayer.parallel.local_shard import local_tensor as _local


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero: int, param_dtype: Optional[torch.dtype] = None,
               expert_mesh: Optional[DeviceMesh] = None) -> None:
    """FSDP2 for ZeRO-2 (keep gathered weights between forward and backward) and ZeRO-3 (reshard)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    reshard = zero >= 3
    for layer in _blocks(model):
        ff = layer.feed_forward
        if expert_mesh is not None and getattr(ff, "ep_size", 1) > 1:
            experts = [p for n, p in ff.named_parameters(recurse=False)]
            if experts:
                # The router and the shared expert are replicated over all of dp·cp: shard them
                # there first, so that only w1/w2/w3 stay for the expert-mesh group below.
                for sub in ff.children():
                    if any(True for _ in sub.parameters()):
                        fully_shard(sub, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
                # Experts shard over the expert-data ranks only (their rescale: grad_scaling.py).
                fully_shard(ff, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def _blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The transformer blocks of a chunk, the MTP depths' blocks included (model/mtp.py): their
    experts must shard over the expert-data ranks like every other MoE block's."""
    yield from model.layers.values()
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        for depth in mtp.layers.values():
            yield depth.block


class ZeroOneOptimizer:
    """ZeRO-1: each data rank keeps AdamW states for its share of the parameters and broadcasts them.

    Parameters are dealt out whole, largest first, to the least-loaded rank, so the split is
    deterministic and balanced; the update each parameter gets is the same as unsharded AdamW.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, rank: int, world: int,
                 group_ranks: list[int], make_opt, local_params: Iterable[nn.Parameter] = ()):
        loads = [0] * world
        self.owner: dict[int, int] = {}
        # Expert weights differ between ep ranks: each rank keeps (and steps) its own.
        local_ids = {id(p) for p in local_params}
        order = sorted(range(len(params)), key=lambda i: -_local(params[i]).numel())
        for i in order:
            if id(params[i]) in local_ids:
                self.owner[i] = rank
                continue
            r = min(range(world), key=lambda j: loads[j])
            self.owner[i] = r
            loads[r] += _local(params[i]).numel()
        self.params, self.group, self.rank = params, group, rank
        self.local_ids = local_ids
        self.group_ranks = group_ranks
        # what each owner broadcasts after the step: its non-local parameters, one flat tensor per dtype
        self.broadcasts: list[tuple[int, list[nn.Parameter]]] = []
        for r in range(world):
            by_dtype: dict = {}
            for i, p in enumerate(params):
                if self.owner[i] == r and id(p) not in local_ids:
                    by_dtype.setdefault(_local(p).dtype, []).append(p)
            self.broadcasts += [(r, group) for group in by_dtype.values()]
        mine = [p for i, p in enumerate(params) if self.owner[i] == rank]
        self.inner = make_opt(mine if mine else [torch.nn.Parameter(torch.zeros(1, device=_local(params[0]).device))])
        self.param_groups = self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Step the owned share, then one broadcast per owner of its updated parameters, flat
        per dtype (a collective per parameter would pay the link latency hundreds of times)."""
        self.inner.step()
        for owner, group in self.broadcasts:
            tensors = [_local(p.data) for p in group]
            if owner == self.rank:
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                                   device=tensors[0].device)
            dist.broadcast(flat, src=self.group_ranks[owner], group=self.group)
            if owner != self.rank:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset: offset + t.numel()].view_as(t))
                    offset += t.numel()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: Optional[dist.ProcessGroup],
                   expert_params: Iterable[nn.Parameter] = (), ep_group: Optional[dist.ProcessGroup] = None,
                   tp_group: Optional[dist.ProcessGroup] = None, skip_norm: Iterable[nn.Parameter] = (),
                   as_tensor: bool = False):
    """Global gradient norm over every shard of every stage; scales grads when above max_norm.
    ``skip_norm``: parameters scaled with the rest but not counted (a tied head's copy).
    ``as_tensor``: return the norm as a 0-d tensor and never read it back (the rehearsal's fake
    tensors have no values); the scaling is then ``min(1, max_norm / norm)`` without a branch.

    A bounded number of collectives, whatever the parameter count: the local squared norms are
    summed per set of process groups they are sharded over (a DTensor's Shard/Partial mesh dims),
    then ONE all-reduce per distinct group carries the sums of every set that includes it. Pipeline
    stages and expert shards hold disjoint parameters: their sums add over pp and ep (one
    all-reduce each). 405B under tp·pp·FSDP: 4 all-reduces, not one per parameter.
    """
    expert_ids = {id(p) for p in expert_params}
    skip_ids = {id(p) for p in skip_norm}
    grads = [p.grad for p in params if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    # (is_expert, tuple of sharded-over groups) -> list of local squared norms
    parts: dict[tuple, list[torch.Tensor]] = {}
    groups: dict[str, dist.ProcessGroup] = {}
    for p in params:
        if p.grad is None or id(p) in skip_ids:
            continue
        g = p.grad
        names: tuple = ()
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # pending sums: settle them first
                from torch.distributed.tensor import Replicate

                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
                p.grad = g
            for dim, pl in enumerate(g.placements):
                if not (pl.is_replicate() or pl.is_partial()):  # Shard, and FSDP+TP's _StridedShard
                    pg = g.device_mesh.get_group(dim)
                    groups[pg.group_name] = pg
                    names += (pg.group_name,)
        local = _local(g)
        parts.setdefault((id(p) in expert_ids, tuple(sorted(names))), []).append(local)
    # the grads to scale, read AFTER the loop above: it may have replaced a Partial p.grad by its sum
    grads = [p.grad for p in params if p.grad is not None]
    keys = sorted(parts)
    acc = wide_dtype(grads[0].dtype) if grads else torch.float32  # fp32, fp64 kept
    sums = torch.zeros(max(len(keys), 1), dtype=acc, device=device)
    for i, k in enumerate(keys):
        norms = private("torch", "_foreach_norm")([t if t.dtype == acc else t.to(acc) for t in parts[k]], 2)
        sums[i] = torch.stack(norms).square().sum()
    for name in sorted(groups):
        rows = [i for i, k in enumerate(keys) if name in k[1]]
        if rows:
            idx = torch.tensor(rows, device=device)
            part = sums.index_select(0, idx)
            dist.all_reduce(part, group=groups[name])
            sums = sums.index_copy(0, idx, part)
    is_exp = torch.tensor([k[0] for k in keys] or [False], device=device)
    expert_sq = (sums * is_exp).sum()
    dense_sq = (sums * ~is_exp).sum()
    if ep_group is not None and expert_ids:
        dist.all_reduce(expert_sq, group=ep_group)
    total = (dense_sq + expert_sq).reshape(1)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm_t = total[0].sqrt()
    if as_tensor:
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm_t + 1e-6), max=1.0)
            private("torch", "_foreach_mul_")([_local(g) for g in grads], coef)
        return norm_t
    norm = float(norm_t)
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                _local(g).mul_(coef)
    return norm
