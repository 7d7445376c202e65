"""One rank's life: mesh from the plan → model on meta → parallelism → weights → train loop.

Everything a rank needs comes from the run directory (``resolved.yaml`` and ``plan.json``);
nothing is re-derived. :func:`train` runs on an already-initialised process group (tests call it
directly on forked gloo ranks); :func:`main` is the entry point the dispatchers start.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from paralayer import config as config_mod
from paralayer.runtime import moe_step as moe_step
from paralayer.parallel import tied_embeddings as tied
from paralayer.config import Config
from paralayer.parallel.mesh import Meshes, build_mesh
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from paralayer.parallel import data as dpar
from paralayer.parallel.tensor import local_tensor, loss_parallel_ctx
from paralayer.runtime.preempt import Preempted, PreemptSave

PG_TIMEOUT_S = float(os.environ.get("PARALAYER_PG_TIMEOUT_S", "120"))


class NonFiniteLoss(RuntimeError):
    pass


# ------------------------------------------------------------------ building
def resolve_device(plan: dict) -> torch.device:
    if plan.get("device", "cpu") == "cuda" and torch.cuda.is_available():
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


def build_model(cfg: Config, plan: dict, meshes: Meshes, device: torch.device) -> Built:
    """Apply parallelism in the order the design gives, then materialise the weights."""
    d = plan["degrees"]
    tp, pp, cp, ep = (int(d[k]) for k in ("tp", "pp", "cp", "ep"))
    with torch.device("meta"):
        model = Transformer(cfg.model, plan.get("padded_vocab_size") or cfg.model.vocab_size)
    if pp > 1:
        from paralayer.parallel import pipeline

        chunks = pipeline.split_model(model, plan, meshes.local_rank("pp"))
    else:
        chunks = [model]
    for chunk in chunks:
        if tp > 1:
            from paralayer.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(chunk, meshes["tp"], bool(plan.get("sequence_parallel", True)),
                                  overlap=bool(plan.get("tp_overlap", False)))
        if cp > 1:
            from paralayer.parallel.context import apply_context_parallel

            apply_context_parallel(chunk, meshes["cp"].get_group(), cfg.model.seq_len)
        if ep > 1:
            from paralayer.parallel.expert import apply_expert_parallel

            for layer in chunk.layers.values():
                if getattr(layer, "is_moe", False):
                    apply_expert_parallel(layer.feed_forward, meshes["ep"].get_group())
        apply_recompute(chunk, cfg.parallel.recompute, cfg.parallel.recompute_every)
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
                            expert_mesh=meshes["edp"] if ep > 1 else None)
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
    params = [p for c in chunks for p in c.parameters()]
    expert_params = [p for c in chunks for n, p in c.named_parameters() if n in expert_names]
    return Built(chunks=chunks, meshes=meshes, device=device, params=params, expert_params=expert_params)


def lr_lambda(cfg: Config):
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
    t = cfg.train

    def make(params):
        # foreach kernels refuse to mix DTensors with plain tensors (MoE blocks stay plain under TP)
        from torch.distributed.tensor import DTensor

        groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                              [p for p in params if not isinstance(p, DTensor)]) if g]
        return torch.optim.AdamW([{"params": g} for g in groups], lr=t.lr, betas=(t.beta1, t.beta2),
                                 weight_decay=t.weight_decay, eps=1e-8, foreach=True)

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
def make_loss_fn(cfg: Config, plan: dict, n_valid_global_per_seq: int):
    """Per-microbatch loss whose average over the dp·cp ranks is the global mean CE.

    Context ranks hold unequal numbers of valid labels (the sequence's last position has none),
    so the local mean is re-weighted by the local share of the sequence's valid tokens.
    """
    tp = int(plan["degrees"]["tp"])
    cp = int(plan["degrees"]["cp"])
    vocab = cfg.model.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n_local = (labels != -100).sum()
        n_global = labels.shape[0] * n_valid_global_per_seq
        if tp > 1:
            from paralayer.parallel.tensor import tp_loss

            mean = tp_loss(logits, labels, vocab)
        else:
            mean = lm_loss(logits, labels, vocab)  # cross_entropy ignores the -100 labels
        if cp == 1:
            return mean
        return mean * (n_local.to(mean.dtype) * cp / n_global)

    return loss_fn


# ------------------------------------------------------------------ the loop
def train(cfg: Config, plan: dict, run_dir: Optional[str] = None, log_progress: bool = False) -> list[dict]:
    """Train on the initialised process group; return the per-step metrics (identical on every rank)."""
    from paralayer.data import loading as data_mod
    from paralayer import metrics as metrics_mod

    rank, world = dist.get_rank(), dist.get_world_size()
    device = resolve_device(plan)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meshes = build_mesh(plan, device.type)
    d = plan["degrees"]
    tp, pp, cp = int(d["tp"]), int(d["pp"]), int(d["cp"])
    torch.manual_seed(cfg.train.seed)
    built = build_model(cfg, plan, meshes, device)
    opt, sched = build_optimizer(cfg, built, meshes)
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    autocast_dtype = torch.bfloat16 if precision == "bf16" else None

    dp_cp_mesh = meshes["dp_cp"]
    dp_size, dp_rank = int(d["dp"]), meshes.local_rank("dp")
    cp_rank = meshes.local_rank("cp")
    seq_len = cfg.model.seq_len
    m = int(plan["microbatches"])
    zero = int(cfg.parallel.zero)
    reducer = None
    if zero <= 1 and dp_cp_mesh.size() > 1:
        edp_group = meshes["edp"].get_group() if meshes.expert is not None else None
        # Under pp the reducer also takes the schedule's 1/m (the schedule then leaves the grads
        # unscaled): buckets that start during the last backward hold grads from before that scaling.
        reducer = dpar.GradReducer(built.params, dp_cp_mesh.get_group(), dp_cp_mesh.size(),
                                   built.expert_params, edp_group, microbatches=m,
                                   divide=dp_cp_mesh.size() * (m if pp > 1 else 1))

    tied_group = None
    tie = bool(cfg.model.tie_embeddings)
    if tie and pp > 1 and plan.get("schedule") not in ("zbv", "dualpipev"):
        # the embedding (first rank) and the head (last rank) sum their grads over the pair; the V
        # schedules keep both chunks on pipeline rank 0
        w = meshes.world.mesh
        tied_group = tied.pair_group(w.permute(1, 2, 3, 0).reshape(-1, w.shape[0]).tolist(), rank)
    cache_dir = os.environ.get("PARALAYER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "paralayer")
    dataset = data_mod.build_dataset(cfg.data, seq_len, cfg.train.seed, cache_dir,
                                     global_batch=cfg.train.global_batch, vocab_size=cfg.model.vocab_size)
    loss_fn = make_loss_fn(cfg, plan, seq_len - 1)

    runner = None
    if pp > 1:
        from paralayer.parallel.pipeline import PipelineRunner

        runner = PipelineRunner(built.chunks, meshes["pp"], plan, loss_fn, device,
                                microbatch_shape=(cfg.train.micro_batch, seq_len // cp),
                                loss_parallel=tp > 1,
                                aux_loss_coef=cfg.model.moe.aux_loss_coef if cfg.model.moe.num_experts > 0 else 0.0,
                                scale_grads=reducer is None,
                                # ZeRO 2/3: reduce-scatter every microbatch (1/dp of the grads at the peak)
                                reduce_each_microbatch={2: "grads", 3: "weights"}.get(zero))
        moe_step.count_real_forwards_only(runner, built.chunks)

    # ---- resume
    start_step = 1
    ckpt_dir = cfg.checkpoint.dir or (os.path.join(run_dir, "checkpoints") if run_dir else None)
    resume = os.environ.get("PARALAYER_RESUME") or cfg.train.resume
    if resume != "none" and ckpt_dir is not None:
        from paralayer.checkpoint import dcp as ckpt

        if resume == "auto":
            found = ckpt.resume_latest(ckpt_dir, built.chunks, [opt])  # falls back past corrupt ones
        else:
            found = (resume, ckpt.load_checkpoint(resume, built.chunks, [opt]))
        if found is not None:
            path, extra = found
            sched.load_state_dict(extra["scheduler"])
            ckpt.set_rng_state(extra["rng"])
            start_step = int(extra["step"]) + 1
            if rank == 0:
                print(f"paralayer: resumed from {path} at step {start_step}", flush=True)
    stop = cfg.train.stop_at_step or cfg.train.steps

    flops_per_token = float(plan.get("flops_per_token") or 0)
    peak, peak_source = None, "rank 0"
    if rank == 0:
        peak, peak_source = metrics_mod.resolve_peak_tflops(device, cfg.cluster.peak_tflops, torch.get_num_threads())
    peak_t = torch.tensor([peak or 0.0], dtype=torch.float64, device=device)
    dist.broadcast(peak_t, src=0)
    peak = float(peak_t.item()) or None

    logger = None
    if run_dir is not None:
        metrics_path = os.path.join(run_dir, "metrics.jsonl")
        if rank == 0 and os.path.exists(metrics_path):
            metrics_mod.truncate_after(metrics_path, start_step - 1)
        logger = metrics_mod.MetricsLogger(
            run_dir, config_mod.to_dict(cfg), plan, rank == 0, cfg.logging.wandb.mode,
            cfg.logging.wandb.project, cfg.logging.wandb.group, cfg.train.steps,
            progress=log_progress and cfg.logging.progress, peak_source=peak_source,
            run_name=cfg.run.name or os.path.basename(os.path.normpath(run_dir)))

    records: list[dict] = []
    tokens_per_step = cfg.train.global_batch * seq_len
    preempt = PreemptSave()
    for step in range(start_step, stop + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        tokens = dataset.get_batch(step, dp_rank, dp_size, cfg.train.global_batch).to(device)
        labels = data_mod.labels_for(tokens)
        if cp > 1:
            from paralayer.parallel.context import zigzag_shard

            tokens = zigzag_shard(tokens, 1, cp, cp_rank)
            labels = zigzag_shard(labels, 1, cp, cp_rank)
        poison = _maybe_inject_fault(rank, step)
        opt.zero_grad(set_to_none=True)
        moe_step.reset(built.chunks)
        if runner is not None:
            loss_sum = runner.step(tokens, labels, autocast_dtype=autocast_dtype)
        else:
            loss_sum = torch.zeros((), device=device)
            for mb_tokens, mb_labels in zip(tokens.chunk(m), labels.chunk(m)):
                with loss_parallel_ctx(tp > 1):
                    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                        logits = built.chunks[0](mb_tokens)
                    loss = loss_fn(logits, mb_labels)
                    aux = built.chunks[0].aux_loss()
                    total = loss if aux is None else loss + cfg.model.moe.aux_loss_coef * aux
                    (total / m).backward()
                loss_sum = loss_sum + loss.detach() / m
        if reducer is not None:
            reducer.reduce()
        elif zero >= 2 and meshes.expert is not None:
            # FSDP averaged expert grads over dp·cp/ep ranks; the mean is over all dp·cp.
            ep = meshes.size("ep")
            for p in built.expert_params:
                if p.grad is not None:
                    local_tensor(p.grad).div_(ep)
        if tie:
            tied.sum_tied_grads(built.chunks, tied_group)
        if poison:
            loss_sum = loss_sum * float("nan")
        # The loss: every rank that computed one holds its dp·cp shard's mean; average over them.
        loss_t = _global_loss(loss_sum, meshes)
        grad_norm = dpar.clip_grad_norm(
            built.params, cfg.train.grad_clip, meshes["pp"].get_group() if pp > 1 else None,
            built.expert_params, meshes["ep"].get_group() if meshes.expert is not None else None,
            skip_norm=tied.head_copy(built.chunks) if tie else ())
        loss_val = float(loss_t)
        if not math.isfinite(loss_val) or not math.isfinite(grad_norm):
            if cfg.train.skip_nonfinite:
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    print(f"paralayer: step {step}: non-finite loss {loss_val}; step skipped", flush=True)
                sched.step()
                continue
            raise NonFiniteLoss(f"step {step}: loss is {loss_val} (grad norm {grad_norm}); stopping. "
                                f"Lower train.lr or set train.skip_nonfinite=true to skip such steps.")
        lr = opt.param_groups[0]["lr"]
        opt.step()
        moe_step.update_bias(built.chunks, cfg, meshes)
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - t0
        rec = metrics_mod.step_record(
            step=step, loss=loss_val, lr=lr, grad_norm=grad_norm, tokens=tokens_per_step, step_time_s=step_time,
            world_size=world, flops_per_token=flops_per_token, peak_tflops=peak, device=device)
        if runner is not None and getattr(runner, "bubble_measured", None) is not None:
            rec["bubble_measured"] = runner.bubble_measured
        moe_stats = moe_step.step_stats(built.chunks, meshes, pp, cfg.model.moe.num_experts, built.device)
        if moe_stats:
            rec.update(moe_stats)
        records.append(rec)
        if logger is not None:
            logger.log(step, rec)
        saved = bool(cfg.checkpoint.every and ckpt_dir and (step % cfg.checkpoint.every == 0 or step == stop))
        if saved:
            _save(cfg, ckpt_dir, step, built, opt, sched)
        sig = preempt.agreed(device) if (preempt.active and step < stop) else None
        if sig is not None:
            if ckpt_dir and not saved:
                _save(cfg, ckpt_dir, step, built, opt, sched)
            if rank == 0:
                then = "handing the signal to the requeue" if sig == signal.SIGUSR2 else "waiting for SLURM"
                print(f"paralayer: {sig.name} after step {step}: checkpoint saved, {then}", flush=True)
            if logger is not None:
                logger.close()
            preempt.hand_on(sig)
            raise Preempted(f"stopped after step {step} on {sig.name}")
    preempt.restore()
    if runner is not None and run_dir is not None and (cfg.logging.timeline or os.environ.get("PARALAYER_TIMELINE")):
        _write_timeline(runner, meshes, run_dir)
    if logger is not None:
        logger.close()
    return records


def _maybe_inject_fault(rank: int, step: int) -> bool:
    """Test hook: PARALAYER_FAULT=raise|kill|nan:RANK:STEP makes that rank fail at that step
    (nan: its loss becomes NaN, which the global loss then carries to every rank)."""
    spec = os.environ.get("PARALAYER_FAULT")
    if not spec:
        return False
    kind, r, s = spec.split(":")
    if int(r) == rank and int(s) == step:
        when = f"at unix time {time.time():.3f}"
        if kind == "kill":
            print(f"paralayer: injecting kill -9 on rank {rank} at step {step} {when}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), 9)
        if kind == "nan":
            return True
        raise RuntimeError(f"injected fault on rank {rank} at step {step} {when}")
    return False


def _save(cfg: Config, ckpt_dir: str, step: int, built: Built, opt, sched) -> None:
    from paralayer.checkpoint import dcp as ckpt

    extra = {"step": step, "scheduler": sched.state_dict(), "rng": ckpt.rng_state()}
    ckpt.save_checkpoint(ckpt_dir, step, built.chunks, [opt], extra, keep=cfg.checkpoint.keep)


def _global_loss(loss_sum: torch.Tensor, meshes: Meshes) -> torch.Tensor:
    # Under pp the runner has already broadcast the last stage's loss to every pp rank.
    t = loss_sum.detach().float().reshape(1).clone()
    dp_cp = meshes["dp_cp"]
    if dp_cp.size() > 1:
        dist.all_reduce(t, group=dp_cp.get_group())
        t /= dp_cp.size()
    return t[0]


def _write_timeline(runner, meshes: Meshes, run_dir: str) -> None:
    from paralayer.parallel.timeline import plot_timeline

    events = runner.last_timeline
    gathered: list = [None] * meshes["pp"].size()
    dist.all_gather_object(gathered, events, group=meshes["pp"].get_group())
    if dist.get_rank() == 0:
        plot_timeline(gathered, os.path.join(run_dir, "timeline.png"))


# ------------------------------------------------------------------ entry point
def init_distributed(device_type: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo") if os.environ.get("MASTER_ADDR", "127.0.0.1") in (
            "127.0.0.1", "localhost") else None
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def main(run_dir: str) -> int:
    """Entry point of every rank: read the run directory, train, leave metrics behind."""
    cfg = config_mod.from_yaml_file(os.path.join(run_dir, "resolved.yaml"))
    with open(os.path.join(run_dir, "plan.json")) as f:
        plan = json.load(f)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    slurm_cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0)  # SLURM's share for this task
    threads = cfg.train.threads or slurm_cpus or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    device = resolve_device(plan)
    init_distributed(device.type)
    rank = dist.get_rank()
    try:
        train(cfg, plan, run_dir, log_progress=True)
        dist.barrier()
    except NonFiniteLoss as exc:
        print(f"paralayer: rank {rank}: {exc}", file=sys.stderr, flush=True)
        raise
    except Preempted:
        # SLURM ends this task (SIGTERM, then SIGKILL): wait for it, rather than end the job step
        # as if training were done
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(1)
        return 3
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)(sys.argv[1]))
