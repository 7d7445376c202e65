"""Experts stored fused for all experts of a layer (GPT-OSS, a family's ``FUSED_EXPERTS``): the
tensor side of the Hugging Face import and export (paralayer/checkpoint/hf.py asks here).

    theirs (model.layers.{i}.)          shape        ours (layers.{i}.feed_forward.)
    mlp.experts.gate_up_proj            (E, d, 2F)   w1 = [..., ::2]ᵀ, w3 = [..., 1::2]ᵀ  (E, F, d): gate and
                                                     up interleaved in the last dim, x @ W (not W x)
    mlp.experts.gate_up_proj_bias       (E, 2F)      b1 = [:, ::2], b3 = [:, 1::2]         (E, F)
    mlp.experts.down_proj               (E, F, d)    w2 = ᵀ                                (E, d, F)
    mlp.experts.down_proj_bias          (E, d)       b2                                    (E, d)

Only the rows of the experts a rank holds are read (expert parallel)."""
from __future__ import annotations

import re

import torch

_OURS = re.compile(r"^layers\.(\d+)\.feed_forward\.([wb][123])$")
#: ours → (their key's role, the interleaved half or None, transposed)
_FROM = {"w1": ("gate_up", 0, True), "w3": ("gate_up", 1, True), "w2": ("down", None, True),
         "b1": ("gate_up_bias", 0, False), "b3": ("gate_up_bias", 1, False), "b2": ("down_bias", None, False)}


def is_fused_name(name: str) -> bool:
    """Our stacked expert weight or bias (``layers.{i}.feed_forward.w1`` … ``b3``)."""
    return _OURS.match(name) is not None


def read_fused(reader, keys: dict, name: str, start: int, count: int) -> torch.Tensor:
    """Experts [start, start + count) of our ``name`` from the fused tensors named by ``keys``
    (the family's FUSED_EXPERTS)."""
    i, ours = _OURS.match(name).groups()
    role, half, transposed = _FROM[ours]
    t = reader.get_rows(f"model.layers.{i}.{keys[role]}", start, count)
    if half is not None:
        t = t[..., half::2]
    return (t.transpose(1, 2) if transposed else t).contiguous()


def write_fused(full: dict, keys: dict) -> dict[str, torch.Tensor]:
    """Our full stacked expert tensors (in ``full``, by our names) → the fused keys."""
    out: dict[str, torch.Tensor] = {}
    layers = sorted({int(m.group(1)) for m in map(_OURS.match, full) if m})
    for i in layers:
        p = f"layers.{i}.feed_forward."
        w1, w3, w2 = full[p + "w1"], full[p + "w3"], full[p + "w2"]
        gu = torch.empty(w1.shape[0], w1.shape[2], 2 * w1.shape[1], dtype=w1.dtype)
        gu[..., 0::2], gu[..., 1::2] = w1.transpose(1, 2), w3.transpose(1, 2)
        out[f"model.layers.{i}.{keys['gate_up']}"] = gu
        out[f"model.layers.{i}.{keys['down']}"] = w2.transpose(1, 2).contiguous()
        if p + "b1" in full:
            b1, b3 = full[p + "b1"], full[p + "b3"]
            gub = torch.empty(b1.shape[0], 2 * b1.shape[1], dtype=b1.dtype)
            gub[:, 0::2], gub[:, 1::2] = b1, b3
            out[f"model.layers.{i}.{keys['gate_up_bias']}"] = gub
            out[f"model.layers.{i}.{keys['down_bias']}"] = full[p + "b2"].contiguous()
    return out
