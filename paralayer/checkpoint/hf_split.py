"""Qwen3.5's checkpoints on the tensor side (paralayer/checkpoint/hf.py asks here; the family is
paralayer/families/qwen3_5/): its linear layers' projections stored split, and the text tower of
its vision-language wrapper.

    theirs (model.layers.{i}.linear_attn.)       ours (layers.{i}.attention.)
    in_proj_qkv [q | k | v], each over all heads  in_proj_qkvz: per k-head h [q_h | k_h | v of its r
    in_proj_z   [z over all v-heads]                           v-heads | z of its r v-heads]
    in_proj_b, in_proj_a [over all v-heads]       in_proj_ba: per k-head h [b of its r v-heads | a of them]

(r = v_heads / k_heads; k-head h serves v-heads h·r … h·r + r − 1, as Qwen3-Next's reshape reads
them.) A permutation of rows: ours = cat(theirs)[rows], theirs = ours[argsort(rows)]. The conv's
channels are [q | k | v] over all heads on both sides: ``conv1d`` is read as it is. Under tensor
parallel each rank reads the two projections whole and keeps its heads' rows (as DeepSeek-V3's
reordered rope rows, checkpoint/hf_moe.py): a rank's rows are spread over both stored tensors.

A wrapper's checkpoint keeps the text model's ``model.X`` at ``model.language_model.X`` (and
``lm_head`` at the top): read through that prefix; its vision tower (``model.visual.*``) and MTP
block (``mtp.*``) are not read, as transformers' Qwen3_5ForCausalLM ignores them, said in one line."""
from __future__ import annotations

import re
from typing import Optional

import torch

from paralayer.checkpoint.hf_mtp import notice

_OURS = re.compile(r"^layers\.(\d+)\.attention\.(in_proj_qkvz|in_proj_ba)\.weight$")
THEIRS = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


def is_split_name(name: str) -> bool:
    """Our fused projection (``layers.{i}.attention.in_proj_qkvz.weight`` or ``in_proj_ba``)."""
    return _OURS.match(name) is not None


def fused_rows(which: str, li) -> torch.Tensor:
    """Rows of cat(theirs) in our order, for ``which`` (in_proj_qkvz | in_proj_ba); ``li``: the
    LinearConfig (k_heads, v_heads, head_k_dim, head_v_dim)."""
    hk, hv, dk, dv = li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim
    r = hv // hk
    if which == "in_proj_ba":
        return torch.cat([torch.cat([torch.arange(h * r, (h + 1) * r), hv + torch.arange(h * r, (h + 1) * r)])
                          for h in range(hk)])
    q, k, v, z = 0, hk * dk, 2 * hk * dk, 2 * hk * dk + hv * dv  # where each block starts in cat(qkv, z)
    return torch.cat([torch.cat([q + torch.arange(h * dk, (h + 1) * dk), k + torch.arange(h * dk, (h + 1) * dk),
                                 v + torch.arange(h * r * dv, (h + 1) * r * dv),
                                 z + torch.arange(h * r * dv, (h + 1) * r * dv)]) for h in range(hk)])


def read_split(reader, name: str, li) -> torch.Tensor:
    """Our fused projection ``name`` from the checkpoint's split ones."""
    i, which = _OURS.match(name).groups()
    parts = [reader.get(f"model.layers.{i}.linear_attn.{t}.weight") for t in THEIRS[which]]
    return torch.cat(parts)[fused_rows(which, li)]


def write_split(full: dict, li) -> dict[str, torch.Tensor]:
    """Our full fused projections (in ``full``, by our names) → their split keys."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _OURS.match(name)
        if m is None:
            continue
        i, which = m.groups()
        cat = t[torch.argsort(fused_rows(which, li))]
        first = t.shape[0] - (li.v_heads * li.head_v_dim if which == "in_proj_qkvz" else li.v_heads)
        for key, part in zip(THEIRS[which], (cat[:first], cat[first:])):
            out[f"model.layers.{i}.linear_attn.{key}.weight"] = part.contiguous()
    return out


def wrapper_prefix(path: str) -> Optional[str]:
    """Where the checkpoint at ``path`` keeps its text model's ``model.`` when config.json's
    model_type is a wrapper its family names (families' ``TEXT_PREFIX``), else None."""
    from paralayer.families import by_type
    from paralayer.families.common import read_config

    mtype = read_config(path).get("model_type")
    fam = by_type(mtype)
    return getattr(fam, "TEXT_PREFIX", {}).get(mtype) if fam is not None else None


def text_tower(weight_map: dict, prefix: str, path: str) -> dict[str, str]:
    """{the key as a text model names it: the stored key} for a wrapper's checkpoint (``prefix``
    standing for ``model.``); the keys it will not read counted in one notice."""
    view = {("model." + k[len(prefix):] if k.startswith(prefix) else k): k for k in weight_map}
    skipped = {p: sum(k.startswith(p) for k in weight_map) for p in ("model.visual.", "mtp.")}
    if any(skipped.values()):
        notice(f"{path}: a vision-language checkpoint: its text tower ({prefix}*) is read; "
               + ", ".join(f"{p}* ({n} tensors)" for p, n in skipped.items() if n) + " not read (the text "
               "model's Qwen3_5ForCausalLM does not read them either)")
    return view
