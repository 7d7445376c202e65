"""Building one rank's model, optimizer, LR schedule and loss from the plan.

The parallelism is applied in the design's order (pipeline split → tensor/sequence → context →
expert → recompute → compile → data/ZeRO), then the weights are materialised with the
layout-independent init. paralayer/runtime/train.py runs the loop over what this builds.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from paralayer.config import Config
from paralayer.model.compile import compile_blocks, compile_loss
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from paralayer.parallel import data as dpar
from paralayer.parallel.grad_scaling import cp_loss_weight
from paralayer.parallel.mesh import Meshes
from paralayer.resolve.plan import Plan
from paralayer.runtime import optimizer, precision


def as_plan(plan: Union[Plan, dict]) -> Plan:
    """The typed plan; ``plan.json`` read as a dict becomes a :class:`Plan` (missing keys raise)."""
    return plan if isinstance(plan, Plan) else Plan.from_dict(plan)



# ------------------------------------------------------------------ building
def resolve_device(plan: Plan) -> torch.device:
    """The plan's device: CUDA (this rank's LOCAL_RANK GPU, set by the launcher) or CPU. A cuda plan
    where no CUDA device is visible is an error naming the rank, never a silent CPU run."""
    if plan.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"rank {os.environ.get('RANK', '?')}: the plan runs on cuda but no CUDA device is "
                               "visible to this process; nothing was trained on CPU")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def apply_recompute(model: Transformer, mode: str, every: int = 1) -> None:
    """none; swiglu: the SwiGLU activation and product; core_attn: RoPE and the attention core;
    selective: both; full: each block from its input, on layers i with i % every == 0 (global
    index: the same layers under any pipeline split; resolve.memory.layer_recompute)."""
    for layer in model.layers.values():
        if mode == "full":
            layer.recompute_full = layer.layer_id % every == 0
        if mode in ("core_attn", "selective"):
            layer.attention.recompute_core = True
        if mode in ("swiglu", "selective") and hasattr(layer.feed_forward, "recompute_act"):
            layer.feed_forward.recompute_act = True


@dataclass
class Built:
    chunks: list[Transformer]
    meshes: Meshes
    device: torch.device
    params: list[nn.Parameter]
    expert_params: list[nn.Parameter] = field(default_factory=list)
    pipeline: Any = None


def build_model(cfg: Config, plan: Union[Plan, dict], meshes: Meshes, device: torch.device,
                materialize: Optional[Any] = None) -> Built:
    """Apply parallelism in the order the design gives, then materialise the weights.

    ``materialize``: a context the weights are materialised in (the rehearsal's FakeTensorMode:
    the model is split and sharded on the meta device outside it, and gets shapes without storage)."""
    plan = as_plan(plan)
    d = plan.degrees
    tp, pp, cp, ep = (int(d[k]) for k in ("tp", "pp", "cp", "ep"))
    with torch.device("meta"):
        model = Transformer(cfg.model, plan.padded_vocab_size)
    if pp > 1:
        from paralayer.parallel import pipeline

        chunks = pipeline.split_model(model, plan, meshes.local_rank("pp"))
    else:
        chunks = [model]
    for chunk in chunks:
        if tp > 1:
            from paralayer.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(chunk, meshes["tp"], bool(plan.sequence_parallel), overlap=bool(plan.tp_overlap))
        if cp > 1:
            from paralayer.parallel.context import apply_context_parallel

            apply_context_parallel(chunk, meshes["cp"].get_group(), cfg.model.seq_len)
        if ep > 1:
            from paralayer.parallel.expert import apply_expert_parallel

            for layer in chunk.layers.values():
                if getattr(layer, "is_moe", False):
                    apply_expert_parallel(layer.feed_forward, meshes["ep"].get_group())
        apply_recompute(chunk, cfg.parallel.recompute, cfg.parallel.recompute_every)
        if cfg.train.compile:  # after tp/cp/ep/recompute, before FSDP (torchtitan's order)
            compile_blocks(chunk, cfg.train.compile_backend, tp=tp, cp=cp)
    expert_names: set[str] = set()
    if cfg.model.moe.num_experts > 0 and ep > 1:  # ep=1: experts are ordinary data-parallel weights
        from paralayer.parallel.expert import is_expert_param

        for chunk in chunks:
            expert_names |= {n for n, _ in chunk.named_parameters() if is_expert_param(n)}
    zero = int(cfg.parallel.zero)
    dp_cp = meshes.size("dp_cp")
    if zero >= 2 and dp_cp > 1:
        for chunk in chunks:
            dpar.apply_fsdp(chunk, meshes["dp_cp"], zero,
                            param_dtype=precision.fsdp_param_dtype(precision.mode(cfg, device, dp_cp)),
                            expert_mesh=meshes["edp"] if ep > 1 else None)
    with materialize if materialize is not None else contextlib.nullcontext():
        _materialize(cfg, chunks, device)
    params = [p for c in chunks for p in c.parameters()]
    expert_params = [p for c in chunks for n, p in c.named_parameters() if n in expert_names]
    return Built(chunks=chunks, meshes=meshes, device=device, params=params, expert_params=expert_params)


def _materialize(cfg: Config, chunks: list, device: torch.device) -> None:
    """Weights for the meta model: a Hugging Face checkpoint or the layout-independent init."""
    for chunk in chunks:
        chunk.to_empty(device=device)
        if cfg.model.init.startswith("hf:"):
            from paralayer.checkpoint.hf import load_hf_weights

            load_hf_weights(chunk, cfg.model.init[3:], cfg.model)
        else:
            init_weights(chunk, cfg.model, cfg.train.seed, device)
        for mod in chunk.modules():  # buffers to_empty left uninitialised (MoE router bias)
            if hasattr(mod, "reset_buffers"):
                mod.reset_buffers()
        for buf_name, buf in chunk.named_buffers():
            if buf.is_meta:  # pragma: no cover - every buffer of ours is re-creatable
                raise RuntimeError(f"buffer {buf_name} left on meta")


def lr_lambda(cfg: Config):
    """The LR multiplier after ``step`` optimizer steps: linear warmup to 1 over ``warmup_steps``
    (step k of the run, 1-based, gets k / warmup_steps), then cosine to ``min_lr_ratio`` at ``steps``."""
    t = cfg.train

    def f(step: int) -> float:  # step counts optimizer steps already taken (0-based)
        s = step + 1
        if t.warmup_steps and s <= t.warmup_steps:
            return s / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (s - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(cfg: Config, built: Built, meshes: Meshes):
    """AdamW over this rank's parameters (ZeRO-1: over its share), in the groups of
    paralayer/runtime/optimizer.py (``train.weight_decay_1d``), and the LambdaLR of :func:`lr_lambda`."""
    t = cfg.train

    def make(params):  # fused on CUDA, foreach elsewhere (paralayer/runtime/optimizer.py)
        return optimizer.adamw(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                               decay_1d=t.weight_decay_1d)

    if int(cfg.parallel.zero) == 1 and meshes.size("dp_cp") > 1:
        dp_mesh = meshes["dp_cp"]
        group_ranks = dist.get_process_group_ranks(dp_mesh.get_group())
        opt = dpar.ZeroOneOptimizer(built.params, dp_mesh.get_group(), dp_mesh.get_local_rank(),
                                    dp_mesh.size(), group_ranks, make, local_params=built.expert_params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lr_lambda(cfg))
    else:
        opt = make(built.params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return opt, sched


# ------------------------------------------------------------------ loss
def make_loss_fn(cfg: Config, plan: Union[Plan, dict], n_valid_global_per_seq: int):
    """Per-microbatch loss whose average over the dp·cp ranks is the global mean CE.

    Context ranks hold unequal numbers of valid labels (the sequence's last position has none),
    so the local mean is re-weighted (``cp_loss_weight``, the gradient-scaling contract).
    """
    plan = as_plan(plan)
    tp = int(plan.degrees["tp"])
    cp = int(plan.degrees["cp"])
    vocab = cfg.model.vocab_size
    ce = compile_loss(lm_loss, cfg.train.compile_backend) if cfg.train.compile and tp == 1 else lm_loss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n_local = (labels != -100).sum()
        n_global = labels.shape[0] * n_valid_global_per_seq
        if tp > 1:
            from paralayer.parallel.tensor import tp_loss

            mean = tp_loss(logits, labels, vocab)
        else:
            mean = ce(logits, labels, vocab)  # cross_entropy ignores the -100 labels
        if cp == 1:
            return mean
        return mean * cp_loss_weight(n_local.to(mean.dtype), n_global, cp)

    return loss_fn
