"""Which layers attend through a sliding window: torch-free, so the model, the planner and the
rehearsal read one definition.

``model.sliding_window`` None: every layer full. Else ``model.layer_types`` (transformers' list,
"full" | "sliding" per layer) when given, else ``model.full_attention_every`` k: layer i is full
when (i+1) % k == 0 (k = 0: every layer sliding). A ``model.layer_types`` with "linear" entries (Gated
DeltaNet, Qwen3-Next: paralayer/model/linear/) is read whatever the window: its other layers are
"full" (or "sliding" with a window)."""
from __future__ import annotations

from typing import List, Optional


def layer_types(cfg) -> List[str]:
    """"full" | "sliding" | "linear" for each of ``cfg.n_layers`` layers (cfg: a ModelConfig)."""
    n = int(cfg.n_layers)
    if cfg.layer_types is not None and "linear" in cfg.layer_types:
        return list(cfg.layer_types)
    if cfg.sliding_window is None:
        return ["full"] * n
    if cfg.layer_types is not None:
        return list(cfg.layer_types)
    k = int(cfg.full_attention_every or 0)
    return ["full" if k and (i + 1) % k == 0 else "sliding" for i in range(n)]


def layer_window(cfg, layer_id: int) -> Optional[int]:
    """The window of layer ``layer_id`` (keys it sees: itself and window-1 before), None = full."""
    types = layer_types(cfg)
    if layer_id >= len(types):  # an MTP depth's block (model/mtp.py, ids n_layers…): full attention
        return None
    return int(cfg.sliding_window) if types[layer_id] == "sliding" else None
