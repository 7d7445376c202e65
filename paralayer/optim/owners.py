"""Which rank orthogonalises which matrix, and the moves that bring it whole to its owner and back.

Newton-Schulz needs the whole matrix, but data parallelism holds either a replica of it on every
rank (ZeRO 0) or a row shard of it on each (FSDP2's Shard(0), ZeRO 2/3). As the peers converged
(Megatron's layer-wise distributed Muon, Dion, torchtitan): each matrix is owned by ONE rank of the
group, owners are balanced by the iteration's cost (~ m·n·min(m, n) per matrix), and

- replicas: the owner orthogonalises, then broadcasts its updates (one flat message per owner);
- row shards: one all-to-all sends every rank's shard of each matrix to its owner, the owner
  orthogonalises the reassembled matrix, and a second all-to-all sends each rank its rows back.

Every rank computes the same assignment from the shapes alone (no communication).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz cost of a matrix (or a stack of them: leading dims multiply): its GEMMs scale
    as m·n·min(m, n) (X Xᵀ, the Gram's square, and the product back, each step)."""
    *stack, m, n = shape
    batch = 1
    for s in stack:
        batch *= int(s)
    return batch * int(m) * int(n) * min(int(m), int(n))


def assign_owners(costs: Sequence[int], world: int) -> list[int]:
    """The owner rank of each matrix: largest cost first, to the least loaded rank (ties to the
    lower rank, then the earlier matrix): the longest-processing-time rule, deterministic."""
    loads = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda j: (loads[j], j))
        owners[i] = r
        loads[r] += costs[i]
    return owners


def loads(costs: Sequence[int], owners: Sequence[int], world: int) -> list[int]:
    """Each rank's summed Newton-Schulz cost under ``owners``."""
    out = [0] * world
    for c, r in zip(costs, owners):
        out[r] += c
    return out


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of ``rank``'s shard: torch.chunk's split, as FSDP2's Shard(0) deals them."""
    size = -(-rows // world)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def _row_numel(shape: Sequence[int], world: int, rank: int) -> int:
    a, b = row_range(shape[0], world, rank)
    per_row = 1
    for s in shape[1:]:
        per_row *= int(s)
    return (b - a) * per_row


def orthogonalise_row_shards(shards: list[torch.Tensor], shapes: list[torch.Size], owners: list[int],
                             group: dist.ProcessGroup, rank: int, world: int,
                             ns: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's row shards in, its rows of each orthogonalised matrix out: all-to-all to the
    owners, ``ns`` on each owned whole matrix, all-to-all back. Two collectives whatever the count."""
    for s, shape in zip(shards, shapes):
        if s.numel() != _row_numel(shape, world, rank):
            raise RuntimeError(f"muon: a shard of {tuple(shape)} holds {s.numel()} elements on rank {rank}, "
                               f"torch.chunk's split gives {_row_numel(shape, world, rank)}")
    dtype, device = shards[0].dtype, shards[0].device
    send_sizes = [sum(s.numel() for s, o in zip(shards, owners) if o == r) for r in range(world)]
    mine = [i for i, o in enumerate(owners) if o == rank]
    recv_sizes = [sum(_row_numel(shapes[i], world, r) for i in mine) for r in range(world)]
    send = torch.cat([s.reshape(-1) for r in range(world) for s, o in zip(shards, owners) if o == r]
                     or [torch.zeros(0, dtype=dtype, device=device)])
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    # reassemble: the block from rank r holds its rows of each owned matrix, in matrix order
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    offset = 0
    for r in range(world):
        for i in mine:
            n = _row_numel(shapes[i], world, r)
            a, b = row_range(shapes[i][0], world, r)
            pieces[i].append(recv[offset: offset + n].view(b - a, *shapes[i][1:]))
            offset += n
    done = {i: ns(torch.cat(pieces[i], dim=0)) for i in mine}
    # back: to rank r, its rows of each owned matrix, in matrix order
    back = torch.cat([done[i][slice(*row_range(shapes[i][0], world, r))].reshape(-1).to(dtype)
                      for r in range(world) for i in mine] or [torch.zeros(0, dtype=dtype, device=device)])
    out = torch.empty(sum(send_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, back, send_sizes, recv_sizes, group=group)
    result: list = [None] * len(shards)
    offset = 0
    for r in range(world):
        for i, (s, o) in enumerate(zip(shards, owners)):
            if o == r:
                result[i] = out[offset: offset + s.numel()].view_as(s)
                offset += s.numel()
    return result


def orthogonalise_replicas(tensors: list[torch.Tensor], owners: list[int], group: dist.ProcessGroup,
                           rank: int, world: int, group_ranks: list[int],
                           ns: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Every rank holds every matrix whole: each owner orthogonalises its own and broadcasts them,
    one flat message per owner (``world`` broadcasts whatever the count)."""
    out: list = [None] * len(tensors)
    for r in range(world):
        idx = [i for i, o in enumerate(owners) if o == r]
        if not idx:
            continue
        if r == rank:
            for i in idx:
                out[i] = ns(tensors[i]).to(tensors[i].dtype)
            flat = torch.cat([out[i].reshape(-1) for i in idx])
        else:
            flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=tensors[idx[0]].dtype,
                               device=tensors[idx[0]].device)
        dist.broadcast(flat, src=group_ranks[r], group=group)
        if r != rank:
            offset = 0
            for i in idx:
                out[i] = flat[offset: offset + tensors[i].numel()].view_as(tensors[i])
                offset += tensors[i].numel()
    return out
