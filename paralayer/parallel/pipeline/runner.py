"""Pipeline parallel on ``torch.distributed.pipelining``: one step through torch's schedule, and the
bubble measured.

This rank's chunks come from :func:`~paralayer.parallel.pipeline.split.split_model` (the layout:
split.py); what is hung on each chunk and stage, stage_hooks.py; the rehearsal's static stages,
rehearsal.py. The schedules' own code is torch's; what is ours is the glue.

Schedules (all torch's)
    gpipe → ScheduleGPipe, 1f1b → Schedule1F1B, interleaved → ScheduleInterleaved1F1B,
    zbv → ScheduleZBVZeroBubble, dualpipev → ScheduleDualPipeV (needs m ≥ 2·pp).

Loss and gradients
    ``loss_fn(logits, labels)`` returns the MEAN loss of one microbatch. Whether the schedule
    divides the summed microbatch gradients by m (``scale_grads``) is factor 1 of the
    gradient-scaling contract (paralayer/parallel/grad_scaling.py). The runner
    returns the mean of the m microbatch losses, broadcast over the pp group so EVERY pp rank
    returns the same value (the last chunk lives on rank pp−1, or rank 0 under a V schedule).

The measured bubble (``runner.bubble_measured``, every step)
    Each rank records its compute actions (F forward, B backward — full, or input-grad only
    under zero-bubble schedules — and W weight-grad) with a :class:`~paralayer.clock.StepClock`
    mark before and after the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
    ``backward_weight_one_chunk``; the last chunk's loss is counted inside its F. On CPU a mark is
    ``time.perf_counter()``; on CUDA it is an event on the compute stream, so the timeline is the
    GPU's, not the host's launches (the marks are read after the step, one synchronise). Times are
    relative to the end of a barrier on the pp group just before the step, so ranks on different
    hosts line up to within a barrier's skew.
    Then, over the window W = [first action start on any rank, last action end on any rank]:

        busy_r = Σ durations of rank r's actions,   idle_r = W − busy_r
        bubble_measured = mean_r(idle_r) / mean_r(busy_r)

    For GPipe/1F1B with per-microbatch forward+backward time t on every stage the window is
    (m+p−1)·t and busy is m·t, so the definition gives exactly (p−1)/m, the formula the plan uses
    (and (p−1)/(v·m) for interleaved). Communication waits and framework overhead between actions
    count as idle — that is what a real bubble costs.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.clock import StepClock
from paralayer.compat import all_gather_single, stage_action_methods
from paralayer.model.moe import shared_weight_casts
from paralayer.parallel.comm_trace import optional_collective, optional_region
from paralayer.parallel.pipeline.early_recv import EarlyRecv
from paralayer.parallel.pipeline.overlap import OverlappedFB
from paralayer.parallel.pipeline.rehearsal import static_stage_args, static_warmup
from paralayer.parallel.pipeline.split import chunk_to_rank, plan_layout, rank_chunks
from paralayer.parallel.pipeline.split_backward import drop_recompute_after_input_pass
from paralayer.parallel.pipeline.stage_hooks import (
    aux_hook,
    boundary_hooks,
    stage_reducing_each_microbatch,
    unview,
    unview_hook,
)
from paralayer.parallel.pipeline.timeline import busy_seconds
from paralayer.resolve.plan import plan_field


# ------------------------------------------------------------------ the runner
class PipelineRunner:
    """Runs one training step's forward + backward over ``plan["microbatches"]`` microbatches.

    Args:
        chunks: this rank's chunks from :func:`split_model`, after TP/FSDP and materialisation.
        pp_group: the pp ProcessGroup, or a 1-D DeviceMesh of the pp axis.
        plan: the :class:`~paralayer.resolve.plan.Plan`, or a dict with its ``degrees``,
            ``microbatches``, ``schedule`` and ``stage_layers``.
        loss_fn: ``loss_fn(logits, labels) -> scalar`` MEAN loss of one microbatch.
        device: the device the stages run on.
        microbatch_shape: optional (b, s) of one microbatch's tokens; checked against step()'s input.
        loss_parallel: run the step under ``loss_parallel()`` (vocab-sharded logits under TP).
        aux_loss_coef: if > 0, each chunk's ``aux_loss()`` (MoE) is added to the objective with
            this weight (gradient only; the returned loss is the LM loss alone).
        seq_aux_loss_coef: the same for each chunk's ``seq_aux_loss()`` (DeepSeek-V3's
            sequence-wise balance loss).
        measure: record the timeline and compute ``bubble_measured`` every step.
        pp_overlap: under dualpipev, run each overlapped forward-backward action with its halves'
            all-to-alls and sends in flight while the other half computes (overlap.py); the
            runner's ``overlap`` then holds that step's log.

    ``scale_grads``: see paralayer/parallel/grad_scaling.py (GradScaling.schedule_scales).
    ``reduce_each_microbatch``: for FSDP chunks (ZeRO 2/3), "grads" reduce-scatters every
    microbatch's gradients into the 1/dp shard, "weights" also reshards the weights after each
    backward (ZeRO-3); None keeps torch's one reduction per step.

    After ``step``: ``last_timeline`` (this rank's events, dicts with action F/B/W, mb, chunk,
    start, end in seconds from the step's common origin), ``bubble_measured`` (float, same on all
    pp ranks), ``busy_by_rank`` / ``window`` (seconds).
    """

    def __init__(self, chunks: Sequence[nn.Module], pp_group: Any, plan: Any,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device | str = "cpu", *, microbatch_shape: Optional[tuple] = None,
                 microbatch_dtype: Optional[torch.dtype] = None, loss_parallel: bool = False,
                 aux_loss_coef: float = 0.0, seq_aux_loss_coef: float = 0.0, measure: bool = True,
                 pp_rank: Optional[int] = None,
                 scale_grads: bool = True, reduce_each_microbatch: Optional[str] = None,
                 rehearse: bool = False, autocast_dtype: Optional[torch.dtype] = None,
                 pp_overlap: bool = False):
        from torch.distributed.pipelining import PipelineStage

        if hasattr(pp_group, "get_group"):  # DeviceMesh
            pp_group = pp_group.get_group()
        self.group = pp_group
        self.pp, self.schedule_name, stage_layers = plan_layout(plan)
        if dist.get_world_size(pp_group) != self.pp:
            raise ValueError(f"pp group has {dist.get_world_size(pp_group)} ranks, plan says pp={self.pp}")
        self.pp_rank = dist.get_rank(pp_group) if pp_rank is None else pp_rank
        self.n_chunks = len(stage_layers)
        self.m = int(plan_field(plan, "microbatches"))
        self.device = torch.device(device)
        self.microbatch_shape = tuple(microbatch_shape) if microbatch_shape is not None else None
        self.loss_parallel = loss_parallel
        self.rehearse = rehearse
        self.measure = measure and not rehearse  # timings of fake tensors mean nothing
        ids = rank_chunks(self.pp_rank, self.pp, self.n_chunks, self.schedule_name)
        if len(ids) != len(chunks):
            raise ValueError(f"pp rank {self.pp_rank} should hold chunks {ids}, got {len(chunks)} modules")
        for c, mod in zip(ids, chunks):
            if getattr(mod, "pp_chunk", c) != c:
                raise ValueError(f"chunk order mismatch: expected chunk {c}, got {mod.pp_chunk}")
        self.chunks = list(chunks)
        self.chunk_ids = ids
        # the V schedules split backward into input and weight passes (and detach in between)
        split_backward = self.schedule_name in ("zbv", "dualpipev")
        for mod in self.chunks:
            if aux_loss_coef:
                mod.register_forward_hook(aux_hook(float(aux_loss_coef)))
            if seq_aux_loss_coef:
                mod.register_forward_hook(aux_hook(float(seq_aux_loss_coef), "seq_aux_loss"))
            if split_backward:
                mod.register_forward_hook(unview_hook)
        if autocast_dtype is not None:
            for c, mod in zip(ids, self.chunks):
                boundary_hooks(mod, c == 0, c == self.n_chunks - 1, autocast_dtype)

        self.trace = None  # a paralayer.parallel.comm_trace.CommTrace, set by the runtime
        self.events: list[dict] = []  # start/end are clock marks until _finish_measure reads them
        self.clock = StepClock(self.device)
        self.stages = []
        static = static_stage_args(self, plan, autocast_dtype) if rehearse else {}
        for c, mod in zip(ids, self.chunks):
            st = PipelineStage(mod, c, self.n_chunks, self.device, group=pp_group, **static.get(c, {}))
            if reduce_each_microbatch:
                stage_reducing_each_microbatch(st, reduce_each_microbatch == "weights")
            if split_backward:
                drop_recompute_after_input_pass(st)
            self._instrument(st, c)
            self.stages.append(st)
        # gpipe/1f1b: post each next receive before the current action computes (early_recv.py)
        self.early_recv = None
        if self.schedule_name in ("gpipe", "1f1b") and len(self.stages) == 1 and not rehearse:
            self.early_recv = EarlyRecv(self.stages[0], self.m)
        self.last_stage_rank = chunk_to_rank(self.n_chunks - 1, self.pp, self.schedule_name)
        self.schedule = self._make_schedule(loss_fn, split_backward, scale_grads)
        if rehearse:
            self.schedule._warmup_p2p = static_warmup
        self.overlap = self._overlap(pp_overlap, rehearse)
        self.last_timeline: list[dict] = []
        self.bubble_measured: Optional[float] = None
        self.busy_by_rank: list[float] = []
        self.window: Optional[float] = None

    def _overlap(self, pp_overlap: bool, rehearse: bool) -> Optional[OverlappedFB]:
        """dualpipev's overlapped forward-backward (overlap.py), registered on the schedule and handed
        to the expert all-to-alls; the rehearsal's one step keeps the serial order (the same
        collectives and sizes; its fake tensors live in this thread's modes)."""
        if not pp_overlap:
            return None
        if self.schedule_name != "dualpipev":
            raise ValueError(f"pp_overlap runs dualpipev's overlapped actions; schedule is {self.schedule_name}")
        if rehearse:
            return None
        overlap = OverlappedFB(self.stages, self.device)
        overlap.register(self.schedule)
        for mod in self.chunks:
            for sub in mod.modules():
                if getattr(sub, "ep_group", None) is not None:
                    sub.ep_overlap = overlap
        return overlap

    def _make_schedule(self, loss_fn: Callable, split_backward: bool, scale_grads: bool):
        """torch's schedule for the plan's name over this rank's stages; its loss closes the F
        action's timing (the last chunk's loss is part of its forward)."""
        from torch.distributed.pipelining import schedules as S

        def timed_loss(logits, labels):
            loss = loss_fn(logits, labels)
            if split_backward:
                loss = unview(loss)
            if self.measure and self.events:
                self.events[-1]["end"] = self.clock.mark()  # the loss belongs to F
            return loss

        cls = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "interleaved": S.ScheduleInterleaved1F1B,
               "zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}[self.schedule_name]
        if self.schedule_name in ("gpipe", "1f1b"):
            if len(self.stages) != 1:
                raise ValueError(f"{self.schedule_name} runs one chunk per rank; use schedule=interleaved for vpp>1")
            return cls(self.stages[0], n_microbatches=self.m, loss_fn=timed_loss, scale_grads=scale_grads)
        if self.schedule_name == "dualpipev" and self.m < 2 * self.pp:
            raise ValueError(f"dualpipev needs microbatches ≥ 2·pp = {2 * self.pp}, got {self.m}")
        return cls(self.stages, n_microbatches=self.m, loss_fn=timed_loss, scale_grads=scale_grads)

    # ---- instrumentation
    def _instrument(self, stage, chunk: int) -> None:
        """Wrap the stage's per-action methods: a clock mark before and after each call."""
        runner = weakref.proxy(self)

        def wrap(fn, action: str):
            def timed(*args, **kwargs):
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
                trace = runner.trace  # paralayer/parallel/comm_trace.py: where am I, profiler ranges
                if trace is not None:
                    trace.at(trace.step, f"pipeline {action} chunk {chunk}", int(mb))
                with optional_region(trace, f"pipeline.{action}.mb{mb}.chunk{chunk}"):
                    if not runner.measure:
                        return fn(*args, **kwargs)
                    clock = runner.clock
                    start = clock.mark()
                    out = fn(*args, **kwargs)
                runner.events.append({"action": action, "mb": int(mb), "chunk": chunk,
                                      "start": start, "end": clock.mark()})
                return out
            return timed

        for action, name in stage_action_methods(stage).items():
            setattr(stage, name, wrap(getattr(stage, name), action))

    # ---- one step
    def step(self, tokens: torch.Tensor, labels: torch.Tensor,
             autocast_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Forward + backward of this dp rank's batch (split into m microbatches along dim 0).

        Accumulates ``param.grad`` (zero them before); returns the mean microbatch loss as a 0-d
        fp32 tensor on EVERY pp rank (broadcast from the rank holding the last chunk).
        """
        if tokens.shape[0] % self.m:
            raise ValueError(f"batch of {tokens.shape[0]} sequences does not split into {self.m} microbatches")
        if self.microbatch_shape is not None and (tokens.shape[0] // self.m,) + tuple(tokens.shape[1:]) != \
                tuple(self.microbatch_shape):
            raise ValueError(f"microbatch shape {(tokens.shape[0] // self.m,) + tuple(tokens.shape[1:])} "
                             f"!= declared {self.microbatch_shape}")
        self.events = []
        if self.early_recv is not None:
            self.early_recv.reset()
        if self.overlap is not None:
            self.overlap.reset()
        if self.measure:
            with optional_collective(self.trace, "pp", "measure_barrier"):  # waiting for a late stage
                dist.barrier(group=self.group)
            if self.clock.cuda:
                torch.cuda.synchronize(self.device)  # the origin is when this rank's GPU is idle
        self.clock.start()
        holds_first = 0 in self.chunk_ids
        holds_last = (self.n_chunks - 1) in self.chunk_ids
        args = (tokens,) if holds_first else ()
        losses: list[torch.Tensor] = []
        ctx = contextlib.ExitStack()
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            ctx.enter_context(loss_parallel())
        if autocast_dtype is not None:
            ctx.enter_context(torch.autocast(self.device.type, dtype=autocast_dtype))
            # the experts' bf16 copy shared by the microbatches, as autocast's cache shares the others
            ctx.enter_context(shared_weight_casts(self.chunks))
        with ctx:
            self.schedule.step(*args, target=labels if holds_last else None,
                               losses=losses if holds_last else None, return_outputs=False)
        if self.early_recv is not None:
            self.early_recv.finish()
        if self.overlap is not None:
            self.overlap.finish()
        if holds_last:
            loss = torch.stack([x.detach().float().reshape(()) for x in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        loss = loss.reshape(1).contiguous()
        with optional_collective(self.trace, "pp", "loss_broadcast"):
            dist.broadcast(loss, group=self.group, group_src=self.last_stage_rank)
        if self.measure:
            self._finish_measure()
        return loss[0]

    def _finish_measure(self) -> None:
        seconds = self.clock.seconds
        ev = [dict(e, start=seconds(e["start"]), end=seconds(e["end"])) for e in self.events]
        busy = busy_seconds(ev)  # overlapped F and B share their seconds
        first = min((e["start"] for e in ev), default=0.0)
        last = max((e["end"] for e in ev), default=0.0)
        mine = torch.tensor([busy, first, last], dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        allv = torch.zeros(self.pp * 3, dtype=torch.float64, device=self.device)
        all_gather_single(allv, mine, group=self.group)
        allv = allv.view(self.pp, 3).cpu()
        window = float(allv[:, 2].max() - allv[:, 1].min())
        busy_r = allv[:, 0].tolist()
        mean_busy = sum(busy_r) / len(busy_r)
        mean_idle = sum(window - b for b in busy_r) / len(busy_r)
        self.window = window
        self.busy_by_rank = busy_r
        self.bubble_measured = mean_idle / mean_busy if mean_busy > 0 else None
        self.last_timeline = [dict(e, rank=self.pp_rank) for e in ev]

    def gather_timeline(self) -> list[list[dict]]:
        """Collective over the pp group: every rank's ``last_timeline``, indexed by pp rank."""
        out: list = [None] * self.pp
        dist.all_gather_object(out, self.last_timeline, group=self.group)
        return out
