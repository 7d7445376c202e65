"""One rank's life: mesh from the plan → model on meta → parallelism → weights → train loop.

Everything a rank needs comes from the run directory (``resolved.yaml`` and ``plan.json``, read
into a :class:`~paralayer.resolve.plan.Plan`); nothing is re-derived, and no environment variable
changes what a rank does. :func:`train` runs on an already-initialised process group (tests call
it directly on forked gloo ranks); :func:`main` is the entry point the dispatchers start.

The steps, in order: :func:`setup` (device, mesh, model, optimizer, gradient reduction, data,
pipeline, peak FLOP/s, all held by one :class:`RankRun`) → resume → :func:`open_logger` →
per step :func:`train_step` (:func:`step_batch` → :func:`forward_backward` →
:func:`reduce_and_clip` → optimizer → :func:`step_record`) → save if due → stop if signalled (the
checkpoint steps: runtime/rank_checkpoints.py). Who divides each gradient by what is stated once,
in paralayer/parallel/grad_scaling.py. Tests reach into a step only through :class:`StepHooks`.
Each step runs through :func:`run_step` (health: timing, watchdog, profiler; evaluation; the
stability verdict and :func:`roll_back`).

What is not the loop lives beside it: building the model, optimizer, data and pipeline
(runtime/build.py), the rank's environment and run directory (runtime/rank_entry.py), resuming and
saving (runtime/rank_checkpoints.py), run health (runtime/health/), evaluation (runtime/evaluate.py).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

if __name__ == "__main__":  # a rank of the local launcher: the collector off while it starts
    from paralayer.runtime import startup_gc

    startup_gc.pause()

import torch
import torch.distributed as dist

from paralayer.checkpoint.manifest import CheckpointError
from paralayer.clock import StepClock
from paralayer.config import Config
from paralayer.config import resolved as config_resolved  # to_dict without OmegaConf (issue #36)
from paralayer.data.errors import DataError
from paralayer.model.moe import shared_weight_casts
from paralayer.optim import qk_clip
from paralayer.parallel import data as dpar
from paralayer.parallel import tied_embeddings as tied
from paralayer.parallel.collective_timing import step_waits, time_fsdp
from paralayer.parallel.comm_trace import CommTrace
from paralayer.parallel.grad_scaling import GradScaling, finish_grads
from paralayer.parallel.mesh import Meshes, build_mesh
from paralayer.parallel.tensor import loss_parallel_ctx
from paralayer.resolve.plan import Plan
from paralayer.runtime import evaluate, mtp_step, placement, precision, rank_checkpoints, startup_gc
from paralayer.runtime import moe_step as moe_step
from paralayer.runtime.batch import rank_batch
from paralayer.runtime.build import (  # noqa: F401 - re-exported: tests and the rehearsal use train.*
    Built,
    agree_peak_tflops,
    apply_recompute,
    as_plan,
    build_data,
    build_model,
    build_optimizer,
    build_reducer,
    build_runner,
    build_tied_group,
    grad_scaling,
    lr_lambda,
    make_loss_fn,
    resolve_device,
)
from paralayer.runtime.health import stability as stab_mod
from paralayer.runtime.health.preempt import Preempted, PreemptSave
from paralayer.runtime.rank_entry import _report_input_error, init_distributed, load_run  # noqa: F401


class NonFiniteLoss(RuntimeError):
    pass


# ------------------------------------------------------------------ the rank's state
class StepHooks:
    """Where a test reaches into a step; the production loop runs these no-ops.

    tests/fault_hook.py installs a subclass that kills, raises or poisons the loss at a chosen rank
    and step (the failure paths: a dying rank, a non-finite loss)."""

    def before_forward(self, rank: int, step: int) -> None:
        """Called before the step's forward."""

    def local_loss(self, rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        """This rank's share of the loss, before it is averaged over the data ranks."""
        return loss

    def on_batch(self, rank: int, step: int, tokens: torch.Tensor) -> None:
        """This rank's tokens of the step (a test sees which data a step read)."""

    def before_save(self, rank: int, step: int) -> None:
        """Called inside a checkpoint save, before its collectives (a rank frozen mid-save)."""


@dataclass
class RankRun:
    """Everything one rank's loop holds, built once by :func:`setup`, read by every step."""

    cfg: Config
    plan: Plan
    device: torch.device
    meshes: Meshes
    built: Built
    opt: Any
    sched: Any
    scaling: GradScaling
    reducer: Any
    runner: Any
    dataset: Any
    loss_fn: Callable
    tied_group: Any
    autocast_dtype: Optional[torch.dtype]
    ckpt_dir: Optional[str]
    rehearsing: bool = False  # paralayer/rehearse/rank.py: fake tensors, fake process group
    peak_tflops: Optional[float] = None
    peak_source: str = "rank 0"
    hooks: StepHooks = field(default_factory=StepHooks)
    checkpointer: Any = None  # paralayer.checkpoint.dcp.Checkpointer, made by checkpoints()
    comm: CommTrace = field(default_factory=CommTrace)  # where am I; our collectives (parallel/comm_trace.py)
    stability: Any = None  # runtime/health/stability.py: non-finite and spiking losses, batches skipped by rollbacks
    qk_clip: Any = None  # paralayer/optim/qk_clip.py (train.muon.qk_clip_tau set): maxima, rescale after the step

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def degree(self) -> dict:
        return {k: int(v) for k, v in self.plan.degrees.items()}


def setup(cfg: Config, plan: Plan, run_dir: Optional[str], hooks: Optional[StepHooks] = None) -> RankRun:
    """Device, mesh, model, optimizer, gradient reduction, data, pipeline and peak FLOP/s."""
    device = resolve_device(plan)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meshes = build_mesh(plan, device.type)
    placement.check(plan, meshes, run_dir)  # an intra-node axis across hosts stops here (one line)
    torch.manual_seed(cfg.train.seed)
    built = build_model(cfg, plan, meshes, device)
    opt, sched = build_optimizer(cfg, built, meshes)
    clip = qk_clip.build(cfg, built, meshes)
    scaling = grad_scaling(plan, meshes)
    loss_fn = make_loss_fn(cfg, plan, cfg.model.seq_len - 1, mtp_step.mtp_chunk(built.chunks))
    reducer = build_reducer(scaling, built, meshes)
    run = RankRun(cfg=cfg, plan=plan, device=device, meshes=meshes, built=built, opt=opt, sched=sched,
                  scaling=scaling, reducer=reducer, runner=None, dataset=None, loss_fn=loss_fn,
                  tied_group=build_tied_group(cfg, plan, meshes),
                  autocast_dtype=precision.autocast_dtype(precision.mode(cfg, device, meshes.size("dp_cp"))),
                  ckpt_dir=cfg.checkpoint.dir or (os.path.join(run_dir, "checkpoints") if run_dir else None),
                  hooks=hooks or StepHooks(), qk_clip=clip)
    run.comm.rank = dist.get_rank()
    for chunk in built.chunks:  # the cp ring counts its K/V bytes in the comm trace
        for layer in chunk.layers.values():
            if getattr(layer.attention, "ring_stats", None) is not None:
                layer.attention.ring_stats.trace = run.comm
        for mod in chunk.modules():  # the expert rows by destination (parallel/expert_node.py): ep.<where>
            if getattr(mod, "ep_bytes_sent", None) is not None:
                mod.ep_trace = run.comm
    time_fsdp(built.chunks, run.comm)  # ZeRO-2/3: waiting in FSDP's collectives is not compute
    run.stability = stab_mod.Stability(cfg.train)
    run.dataset = build_data(cfg)
    run.runner = build_runner(run)
    if run.runner is not None:
        run.runner.trace = run.comm
    run.peak_tflops, run.peak_source = agree_peak_tflops(cfg, device)
    return run



# ------------------------------------------------------------------ logging
def open_logger(run: RankRun, run_dir: Optional[str], start_step: int, log_progress: bool):
    """metrics.jsonl (cut back to the resumed step), console and W&B; None without a run directory."""
    if run_dir is None:
        return None
    from paralayer import metrics as metrics_mod

    cfg = run.cfg
    return metrics_mod.MetricsLogger(  # metrics.jsonl is cut back to start_step - 1 at its first record
        run_dir, config_resolved.to_dict(cfg), run.plan.to_dict(), run.rank == 0, cfg.logging.wandb.mode,
        cfg.logging.wandb.project, cfg.logging.wandb.group, cfg.train.steps,
        progress=log_progress and cfg.logging.progress, peak_source=run.peak_source,
        run_name=cfg.run.name or os.path.basename(os.path.normpath(run_dir)), log_every=cfg.train.log_every,
        keep_through=start_step - 1)


# ------------------------------------------------------------------ one step
def step_batch(run: RankRun, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and labels of the step's global batch (its dp share, its cp zigzag shard)."""
    batch = run.stability.batch_for(step) if run.stability is not None else step  # rollbacks skip batches
    return rank_batch(run, run.dataset, batch)


def forward_backward(run: RankRun, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The step's forward and backward over its microbatches; returns this rank's mean loss.

    Gradients are left as the contract says (paralayer/parallel/grad_scaling.py): scaled for the
    microbatches, not yet reduced over the data ranks."""
    if run.runner is not None:
        return run.runner.step(tokens, labels, autocast_dtype=run.autocast_dtype)
    model, m = run.built.chunks[0], run.scaling.microbatches
    dtype = run.autocast_dtype
    loss_sum = torch.zeros((), device=run.device)
    for i, (mb_tokens, mb_labels) in enumerate(zip(tokens.chunk(m), labels.chunk(m))):
        with loss_parallel_ctx(run.degree["tp"] > 1):
            run.comm.at(run.comm.step, "forward", i)
            with torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None), \
                    shared_weight_casts([model] if dtype is not None else []), run.comm.region("forward"):
                logits = model(mb_tokens)
                loss = run.loss_fn(logits, mb_labels)
            aux, seq_aux = model.aux_loss(), model.seq_aux_loss()
            total = loss if aux is None else loss + run.cfg.model.moe.aux_loss_coef * aux
            if seq_aux is not None:  # DeepSeek-V3's sequence-wise balance loss
                total = total + run.cfg.model.moe.seq_aux_loss_coef * seq_aux
            run.comm.at(run.comm.step, "backward", i)
            with run.comm.region("backward"):
                (total / run.scaling.loss_divisor).backward()
        loss_sum = loss_sum + loss.detach() / m
    return loss_sum


def reduce_and_clip(run: RankRun, local_loss: torch.Tensor) -> tuple[float, float]:
    """Finish the gradients (contract), average the loss over dp·cp, clip; (loss, grad norm)."""
    loss_t, norm_t = reduce_and_clip_tensors(run, local_loss)
    return float(loss_t), float(norm_t)


def reduce_and_clip_tensors(run: RankRun, local_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reduce_and_clip` without reading back to the host (the rehearsal's fake tensors have
    no values; a GPU is not made to wait): the loss and the grad norm as 0-d tensors."""
    built, meshes = run.built, run.meshes
    tie = tied.shares_embedding(run.cfg.model, run.degree["pp"])
    run.comm.at(run.comm.step, "reduce")
    with run.comm.collective("dp_cp", "grad_reduce"):
        finish_grads(run.scaling, run.reducer, built.expert_params,
                     tied_chunks=built.chunks if tie else None, tied_group=run.tied_group)
    with run.comm.collective("dp_cp", "loss_all_reduce"):
        loss_t = _global_loss(local_loss, meshes)
    with run.comm.collective("pp_ep_tp", "grad_norm"):
        grad_norm = _clip(run, built, meshes, tie)
    return loss_t, grad_norm


def _clip(run: RankRun, built: Built, meshes: Meshes, tie: bool) -> torch.Tensor:
    return dpar.clip_grad_norm(
        built.params, run.cfg.train.grad_clip, meshes["pp"].get_group() if run.degree["pp"] > 1 else None,
        built.expert_params, meshes["ep"].get_group() if meshes.expert is not None else None,
        skip_norm=tied.head_copy(built.chunks) if tie else (), as_tensor=True)


def bad_step(run: RankRun, step: int, loss: float, grad_norm: float) -> Optional[stab_mod.Verdict]:
    """A non-finite or spiking loss (runtime/health/stability.py): None to go on with the update; the
    verdict when the update is skipped (skip) or the loop must roll back; raises on stop."""
    v = run.stability.check(step, loss, grad_norm)
    if v is None or v.action == "warn":
        if v is not None and run.rank == 0:
            print(f"paralayer: warning: {v.why}", flush=True)
        run.stability.accept(loss)
        return None
    if v.action == "stop":
        if v.nonfinite:
            raise NonFiniteLoss(f"{v.why}; stopping. Lower train.lr or set train.on_nonfinite=skip|rollback "
                                f"to skip such steps or roll back.")
        raise stab_mod.LossSpike(f"{v.why}; stopping (train.spike.action=stop)")
    run.opt.zero_grad(set_to_none=True)
    if v.action == "skip":
        if run.rank == 0:
            what = f"non-finite loss {loss}" if v.nonfinite else v.why
            print(f"paralayer: step {step}: {what}; step skipped", flush=True)
        run.sched.step()
    return v


def train_step(run: RankRun, step: int) -> Union[dict, stab_mod.Verdict]:
    """One optimizer step; its metrics record, or the verdict on a skipped or rolled-back step."""
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    clock = StepClock(run.device)  # CUDA events on a GPU: step_time_s is the device's time
    clock.start()
    run.comm.new_step(step)
    t_data = time.perf_counter()
    tokens, labels = step_batch(run, step)
    run.comm.data_s = time.perf_counter() - t_data
    run.hooks.on_batch(run.rank, step, tokens)
    run.hooks.before_forward(run.rank, step)
    run.opt.zero_grad(set_to_none=True)
    if run.cfg.train.precision == "fp8":  # FSDP's FP8 all-gather: scales of the updated weights
        from paralayer.model.float8 import refresh_scales

        refresh_scales(run.built.chunks)
    moe_step.reset(run.built.chunks)
    if run.qk_clip is not None:
        run.qk_clip.reset()
    mtp_step.reset(run.built.chunks)
    with step_waits(run.comm, run.degree["tp"] > 1):  # DTensor's and P2P waits are not compute
        local_loss = run.hooks.local_loss(run.rank, step, forward_backward(run, tokens, labels))
    loss, grad_norm = reduce_and_clip(run, local_loss)
    verdict = bad_step(run, step, loss, grad_norm)
    if verdict is not None:
        return verdict
    lr = run.opt.param_groups[0]["lr"]
    run.comm.at(step, "optimizer")
    with run.comm.region("optimizer"):
        run.opt.step()
        if run.qk_clip is not None:  # MuonClip: the heads whose logits passed tau, rescaled
            run.qk_clip.after_step()
    moe_step.update_bias(run.built.chunks, run.cfg, run.meshes)
    run.sched.step()
    return step_record(run, step, loss, lr, grad_norm, clock.elapsed())


def step_record(run: RankRun, step: int, loss: float, lr: float, grad_norm: float, seconds: float) -> dict:
    """The metrics.jsonl record of a step (+ the measured bubble under pp, + MoE routing stats)."""
    from paralayer import metrics as metrics_mod

    cfg = run.cfg
    rec = metrics_mod.step_record(
        step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=cfg.train.global_batch * cfg.model.seq_len,
        step_time_s=seconds, world_size=dist.get_world_size(), flops_per_token=float(run.plan.flops_per_token),
        peak_tflops=run.peak_tflops, device=run.device)
    if run.runner is not None and getattr(run.runner, "bubble_measured", None) is not None:
        rec["bubble_measured"] = run.runner.bubble_measured
    rec.update(moe_step.step_stats(run.built.chunks, run.meshes, run.degree["pp"], cfg.model.moe.num_experts,
                                   run.device) or {})
    rec.update(qk_clip.step_stats(run.qk_clip, run.meshes, run.degree["pp"]))
    rec.update(mtp_step.step_loss(run.built.chunks, run.meshes, run.degree["pp"], cfg.model.mtp.depth, run.device))
    if hasattr(run.dataset, "source_sequences"):  # {source: sequences drawn so far} (data/blend.py)
        batch = run.stability.batch_for(step) if run.stability is not None else step  # batches a rollback skipped count
        rec["source_sequences"] = run.dataset.source_sequences(batch, cfg.train.global_batch)
    return rec


# ------------------------------------------------------------------ the loop
def train(cfg: Config, plan: Union[Plan, dict], run_dir: Optional[str] = None, log_progress: bool = False,
          hooks: Optional[StepHooks] = None) -> list[dict]:
    """Train on the initialised process group; return the per-step metrics (identical on every rank)."""
    from paralayer.runtime.health.run_health import RunHealth

    marks = {"train_start": time.time()}  # when each start-up part ended (goodput.json: recovery time)
    run = setup(cfg, as_plan(plan), run_dir, hooks)
    marks["setup"] = time.time()
    start_step = rank_checkpoints.resume(run)
    marks["loaded"] = time.time()
    stop = cfg.train.stop_at_step or cfg.train.steps
    validator = evaluate.build_validator(run)  # None unless train.eval_every > 0
    logger = open_logger(run, run_dir, start_step, log_progress)
    health = RunHealth(run, run_dir, start_step, stop, marks)  # profiler, rank timing, watchdog, goodput
    records: list[dict] = []
    preempt = PreemptSave()
    finished = False
    startup_gc.resume()  # off through the start-up (runtime/startup_gc.py)
    try:
        step = start_step
        while step <= stop:
            step = run_step(run, health, step, stop, logger, records, preempt, validator)
        finished = True
    finally:
        goodput = health.close(finished)
    preempt.restore()
    if run.checkpointer is not None:
        run.checkpointer.wait()
    if run.runner is not None and run_dir is not None and cfg.logging.timeline:
        _write_timeline(run.runner, run.meshes, run_dir)
    if logger is not None:
        logger.close(goodput)
    return records


def run_step(run: RankRun, health, step: int, stop: int, logger, records: list, preempt: PreemptSave,
             validator: Optional[evaluate.Validator] = None) -> int:
    """One step of the loop with its evaluation, logging, checkpoint and signal check; the next step to run."""
    health.before_step(step)
    out = train_step(run, step)
    if isinstance(out, stab_mod.Verdict):
        health.after_step(step, None)
        return roll_back(run, health, step, out, logger, records) if out.action == "rollback" else step + 1
    out.update(health.after_step(step, out))
    if validator is not None and validator.due(step):
        with health.timed("eval"):
            evaluate.maybe_evaluate(validator, run, step, out)  # out["val_loss"]
    records.append(out)
    if logger is not None:
        logger.log(step, out)
    with health.timed("checkpoint"):
        saved = rank_checkpoints.save_if_due(run, step, stop)
    if saved:
        health.saved(step)
    rank_checkpoints.stop_if_signalled(run, preempt, step, stop, saved, logger)
    return step + 1


def roll_back(run: RankRun, health, step: int, verdict, logger, records: list) -> int:
    """train.on_nonfinite / train.spike.action = rollback: reload the newest verified checkpoint
    before ``step``, skip the batches since (runtime/health/stability.py); the step to run next."""
    t0 = time.perf_counter()
    if health.watchdog is not None:
        health.watchdog.pause()  # the load has checkpoint.timeout_s
    event = stab_mod.rollback(run, step, rank_checkpoints.checkpoints(run).group,
                             lambda extra: rank_checkpoints.restore_extra(run, extra, True))
    health.beat()
    from_step, skipped = event["from_step"], event["skipped_batches"]
    records[:] = [r for r in records if r["step"] <= from_step]
    if logger is not None:
        logger.rewind(from_step, dict(event, reason=verdict.why))
    if run.rank == 0:
        print(f"paralayer: {verdict.why}; rolled back to the checkpoint of step {from_step}, skipping data "
              f"batches {skipped[0]}..{skipped[-1]}", flush=True)
    health.rolled_back(from_step, time.perf_counter() - t0)
    return from_step + 1


def _global_loss(loss_sum: torch.Tensor, meshes: Meshes) -> torch.Tensor:
    # Under pp the runner has already broadcast the last stage's loss to every pp rank.
    t = loss_sum.detach().float().reshape(1).clone()
    dp_cp = meshes["dp_cp"]
    if dp_cp.size() > 1:
        dist.all_reduce(t, group=dp_cp.get_group())
        t /= dp_cp.size()
    return t[0]


def _write_timeline(runner, meshes: Meshes, run_dir: str) -> None:
    from paralayer.parallel.pipeline.timeline import plot_timeline

    events = runner.last_timeline
    gathered: list = [None] * meshes["pp"].size()
    dist.all_gather_object(gathered, events, group=meshes["pp"].get_group())
    if dist.get_rank() == 0:
        plot_timeline(gathered, os.path.join(run_dir, "timeline.png"))


# ------------------------------------------------------------------ entry point

def main(run_dir: str, *overrides: str, hooks: Optional[StepHooks] = None) -> int:
    """Entry point of every rank: read the run directory, train, leave metrics behind.

    What a rank does is decided by resolved.yaml and plan.json (plus ``overrides`` from the
    launcher); the environment only carries the launcher's RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and SLURM's SLURM_CPUS_PER_TASK."""
    from paralayer.runtime import completion, teardown
    from paralayer.runtime.health.orphans import die_with_launcher

    watch = die_with_launcher()  # a launcher killed with SIGKILL takes this rank with it
    cfg, plan = load_run(run_dir, overrides)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    slurm_cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)  # SLURM's share for this task
    threads = cfg.train.threads or slurm_cpus or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    device = resolve_device(plan)
    init_distributed(device.type, cfg.train.collective_timeout_s)
    rank = dist.get_rank()
    ok = False
    try:
        train(cfg, plan, run_dir, log_progress=True, hooks=hooks)
        # every step logged, the final state written: the run is done whatever this process does next
        completion.mark_done(run_dir, rank, cfg.train.stop_at_step or cfg.train.steps)
        ok = True
    except (NonFiniteLoss, stab_mod.LossSpike) as exc:
        print(f"paralayer: rank {rank}: {exc}", file=sys.stderr, flush=True)
        raise
    except (CheckpointError, DataError, placement.PlacementError) as exc:  # bad input: one line, every rank exits 2
        _report_input_error(exc, rank)
        return 2
    except Preempted:
        # SLURM ends this task (SIGTERM, then SIGKILL): wait for it, rather than end the job step
        # as if training were done
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(1)
        return 3
    finally:
        try:  # barrier, destroy, the groups' threads joined here (runtime/teardown.py, issue 48)
            teardown.finish(ok, cfg.train.collective_timeout_s)
        finally:
            if watch is not None:
                watch.stop()
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # through the imported module, not this __main__ copy: what a test installs on it applies
    from paralayer.runtime import train as _runtime_train

    sys.exit(record(_runtime_train.main)(*sys.argv[1:]))
