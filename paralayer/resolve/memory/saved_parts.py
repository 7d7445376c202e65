"""Which saved tensor makes a layout's activations too big: the per-token set of a layer, by tensor.

Why: "activations 157 GiB" tells a user that a layout does not fit, not what to change. DeepSeek-V3's
published layout without full recompute (issue 45) does not fit this runtime, and the plan must say
exactly which tensor is the reason. The parts are :func:`activations.act_elems_per_token`'s own terms,
summed to the same total (tests/test_saved_parts.py), in bytes per token and layer.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import fp8_blocks
from paralayer.resolve.memory.activations import KINDS, _act_elems, act_elems_per_token, layer_kind
from paralayer.resolve.memory.bf16_acts import bf16_extra_elems
from paralayer.resolve.memory.norm_up_acts import norm_up_freed
from paralayer.resolve.memory.states import ACT_BYTES, chunk_blocks, layer_recompute
from paralayer.resolve.rules import Layout

KIND_NAMES = ("dense", "MoE", "Gated DeltaNet dense", "Gated DeltaNet MoE")


def act_parts(cfg: Config, lay: Layout, moe: bool, recompute: str | None = None,
              linear: bool = False) -> dict[str, float]:
    """:func:`act_elems_per_token` by tensor (same units: elements of ``ACT_BYTES[precision]``)."""
    mode = recompute or lay.recompute
    if mode == "norm_up":
        out = act_parts(cfg, lay, moe, "swiglu" if moe else "none", linear)
        out["rebuilt by norm_up (the norms' outputs, MLA's up-projections)"] = -norm_up_freed(cfg, lay)
        return out
    out: dict[str, float] = {}
    _act_elems(cfg, lay, moe, mode, linear, parts=out)
    if lay.precision == "bf16":
        out["kept in fp32 under bf16"] = bf16_extra_elems(cfg, lay, mode, moe, linear)
    if cfg.train.precision == "fp8":
        out["FP8 blocks' own copies"] = fp8_blocks.act_delta(cfg, lay, moe, mode, linear)
    return out


def largest_saved(cfg: Config, lay: Layout, r: int) -> dict:
    """Pipeline rank r's heaviest layer group (kind and recompute mode, by layers × bytes a token)
    and its saved set by tensor, largest first: the plan's ``activations_by_tensor``."""
    groups: dict[tuple[int, str], int] = {}
    for ids in chunk_blocks(cfg, lay, r):
        for i in ids:
            key = (layer_kind(cfg, i), layer_recompute(lay, i))
            groups[key] = groups.get(key, 0) + 1
    if not groups:
        return {}
    ab = ACT_BYTES[lay.precision]

    def per_token(key: tuple[int, str]) -> float:
        moe, linear = KINDS[key[0]]
        return act_elems_per_token(cfg, lay, moe, key[1], linear) * ab

    (kind, mode), n = max(groups.items(), key=lambda kv: (kv[1] * per_token(kv[0]), -kv[0][0]))
    moe, linear = KINDS[kind]
    total = per_token((kind, mode))
    parts = sorted(((name, e * ab) for name, e in act_parts(cfg, lay, moe, mode, linear).items() if e),
                   key=lambda p: -p[1])
    return {"pp_rank": r, "layer_kind": KIND_NAMES[kind], "recompute": mode, "layers": n,
            "bytes_per_token_per_layer": total,
            "tensors": [{"tensor": name, "bytes_per_token_per_layer": b, "share": b / total if total else 0.0}
                        for name, b in parts]}
