"""Which gradients of a fused tensor-parallel GEMM the running backward pass asks for.

The zero-bubble schedules (zbv, dualpipev) split a stage's backward into two autograd passes over
the same graph: ``stage_backward_input`` (``autograd.grad`` w.r.t. the stage's inputs) and later
``stage_backward_weight`` (``autograd.grad`` from the captured intermediates to the weights).
A custom Function's ``ctx.needs_input_grad`` only says what requires grad, so a fused GEMM that
returns grad-input and grad-weight together would compute both, and issue both collectives, in
each pass. Built-in nodes ask the engine instead; :func:`wanted` does the same for ours, so the
input pass does grad-input only and the weight pass grad-weight only (a plain ``backward()``
wants both, as before). No state outside the autograd engine's own current pass.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from paralayer.compat import private

_will_execute = private("torch._C", "_will_engine_execute_node")


def wanted(ctx: Any, arg: int, edge: int) -> bool:
    """Does the current backward pass need the gradient of ``ctx``'s forward argument ``arg``, its
    tensor argument number ``edge`` (``next_functions`` lists the tensor arguments only)?"""
    if not ctx.needs_input_grad[arg]:
        return False
    fn = ctx.next_functions[edge][0]
    if fn is None:
        return True
    try:
        return bool(_will_execute(fn))
    except RuntimeError:
        # a leaf captured by autograd.grad(inputs=...) is refused by the query: it is wanted
        return True


def later(ctx: Any, arg: int, edge: int) -> bool:
    """Argument ``arg`` requires grad but this pass does not compute it: a later pass (the
    zero-bubble weight pass) will."""
    return bool(ctx.needs_input_grad[arg]) and not wanted(ctx, arg, edge)


def keep(ctx: Any, grad: torch.Tensor, gathered: torch.Tensor) -> None:
    """The input pass of a row-parallel GEMM keeps its all-gathered output grad for the weight
    pass (one all-gather per backward, as without the split); freed when the weight pass takes it
    or the graph dies."""
    ctx.kept_grad = (grad, gathered)


def kept(ctx: Any, grad: torch.Tensor) -> Optional[torch.Tensor]:
    """What :func:`keep` kept, once, if this pass brings the same output grad (torch's weight pass
    replays the tensors its input pass captured); None otherwise (gather again)."""
    k, ctx.kept_grad = getattr(ctx, "kept_grad", None), None
    return k[1] if k is not None and k[0] is grad else None
