"""What a checkpoint holds, keyed by parameter name so it loads under any layout.

Model and optimizer state come from ``torch.distributed.checkpoint.state_dict``: the model's
``get_model_state_dict`` per part, the optimizer's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` with ``StateDictOptions(flatten_optimizer_state_dict=True)``
(``state.{fqn}.exp_avg``, ``param_groups.{fqn}.lr``), so a pipeline stage, a ZeRO-1 shard or a
tensor-parallel rank holds only its own keys and DCP reshards DTensors between layouts.
Experts under expert parallel are plain local slices (not DTensors); they are stored under
per-expert keys (``...feed_forward.w1`` → ``...feed_forward.w1.expert{j}``, expert_keys.py), so
the ep degree may change too.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from paralayer.checkpoint.expert_keys import expert_owners, expert_templates, merge_expert_keys, split_expert_keys


def options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=full)


def inner_optimizer(opt) -> torch.optim.Optimizer:
    """The torch optimizer behind a wrapper (the ZeRO-1 wrapper keeps it as ``.inner``)."""
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "inner"):
        opt = opt.inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"not an optimizer: {type(opt).__name__} (expected torch.optim.Optimizer or a "
                        f"wrapper with .inner)")
    return opt


def merged_model(parts: Sequence[nn.Module]) -> nn.Module:
    """One module whose parameter names are the parts' own (a rank's pipeline chunks hold disjoint
    layers of one model under the same names), for the optimizer state-dict API that wants a single
    model owning every parameter an optimizer holds."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    root = nn.Module()
    for part in parts:
        for name, child in part.named_children():
            have = root._modules.get(name)
            if have is None:
                root.add_module(name, child)
            elif isinstance(have, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
                root._modules[name] = nn.ModuleDict({**dict(have.items()), **dict(child.items())})
            elif have is not child:
                raise ValueError(f"two model parts both hold '{name}'")
        for name, p in part.named_parameters(recurse=False):
            root.register_parameter(name, p)
    return root


def _optimizers(model: nn.Module, optimizers: Sequence) -> list[torch.optim.Optimizer]:
    """The torch optimizers over ``model``'s parameters. A ZeRO-1 rank that owns no parameter
    steps a one-element placeholder that belongs to no model: it has no state worth keeping."""
    known = {id(p) for p in model.parameters()}
    out = []
    for opt in optimizers:
        inner = inner_optimizer(opt)
        params = [p for g in inner.param_groups for p in g["params"]]
        if any(id(p) in known for p in params):
            out.append(inner)
    return out


def raw_states(parts: Sequence[nn.Module], optimizers: Sequence) -> tuple[dict, dict, dict, nn.Module, list]:
    """(model sd, flattened optimizer sd, expert owners, merged model, torch optimizers), FQN keyed,
    experts still as local slices. Creates empty optimizer state (DSD's zero-lr step) if none."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    parts = list(parts)
    model_sd: dict = {}
    owners: dict = {}
    for part in parts:
        owners.update(expert_owners(part))
        model_sd.update(get_model_state_dict(part, options=options()))
    model = merged_model(parts)
    opts = _optimizers(model, optimizers or [])
    optim_sd = get_optimizer_state_dict(model, opts, options=options()) if opts else {}
    return model_sd, optim_sd, owners, model, opts


def get_states(model_parts: Sequence[nn.Module], optimizers: Sequence) -> dict:
    """{"model": {fqn: tensor}, "optim": {flattened fqn keys}} merged over the model parts, with
    expert slices split into per-expert keys: what a checkpoint holds."""
    model_sd, optim_sd, owners, _model, opts = raw_states(model_parts, optimizers)
    out = {"model": split_expert_keys(model_sd, owners)}
    if opts:
        out["optim"] = split_expert_keys(optim_sd, owners)
    return out


class LoadRequest:
    """The keys a load asks DCP for (per-expert where the model holds local slices), and how to
    put what came back into the model and optimizers."""

    def __init__(self, model_parts: Sequence[nn.Module], optimizers: Sequence):
        self.parts = list(model_parts)
        self.model_raw, self.optim_raw, self.owners, self.model, self.opts = raw_states(self.parts, optimizers)
        self.request = {"model": expert_templates(self.model_raw, self.owners)}
        if self.opts:
            self.request["optim"] = expert_templates(self.optim_raw, self.owners)

    def apply(self) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model_sd = merge_expert_keys(self.request["model"], self.model_raw, self.owners)
        for part in self.parts:
            keys = set(get_model_state_dict(part, options=options()))
            set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in keys}, options=options())
        if self.opts:
            optim_sd = merge_expert_keys(self.request["optim"], self.optim_raw, self.owners)
            before = [opt.param_groups for opt in self.opts]
            set_optimizer_state_dict(self.model, self.opts, optim_sd, options=options())
            for opt, groups in zip(self.opts, before):
                _keep_group_objects(opt, groups)


def _keep_group_objects(opt: torch.optim.Optimizer, groups: list) -> None:
    """``load_state_dict`` replaces the optimizer's param_groups list; a wrapper (ZeRO-1) holds
    the old one. Put the loaded hyperparameters into the old dicts and the old list back."""
    if opt.param_groups is groups:
        return
    for old, new in zip(groups, opt.param_groups):
        old.update({k: v for k, v in new.items() if k != "params"})
    opt.param_groups = groups
