"""Hugging Face format: weight import into any layout, export. What each family is (config.json
→ our keys, its weight names both ways, its export) is paralayer/families/; this module is the
tensor side, asking the family.

Import (``model.init=hf:PATH``): ``config.json`` gives the model shape
(``paralayer.families.apply_hf_config``); the weights come from ``model.safetensors`` or the shards
listed in ``model.safetensors.index.json``, read with ``safetensors.safe_open`` (never pickle). Each
rank reads only the slice it holds (``safe_open(...).get_slice(key)[region]``): the region of a
DTensor parameter is its local shard (``compute_local_shape_and_global_offset`` over its mesh and
placements, any mix of tp / fsdp sharding), a replicated parameter is read whole, experts under
expert parallel are read for this rank's experts only; padded vocab rows are zero. So 512 ranks
read the model about once between them, plus what each holds replicated, not 512 times.

Names: paralayer/families/names.py (the shared table) and each family's ``NAMES`` / ``EXPERTS``.
Mixtral: transformers 5 keeps experts fused in memory (``mlp.experts.gate_up_proj`` (E, 2F, d),
``mlp.experts.down_proj`` (E, d, F), ``mlp.gate.weight``) but ``save_pretrained`` writes the
per-expert layout; both are read here, and the export writes the per-expert layout.
RoPE is rotate-half on both sides (but DeepSeek-V3's interleaved rows, checkpoint/hf_moe.py).
Qwen3.5's split linear projections and its vision-language wrapper's text tower: checkpoint/hf_split.py.
"""
from __future__ import annotations

import json
import os
import re
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from paralayer.checkpoint import hf_fused, hf_mtp, hf_split
from paralayer.checkpoint.expert_keys import expert_owners
from paralayer.checkpoint.hf_moe import (
    _deinterleave_rope,
    _load_router_bias,
    _mtp_to_deepseek,
    _reordered,
    _rope_rows,
    mtp_as_layer,
    mtp_hf_key,
)
from paralayer.families import HFFormatError, family, family_for_config
from paralayer.families.names import DEFAULT_EXPERTS, expert_keys, ours_to_hf, router_keys
from paralayer.families.rope import rope_parameters

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# ------------------------------------------------------------------ reading safetensors
class _Reader:
    """Lazy access to tensors across one or several safetensors files (never unpickles)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        idx = os.path.join(path, INDEX)
        if os.path.isfile(idx):
            with open(idx) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, SINGLE)):
            weight_map = None
        else:
            raise HFFormatError(f"{path}: neither {SINGLE} nor {INDEX} found (only safetensors are read)")
        self._open = safe_open
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0  # bytes of the tensors and slices this reader returned
        self.rope_rows: Optional[dict] = None  # rows to reorder on import (_rope_rows)
        self.n_layers: Optional[int] = None  # set: MTP names read as DeepSeek's layers n_layers+k (hf_moe)
        self.family = DEFAULT_EXPERTS  # the checkpoint's family: its own names (RENAMES) first
        self.linear = None  # the LinearConfig, for split projections (hf_split.py)
        self._stored: dict[str, str] = {}  # a key as read → as stored (a wrapper's text tower, hf_split.py)
        if weight_map is None:
            h = self._handle(SINGLE)
            weight_map = {k: SINGLE for k in h.keys()}
        self.weight_map = weight_map

    def view(self, stored: dict[str, str]) -> None:
        """Read each key of ``stored`` (as a text model names it) from the key it is stored under."""
        self.weight_map = {k: self.weight_map[v] for k, v in stored.items()}
        self._stored = stored

    def _handle(self, fname: str):
        if fname not in self._handles:
            fp = os.path.join(self.path, fname)
            try:
                self._handles[fname] = self._open(fp, framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001
                raise HFFormatError(f"{fp}: cannot open as safetensors: {exc}") from None
        return self._handles[fname]

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise HFFormatError(f"{self.path}: tensor '{key}' is missing from the checkpoint")
        fname = self.weight_map[key]
        try:
            t = self._handle(fname).get_tensor(self._stored.get(key, key))
        except HFFormatError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise HFFormatError(f"{os.path.join(self.path, fname)}: cannot read '{key}': {exc}") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, key: str) -> list[int]:
        """The stored shape of ``key`` (from the header: nothing is read)."""
        if key not in self.weight_map:
            raise HFFormatError(f"{self.path}: tensor '{key}' is missing from the checkpoint")
        return list(self._handle(self.weight_map[key]).get_slice(self._stored.get(key, key)).get_shape())

    def region(self, key: str, index: Sequence[slice]) -> torch.Tensor:
        """``key[index]`` (one slice per dim) without reading the rest of the tensor."""
        if key not in self.weight_map:
            raise HFFormatError(f"{self.path}: tensor '{key}' is missing from the checkpoint")
        fname = self.weight_map[key]
        try:
            t = self._handle(fname).get_slice(self._stored.get(key, key))[tuple(index)]
        except Exception as exc:  # noqa: BLE001
            raise HFFormatError(f"{os.path.join(self.path, fname)}: cannot read '{key}': {exc}") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get_rows(self, key: str, start: int, length: int) -> torch.Tensor:
        """Rows [start, start+length) of dim 0 without reading the rest."""
        return self.region(key, [slice(start, start + length)])


def _full_for(reader: _Reader, name: str, shape: tuple[int, ...], experts: Optional[tuple[int, int]]) -> torch.Tensor:
    """The full tensor of our parameter ``name`` (global shape ``shape``; ``experts`` = (offset,
    count) to read only those experts of a stacked expert weight)."""
    if mtp_hf_key(name, reader.n_layers) is None:
        name = mtp_as_layer(name, reader.n_layers)
    fused = getattr(family(reader.family), "FUSED_EXPERTS", None)
    if fused and hf_fused.is_fused_name(name):  # GPT-OSS: all experts of a layer in one tensor
        start, count = experts if experts else (0, shape[0])
        return hf_fused.read_fused(reader, fused, name, start, count)
    m = re.match(r"^layers\.(\d+)\.feed_forward\.(w[123])$", name)
    if m:
        i, w = m.groups()
        start, count = experts if experts else (0, shape[0])
        for per in expert_keys(i, w):  # each family's per-expert names, the first the checkpoint has
            if per.format(j=start) in reader:
                break
        if per.format(j=start) in reader:
            return torch.stack([reader.get(per.format(j=j)) for j in range(start, start + count)])
        fused_gu = f"model.layers.{i}.mlp.experts.gate_up_proj"
        fused_d = f"model.layers.{i}.mlp.experts.down_proj"
        if w == "w2" and fused_d in reader:
            return reader.get_rows(fused_d, start, count)
        if w in ("w1", "w3") and fused_gu in reader:
            gu = reader.get_rows(fused_gu, start, count)  # (count, 2F, d): gate rows first, then up
            f = gu.shape[1] // 2
            return (gu[:, :f] if w == "w1" else gu[:, f:]).contiguous()
        raise HFFormatError(f"{reader.path}: expert weights for {name} not found "
                            f"(looked for {per.format(j=start)} and {fused_gu})")
    if _split(reader, name):  # Qwen3.5: in_proj_qkv / _z / _b / _a into our fused rows
        return hf_split.read_split(reader, name, reader.linear)
    full = reader.get(_hf_key(reader, name))
    return _deinterleave_rope(full, name, reader.rope_rows) if reader.rope_rows else full


# ------------------------------------------------------------------ import
def _clean(name: str) -> str:
    from paralayer.model.transformer import _clean_name

    return _clean_name(name)



@torch.no_grad()
def copy_full_tensors(model: nn.Module, full_for: Callable[[str, tuple, Optional[tuple]], torch.Tensor],
                      vocab_size: int, only: Optional[set] = None) -> None:
    """Fill every parameter of ``model`` (any layout) from its FULL tensor ``full_for(name, global
    shape, experts)``: the slicing of ``init_weights``. ``experts``: (offset, count) of the experts
    this rank holds for a stacked expert weight, else None. ``only``: these parameter names."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    owners = expert_owners(model)
    for name, param in model.named_parameters():
        if only is not None and name not in only:
            continue
        clean = _clean(name)
        global_shape = tuple(param.shape)
        if clean in owners:
            mod, p_name = owners[clean]
            dim, offset, full_len = mod.local_slices[p_name]
            # this rank's experts (a DTensor's shape is its global shape over expert-dp)
            local_len = param.shape[dim]
            shp = list(global_shape)
            shp[dim] = full_len
            if dim != 0:
                raise HFFormatError(f"{clean}: expert slicing along dim {dim} is not supported")
            full = full_for(clean, tuple(shp), (offset, local_len)).to(torch.float32)
            expect = list(shp)
            expect[dim] = local_len
            if list(full.shape) != expect:
                raise HFFormatError(f"{clean}: checkpoint shape {list(full.shape)} != model {expect}")
        else:
            full = full_for(clean, global_shape, None)
            logical = list(global_shape)
            if clean.startswith(("tok_embeddings.", "output.", "mtp.embed.")):
                logical[0] = vocab_size
            if list(full.shape) != logical:
                raise HFFormatError(f"{clean}: checkpoint shape {list(full.shape)} != model {logical} "
                                    f"(is config.json the one of these weights?)")
            if tuple(logical) != global_shape:
                pad = torch.zeros(global_shape, dtype=full.dtype)
                pad[: logical[0]] = full
                full = pad
        full = full.to(device=(param.to_local() if isinstance(param, DTensor) else param).device, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def _family_name(path: str) -> str:
    """The family of the checkpoint at ``path`` (config.json's model_type), for its own names."""
    from paralayer.families import by_type
    from paralayer.families.common import read_config

    fam = by_type(read_config(path).get("model_type", "llama"))
    return fam.NAME if fam is not None else DEFAULT_EXPERTS


def _split(reader: _Reader, name: str) -> bool:
    return getattr(family(reader.family), "SPLIT_PROJ", False) and hf_split.is_split_name(name)


def _hf_key(reader: _Reader, name: str) -> str:
    own = mtp_hf_key(name, reader.n_layers)
    if own is not None:
        return own
    name = mtp_as_layer(name, reader.n_layers)
    if name == "output.weight" and "lm_head.weight" not in reader:
        return "model.embed_tokens.weight"  # tied embeddings
    key = ours_to_hf(name, family=reader.family)
    if key not in reader and name.endswith("feed_forward.gate.weight"):
        keys = router_keys(name)  # each family's router name, the first the checkpoint has
        return next((k for k in keys if k in reader), keys[-1])
    return key


def _local_region(param) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(local shape, global offset) of this rank's shard of a DTensor parameter; None if plain."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return None
    try:  # a private torch helper (torch 2.4+): without it, read whole and slice as init does
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - depends on the torch version
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):  # e.g. padded shards: read whole, slice as init does
        return None
    return tuple(shape), tuple(offset)


@torch.no_grad()
def copy_sliced_tensors(model: nn.Module, reader: _Reader, vocab_size: int, skip: frozenset = frozenset()) -> None:
    """Fill every parameter of ``model`` from ``reader``, reading only this rank's region of each
    (experts and anything unusual go through :func:`copy_full_tensors`'s slicing). ``skip``:
    clean names left alone."""
    owners = expert_owners(model)
    rest: list[str] = []
    for name, param in model.named_parameters():
        clean = _clean(name)
        if clean in skip:
            continue
        region = None if clean in owners else _local_region(param)
        if (clean in owners or (region is None and hasattr(param, "device_mesh")) or _reordered(reader, clean)
                or _split(reader, clean)):
            rest.append(name)
            continue
        shape, offset = region if region is not None else (tuple(param.shape), (0,) * param.dim())
        key = _hf_key(reader, clean)
        logical = list(param.shape)
        if clean.startswith(("tok_embeddings.", "output.", "mtp.embed.")):
            logical[0] = vocab_size
        if reader.shape(key) != logical:
            raise HFFormatError(f"{clean}: checkpoint shape {reader.shape(key)} != model {logical} "
                                f"(is config.json the one of these weights?)")
        index = [slice(o, o + n) for o, n in zip(offset, shape)]
        hi = min(offset[0] + shape[0], logical[0]) if shape else 0
        local = (param.to_local() if region is not None else param)
        if shape and hi < offset[0] + shape[0]:  # padded vocab rows: zero
            local.zero_()
            if hi > offset[0]:
                local[: hi - offset[0]].copy_(reader.region(key, [slice(offset[0], hi)] + index[1:]))
        else:
            local.copy_(reader.region(key, index))
    if rest:
        keep = set(rest)
        copy_full_tensors(model, lambda n, s, e: _full_for(reader, n, s, e), vocab_size, only=keep)


def load_hf_weights(model: nn.Module, path: str, cfg, seed: int = 0) -> int:
    """Copy the Hugging Face weights at ``path`` into ``model`` (one pipeline chunk or the whole
    model, under any tp / fsdp / ep layout), reading only what this rank holds. ``cfg``: the
    ModelConfig (its shape must match config.json: use :func:`apply_hf_config` first).
    MTP depths (``model.mtp.depth``) are read from DeepSeek's ``model.layers.{n_layers+k}.*``;
    a depth the checkpoint lacks starts fresh from the layout-independent init of ``seed`` (as a
    Megatron or torchtitan run adding MTP to a base model does), with a one-line notice; depths it
    carries beyond the model's are ignored, with a notice. Returns the bytes this rank read."""
    reader = _Reader(path)
    reader.rope_rows = _rope_rows(path)
    reader.family = _family_name(path)
    reader.n_layers, reader.linear = cfg.n_layers, cfg.linear
    prefix = hf_split.wrapper_prefix(path)
    if prefix and any(k.startswith(prefix) for k in reader.weight_map):
        reader.view(hf_split.text_tower(reader.weight_map, prefix, path))
    vocab = getattr(model, "vocab_size", cfg.vocab_size)
    fresh = hf_mtp.fresh_depths(model, reader, cfg, seed, path)
    copy_sliced_tensors(model, reader, vocab, skip=fresh)
    hf_mtp.init_fresh(model, fresh, cfg, seed, vocab, copy_full_tensors)
    _load_router_bias(model, reader)
    return reader.bytes_read


# ------------------------------------------------------------------ export
def _gather_experts(t: torch.Tensor, mod) -> torch.Tensor:
    import torch.distributed as dist

    if getattr(mod, "ep_group", None) is None or mod.ep_size == 1:
        return t
    out = torch.empty((mod.ep_size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=mod.ep_group)  # ep rank order = expert order
    return out


def gather_full_state(model_parts: Sequence[nn.Module], group=None) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter, by our clean names, on rank 0 of ``group`` (an empty dict
    elsewhere). Collective: every rank calls it with its own chunks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local: dict[str, torch.Tensor] = {}
    for part in model_parts:
        owners = {k: mod for k, (mod, _p) in expert_owners(part).items()}
        for name, p in part.named_parameters():
            clean = _clean(name)
            t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if clean in owners:
                t = _gather_experts(t, owners[clean])
            local[clean] = t.detach().to("cpu", copy=True)
        for name, mod in part.named_modules():  # the sigmoid router's selection bias (DeepSeek-V3)
            if getattr(mod, "router", None) == "sigmoid" and hasattr(mod, "expert_bias"):
                local[f"{_clean(name)}.expert_bias"] = mod.expert_bias.detach().to("cpu", copy=True)
        vocab = getattr(part, "vocab_size", None)
        for key in ("tok_embeddings.weight", "output.weight"):
            if key in local and vocab is not None:
                local[key] = local[key][:vocab].clone()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local
    # Each name is sent by the lowest rank holding it (pipeline stages hold different names).
    world = dist.get_world_size(group)
    names: list = [None] * world
    dist.all_gather_object(names, sorted(local), group=group)
    me = dist.get_rank(group)
    owner: dict[str, int] = {}
    for r, ns in enumerate(names):
        for n in ns:
            owner.setdefault(n, r)
    mine = {n: t for n, t in local.items() if owner[n] == me}
    out: list = [None] * world if me == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(mine, out, dst=dst, group=group)
    if me != 0:
        return {}
    full: dict[str, torch.Tensor] = {}
    for d in out:
        full.update(d)
    return full


def hf_config_dict(cfg) -> dict:
    """Our ModelConfig → a transformers config.json (the family's: paralayer/families/)."""
    from paralayer.model.attention import head_dim_of

    fam = family_for_config(cfg)
    base = {
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope_parameters(cfg),
        "tie_word_embeddings": bool(cfg.tie_embeddings), "max_position_embeddings": cfg.seq_len,
        "hidden_act": "silu", "head_dim": head_dim_of(cfg), "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "dtype": "float32",
        "torch_dtype": "float32", "use_cache": True,
    }
    base.update(fam.export_config(cfg))
    return base


def full_state_to_hf(full: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    fam = family_for_config(cfg)
    names = partial(ours_to_hf, family=fam.NAME)
    rows = fam.export_rope_rows(cfg) if fam.export_rope_rows else None
    fused = getattr(fam, "FUSED_EXPERTS", None)
    if fused:  # GPT-OSS: all experts of a layer in one tensor
        out.update(hf_fused.write_fused(full, fused))
        full = {k: v for k, v in full.items() if not hf_fused.is_fused_name(k)}
    if getattr(fam, "SPLIT_PROJ", False):  # Qwen3.5: our fused projections as in_proj_qkv / _z / _b / _a
        out.update(hf_split.write_split(full, cfg.linear))
        full = {k: v for k, v in full.items() if not hf_split.is_split_name(k)}
    for name, t in full.items():
        if name.startswith("mtp."):
            if fam.MTP_AS_LAYERS:
                out.update(_mtp_to_deepseek(name, t, cfg, rows, names))
            continue  # other families have no MTP layers
        if name.endswith("feed_forward.expert_bias") and not (fam.EXPERTS and fam.EXPERTS.bias):
            continue
        if rows:
            t = _deinterleave_rope(t, name, rows, inverse=True)
        if re.match(r"^layers\.\d+\.feed_forward\.w[123]$", name):
            for j in range(t.shape[0]):
                out[names(name, expert=j)] = t[j].contiguous()
        else:
            out[names(name)] = t.contiguous()
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def export_hf(model_parts: Sequence[nn.Module], cfg, out_dir: str, group=None) -> Optional[str]:
    """Write ``out_dir/config.json`` + ``out_dir/model.safetensors`` (rank 0 of ``group``) that
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads. ``cfg``: the ModelConfig.
    Collective over ``group``; returns out_dir on rank 0, None elsewhere."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    full = gather_full_state(model_parts, group)
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return None
    expected = {f"layers.{i}." for i in range(cfg.n_layers)}
    missing = [p for p in sorted(expected) if not any(k.startswith(p) for k in full)]
    if missing:
        raise HFFormatError(f"export: no parameters for {missing} (were all pipeline chunks passed?)")
    tensors = full_state_to_hf(full, cfg)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2, sort_keys=True)
    tmp = os.path.join(out_dir, SINGLE + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, SINGLE))
    return out_dir
