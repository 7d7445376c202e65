"""Tied input embedding and output head (``model.tie_embeddings``), Megatron's way.

The embedding sits on the first pipeline chunk and the head on the last, often on different ranks,
so each keeps its own copy of the one (vocab, d) matrix: both are drawn from the same (seed, name)
(``model.full_init``), and after every backward both copies get the SUM of their gradients (on one
rank a local add; across the first and last pipeline ranks an all-reduce over the pair). Same
start, same gradient, same AdamW update: the copies stay equal, bit for bit, and train exactly
like one shared matrix. The gradient norm counts the pair once (the head's copy is left out).
Works under tp (both are split over the vocabulary the same way) and FSDP (same shards).
Multi-token prediction under pp keeps a copy of the embedding on the last stage (model/mtp.py):
the same pairing, the same sum (MTP with tied embeddings under pp would make three copies: refused).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.parallel.local_shard import local_tensor
from paralayer.parallel.tensor.layout import align_grad


def tied_params(chunks: Sequence[nn.Module]) -> tuple[Optional[nn.Parameter], Optional[nn.Parameter]]:
    """(embedding weight, head weight) this rank holds (None where its chunks have neither)."""
    emb = out = None
    for c in chunks:
        if getattr(c, "tok_embeddings", None) is not None:
            emb = c.tok_embeddings.weight
        mtp = getattr(c, "mtp", None)
        if mtp is not None and mtp.embed is not None:
            out = mtp.embed.weight  # MTP's copy on the last stage (model/mtp.py): the same pairing
        elif getattr(c, "output", None) is not None and getattr(getattr(c, "cfg", None), "tie_embeddings", True):
            out = c.output.weight
    return emb, out


def shares_embedding(model_cfg, pp: int) -> bool:
    """Two copies of the embedding to keep equal: tied embeddings, or MTP's copy under pp > 1."""
    return bool(model_cfg.tie_embeddings) or (model_cfg.mtp.depth > 0 and pp > 1)


def pair_group(pp_ranks: Sequence[Sequence[int]], rank: int) -> Optional[dist.ProcessGroup]:
    """The group {first, last pipeline rank} holding ``rank`` (collective: every rank calls it with
    the same ``pp_ranks``, the global ranks of each pipeline, so all pairs are made in one order)."""
    mine = None
    for ranks in pp_ranks:
        pair = sorted({int(ranks[0]), int(ranks[-1])})
        g = dist.new_group(pair) if len(pair) > 1 else None
        if rank in pair:
            mine = g
    return mine


def sum_tied_grads(chunks: Sequence[nn.Module], group: Optional[dist.ProcessGroup]) -> None:
    """Give both copies the sum of their gradients (after the data-parallel averaging)."""
    emb, out = tied_params(chunks)
    for p in (emb, out):
        if p is not None and p.grad is not None:
            # a vocab-parallel embedding's grad comes out Replicate; tensor.py's hook slices it to the
            # parameter's Shard(0), but a split backward (zbv, dualpipev) may set it without the hook
            align_grad(p)
    if emb is not None and out is not None:  # one rank holds both (pp = 1, or a V schedule's rank 0)
        if emb.grad is None or out.grad is None:
            return
        total = local_tensor(emb.grad) + local_tensor(out.grad)
        local_tensor(emb.grad).copy_(total)
        local_tensor(out.grad).copy_(total)
        return
    mine = emb if emb is not None else out
    if mine is None or group is None:
        return
    g = local_tensor(mine.grad) if mine.grad is not None else torch.zeros_like(local_tensor(mine))
    dist.all_reduce(g, group=group)
    if mine.grad is None:
        mine.grad = g


def head_copy(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The head's weight on this rank (the copy the gradient norm leaves out), if any."""
    _, out = tied_params(chunks)
    return [out] if out is not None else []
