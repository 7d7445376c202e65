"""What a pipeline chunk keeps per microbatch beside its layers' saved sets: RoPE's tables and
the window mask, each computed once per forward of the chunk (model/transformer.py) and saved
by every layer that uses it, one storage for the chunk.

- RoPE's cos and sin, (s/cp, rotated dims) each: the full layers' table, and under Gemma 3's
  ``model.rope_local_theta`` the sliding layers' own. A table no layer of the chunk uses is freed
  (tiny-gemma3 at 6 layers keeps both, at 2, all sliding, one: rehearsed).
- A windowed layer's additive mask (s, s) in the core's dtype (model/attention.py window_bias):
  one per window the chunk's SDPA cores take, whatever the recompute mode (a recomputed region
  keeps it as an input). Not under cp (the ring replaces the core) nor with GPT-OSS's sinks
  (their own core) nor MLA.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.config.layer_pattern import layer_types
from paralayer.resolve import model_parts as parts
from paralayer.resolve.rules import Layout


def _shares_mask(cfg: Config, lay: Layout, types: list, i: int) -> bool:
    """Layer i's core takes the chunk's window mask (model/attention.py ``shared_mask_window``)."""
    return (lay.cp == 1 and i < len(types) and types[i] == "sliding" and not cfg.model.attn_sinks
            and parts.attention_kind(cfg) != "mla")


def chunk_tables(cfg: Config, lay: Layout, ids, last: bool = False) -> tuple[int, int]:
    """(RoPE tables, window masks) a chunk of pipeline layers ``ids`` keeps per microbatch; ``last``:
    it holds the model's last layers (the MTP depths rotate by the full layers' table)."""
    if not ids:
        return 0, 0
    if cfg.model.sliding_window is None:  # no sliding layer: one table, no mask (the planner's common case)
        return 1, 0
    types = layer_types(cfg.model)
    sliding = [types[i] == "sliding" for i in ids]
    if cfg.model.rope_local_theta is None or not any(t == "sliding" for t in types):
        tables = 1
    else:
        tables = int(any(sliding)) + int(not all(sliding) or (last and cfg.model.mtp.depth > 0))
    # one window size per model (model.sliding_window): a mask if any layer here shares it
    return tables, int(any(_shares_mask(cfg, lay, types, i) for i in ids))
def mask_bytes_for(positions: float, mode: str) -> float:
    """One window mask: (s, s) in the core's dtype (bf16 under autocast and FSDP's bf16)."""
    return positions * positions * (4 if mode == "fp32" else 2)


def fixed_bytes(tables: tuple[int, int], rope: float, mask: float) -> float:
    """The bytes of a chunk's :func:`chunk_tables` given one table's and one mask's bytes (the
    resolver and the planner sum through here: the same floats)."""
    return tables[0] * rope + tables[1] * mask
