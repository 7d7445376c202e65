"""The MoE families' extras to the Hugging Face import and export (paralayer/checkpoint/hf.py):
DeepSeek-V3's interleaved rope rows (reordered into our rotate-half on import, back on export),
its router's selection bias (a buffer the parameter copy skips), and its MTP depths in DeepSeek's
own naming ``model.layers.{n_layers+k}.*``."""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from paralayer.model.transformer import _clean_name

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _rope_rows(path: str) -> Optional[dict]:
    """{our name: (row offset in a head, rope dims, head width)} of the rows to reorder on import,
    as the checkpoint's family says (paralayer/families/: DeepSeek's ``rope_interleave`` lays the
    rope dims of q and of the shared key out in interleaved pairs; ours is rotate-half); None when
    nothing is to reorder."""
    from paralayer.families import by_type
    from paralayer.families.common import read_config

    hf = read_config(path)
    fam = by_type(hf.get("model_type"))
    return fam.rope_rows(hf) if fam is not None and fam.rope_rows else None


def _reordered(reader, name: str) -> bool:
    m = _LAYER.match(mtp_as_layer(name, getattr(reader, "n_layers", None)))
    return bool(reader.rope_rows) and m is not None and m.group(2) in reader.rope_rows


def _deinterleave_rope(t: torch.Tensor, name: str, rows: dict, inverse: bool = False) -> torch.Tensor:
    m = _LAYER.match(name)
    spec = rows.get(m.group(2)) if m else None
    if spec is None:
        return t
    start, n, width = spec
    perm = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
    if inverse:
        perm = torch.argsort(perm)
    heads = t.shape[0] // width
    v = t.reshape(heads, width, *t.shape[1:]).clone()
    v[:, start:start + n] = v[:, start:start + n][:, perm]
    return v.reshape(t.shape)


def _load_router_bias(model: nn.Module, reader) -> None:
    """DeepSeek-V3's selection bias (``mlp.gate.e_score_correction_bias``) into each sigmoid
    router's ``expert_bias`` buffer (the MTP depths' too) (a buffer, not a parameter: the loop above skips it)."""
    for name, mod in model.named_modules():
        clean = _clean_name(name)
        if clean.startswith("mtp."):  # an MTP depth's block: DeepSeek's layer n_layers+k
            clean = mtp_as_layer(clean + ".weight", getattr(reader, "n_layers", None))[:-len(".weight")]
        m = re.match(r"^(?:.*\.)?layers\.(\d+)\.feed_forward$", clean)
        key = f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias" if m else None
        if key is not None and getattr(mod, "router", None) == "sigmoid" and key in reader:
            with torch.no_grad():
                mod.expert_bias.copy_(reader.get(key).to(mod.expert_bias.dtype))


_MTP_PARTS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
              "norm.weight": "shared_head.norm.weight"}


_HF_MTP_PARTS = {v: k for k, v in _MTP_PARTS.items()}
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def mtp_as_layer(name: str, n_layers: Optional[int]) -> str:
    """Our MTP name as the decoder-layer name DeepSeek stores it under (the import's reading of
    :func:`_mtp_to_deepseek`): ``mtp.layers.{k}.block.X`` → ``layers.{n_layers+k}.X``, the last
    stage's embedding copy ``mtp.embed.weight`` → ``tok_embeddings.weight``; any other name as is."""
    if name == "mtp.embed.weight":
        return "tok_embeddings.weight"
    m = _MTP.match(name)
    if m is None or n_layers is None or not m.group(2).startswith("block."):
        return name
    return f"layers.{n_layers + int(m.group(1))}.{m.group(2)[len('block.'):]}"


def mtp_hf_key(name: str, n_layers: Optional[int]) -> Optional[str]:
    """The DeepSeek key of an MTP depth's own parts (enorm, hnorm, eh_proj, shared_head.norm), or
    None for any other name (its block's weights go through :func:`mtp_as_layer`)."""
    m = _MTP.match(name)
    if m is None or n_layers is None or m.group(2) not in _MTP_PARTS:
        return None
    return f"model.layers.{n_layers + int(m.group(1))}.{_MTP_PARTS[m.group(2)]}"


def mtp_depths_in(reader, n_layers: int) -> int:
    """How many MTP depths the checkpoint carries in DeepSeek's naming (``model.layers.{n+k}.enorm``
    for k = 0, 1, … without a gap)."""
    k = 0
    while f"model.layers.{n_layers + k}.enorm.weight" in reader:
        k += 1
    return k


def _mtp_to_deepseek(name: str, t: torch.Tensor, cfg, rows, ours_to_hf) -> dict[str, torch.Tensor]:
    """MTP depth k in DeepSeek's own naming, ``model.layers.{n_layers+k}.*`` (its block as a
    decoder layer's, plus enorm, hnorm, eh_proj, shared_head.norm; ``ours_to_hf``: the family's
    name table, families/names.py's with the family bound); the embedding copy of a pp run
    is the model's and is not written twice. transformers' class does not read these layers."""
    m = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        return {}
    i = cfg.n_layers + int(m.group(1))
    rest = m.group(2)
    if rest in _MTP_PARTS:
        return {f"model.layers.{i}.{_MTP_PARTS[rest]}": t.contiguous()}
    inner = f"layers.{i}.{rest[len('block.'):]}"
    t = _deinterleave_rope(t, inner, rows, inverse=True) if rows else t
    if re.match(r"^layers\.\d+\.feed_forward\.w[123]$", inner):
        return {ours_to_hf(inner, expert=j): t[j].contiguous() for j in range(t.shape[0])}
    return {ours_to_hf(inner): t.contiguous()}
