"""A rank's share of one global batch: its dp slice of the sequences, then its cp zigzag shard of
each (the training step and the evaluation read batches the same way)."""
from __future__ import annotations

from typing import Any

import torch


def rank_batch(run: Any, dataset: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of global batch ``index`` (1-based) of ``dataset`` for this rank."""
    from paralayer.data.sampler import labels_for

    d = run.degree
    tokens = dataset.get_batch(index, run.meshes.local_rank("dp"), d["dp"], run.cfg.train.global_batch)
    tokens = tokens.to(run.device)
    labels = labels_for(tokens)
    if d["cp"] > 1:
        from paralayer.parallel.context import zigzag_shard

        cp_rank = run.meshes.local_rank("cp")
        tokens = zigzag_shard(tokens, 1, d["cp"], cp_rank)
        labels = zigzag_shard(labels, 1, d["cp"], cp_rank)
    return tokens, labels
