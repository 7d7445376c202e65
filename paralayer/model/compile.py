"""``train.compile``: compile each transformer block, as torchtitan does, and the loss.

One compiled block serves every layer (same code, same shapes), so compile time stays that of
one block however deep the model. Without tensor or context parallel we compile the block's
inner ``_forward`` (norms, attention, FFN, residuals), not the module:
  - the module keeps its class and parameter names (checkpoints, init and HF export see no
    ``_orig_mod.`` prefix), and FSDP2's pre/post-forward hooks, which sit on the module's call,
    stay outside the graph, as under torchtitan's per-block compile;
  - full recompute wraps ``_forward`` in an eager ``recompute`` (model/recompute.py) that calls the compiled code in
    the forward and again in the recomputation; selective recompute's checkpoints trace inside.
Under tensor parallel our sequence-parallel GEMMs and DTensor layouts, and under context
parallel the ring's point-to-point exchange, are custom autograd functions around collectives:
there the block is compiled in the pieces between the collectives, which is where compile's
fusions are (the GEMMs themselves are cuBLAS either way): RoPE + attention core (not under cp:
it is the ring) and the SwiGLU activation. An MoE block compiles its attention core only:
routing makes data-dependent shapes and all-to-all splits that would recompile every step.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def compile_blocks(model: nn.Module, backend: str = "inductor", tp: int = 1, cp: int = 1) -> int:
    """Compile every transformer block of ``model`` (a Transformer or a pipeline chunk) in place.

    Apply after tensor/context/expert parallel and recompute, before FSDP (torchtitan's order).
    Returns the number of compiled functions."""
    n = 0
    for layer in model.layers.values():
        moe = getattr(layer, "is_moe", False)
        if tp == 1 and cp == 1 and not moe:
            layer._forward = torch.compile(layer._forward, backend=backend)
            n += 1
            continue
        if cp == 1:
            layer.attention._core = torch.compile(layer.attention._core, backend=backend)
            n += 1
        if not moe:
            layer.feed_forward.act_fn = torch.compile(layer.feed_forward.act_fn, backend=backend)
            n += 1
    return n


def compile_loss(loss: Callable[..., torch.Tensor], backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """The loss compiled: the fp32 upcast of the logits, log-softmax and the gather fuse into a
    few kernels instead of materialising fp32 logits twice (pays with a large vocabulary)."""
    return torch.compile(loss, backend=backend)
