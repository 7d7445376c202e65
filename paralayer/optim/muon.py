"""Muon for the blocks' matrices, AdamW for the rest, in one optimizer (one LR schedule, one state dict).

The update is torch.optim.Muon's (torch >= 2.9; Keller Jordan's Muon, Moonshot's "Muon is Scalable"):
momentum ``B ← μB + (1−μ)G``, Nesterov ``G + μ(B − G)``, ``ns_steps`` quintic Newton-Schulz steps with
the coefficients (3.4445, −4.7750, 2.0315), decoupled decay ``θ ← θ(1 − lr·wd)``, then ``θ ← θ − lr'·O``
with lr' from torch's ``_adjust_lr`` ('original': √max(1, A/B); 'match_rms_adamw': 0.2·√max(A, B),
Moonshot's, which lets Muon reuse AdamW's LR and decay). What we add, and why torch's class is not
used as it is: (1) the distributed step: the Newton-Schulz of a matrix runs once, on its owner
(paralayer/optim/owners.py), not on every data rank, and a sharded matrix is made whole first;
(2) stacks: an MoE layer's experts are one 3-D weight, orthogonalised as a stack of matrices;
(3) the iteration's dtype: torch hard-codes bf16, which this CPU runs ~40× slower than fp32 (no
bf16 instructions) — we keep bf16 on CUDA, fp32 elsewhere; in bf16 and 2-D it is torch's function
(tests/test_muon.py checks it bit for bit).

Which parameters get Muon (Moonshot / Kimi's rule): every matrix of the blocks (attention and MLP
projections, MLA's low-rank pairs, the router, MTP's projection, experts as stacks); AdamW for
the 1-D parameters (norms, biases), the token embedding and the output head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr

from paralayer.optim import owners as own

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
#: parameter names that stay on AdamW although they are matrices (the embedding and the head)
ADAMW_MATRICES = ("tok_embeddings", "output", "embed")


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """Muon for a block's matrix (or stack of matrices); AdamW for 1-D parameters, the embeddings
    and the head. ``p.dim()`` is the logical one (a DTensor's global)."""
    if p.dim() < 2:
        return False
    parts = name.split(".")
    return not any(part in ADAMW_MATRICES for part in parts)


def newton_schulz(g: torch.Tensor, steps: int, coefficients: tuple = NS_COEFFICIENTS, eps: float = EPS,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.optim.Muon's quintic iteration (``_zeropower_via_newtonschulz``) in ``dtype``, over the
    last two dims (a 3-D input is a stack: each matrix normalised and iterated alone)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust: str, shape) -> float:
    """torch's LR adjustment on the matrix's (rows, cols): the last two dims of a stack."""
    return _adjust_lr(lr, adjust, torch.Size(tuple(shape)[-2:]))


@dataclass
class DataGroup:
    """The ranks that hold the same dense weights (dp·cp): among them each replica matrix is owned
    by one rank. ``local``: parameters each rank keeps to itself (experts under ep)."""
    group: Optional[dist.ProcessGroup]
    rank: int = 0
    world: int = 1
    ranks: list = field(default_factory=lambda: [0])
    local: set = field(default_factory=set)


def _kind(p: torch.Tensor, data: DataGroup) -> tuple:
    """How the matrix reaches its Newton-Schulz: ('local',), ('replicas',), ('rows', group key) or
    ('gather',) (a DTensor sharded otherwise: tp's columns, FSDP over tp, a strided shard)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(p, DTensor):
        pl = p.placements
        if all(x.is_replicate() for x in pl):
            return ("local",)
        if p.device_mesh.ndim == 1 and type(pl[0]) is Shard and pl[0].dim == 0:
            return ("rows", p.device_mesh.get_group(0).group_name)
        return ("gather",)
    if id(p) in data.local or data.group is None or data.world == 1:
        return ("local",)
    return ("replicas",)


class MatrixExchange:
    """Orthogonalises a step's matrices where they are owned and gives each rank its part back.
    ``done``: the Newton-Schulz cost this rank ran at its last step (the balance tests read it)."""

    def __init__(self, data: DataGroup, ns_steps: int, dtype: torch.dtype):
        self.data, self.ns_steps, self.dtype = data, ns_steps, dtype
        self.done = 0

    def ns(self, x: torch.Tensor) -> torch.Tensor:
        self.done += own.ns_cost(x.shape)
        return newton_schulz(x, self.ns_steps, dtype=self.dtype)

    def __call__(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """``updates``: each parameter's local momentum update; returns its local orthogonalised part."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        self.done = 0
        out: list = [None] * len(params)
        by_kind: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            by_kind.setdefault(_kind(p, self.data), []).append(i)
        for kind, idx in sorted(by_kind.items()):
            if kind[0] == "local":
                for i in idx:
                    out[i] = self.ns(updates[i]).to(updates[i].dtype)
            elif kind[0] == "replicas":
                d = self.data
                owners = own.assign_owners([own.ns_cost(params[i].shape) for i in idx], d.world)
                res = own.orthogonalise_replicas([updates[i] for i in idx], owners, d.group, d.rank, d.world,
                                                 d.ranks, self.ns)
                for i, r in zip(idx, res):
                    out[i] = r
            elif kind[0] == "rows":
                mesh = params[idx[0]].device_mesh
                world, rank = mesh.size(), mesh.get_local_rank()
                owners = own.assign_owners([own.ns_cost(params[i].shape) for i in idx], world)
                res = own.orthogonalise_row_shards([updates[i] for i in idx], [params[i].shape for i in idx],
                                                   owners, mesh.get_group(0), rank, world, self.ns)
                for i, r in zip(idx, res):
                    out[i] = r
            else:  # the whole matrix on every rank of its mesh (DTensor's gather), each keeps its part
                for i in idx:
                    p = params[i]
                    whole = DTensor.from_local(updates[i], p.device_mesh, p.placements, shape=p.shape,
                                               stride=p.stride()).full_tensor()
                    o = self.ns(whole).to(whole.dtype)
                    out[i] = distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None).to_local()
        return out


def split_params(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's), each in the given order, duplicates (tied weights) once."""
    seen: set[int] = set()
    muon, adam = [], []
    for name, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (muon if uses_muon(name, p) else adam).append(p)
    return muon, adam
