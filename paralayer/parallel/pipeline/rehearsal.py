"""The rehearsal's pipeline stages (paralayer/rehearse/): built with static shapes, since under the fake
process group and fake tensors the schedule cannot vote on shapes at run time."""
from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from paralayer.compat import private
from paralayer.resolve.plan import plan_field


class StageSource(Protocol):
    """What :func:`static_stage_args` reads of the pipeline runner (parallel/pipeline/runner.py's
    PipelineRunner), named here so that this module does not import the runner that imports it."""

    microbatch_shape: tuple[int, int]
    chunk_ids: list[int]
    chunks: list[Any]
    n_chunks: int
    device: torch.device
    loss_parallel: bool


def static_warmup(stages, has_backward: bool, p2p_done: bool) -> None:
    """The schedule's P2P warm-up, rehearsed: its vote (an all-reduce read back with ``.item()``)
    and its pickled shapes cannot cross the fake process group, and every stage was built with
    static shapes (:func:`static_stage_args`), which is what the vote would have agreed on."""
    InferenceMode = private("torch.distributed.pipelining._utils", "InferenceMode")

    for st in stages:
        st._inference_mode = InferenceMode.STATIC


def static_stage_args(runner: StageSource, plan: dict, autocast_dtype) -> dict:
    """Example input and output of each of this rank's chunks, for ``PipelineStage``'s static mode.

    A chunk's input is the token ids (chunk 0) or the residual stream, in the autocast dtype if
    any else fp32 (:func:`~paralayer.parallel.pipeline.stage_hooks.boundary_hooks`), (b, s/cp, h), split
    over tp under sequence parallel; its output comes from running the chunk once without grad."""
    d = plan_field(plan, "degrees")
    b, s = runner.microbatch_shape
    tp = int(d["tp"])
    out: dict = {}
    for c, mod in zip(runner.chunk_ids, runner.chunks):
        if c == 0:
            x = torch.zeros((b, s), dtype=torch.long, device=runner.device)
        else:
            s_stream = s // tp if (tp > 1 and plan_field(plan, "sequence_parallel")) else s
            x = torch.zeros((b, s_stream, mod.cfg.d_model), dtype=autocast_dtype or torch.float32, device=runner.device,
                            requires_grad=True)  # received activations carry the backward
        ctx = contextlib.ExitStack()
        if runner.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            ctx.enter_context(loss_parallel())
        if autocast_dtype is not None:
            ctx.enter_context(torch.autocast(runner.device.type, dtype=autocast_dtype))
        with ctx, torch.no_grad():
            y = mod(x)
        y = y.detach().requires_grad_(True)
        last = c == runner.n_chunks - 1
        out[c] = {"input_args": (x,), "output_args": (y,),
                  "output_grads": (None,) if last else (torch.zeros_like(y),),
                  "input_grads": (None,) if c == 0 else (torch.zeros_like(x),)}
    return out
