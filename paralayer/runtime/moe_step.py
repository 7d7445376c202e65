"""The MoE layers' per-step bookkeeping in training: counting only the real microbatch forwards,
the aux-loss-free bias step of the sigmoid router, and the step's routing statistics over the
whole global batch (what metrics.jsonl logs)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.config import Config
from paralayer.parallel.mesh import Meshes


def moe_layers(chunks: Sequence[nn.Module], mtp: bool = True) -> list:
    """The MoE feed-forward blocks of this rank's model chunks (with the MTP depths' unless
    ``mtp=False``: those run in the loss, outside the stage's forward)."""
    from paralayer.model.mtp import moe_blocks

    main = [layer.feed_forward for c in chunks for layer in c.layers.values()
            if hasattr(layer.feed_forward, "step_stats")]
    return main + ([ff for c in chunks for ff in moe_blocks(getattr(c, "mtp", None))] if mtp else [])


def count_real_forwards_only(runner, chunks: Sequence[nn.Module]) -> None:
    """MoE statistics, the MTP loss and QK-clip's max logits (model/max_logit.py) count only the
    schedule's microbatch forwards, not the stages' one-off shape inference (a forward on
    uninitialised tensors at the first step)."""
    layers = moe_layers(chunks, mtp=False) + [c.mtp for c in chunks if getattr(c, "mtp", None) is not None]
    layers += [m.max_logit for c in chunks for m in c.modules() if getattr(m, "max_logit", None) is not None]
    if not layers:
        return
    for ff in layers:
        ff.count_stats = False
    for stage in runner.stages:
        def counted(*args, _fwd=stage.forward_one_chunk, **kwargs):
            for ff in layers:
                ff.count_stats = True
            try:
                return _fwd(*args, **kwargs)
            finally:
                for ff in layers:
                    ff.count_stats = False
        stage.forward_one_chunk = counted


def update_bias(chunks: Sequence[nn.Module], cfg: Config, meshes: Meshes) -> None:
    """Sigmoid router: the aux-loss-free balancing step (DeepSeek-V3), once per optimizer step, from
    the load over every replica of the router (all dp·cp ranks; tp ranks see the same tokens)."""
    if cfg.model.moe.router != "sigmoid":
        return
    group = meshes["dp_cp"].get_group() if meshes.size("dp_cp") > 1 else None
    for ff in moe_layers(chunks):
        ff.update_bias(cfg.model.moe.bias_update_rate, group=group)


def reset(chunks: Sequence[nn.Module]) -> None:
    for ff in moe_layers(chunks):
        ff.reset_step_stats()


def step_stats(chunks: Sequence[nn.Module], meshes: Meshes, pp: int, num_experts: int,
               device: torch.device) -> dict:
    """The step's routing over the whole global batch (every microbatch, data rank and MoE layer):
    routed token-slots per expert summed over the MoE layers (min, mean, max over experts), dropped
    token-slots, and the aux loss (sum over layers of its mean over microbatches and data ranks,
    before ``aux_loss_coef``). Identical on every rank. Collectives: one over dp·cp, one over pp."""
    if num_experts <= 0:
        return {}
    counts = torch.zeros(num_experts, dtype=torch.float64)
    dropped, aux_sum, forwards = 0.0, 0.0, 0.0
    for ff in moe_layers(chunks):
        st = ff.step_stats
        if st["tokens_per_expert"] is not None:
            counts += st["tokens_per_expert"].double().cpu()
        dropped += st["dropped"]
        aux_sum += st["aux_loss_sum"]
        forwards = max(forwards, float(st["forwards"]))  # the same for every layer of this rank
    dev = device
    t = torch.cat([counts, torch.tensor([dropped, aux_sum, forwards], dtype=torch.float64)]).to(dev)
    if meshes.size("dp_cp") > 1:  # tp ranks hold the same tokens: not summed over tp
        dist.all_reduce(t, group=meshes["dp_cp"].get_group())
    aux_mean = t[-2] / t[-1] if float(t[-1]) > 0 else torch.zeros((), dtype=torch.float64, device=dev)
    t = torch.cat([t[:-2], aux_mean.reshape(1)])
    if pp > 1:  # stages hold different layers
        dist.all_reduce(t, group=meshes["pp"].get_group())
    t = t.cpu()
    counts = t[:num_experts]
    return {"aux_loss": float(t[-1]), "tokens_per_expert_min": float(counts.min()),
            "tokens_per_expert_mean": float(counts.mean()), "tokens_per_expert_max": float(counts.max()),
            "dropped_tokens": int(round(float(t[num_experts])))}
