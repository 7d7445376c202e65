"""Context parallel: the zigzag layout of the sequence (zigzag.py), ring attention (ring.py), the
window ring for sliding-window layers (window_ring.py), and each attention layer given the ring
its core needs (layers.py).

The names ``paralayer.parallel.context`` always had are re-exported here; a test that replaces
one must patch the module that holds it (e.g. ``paralayer.parallel.context.ring``), not this one."""
from paralayer.parallel.context.ring import RingAttention, RingStats, make_ring_attention, ring_attention
from paralayer.parallel.context.zigzag import zigzag_indices, zigzag_shard, zigzag_unshard

__all__ = ["RingAttention", "RingStats", "make_ring_attention", "ring_attention", "zigzag_indices", "zigzag_shard",
           "zigzag_unshard"]
