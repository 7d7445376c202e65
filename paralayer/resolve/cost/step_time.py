"""The cost model's step time for ONE resolved layout, and the time and cost to train with it.

Why its own file: the dry run (``resolve``), the planner's ``predict`` (the calibrations) and the
sweep report all time a single plan; the planner's ranking loop evaluates the same terms in closed
form for thousands of layouts (``paralayer.resolve.planner``). The terms are listed in the
planner's docstring; the machine side (peak, efficiency, links, overlaps) is
``paralayer.resolve.cost.machine``. Torch-free.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from paralayer.config import Config
from paralayer.resolve import memory as mem_mod
from paralayer.resolve import model_parts
from paralayer.resolve.cost import optimizer_step
from paralayer.resolve.cost import terms as cost_mod
from paralayer.resolve.cost.machine import (
    Machine,
    comm_seconds,
    distopt_dp_seconds,
    dp_exposed_seconds,
    dp_reduce_seconds,
    machine_for,
    tp_overlap_seconds,
    wire_factor,
)
from paralayer.resolve.cost.split import layer_work, rank_work
from paralayer.resolve.memory import ACT_BYTES, BYTES_PER_PARAM
from paralayer.resolve.rules import V_SCHEDULES, chunk_rank

AXES = ("tp", "pp", "cp", "ep", "dp")
SECONDS_PER_DAY = 86400.0


class StepShape(NamedTuple):
    """What of a plan the step time needs that no calibration changes (computed once per plan)."""

    imbalance: float  # FLOPs of the busiest pipeline rank / the mean
    recompute_frac: float  # recompute FLOPs / forward+backward FLOPs
    layer_kinds: list  # (dense, MoE) layers per pipeline rank
    ring_flops: tuple  # cost.tp_ring_flops under tp_overlap, else ()
    rank_layers: tuple = ()  # the blocks of each pipeline rank (MTP depths apart)
    busiest: int = 0  # the pipeline rank with the most FLOPs


def step_shape(cfg: Config, plan) -> StepShape:
    g = plan.degrees
    work, head = layer_work(cfg)
    split = [len(s) for s in plan.stage_layers]
    rw = rank_work(work, head, split, g["pp"], plan.schedule)
    imbalance = g["pp"] * max(rw) / (sum(work) + head)
    L, h, seq = cfg.model.n_layers, cfg.model.d_model, cfg.model.seq_len
    rc = cost_mod.recompute_fraction(cfg, plan.recompute, cfg.parallel.recompute_every, plan.flops_per_token)
    kinds, rank_layers = [], []
    for r in range(g["pp"]):
        layers = [i for c in range(len(plan.stage_layers)) if chunk_rank(c, g["pp"], plan.schedule) == r
                  for i in plan.stage_layers[c]]
        rank_layers.append(tuple(layers))
        if chunk_rank(len(plan.stage_layers) - 1, g["pp"], plan.schedule) == r:
            layers += model_parts.mtp_layers(cfg)  # the MTP blocks run on the last chunk's rank
        n_moe = sum(1 for i in layers if mem_mod.is_moe_layer(cfg, i))
        kinds.append((len(layers) - n_moe, n_moe))
    split = plan.schedule in V_SCHEDULES and g["pp"] > 1
    ring = cost_mod.tp_ring_flops(cfg, g["tp"], plan.recompute, split) if plan.tp_overlap else ()
    return StepShape(imbalance, rc, kinds, ring, tuple(rank_layers), max(range(len(rw)), key=rw.__getitem__))


def compute_seconds(flops_step: float, tokens_step: float, cfg: Config, mach: Machine) -> float:
    """Seconds per device of the step's model FLOPs: the matmuls at ``efficiency``, the attention
    core (12·L·h·s per token) at ``attention_efficiency``, plus the non-matmul kernels' HBM time."""
    m = cfg.model
    peak = mach.world * mach.peak_tflops * 1e12
    attn = cost_mod.attn_core_flops_per_token(cfg) * tokens_step  # windows, head widths, MLA, MTP
    att_eff = mach.attention_efficiency or mach.efficiency
    return ((flops_step - attn) / (peak * mach.efficiency) + attn / (peak * att_eff)
            + mach.elementwise_seconds(tokens_step, m.n_layers, m.d_model))


#: how the dp traffic is moved: ``runtime`` = our runtime (cost.comm's dp entry); a published row's
#: framework: ``distopt`` = Megatron-Core's distributed optimizer with overlapped grad reduce-scatter
#: and param all-gather (``machine.distopt_dp_seconds``); ``allreduce-after-fp16`` = Megatron-LM
#: 2021's local DDP: one all-reduce of the fp16 grads after the step's last backward, nothing
#: hidden (``training.train_step``: ``model.allreduce_gradients()`` after ``forward_backward_func``)
DP_SYNCS = ("runtime", "distopt", "allreduce-after-fp16")


class Framework(NamedTuple):
    """Whose software moves the traffic: our runtime (the default, what the planner ranks) or a
    published row's framework, as far as it differs in what the cost model charges.

    ``dp_sync``: one of DP_SYNCS. ``pp_scatter_gather``: Megatron-LM's scatter/gather of pipeline
    hand-offs without sequence parallelism (Narayanan et al. 2021 §4.1: each of the tp ranks sends
    1/tp of the activation across nodes, then an all-gather over NVLink rebuilds it)."""

    dp_sync: str = "runtime"
    pp_scatter_gather: bool = False


RUNTIME = Framework()


#: Korthikanti et al. 2022 (REFERENCE.md): a layer's activations are s·b·h·(10 + 24/t) bytes per
#: tp rank without sequence parallelism — the norms, dropouts and residual adds (10) run whole on
#: every tp rank, the attention and MLP blocks (24) split — and s·b·h·34/t with it.
SP_REPLICATED, SP_SPLIT = 10.0, 24.0


def replicated_elementwise_seconds(cfg: Config, mach: Machine, tp: int, sequence_parallel: bool) -> float:
    """Seconds per device per step that tp without sequence parallelism adds to the non-matmul
    kernels: their HBM bytes scale as (10 + 24/t) instead of 34/t (the norms, dropouts and residual
    adds are replicated over the tp ranks). 0 with SP or tp = 1; the step's tokens are the global batch."""
    if tp <= 1 or sequence_parallel or not mach.elementwise_bytes:
        return 0.0
    m = cfg.model
    base = mach.elementwise_seconds(cfg.train.global_batch * m.seq_len, m.n_layers, m.d_model)
    return base * ((SP_REPLICATED * tp + SP_SPLIT) / (SP_REPLICATED + SP_SPLIT) - 1.0)


def time_plan(cfg: Config, plan, mach: Machine, shape: Optional[StepShape] = None,
              framework: Framework = RUNTIME, fp8: bool = True) -> dict:
    """Predicted step time of a resolved, valid plan on ``mach``, with every term. ``framework``:
    whose traffic — the planner times our runtime's; the calibration a published row's framework's.
    Under train.precision=fp8 on a GPU the FP8 GEMMs and casts change the busiest rank's work
    (``fp8=False``: the same plan timed in bf16), and the result gains ``bf16_step_time_s``,
    ``fp8_gain`` and ``step_time_by_precision``."""
    shape = shape or step_shape(cfg, plan)
    g = plan.degrees
    compute = compute_seconds(plan.flops_per_step, plan.tokens_per_step, cfg, mach)
    t_ax = {ax: comm_seconds(plan.comm[ax], plan.spans[ax], mach, ax) for ax in AXES}
    work_s = (compute + replicated_elementwise_seconds(cfg, mach, g["tp"], plan.sequence_parallel)) * shape.imbalance
    recomp = work_s * shape.recompute_frac
    change = plan_fp8_change(cfg, plan, shape, mach) if fp8 else None
    if change is not None:  # the FP8 GEMMs' time and their casts (cost/fp8_time.py); bf16 plans: untouched
        work_s, recomp = work_s - change.save_work, recomp - change.save_recompute
    mm = plan.microbatches
    ovh = max(mach.layer_overhead(d, e, g["tp"]) for d, e in shape.layer_kinds) * mm
    if plan.tp_overlap:
        t_ax["tp"] = tp_overlap_seconds(shape.ring_flops, *shape.layer_kinds[0],
                                        plan.micro_batch * cfg.model.seq_len / g["cp"], mm, g["tp"],
                                        cfg.model.d_model, ACT_BYTES[plan.precision],
                                        plan.recompute == "full", mach, plan.spans["tp"])
    dp_sync = framework.dp_sync
    if framework.pp_scatter_gather and g["pp"] > 1 and g["tp"] > 1 and not plan.sequence_parallel:
        e, span = plan.comm["pp"], plan.spans["pp"]
        hop = e["message_bytes"] / g["tp"]
        t_ax["pp"] = e["count_per_step"] * (mach.latency(span) + hop / mach.bandwidth(span)
                                            + mach.latency("intra-node")
                                            + hop * wire_factor("all-gather", g["tp"]) / mach.bandwidth("intra-node"))
    inner = work_s + recomp + ovh + t_ax["tp"] + t_ax["pp"] + t_ax["cp"] + t_ax["ep"]
    if dp_sync not in DP_SYNCS:
        raise ValueError(f"dp_sync {dp_sync!r}: one of {DP_SYNCS}")
    d = g["dp"] * g["cp"]
    if dp_sync != "runtime" and plan.zero > 1:
        raise ValueError(f"dp_sync={dp_sync!r} is a Megatron data-parallel scheme: zero 0 or 1")
    params = (plan.comm["dp"]["message_bytes"] / BYTES_PER_PARAM[plan.precision][1]
              if d > 1 and dp_sync != "runtime" else 0.0)  # the rank's parameters (ZeRO 0/1: one message)
    if dp_sync == "allreduce-after-fp16":
        span = plan.spans["dp"]
        t_ax["dp"] = dp_exposed = (mach.latency(span) + wire_factor("all-reduce", d) * 2.0 * params
                                   / mach.bandwidth(span)) if d > 1 else 0.0
    elif dp_sync == "distopt":
        chunks = (len(plan.stage_layers) // g["pp"]) if g["pp"] > 1 else max(sum(shape.layer_kinds[0]), 1)
        t_ax["dp"] = dp_exposed = distopt_dp_seconds(params, d, plan.spans["dp"], mach, work_s + recomp, mm,
                                                     inner * plan.bubble_fraction, chunks)
    else:
        dp_exposed = dp_exposed_seconds(t_ax["dp"], dp_reduce_seconds(plan.comm["dp"], plan.spans["dp"], mach),
                                        plan.zero, g["pp"], work_s + recomp, mm, mach)
    opt_s = optimizer_step.plan_seconds(cfg, g, plan.zero, plan.stage_layers, mach, plan.spans)  # muon; 0: adamw
    step = inner * (1 + plan.bubble_fraction) + dp_exposed + opt_s
    out = {"degrees": dict(g), "schedule": plan.schedule, "zero": plan.zero, "recompute": plan.recompute,
            "tp_overlap": plan.tp_overlap,
            "micro_batch": plan.micro_batch, "microbatches": mm, "step_time_s": step,
            "compute_s": compute, "imbalance": shape.imbalance, "recompute_s": recomp, "overhead_s": ovh,
            "bubble": plan.bubble_fraction, "bubble_s": inner * plan.bubble_fraction, "comm_time_s": t_ax,
            "dp_exposed_s": dp_exposed, "optimizer_s": opt_s, "memory": dict(plan.memory_per_device_bytes),
            "tokens_per_s": plan.tokens_per_step / step,
            "mfu": plan.flops_per_step / (step * mach.world * mach.peak_tflops * 1e12)}
    if change is not None:
        bf16 = time_plan(cfg, plan, mach, shape, framework, fp8=False)
        out.update(fp8_fields(step, bf16["step_time_s"], change, bf16["compute_s"] * shape.imbalance
                              + bf16["recompute_s"], matmul_share(cfg, plan, mach)))
    return out


def plan_fp8_change(cfg: Config, plan, shape: StepShape, mach: Machine):
    """FP8's change to the plan's busiest rank (cost/fp8_time.step_change), or None: bf16 or fp32
    plans, and CPU ranks (their FP8 casts are emulated, the matmuls stay fp32)."""
    if cfg.train.precision != "fp8" or mach.kind != "gpu":
        return None
    from paralayer.resolve.cost import fp8_time

    g = plan.degrees
    layers = shape.rank_layers[shape.busiest] if shape.rank_layers else tuple(range(cfg.model.n_layers))
    full = fp8_time.full_layers(plan.recompute, cfg.parallel.recompute_every, layers)
    return fp8_time.step_change(cfg, list(layers), g["tp"], plan.micro_batch * cfg.model.seq_len / g["cp"],
                                plan.microbatches, full, mach.efficiency, *fp8_time.peaks(mach),
                                mach.hbm_bytes_per_s)


def matmul_share(cfg: Config, plan, mach: Machine) -> float:
    """The share of the step's compute that is matmuls outside the attention core, at bf16."""
    attn = cost_mod.attn_core_flops_per_token(cfg) * plan.tokens_per_step
    total = compute_seconds(plan.flops_per_step, plan.tokens_per_step, cfg, mach)
    peak = mach.world * mach.peak_tflops * 1e12
    return (plan.flops_per_step - attn) / (peak * mach.efficiency) / total if total else 0.0


def fp8_fields(step: float, bf16_step: float, change, bf16_work: float, mm_share: float) -> dict:
    """What a plan (or a planner row) at FP8 adds: its bf16 step, the gain, and the step's split by
    precision on the busiest rank — FP8 GEMMs, the GEMMs left in bf16 (the head and every block
    under ``bf16_first/last_blocks``), the casts, and the rest — and the FP8 GEMMs' time at bf16
    (``fp8_gemms_at_bf16_s``: over it, ``fp8_gemm_s`` is the rank's effective FP8/bf16 ratio)."""
    bf16_gemm = max(0.0, bf16_work * mm_share - change.bf16_of_fp8_gemm_s)
    rest = max(0.0, step - change.fp8_gemm_s - bf16_gemm - change.cast_s)
    return {"bf16_step_time_s": bf16_step, "fp8_gain": bf16_step / step,
            "step_time_by_precision": {"fp8_gemm_s": change.fp8_gemm_s, "bf16_gemm_s": bf16_gemm,
                                       "cast_s": change.cast_s, "other_s": rest,
                                       "fp8_gemms_at_bf16_s": change.bf16_of_fp8_gemm_s}}


def train_budget(cfg: Config, tokens_per_step: int) -> tuple[float, str]:
    """Tokens to train on: ``train.tokens`` when given, else ``train.steps`` × tokens per step."""
    tokens = getattr(cfg.train, "tokens", None)
    if tokens:
        return float(tokens), "train.tokens"
    return float(cfg.train.steps) * tokens_per_step, "train.steps"


def time_to_train(cfg: Config, step_time_s: float, tokens_per_step: int, world: int) -> dict:
    """Wall-clock days and device-hours for the token budget at ``step_time_s`` per step: ideal
    steps only (no failures, restarts, checkpoint stalls, evaluation or queueing)."""
    tokens, basis = train_budget(cfg, tokens_per_step)
    seconds = tokens / tokens_per_step * step_time_s
    out = {"train_tokens": tokens, "train_tokens_from": basis, "train_steps": tokens / tokens_per_step,
           "train_days": seconds / SECONDS_PER_DAY, "device_hours": seconds * world / 3600.0}
    price = getattr(cfg.cluster, "price_per_device_hour", None)
    if price is not None:
        out["train_cost"] = out["device_hours"] * float(price)
    return out


def plan_timing(cfg: Config, plan, calibration: Optional[dict] = None) -> dict:
    """The dry run's time fields for a valid plan on a GPU profile: step_time_s, tokens_per_s,
    mfu (when the peak is known), and train_days, device_hours (+ train_cost with a price)."""
    mach = machine_for(cfg, calibration)
    t = time_plan(cfg, plan, mach)
    out = {"step_time_s": t["step_time_s"], "tokens_per_s": t["tokens_per_s"],
           "mfu": t["mfu"] if plan.peak_tflops_given else None, "gpu": mach.gpu,
           "calibration": "GPU_CALIBRATION (benchmarks/calibrate_gpu.py)"}
    for key in ("bf16_step_time_s", "fp8_gain", "step_time_by_precision"):  # train.precision=fp8 only
        if key in t:
            out[key] = t[key]
    out.update(time_to_train(cfg, t["step_time_s"], plan.tokens_per_step, plan.world_size))
    return out


__all__ = ["Framework", "RUNTIME", "DP_SYNCS", "StepShape", "step_shape", "compute_seconds",
           "replicated_elementwise_seconds", "time_plan", "time_to_train", "plan_timing", "train_budget"]
