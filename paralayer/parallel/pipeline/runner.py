"""Pipeline parallel on ``torch.distributed.pipelining``: split, schedule, measure the bubble.

Why this file is long: one concept, torch's pipelining driven for every schedule, whose parts (the
chunk split, the stage hooks, the runner and its measured bubble) share the layout conventions
below and change together (the schedules' own code is torch's; what is ours is the glue).

Layout (the plan's convention, see docs/pipeline.md)
    ``plan["stage_layers"][c]`` lists the GLOBAL layer indices of pipeline chunk ``c`` (there are
    pp·v chunks). Chunk 0 also owns the embedding, the last chunk the final norm + head (+ loss).
    Which pp rank runs chunk ``c``:
      gpipe, 1f1b, interleaved   c % pp                (Megatron's looped/interleaved layout)
      zbv, dualpipev             c for c < pp, 2pp−1−c after (the "V": rank 0 holds the first
                                 and the last chunk; two chunks per rank, always)
    A chunk is the plain :class:`~paralayer.model.transformer.Transformer` with the other layers deleted and
    ``tok_embeddings`` / ``norm`` + ``output`` set to None where not owned, so parameter names are
    the same under every layout and :func:`paralayer.model.transformer.init_weights` gives the same weights.

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
import copy
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.clock import StepClock
from paralayer.compat import all_gather_single, is_view, private, stage_action_methods
from paralayer.model.moe import shared_weight_casts
from paralayer.parallel.comm_trace import optional_collective, optional_region
from paralayer.parallel.pipeline.early_recv import EarlyRecv
from paralayer.parallel.pipeline.split_backward import drop_recompute_after_input_pass
from paralayer.resolve.plan import plan_field

V_SCHEDULES = ("zbv", "dualpipev")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


# ------------------------------------------------------------------ layout (torch-free helpers)
def chunks_per_rank(schedule: str, vpp: int = 1) -> int:
    """Chunks each pp rank holds: vpp for gpipe/1f1b/interleaved (gpipe/1f1b want 1), 2 for V."""
    if schedule in V_SCHEDULES:
        return 2
    return max(1, int(vpp))


def chunk_to_rank(chunk: int, pp: int, schedule: str) -> int:
    """The pp rank that runs ``chunk`` (see the module docstring)."""
    if schedule in V_SCHEDULES:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(pp_rank: int, pp: int, n_chunks: int, schedule: str) -> list[int]:
    """Chunk indices held by ``pp_rank``, in pipeline order (ascending)."""
    return [c for c in range(n_chunks) if chunk_to_rank(c, pp, schedule) == pp_rank]


def auto_balance(n_layers: int, chunks: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[int]:
    """Layers per chunk (contiguous, ≥ 1 each) minimising the most loaded chunk's cost.

    A layer costs 1; the embedding counts ``embed_cost`` layer-equivalents on chunk 0 and the final
    norm + head + loss ``head_cost`` on the last chunk (Megatron's
    ``account_for_embedding/loss_in_pipeline_split`` count one layer each, the default here).
    Ties go to the split closest to even. Examples: 6 layers on 4 chunks → [1, 2, 2, 1]
    (costs 2, 2, 2, 2); 8 layers on 4 chunks → [2, 2, 2, 2] (costs 3, 2, 2, 3; the unevener
    [1, 3, 3, 1] has the same maximum, 3, and loses the tie).
    """
    if chunks < 1 or n_layers < chunks:
        raise ValueError(f"cannot split {n_layers} layers into {chunks} chunks of at least one layer")
    extra = [0.0] * chunks
    extra[0] += embed_cost
    extra[-1] += head_cost
    even = n_layers / chunks
    # dp[c][n] = (max cost, squared deviation) best for the first c chunks holding n layers.
    INF = (float("inf"), float("inf"))
    best = [[INF] * (n_layers + 1) for _ in range(chunks + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for c in range(1, chunks + 1):
        for n in range(c, n_layers - (chunks - c) + 1):
            for k in range(1, n - (c - 1) + 1):
                prev = best[c - 1][n - k]
                if prev[0] == float("inf"):
                    continue
                cand = (max(prev[0], k + extra[c - 1]), prev[1] + (k - even) ** 2)
                if cand < best[c][n]:
                    best[c][n] = cand
                    choice[c][n] = k
    out, n = [], n_layers
    for c in range(chunks, 0, -1):
        k = choice[c][n]
        out.append(k)
        n -= k
    return out[::-1]


def default_stage_layers(n_layers: int, pp: int, vpp: int = 1, schedule: str = "1f1b",
                         pp_layout: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Global layer indices per pipeline chunk (pp·v chunks; v = 2 for zbv/dualpipev).

    ``pp_layout`` (layers per chunk, in chunk order) gives an explicit uneven split; without it
    the split is even when the layers divide, else :func:`auto_balance`.
    """
    n_chunks = pp * chunks_per_rank(schedule, vpp)
    if pp_layout is not None:
        counts = [int(x) for x in pp_layout]
        if len(counts) != n_chunks or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(f"parallel.pp_layout must list {n_chunks} positive layer counts summing to "
                             f"model.n_layers={n_layers}, got {list(pp_layout)}")
    elif n_layers % n_chunks == 0:
        counts = [n_layers // n_chunks] * n_chunks
    else:
        counts = auto_balance(n_layers, n_chunks)
    out, start = [], 0
    for k in counts:
        out.append(list(range(start, start + k)))
        start += k
    return out


def _plan_layout(plan: Any) -> tuple[int, str, list[list[int]]]:
    pp = int(plan_field(plan, "degrees")["pp"])
    schedule = str(plan_field(plan, "schedule"))
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    stage_layers = plan_field(plan, "stage_layers")
    if not stage_layers:
        raise ValueError("plan has no stage_layers (the resolver lists the layers of every pipeline chunk)")
    return pp, schedule, [list(map(int, s)) for s in stage_layers]


# ------------------------------------------------------------------ split
def split_model(model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
    """This rank's pipeline chunks, in pipeline order: deep copies of the (meta) model holding
    only their layers; the embedding stays on chunk 0, norm + head on the last chunk.

    Each returned chunk carries ``pp_chunk`` (its global chunk index) for :class:`PipelineRunner`.
    """
    pp, schedule, stage_layers = _plan_layout(plan)
    n_chunks = len(stage_layers)
    mine = rank_chunks(pp_rank, pp, n_chunks, schedule)
    if not mine:
        raise ValueError(f"pp rank {pp_rank} holds no chunk of {n_chunks} (pp={pp}, schedule={schedule})")
    chunks = []
    for c in mine:
        keep = {str(i) for i in stage_layers[c]}
        chunk = copy.deepcopy(model)
        for name in list(chunk.layers.keys()):
            if name not in keep:
                del chunk.layers[name]
        if c != 0:
            chunk.tok_embeddings = None
        if c != n_chunks - 1:
            chunk.norm = None
            chunk.output = None
            chunk.mtp = None
        elif getattr(chunk, "mtp", None) is not None:
            chunk.mtp.add_embedding_copy()  # MTP reads the embedding on the last stage (model/mtp.py)
        chunk.pp_chunk = c
        chunks.append(chunk)
    return chunks


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


def _aux_hook(coef: float, attr: str = "aux_loss"):
    def hook(module, inputs, output):
        aux_fn = getattr(module, attr, None)
        aux = aux_fn() if aux_fn is not None else None
        if aux is None or not torch.is_grad_enabled():
            return output
        return _AttachAux.apply(output, aux, coef)

    return hook


def _unview(t):
    """A copy of ``t`` if it is a view. The zero-bubble schedules split backward into input and
    weight passes and ``detach_()`` the stage output in between, which autograd refuses on a view
    (a chunk ending in the MoE aux hook, the vocab-parallel loss, DTensor's ``to_local``)."""
    return t.clone() if is_view(t) else t


def _unview_hook(module, inputs, output):
    return _unview(output)


def _boundary_hooks(mod: nn.Module, first: bool, last: bool, dtype: torch.dtype) -> None:
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
def _stage_reducing_each_microbatch(stage, reshard_weights: bool) -> None:
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


# ------------------------------------------------------------------ rehearsal (fake tensors)
def _static_warmup(stages, has_backward: bool, p2p_done: bool) -> None:
    """The schedule's P2P warm-up, rehearsed: its vote (an all-reduce read back with ``.item()``)
    and its pickled shapes cannot cross the fake process group, and every stage was built with
    static shapes (``_static_stage_args``), which is what the vote would have agreed on."""
    InferenceMode = private("torch.distributed.pipelining._utils", "InferenceMode")

    for st in stages:
        st._inference_mode = InferenceMode.STATIC


def _static_stage_args(runner: "PipelineRunner", plan: dict, autocast_dtype) -> dict:
    """Example input and output of each of this rank's chunks, for ``PipelineStage``'s static mode.

    A chunk's input is the token ids (chunk 0) or the residual stream, in the autocast dtype if
    any else fp32 (:func:`_boundary_hooks`), (b, s/cp, h), split
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
                 aux_loss_coef: float = 0.0, seq_aux_loss_coef: float = 0.0, measure: bool = True, pp_rank: Optional[int] = None,
                 scale_grads: bool = True, reduce_each_microbatch: Optional[str] = None,
                 rehearse: bool = False, autocast_dtype: Optional[torch.dtype] = None):
        from torch.distributed.pipelining import PipelineStage

        if hasattr(pp_group, "get_group"):  # DeviceMesh
            pp_group = pp_group.get_group()
        self.group = pp_group
        self.pp, self.schedule_name, stage_layers = _plan_layout(plan)
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
                mod.register_forward_hook(_aux_hook(float(aux_loss_coef)))
            if seq_aux_loss_coef:
                mod.register_forward_hook(_aux_hook(float(seq_aux_loss_coef), "seq_aux_loss"))
            if split_backward:
                mod.register_forward_hook(_unview_hook)
        if autocast_dtype is not None:
            for c, mod in zip(ids, self.chunks):
                _boundary_hooks(mod, c == 0, c == self.n_chunks - 1, autocast_dtype)

        self.trace = None  # a paralayer.parallel.comm_trace.CommTrace, set by the runtime
        self.events: list[dict] = []  # start/end are clock marks until _finish_measure reads them
        self.clock = StepClock(self.device)
        self.stages = []
        static = _static_stage_args(self, plan, autocast_dtype) if rehearse else {}
        for c, mod in zip(ids, self.chunks):
            st = PipelineStage(mod, c, self.n_chunks, self.device, group=pp_group, **static.get(c, {}))
            if reduce_each_microbatch:
                _stage_reducing_each_microbatch(st, reduce_each_microbatch == "weights")
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
            self.schedule._warmup_p2p = _static_warmup
        self.last_timeline: list[dict] = []
        self.bubble_measured: Optional[float] = None
        self.busy_by_rank: list[float] = []
        self.window: Optional[float] = None

    def _make_schedule(self, loss_fn: Callable, split_backward: bool, scale_grads: bool):
        """torch's schedule for the plan's name over this rank's stages; its loss closes the F
        action's timing (the last chunk's loss is part of its forward)."""
        from torch.distributed.pipelining import schedules as S

        def timed_loss(logits, labels):
            loss = loss_fn(logits, labels)
            if split_backward:
                loss = _unview(loss)
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
        busy = sum(e["end"] - e["start"] for e in ev)
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
