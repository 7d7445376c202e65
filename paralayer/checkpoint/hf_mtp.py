"""MTP depths on import from a Hugging Face checkpoint (DeepSeek's ``model.layers.{n+k}.*``):
which depths the checkpoint lacks (they start from the layout-independent init, as a Megatron or
torchtitan run that adds MTP to a base model does) and which it carries beyond the model's (not
read). Each case is said in one ``notice:`` line; the names themselves are in hf_moe.py."""
from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from paralayer.checkpoint.hf_moe import mtp_depths_in


def _clean(name: str) -> str:
    from paralayer.model.transformer import _clean_name

    return _clean_name(name)


def notice(msg: str) -> None:
    """One line on stderr, from global rank 0 only."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(f"notice: {msg}", file=sys.stderr, flush=True)


def fresh_depths(model: nn.Module, reader, cfg, seed: int, path: str) -> frozenset:
    """The clean names of this chunk's MTP parameters the checkpoint at ``path`` does not carry."""
    held = mtp_depths_in(reader, cfg.n_layers)
    want = cfg.mtp.depth if getattr(model, "mtp", None) is not None else 0
    fresh = frozenset(_clean(n) for n, _ in model.named_parameters()
                      if any(_clean(n).startswith(f"mtp.layers.{k}.") for k in range(held, want)))
    if held < want and fresh:
        notice(f"{path}: carries {held} MTP depth(s), model.mtp.depth={want}: depths {held}..{want - 1} "
               f"start from a fresh init (seed {seed})")
    elif held > cfg.mtp.depth:
        notice(f"{path}: carries {held} MTP depth(s) (model.layers.{cfg.n_layers}..); model.mtp.depth="
               f"{cfg.mtp.depth}: the rest are not read")
    return fresh


@torch.no_grad()
def init_fresh(model: nn.Module, fresh: frozenset, cfg, seed: int, vocab: int, copy_full_tensors) -> None:
    """Give the ``fresh`` parameters the layout-independent init of ``seed`` (through hf.py's
    ``copy_full_tensors``, handed in: it slices each full tensor to this rank's layout)."""
    if not fresh:
        return
    from paralayer.model.transformer import full_init

    def init_for(name: str, shape: tuple, experts: Optional[tuple]) -> torch.Tensor:
        full = full_init(name, shape, cfg, seed)
        return full if experts is None else full.narrow(0, experts[0], experts[1]).contiguous()

    copy_full_tensors(model, init_for, vocab, only={n for n, _ in model.named_parameters() if _clean(n) in fresh})
