"""Expert parallelism for ``MoEFeedForward``.

Layout. The expert-parallel (ep) group is carved out of the data-parallel ranks (dp·cp): the ranks
in one ep group hold DIFFERENT tokens. Router, attention, norms, embeddings and the shared expert
stay data parallel (replicated); only the routed experts are sharded: ep rank r holds experts
[r·E/ep, (r+1)·E/ep).

Forward (per MoE layer, on every ep rank):
    route locally → sort token-slots by expert (MoEFeedForward.forward)
    → exchange per-expert counts (all_to_all_single, no grad)
    → send each token-slot to the rank owning its expert (autograd all_to_all, unequal splits)
    → regroup the received rows by local expert, run the local experts, undo the regrouping
    → send the results back (autograd all_to_all, splits reversed)
    → weighted combine into the token rows (MoEFeedForward.forward)
The backward of each all_to_all is the all_to_all with the splits swapped, so gradients reach both
the inputs (other ranks' tokens) and the experts. Each all-to-all is posted asynchronously and waited
on at once, except inside dualpipev's overlapped forward-backward (parallel/pipeline/overlap.py),
where the other microbatch's half computes while it is in flight.

GRADIENT REDUCTION — what the data-parallel code must do:
  * Expert parameters (``is_expert_param(name)``: the stacked ``w1``/``w2``/``w3`` of each MoE
    block) already hold, after backward, the SUM of the gradients from every token of the ep group
    that was routed to them: the all_to_all did the reduction over ep. They must NOT be reduced over
    the ep group again. Reduce them (sum) only over the expert-data-parallel group, i.e. the ranks of
    dp·cp holding the same expert shard (size dp·cp / ep: same ep rank, different ep group).
  * Everything else is reduced over all dp·cp ranks, as usual.
  * Scaling: expert gradients divide by N = dp·cp like every other weight, not by the expert-dp
    group size N/ep (factor 3 of the gradient-scaling contract, paralayer/parallel/grad_scaling.py).
    The router and shared expert are sharded on the dp·cp mesh (``paralayer.parallel.data.apply_fsdp``).
  * Only with ep > 1: at ep = 1 the experts are ordinary data-parallel weights (the trainer passes
    no expert params then).
  * Tensor parallel: experts are NOT split by tp (ETP=1). The MoE block runs whole on every tp rank
    over the full (gathered) sequence; each ep group lies inside one tp coordinate of the expert grid
    (pp, edp, ep, tp), and the tp replicas compute identical gradients. (Tested: rank r's expert
    gradient equals rows [r·E/ep, (r+1)·E/ep) of the ep=1 gradient
    over the concatenated batch; non-expert gradients summed over ranks equal the ep=1 gradient.)

Stats (``module.stats``) are summed over the ep group. The aux loss is per rank (its own tokens), like
the rest of the loss. Capacity is applied per rank before dispatch (see paralayer/model/moe.py).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from paralayer.parallel.expert_bytes import byte_counter

if TYPE_CHECKING:
    from paralayer.model.moe import MoEFeedForward

EXPERT_PARAM_NAMES = ("w1", "w2", "w3", "b1", "b2", "b3")  # b: GPT-OSS's expert biases, when present
# stacked expert weights are raw Parameters named ...w1 (no ".weight"); dense SwiGLU / shared expert
# Linears are named ...w1.weight and are NOT expert params
_EXPERT_PARAM_RE = re.compile(r"(^|\.)[wb][123]$")


def is_expert_param(name: str) -> bool:
    """True for the expert-sharded parameters of MoE blocks (gradients reduced over expert-dp only).

    Works on names from ``model.named_parameters()``, also with wrapper prefixes
    (``_orig_mod.``, ``_checkpoint_wrapped_module.``) since it looks at the last component only:
    ``layers.3.moe.w1`` → True; ``layers.3.moe.gate.weight``, ``layers.3.moe.shared.w1.weight``,
    ``layers.0.ffn.w1.weight`` → False.
    """
    return bool(_EXPERT_PARAM_RE.search(name))


def expert_param_names(model: nn.Module) -> set[str]:
    """The exact parameter names of all MoE expert weights in ``model`` (by module type, not by
    name pattern) — use it to cross-check ``is_expert_param``."""
    from paralayer.model.moe import MoEFeedForward
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MoEFeedForward):
            prefix = f"{mod_name}." if mod_name else ""
            names.update(prefix + p for p in EXPERT_PARAM_NAMES if getattr(mod, p) is not None)
    return names


def apply_expert_parallel(module: nn.Module, ep_group) -> nn.Module:
    """Shard the experts of ``module`` (a MoEFeedForward, or any model containing them) over
    ``ep_group`` (a ProcessGroup, or a 1-D DeviceMesh). Keeps rows [r·E/ep, (r+1)·E/ep) of
    w1/w2/w3 (works on meta tensors too) and updates ``local_slices``. Returns ``module``."""
    from paralayer.model.moe import MoEFeedForward
    if hasattr(ep_group, "get_group"):  # DeviceMesh
        ep_group = ep_group.get_group()
    ep = dist.get_world_size(ep_group)
    rank = dist.get_rank(ep_group)
    mods = [module] if isinstance(module, MoEFeedForward) else \
        [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    for m in mods:
        if m.ep_group is not None:
            raise RuntimeError("expert parallel already applied to this MoE block")
        if m.num_experts % ep:
            raise ValueError(f"num_experts={m.num_experts} is not divisible by ep={ep}")
        n_local = m.num_experts // ep
        start = rank * n_local
        for name in EXPERT_PARAM_NAMES:
            full = getattr(m, name)
            if full is None:
                continue
            local = full.detach()[start:start + n_local].clone()
            setattr(m, name, nn.Parameter(local, requires_grad=full.requires_grad))
        m.ep_group, m.ep_size, m.ep_rank = ep_group, ep, rank
        m.ep_overlap = None  # the pipeline runner's OverlappedFB under parallel.pp_overlap
        m.ep_dispatch = expert_parallel_forward
        m.num_local_experts, m.expert_offset = n_local, start
        m.local_slices = m._make_local_slices()
    return module


def start_all_to_all(out: Tensor, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> dist.Work:
    """Post one all_to_all_single (``async_op=True``); the caller waits. Every expert all-to-all
    goes through here, so a benchmark can delay their completion (benchmarks/ep_overlap.py)."""
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)


def finish(work: dist.Work, overlap, label: str) -> None:
    """Wait on ``work``; inside DualPipe's overlapped forward-backward (``overlap``, the runner's
    :class:`~paralayer.parallel.pipeline.overlap.OverlappedFB`) the other half computes first."""
    if overlap is None:
        work.wait()
    else:
        overlap.wait(work, label)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with unequal splits; backward is the same exchange reversed. ``on_send``
    (optional): called with (send splits, bytes per row) for every exchange, forward and backward."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group, overlap=None,
                label: str = "", on_send=None) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.overlap, ctx.label = out_splits, in_splits, group, overlap, label
        ctx.on_send = on_send
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        x = x.contiguous()
        if on_send is not None:
            on_send(in_splits, _row_bytes(x))
        finish(start_all_to_all(out, x, out_splits, in_splits, group), overlap, label)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_in = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        grad = grad.contiguous()
        if ctx.on_send is not None:
            ctx.on_send(ctx.out_splits, _row_bytes(grad))
        finish(start_all_to_all(grad_in, grad, ctx.in_splits, ctx.out_splits, ctx.group), ctx.overlap,
               ctx.label + "'")
        return grad_in, None, None, None, None, None, None


def _row_bytes(t: Tensor) -> int:
    """Bytes of one row (dim 0) of ``t``."""
    n = 1
    for s in t.shape[1:]:
        n *= int(s)
    return n * t.element_size()


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group, overlap=None,
               label: str = "", on_send=None) -> Tensor:
    """Differentiable all_to_all_single along dim 0: send x[sum(in_splits[:j]) : ...] to rank j,
    receive out_splits[j] rows from rank j. ``overlap``/``label``: see :func:`finish`; ``on_send``:
    see :class:`_AllToAll`."""
    return _AllToAll.apply(x, out_splits, in_splits, group, overlap, label, on_send)


def _wire_dtype(xs: Tensor) -> Tensor:
    """Under autocast the token rows are the fp32 residual stream; the experts' GEMMs would cast
    them to the autocast dtype on arrival anyway, so they travel in it: half the dispatch bytes,
    the same numbers (Megatron dispatches bf16 too). The combine sends the GEMMs' bf16 output."""
    kind = xs.device.type
    if xs.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return xs.to(torch.get_autocast_dtype(kind))
    return xs


def expert_parallel_forward(m: MoEFeedForward, xs: Tensor, counts: Tensor) -> Tensor:
    """``xs`` (N, d): this rank's token-slots sorted by GLOBAL expert id; ``counts`` (E,) rows per
    expert. Returns the expert outputs (N, d) in the same order."""
    group, ep, n_local = m.ep_group, m.ep_size, m.num_local_experts
    if isinstance(counts, list):  # the rehearsal's even routing: every rank sends alike
        return _even_forward(m, xs, counts, group, ep, n_local)
    overlap = getattr(m, "ep_overlap", None)  # set by the pipeline runner under parallel.pp_overlap

    # 1. counts exchange: recv_counts[s, e] = rows rank s sends to my local expert e
    send_counts = counts.to(torch.long).contiguous()
    recv_counts = torch.empty_like(send_counts)
    finish(start_all_to_all(recv_counts, send_counts, None, None, group), overlap, "counts")
    send_counts = send_counts.view(ep, n_local)
    recv_counts = recv_counts.view(ep, n_local)
    in_splits = send_counts.sum(1).tolist()
    out_splits = recv_counts.sum(1).tolist()

    # 2. dispatch: received rows are ordered (source rank, local expert)
    count = byte_counter(m)
    received = all_to_all(_wire_dtype(xs), out_splits, in_splits, group, overlap, "dispatch", count)

    # 3. regroup by local expert (stable: source-rank order within an expert), compute, ungroup
    row_expert = torch.arange(n_local, device=xs.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.argsort(row_expert, stable=True)
    ys = m.experts_forward(received[perm], recv_counts.sum(0).tolist(), sources=recv_counts.t().tolist())
    ys = ys[torch.argsort(perm)]

    # 4. combine: send results back to the ranks that own the tokens
    return all_to_all(ys, in_splits, out_splits, group, overlap, "combine", count)


def _even_forward(m: MoEFeedForward, xs: Tensor, counts: list[int], group, ep: int, n_local: int) -> Tensor:
    """:func:`expert_parallel_forward` when every rank routes the same ``counts`` (a Python list,
    the rehearsal's even router): split sizes are known without the counts exchange's values, so
    the same collectives run with sizes the fake tensors never have to provide."""
    send_counts = torch.tensor(counts, dtype=torch.long, device=xs.device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # the exchange training runs
    mine = counts[m.expert_offset: m.expert_offset + n_local]        # what each source sends me
    in_splits = [sum(counts[j * n_local:(j + 1) * n_local]) for j in range(ep)]
    out_splits = [sum(mine)] * ep
    count = byte_counter(m)
    received = all_to_all(_wire_dtype(xs), out_splits, in_splits, group, on_send=count)
    # rows arrive (source rank, local expert); regroup by local expert, compute, ungroup
    idx = torch.arange(sum(out_splits), device=xs.device).view(ep, -1)
    starts = [sum(mine[:e]) for e in range(n_local)]
    perm = torch.cat([idx[:, s:s + c].reshape(-1) for s, c in zip(starts, mine)])
    ys = m.experts_forward(received[perm], [c * ep for c in mine], sources=[[c] * ep for c in mine])
    ys = ys[torch.argsort(perm)]
    return all_to_all(ys, in_splits, out_splits, group, on_send=count)
