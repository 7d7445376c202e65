"""Context parallel applied to a model: each attention layer gets the ring its core needs — the
full ring (paralayer/parallel/context/ring.py) or, for a sliding-window layer, the window ring that
moves only the chunks its queries see (paralayer/parallel/context/window_ring.py); a Gated DeltaNet
layer gets the conv tail and recurrent state passed along the zigzag chunks in sequence order
(paralayer/parallel/context/linear_state.py), on the same zigzag shard."""
from __future__ import annotations

import torch.distributed as dist

from paralayer.parallel.context.linear_state import apply_linear_context_parallel
from paralayer.parallel.context.ring import RingStats, make_ring_attention
from paralayer.parallel.context.window_ring import make_window_ring_attention
from paralayer.parallel.context.zigzag import zigzag_indices


def apply_context_parallel(model, group: dist.ProcessGroup, seq_len: int) -> None:
    """Make a (stage of a) Transformer attend over the cp ring on zigzag-sharded sequences.

    RoPE follows the chunks: the model's positions become this rank's global token positions.
    Each attention module gets a ``ring_stats`` (RingStats) recording this rank's attention work.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    model.positions = zigzag_indices(seq_len, cp, rank)
    for layer in model.layers.values():
        att = layer.attention
        if hasattr(att, "rule_fn"):  # Gated DeltaNet: a recurrence, no ring
            apply_linear_context_parallel(att, group)
            continue
        att.ring_stats = RingStats()
        if getattr(att, "window", None) is not None:  # sliding window: only the chunks it sees move
            att.attn_fn = make_window_ring_attention(group, att.window, att.ring_stats)
        else:
            att.attn_fn = make_ring_attention(group, att.ring_stats)
