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
from paralayer.resolve import model_parts, rules
from paralayer.resolve.cost import fb_overlap, optimizer_step
from paralayer.resolve.cost import terms as cost_mod
from paralayer.resolve.cost.entry import exchanges
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
from paralayer.resolve.cost.rank_groups import timing_ranks
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
    ranks: tuple = ()  # cost.rank_groups.timing_ranks: (rank, FLOPs / the mean rank's, its group, kinds)
    rank_comm: dict = {}  # rank -> cost.comm of that rank, for the ranks in ``ranks`` (0: plan.comm)
    chunk_facts: dict = {}  # rank -> fb_overlap_facts of its two chunks, under pp_overlap


def step_shape(cfg: Config, plan) -> StepShape:
    g = plan.degrees
    work, head = layer_work(cfg)
    split = [len(s) for s in plan.stage_layers]
    rw = rank_work(work, head, split, g["pp"], plan.schedule)
    total = sum(work) + head
    imbalance = g["pp"] * max(rw) / total
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
    lay = rules.check(cfg)  # the plan's layout (resolve's), for every rank's traffic
    ranks = timing_ranks(cfg, lay, work, head)
    # rank 0's from plan.comm (its tp/pp/cp/ep; plan.comm's dp is the rank moving the most: its own here)
    rank_comm = {q[0]: dict(plan.comm, dp=cost_mod.dp_comm(cfg, lay, 0)) if q[0] == 0 else cost_mod.comm(cfg, lay, q[0])
                 for q in ranks}
    facts = {q[0]: fb_overlap_facts(cfg, lay, q[0], work, head, total) for q in ranks} \
        if getattr(plan, "pp_overlap", False) else {}
    return StepShape(imbalance, rc, kinds, ring, tuple(rank_layers), max(range(len(rw)), key=rw.__getitem__),
                     ranks, rank_comm, facts)


def fb_overlap_facts(cfg: Config, lay, r: int, work: list, head: float, total: float) -> tuple:
    """Rank r's two chunks (c0 = r, c1 = 2·pp − 1 − r) as cost/fb_overlap.py reads them: per chunk
    (its FLOPs / the mean rank's, its MoE layers, whether its forward sends its output to another
    rank, whether its backward sends its input's grad to another rank)."""
    pp = lay.pp
    out = []
    for c in (r, 2 * pp - 1 - r):
        layers = list(lay.stage_layers[c])
        w = sum(work[i] for i in layers)
        if c == lay.chunks - 1:
            w += head
            layers += model_parts.mtp_layers(cfg)
        moe = tuple(i for i in layers if mem_mod.is_moe_layer(cfg, i))
        fwd_send = c + 1 < lay.chunks and chunk_rank(c + 1, pp, lay.schedule) != r
        bwd_send = c > 0 and chunk_rank(c - 1, pp, lay.schedule) != r
        out.append((pp * w / total, moe, fwd_send, bwd_send))
    return tuple(out)


def overlap_exposure(facts: tuple, counts: tuple, work_s: float, rc: float, mm: int, t_ep: float, ep_count: float,
                     t_pp: float, pp_count: float, full_layer, sm_fraction: float) -> fb_overlap.Exposure:
    """One rank's :func:`fb_overlap.rank_exposure` from its chunk facts: ``work_s`` the mean rank's
    compute seconds per step (a chunk's is its share of it), ``rc`` the recompute fraction (it runs in
    the backward), ``t_ep``/``ep_count`` and ``t_pp``/``pp_count`` the rank's ep and pp seconds and
    collectives per step (one all-to-all, one send: their mean), ``full_layer(i)``: layer i rerun."""
    a2a = t_ep / ep_count if ep_count else 0.0
    hop = t_pp / pp_count if pp_count else 0.0
    halves = []
    for share, moe, fwd_send, bwd_send in facts:
        k = work_s * share / mm
        n_full = sum(1 for i in moe if full_layer(i))
        halves.append((fb_overlap.Half(k / 3.0, {"ep": 2 * len(moe) * a2a, "pp": fwd_send * hop}),
                       fb_overlap.Half(k * (2.0 / 3.0 + rc), {"ep": (2 * len(moe) + 2 * n_full) * a2a,
                                                               "pp": bwd_send * hop})))
    return fb_overlap.rank_exposure(counts, halves[0], halves[1], sm_fraction)


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
    base = compute + replicated_elementwise_seconds(cfg, mach, g["tp"], plan.sequence_parallel)  # the mean rank's
    work_s = base * shape.imbalance
    recomp = work_s * shape.recompute_frac
    change = plan_fp8_change(cfg, plan, shape, mach) if fp8 else None
    if change is not None:  # the FP8 GEMMs' time and their casts (cost/fp8_time.py); bf16 plans: untouched
        work_s, recomp = work_s - change.save_work, recomp - change.save_recompute
    mm = plan.microbatches
    ovh = max(mach.layer_overhead(d, e, g["tp"]) for d, e in shape.layer_kinds) * mm
    ranks = rank_seconds(cfg, plan, shape, mach, framework, base, change)
    if plan.tp_overlap:
        t_ax["tp"] = ranks[0]["comm_s"]["tp"]
    if framework.pp_scatter_gather:
        t_ax["pp"] = ranks[0]["comm_s"]["pp"]
    slowest = max(ranks, key=lambda q: q["inner_s"])  # the first of the slowest: the lowest rank
    inner = slowest["inner_s"] + ovh
    dp_sync = framework.dp_sync
    if dp_sync not in DP_SYNCS:
        raise ValueError(f"dp_sync {dp_sync!r}: one of {DP_SYNCS}")
    if dp_sync != "runtime" and plan.zero > 1:
        raise ValueError(f"dp_sync={dp_sync!r} is a Megatron data-parallel scheme: zero 0 or 1")
    # dp per pipeline rank (its own parameters' grads and gathers), exposed after the pipeline's common
    # end (the slowest rank paces every rank, so no rank's dp starts before it): the max over ranks
    rank_dp = {q[0]: dp_seconds(cfg, plan, shape, mach, dp_sync, shape.rank_comm[q[0]]["dp"], work_s + recomp, inner)
               for q in shape.ranks}
    # the rank that shows the most, then moves the most (plan.comm's dp where the exposed seconds tie), then the lowest
    dp_rank = max(rank_dp, key=lambda r: (rank_dp[r][0], rank_dp[r][1], -r))
    dp_exposed, t_ax["dp"] = rank_dp[dp_rank]
    opt_s = (optimizer_step.plan_seconds(cfg, rules.check(cfg), plan.zero, mach, plan.spans)  # muon; 0: adamw
             if cfg.train.optimizer == "muon" else 0.0)
    step = inner * (1 + plan.bubble_fraction) + dp_exposed + opt_s
    out = {"degrees": dict(g), "schedule": plan.schedule, "zero": plan.zero, "recompute": plan.recompute,
            "tp_overlap": plan.tp_overlap,
            "micro_batch": plan.micro_batch, "microbatches": mm, "step_time_s": step,
            "compute_s": compute, "imbalance": shape.imbalance, "recompute_s": recomp, "overhead_s": ovh,
            "bubble": plan.bubble_fraction, "bubble_s": inner * plan.bubble_fraction, "comm_time_s": t_ax,
            "dp_exposed_s": dp_exposed, "optimizer_s": opt_s, "memory": dict(plan.memory_per_device_bytes),
            "step_rank": slowest["rank"], "dp_rank": dp_rank,
            "rank_dp_exposed_s": [x for _, x in sorted((m, rank_dp[q["rank"]][0])
                                                       for q in ranks for m in q["members"])],
            "rank_step_time_s": [s for _, s in sorted((m, (q["inner_s"] + ovh) * (1 + plan.bubble_fraction)
                                                         + dp_exposed + opt_s) for q in ranks for m in q["members"])],
            "comm_overlap": {ax: {"comm_s": slowest["comm_s"][ax], "hidden_s": slowest["hidden_s"][ax],
                                  "exposed_s": slowest["comm_s"][ax] - slowest["hidden_s"][ax]}
                             for ax in ("tp", "pp", "cp", "ep")},
            "comm_sm_slowdown_s": slowest["slowdown_s"],
            "tokens_per_s": plan.tokens_per_step / step,
            "mfu": plan.flops_per_step / (step * mach.world * mach.peak_tflops * 1e12)}
    if change is not None:
        bf16 = time_plan(cfg, plan, mach, shape, framework, fp8=False)
        out.update(fp8_fields(step, bf16["step_time_s"], change, bf16["compute_s"] * shape.imbalance
                              + bf16["recompute_s"], matmul_share(cfg, plan, mach)))
    return out


def dp_seconds(cfg: Config, plan, shape: StepShape, mach: Machine, dp_sync: str, e: dict, window: float,
               inner: float) -> tuple[float, float]:
    """(exposed seconds, seconds on the wire) of one pipeline rank's dp entry ``e`` (cost.dp_comm) as
    ``dp_sync`` moves it; ``window``: the busiest rank's compute (what hides it, machine.dp_exposed_seconds),
    ``inner``: the step before the bubble (distopt hides some under the bubble)."""
    g = plan.degrees
    d, span = g["dp"] * g["cp"], plan.spans["dp"]
    t_dp = comm_seconds(e, span, mach, "dp")
    params = e["message_bytes"] / BYTES_PER_PARAM[plan.precision][1] if d > 1 and dp_sync != "runtime" else 0.0
    if dp_sync == "allreduce-after-fp16":  # the rank's parameters (ZeRO 0/1: one message)
        t = (mach.latency(span) + wire_factor("all-reduce", d) * 2.0 * params / mach.bandwidth(span)) if d > 1 else 0.0
        return t, t
    if dp_sync == "distopt":
        chunks = (len(plan.stage_layers) // g["pp"]) if g["pp"] > 1 else max(sum(shape.layer_kinds[0]), 1)
        t = distopt_dp_seconds(params, d, span, mach, window, plan.microbatches, inner * plan.bubble_fraction, chunks)
        return t, t
    return dp_exposed_seconds(t_dp, dp_reduce_seconds(e, span, mach), plan.zero, g["pp"], window,
                              plan.microbatches, mach), t_dp


def rank_seconds(cfg: Config, plan, shape: StepShape, mach: Machine, framework: Framework, base: float,
                 change) -> list[dict]:
    """Each pipeline rank's step before the bubble, the layer overhead and dp: its compute (its share of
    the FLOPs, FP8's change scaled from the busiest rank's) and recompute, plus its own traffic
    (``shape.rank_comm``) less what parallel.pp_overlap hides (cost/fb_overlap.py). Per rank:
    {inner_s, comm_s by axis, hidden_s by axis, slowdown_s}; the step is the max over ranks."""
    g = plan.degrees
    mm = plan.microbatches
    busiest = base * shape.imbalance
    keep_w = keep_r = 1.0
    if change is not None and busiest > 0:  # FP8's saving as a share of the busiest rank's work, every rank
        keep_w = 1.0 - change.save_work / busiest
        keep_r = (1.0 - change.save_recompute / (busiest * shape.recompute_frac)) if shape.recompute_frac else 1.0
    every = max(cfg.parallel.recompute_every, 1)

    def full_layer(i: int) -> bool:
        return plan.recompute == "full" and i % every == 0

    out = []
    for r, share, members, kinds in shape.ranks:
        comm = shape.rank_comm[r]
        work = base * share * keep_w
        recomp = base * share * shape.recompute_frac * keep_r
        t = {ax: comm_seconds(comm[ax], plan.spans[ax], mach, ax) for ax in AXES}
        if plan.tp_overlap:
            t["tp"] = tp_overlap_seconds(shape.ring_flops, *kinds,
                                         plan.micro_batch * cfg.model.seq_len / g["cp"], mm, g["tp"],
                                         cfg.model.d_model, ACT_BYTES[plan.precision],
                                         plan.recompute == "full", mach, plan.spans["tp"])
        if framework.pp_scatter_gather and g["pp"] > 1 and g["tp"] > 1 and not plan.sequence_parallel:
            e, span = comm["pp"], plan.spans["pp"]
            hop = e["message_bytes"] / g["tp"]
            t["pp"] = e["count_per_step"] * (mach.latency(span) + hop / mach.bandwidth(span)
                                             + mach.latency("intra-node")
                                             + hop * wire_factor("all-gather", g["tp"]) / mach.bandwidth("intra-node"))
        inner, hidden, slow = rank_inner(work, recomp, t, shape.chunk_facts.get(r), r, g["pp"], mm, base * keep_w,
                                         exchanges(comm["ep"]), comm["pp"]["count_per_step"],
                                         full_layer, mach.comm_sm_fraction)
        out.append({"rank": r, "members": members, "inner_s": inner, "comm_s": t,
                    "hidden_s": hidden, "slowdown_s": slow})
    return out


def rank_inner(work: float, recomp: float, t: dict, facts, rank: int, pp: int, mm: int, mean_work: float,
               ep_count: float, pp_count: float, full_layer, sm_fraction: float) -> tuple[float, dict, float]:
    """One rank's step before the bubble, the layer overhead and dp: (its work + recompute + the tp,
    pp, cp, ep seconds ``t`` left exposed + the slowdown, hidden seconds by axis, the slowdown).
    ``facts``: pipeline rank ``rank``'s fb_overlap_facts under parallel.pp_overlap (None: nothing
    hidden; the pairs are torch's, fb_overlap.pair_counts); ``mean_work``:
    the mean rank's compute per step; ``ep_count``/``pp_count``: its all-to-alls and sends per step."""
    hidden = dict.fromkeys(AXES, 0.0)
    slow = 0.0
    if facts:
        ex = overlap_exposure(facts, fb_overlap.pair_counts(pp, mm, rank), mean_work,
                              recomp / work if work else 0.0, mm, t["ep"], ep_count, t["pp"], pp_count,
                              full_layer, sm_fraction)
        hidden.update(ex.hidden_s)
        slow = ex.slowdown_s
    exposed = sum(t[ax] - hidden[ax] for ax in ("tp", "pp", "cp", "ep"))
    return work + recomp + exposed + slow, hidden, slow


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
    if cfg.train.optimizer == "muon":  # Muon's step (cost/optimizer_step.py), beside the plan's optimizer_step
        out["optimizer_s"] = t["optimizer_s"]
    for key in ("bf16_step_time_s", "fp8_gain", "step_time_by_precision"):  # train.precision=fp8 only
        if key in t:
            out[key] = t[key]
    # the step is the slowest pipeline rank's (each rank's compute and its own traffic); its traffic
    # by axis, what parallel.pp_overlap hides of it and what stays exposed (cost/fb_overlap.py)
    out.update({"step_rank": t["step_rank"], "rank_step_time_s": t["rank_step_time_s"],
                "dp_rank": t["dp_rank"], "rank_dp_exposed_s": t["rank_dp_exposed_s"],
                "comm_overlap": t["comm_overlap"], "comm_sm_slowdown_s": t["comm_sm_slowdown_s"],
                "comm_sm_fraction": mach.comm_sm_fraction})
    out.update(time_to_train(cfg, t["step_time_s"], plan.tokens_per_step, plan.world_size))
    return out


__all__ = ["Framework", "RUNTIME", "DP_SYNCS", "StepShape", "step_shape", "compute_seconds",
           "replicated_elementwise_seconds", "time_plan", "time_to_train", "plan_timing", "train_budget"]
