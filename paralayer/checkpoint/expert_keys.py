"""Expert weights under a layout-independent key set: a rank holds a slice of the stacked experts
(its ep share), and a checkpoint stores them one key per global expert (``fqn.expert{j}``), so a
run saved at one ep degree loads at any other. Used by the checkpoint (model and optimizer state)
and the Hugging Face import/export."""
from __future__ import annotations

import torch
from torch import nn


def expert_owners(part: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """FQN (as the state dict names it) → (module, param name) for params held as a local slice."""
    owners = {}
    for mod_name, mod in part.named_modules():
        for p_name in getattr(mod, "local_slices", {}) or {}:
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            owners[clean_name(fqn)] = (mod, p_name)
    return owners


def clean_name(name: str) -> str:
    """A parameter's name as the state dict gives it, without wrapper prefixes."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _expert_slots(key: str, val, owners: dict):
    """For an expert-sliced entry: (dim, [(per-expert key, local index j), ...]); else None."""
    hit = _match_owner(key, owners)
    if hit is None or not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    fqn, (mod, p_name) = hit
    dim, offset, _full = mod.local_slices[p_name]
    cut = key.index(fqn) + len(fqn)
    pre, post = key[:cut], key[cut:]
    return dim, [(f"{pre}.expert{offset + j}{post}", j) for j in range(val.shape[dim])]


def split_expert_keys(sd: dict, owners: dict) -> dict:
    """Replace the local slice ``fqn`` (a tensor or DTensor over expert-dp) by per-expert entries
    ``fqn.expert{j}`` (global expert ids): a layout-independent key set for any ep degree.
    Works on model state dicts (key == fqn) and flattened optimizer state (``state.fqn.exp_avg``)."""
    return _per_expert(sd, owners, lambda val, dim, j: _select(val, dim, j))


def _match_owner(key: str, owners: dict):
    for fqn, owner in owners.items():
        if key == fqn or key.startswith(f"state.{fqn}.") and key.count(".") == fqn.count(".") + 2:
            return fqn, owner
    return None


def _select(val, dim: int, j: int):
    from torch.distributed.tensor import DTensor

    if isinstance(val, DTensor):
        # experts further sharded (FSDP over expert-dp): gather this rank's expert slice (E_local
        # rows, a collective over the expert-dp mesh, same order on all its ranks), then index it
        return val.full_tensor().select(dim, j)
    return val.select(dim, j)


def merge_expert_keys(loaded: dict, template: dict, owners: dict) -> dict:
    """Inverse of :func:`split_expert_keys`: stack per-expert entries back into ``template``'s
    tensors (in place), returning the state dict keyed like ``template``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not owners:
        return loaded
    out = {}
    for key, tmpl in template.items():
        slots = _expert_slots(key, tmpl, owners)
        if slots is None:
            out[key] = loaded[key]
            continue
        dim, keys = slots
        rows = [loaded[ekey] for ekey, _j in keys]
        full = torch.stack([r.full_tensor() if isinstance(r, DTensor) else r for r in rows], dim=dim)
        if isinstance(tmpl, DTensor):
            full = distribute_tensor(full.to(tmpl.dtype), tmpl.device_mesh, tmpl.placements, src_data_rank=None)
        out[key] = full
    return out


def expert_templates(sd: dict, owners: dict) -> dict:
    """The per-expert keys a load must request (plain tensors of the right shape)."""
    from torch.distributed.tensor import DTensor

    def empty(val, dim: int, _j: int) -> torch.Tensor:
        shape = list(val.shape)  # DTensor: global shape over expert-dp = E_local rows
        del shape[dim]
        local = val.to_local() if isinstance(val, DTensor) else val
        return torch.empty(shape, dtype=local.dtype, device=local.device)

    return _per_expert(sd, owners, empty)


def _per_expert(sd: dict, owners: dict, entry) -> dict:
    """``sd`` with each expert-sliced entry replaced by one ``entry(val, dim, j)`` per expert."""
    if not owners:
        return sd
    out = {}
    for key, val in sd.items():
        slots = _expert_slots(key, val, owners)
        if slots is None:
            out[key] = val
            continue
        dim, keys = slots
        for ekey, j in keys:
            out[ekey] = entry(val, dim, j)
    return out
