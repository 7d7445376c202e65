"""What the runner hangs on each chunk and stage: the MoE aux loss joined to its microbatch's
backward, outputs that are not views (the split backward detaches them), bf16 between chunks under
autocast, and ZeRO-2/3 stages that reduce-scatter every microbatch's gradients."""
from __future__ import annotations

import torch
from torch import nn

from paralayer.compat import is_view, private


# ------------------------------------------------------------------ MoE aux loss through the pipe
class _AttachAux(torch.autograd.Function):
    """Identity on ``h``; in backward gives ``aux`` the gradient ``coef`` (Megatron's
    MoEAuxLossAutoScaler), so each chunk's load-balancing loss joins the backward of its own
    microbatch without travelling down the pipe. The schedule's final ÷m applies to it too."""

    @staticmethod
    def forward(ctx, h, aux, coef):
        ctx.coef = coef
        ctx.aux_shape = aux.shape
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h):
        return grad_h, torch.full(ctx.aux_shape, ctx.coef, dtype=grad_h.dtype, device=grad_h.device), None


def aux_hook(coef: float, attr: str = "aux_loss"):
    def hook(module, inputs, output):
        aux_fn = getattr(module, attr, None)
        aux = aux_fn() if aux_fn is not None else None
        if aux is None or not torch.is_grad_enabled():
            return output
        return _AttachAux.apply(output, aux, coef)

    return hook


def unview(t):
    """A copy of ``t`` if it is a view. The zero-bubble schedules split backward into input and
    weight passes and ``detach_()`` the stage output in between, which autograd refuses on a view
    (a chunk ending in the MoE aux hook, the vocab-parallel loss, DTensor's ``to_local``)."""
    return t.clone() if is_view(t) else t


def unview_hook(module, inputs, output):
    return unview(output)


def boundary_hooks(mod: nn.Module, first: bool, last: bool, dtype: torch.dtype) -> None:
    """Under autocast the residual stream is fp32 inside a chunk; between chunks it travels in
    ``dtype`` (bf16), as Megatron sends it: half the pp bytes. A chunk that is not the last casts
    its output down, one that is not the first casts its input back up (the cast's backward
    returns the received activation's grad in ``dtype`` too)."""
    if not last:
        mod.register_forward_hook(lambda m, args, out: out.to(dtype))
    if not first:
        mod.register_forward_pre_hook(lambda m, args: tuple(a.float() if torch.is_floating_point(a) else a
                                                            for a in args))


# ------------------------------------------------------------------ ZeRO-2/3 under pp
def stage_reducing_each_microbatch(stage, reshard_weights: bool) -> None:
    """Make an FSDP stage reduce-scatter its gradients after EVERY microbatch's backward.

    torch's stages turn FSDP's gradient sync off for all but the step's last backward, so a data
    rank holds its stage's whole gradients (fp32) through the step — ZeRO 2/3 then save nothing
    where gradients weigh most. Here each backward reduce-scatters, FSDP accumulates into the
    1/dp shard and frees the full gradient: at the peak a rank holds 1/dp of its stage's
    gradients (and, under ZeRO-3, weights), at the price of one reduce-scatter per microbatch
    instead of one per step (DeepSpeed ZeRO-2's accumulation; the resolver counts it so).
    The V schedules split input and weight grads: their weight pass runs after FSDP's
    post-backward hook, so the reduce-scatter is started by hand once the weight pass is done
    (as torch's own REDUCE_GRAD does at the step's end).
    Under ZeRO-3 both passes first unshard the chunk's FSDP modules (a no-op when they are
    already unsharded): torch's input pass finds the weights' gradient nodes through
    ``submod.parameters()`` BEFORE FSDP's pre-backward hook swaps the unsharded parameters in, and
    its weight pass maps gradients back through the same call, after another microbatch's forward
    may have resharded them. Against the sharded parameters the input pass found no weight of a
    resharded layer: those layers' weight gradients came only from the microbatches whose weight
    pass happened to run unsharded (dualpipev: grad norm 6.86 instead of 7.25), and zbv crashed.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    stage_backward = private("torch.distributed.pipelining._backward", "stage_backward")

    mod = stage.submod
    if not isinstance(mod, FSDPModule):
        return
    base = stage.backward_maybe_with_nosync

    def sync_on() -> None:
        mod.set_is_last_backward(False)  # the schedule's REDUCE_GRAD finalises at the step's end
        mod.set_reshard_after_backward(reshard_weights)
        mod.set_requires_gradient_sync(True)

    fsdp_mods = [m for m in mod.modules() if isinstance(m, FSDPModule)]

    def unshard_all() -> None:
        for m in fsdp_mods:
            m.unshard()

    def backward(backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type == "input":  # the weight grads come in the weight pass
            if reshard_weights:
                unshard_all()
            return base(backward_type, bwd_kwargs, last_backward=last_backward)
        if backward_type == "weight":
            if reshard_weights:
                unshard_all()
            out = base(backward_type, bwd_kwargs, last_backward=last_backward)
            sync_on()
            state = fully_shard.state(mod)
            for st in state._state_ctx.all_states:
                for group in st._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
            return out
        sync_on()
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                               bwd_kwargs["input_values"])
        return grads, None

    stage.backward_maybe_with_nosync = backward
