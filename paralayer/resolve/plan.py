"""The plan: one object holding everything a run needs, resolved once, before any rank starts.

Why one object: the dry run prints it, ``--json`` and ``plan.json`` serialise it, the runtime
builds its mesh and pipeline split from it, the planner ranks many of them. Nothing is re-derived
later, so nothing can disagree. Torch-free: resolving imports no torch.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Optional

from paralayer.config import Config
from paralayer.resolve import cost, memory, rules
from paralayer.resolve.rules import Issue, Layout, chunk_rank

#: Device mesh axes, outermost first, as paralayer/parallel/mesh.py builds them: tp innermost (consecutive
#: ranks, inside a node), pp outermost (across nodes) — REFERENCE.md "Layout".
MESH_ORDER = ("pp", "dp", "cp", "tp")


@dataclass
class Plan:
    world_size: int
    degrees: dict
    microbatches: int
    bubble_fraction: float
    memory_per_device_bytes: dict
    fits: bool
    parameters: dict
    comm: dict
    flops_per_token: int
    errors: list
    warnings: list
    notes: list
    valid: bool
    schedule: str
    sequence_parallel: bool
    padded_vocab_size: int
    stage_layers: list
    chunk_ranks: list
    device: str
    precision: str
    peak_tflops: Optional[float]
    peak_tflops_given: bool
    expert_grid: dict
    spans: dict
    mesh: dict
    nodes: int
    devices_per_node: int
    memory_stage: int
    memory_reserve_bytes: int
    zero: int
    recompute: str
    micro_batch: int
    global_batch: int
    tokens_per_step: int
    flops_per_step: int
    recipe: str = ""
    tp_overlap: bool = False
    pp_overlap: bool = False
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra") or {})
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """plan.json → Plan, the typed object the runtime reads (never a dict with defaults).

        Every field without a default must be present (a missing one raises, naming it); keys this
        version does not know are kept in ``extra``, so ``to_dict`` gives the same JSON back."""
        known = {f.name: f for f in fields(cls) if f.name != "extra"}
        missing = [n for n, f in known.items()
                   if n not in d and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"plan is missing {', '.join(missing)} (was it written by paralayer's resolver?)")
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**{k: v for k, v in d.items() if k in known}, extra=extra)

    @property
    def ok(self) -> bool:
        """Valid and fits: what a dry run's exit code reports."""
        return self.valid and self.fits


def plan_field(plan: Any, key: str) -> Any:
    """``key`` of a :class:`Plan` or of its JSON dict (a test's hand-made layout); a missing key is
    an error naming it, never a silent default."""
    if isinstance(plan, Plan):
        return getattr(plan, key) if key in plan.__dataclass_fields__ else plan.extra[key]
    try:
        return plan[key]
    except KeyError:
        raise KeyError(f"plan has no {key!r} (plan.json is written by paralayer's resolver)") from None


def _group(axis_sizes: dict, members: dict) -> list[int]:
    """Global ranks of the group through rank 0 that varies the axes in ``members`` (size each)."""
    strides, s = {}, 1
    for name in reversed(MESH_ORDER):
        strides[name] = s
        s *= axis_sizes[name]
    ranks = [0]
    for name, size in members.items():
        ranks = [r + i * strides[name] for r in ranks for i in range(size)]
    return ranks


def spans(lay: Layout) -> dict:
    """'intra-node' when the group through rank 0 lies in one node, else 'inter-node'."""
    sizes = {"dp": lay.dp, "pp": lay.pp, "cp": lay.cp, "tp": lay.tp}
    dpn = max(lay.devices_per_node, 1)

    def where(ranks: list[int]) -> str:
        return "intra-node" if len({r // dpn for r in ranks}) <= 1 else "inter-node"

    out = {name: where(_group(sizes, {name: sizes[name]})) for name in MESH_ORDER}
    # the expert grid: ep consecutive ranks of the flattened (dp, cp), cp fastest
    ep_cp = min(lay.ep, lay.cp) if lay.ep % max(min(lay.ep, lay.cp), 1) == 0 else lay.cp
    ep_dp = max(lay.ep // max(ep_cp, 1), 1)
    out["ep"] = where(_group(sizes, {"cp": ep_cp, "dp": ep_dp}))
    return {k: out[k] for k in ("tp", "pp", "cp", "ep", "dp")}


def _notes(cfg: Config, lay, mem) -> list[str]:
    """The plan's notes: what the layout rules said, and how memory and precision were counted."""
    notes = list(lay.notes)
    if mem.capacity is None:
        notes.append("device memory unknown (cluster.device_memory_gib is null): fits is assumed; "
                     "set cluster.device_memory_gib to check it")
    else:
        notes.append(f"fits = total <= capacity - reserve (cluster.memory_reserve_gib="
                     f"{cfg.cluster.memory_reserve_gib:g} GiB kept free)")
    if lay.precision == "bf16":
        notes.append("bf16 mixed precision as the runtime runs it: ZeRO 0/1 autocast (fp32 weights 4 B, + 2 B for "
                     "the weights whose bf16 copy backward keeps: the head, MoE blocks, and the layers' GEMMs "
                     "without sequence parallel unless fully recomputed; fp32 grads 4 B, m, v 8 B); "
                     "ZeRO 2/3 FSDP2 MixedPrecisionPolicy (fp32 shards, bf16 gathered weights under ZeRO-2, fp32 reduce) "
                     "per parameter before ZeRO sharding")
    if cfg.cluster.peak_tflops is None:
        notes.append("peak TFLOP/s unknown for this device: no MFU will be reported")
    return notes


def _sections(cfg: Config, lay: Layout, plan: Plan) -> None:
    """The plan's optional sections: ``fp8``, which GEMMs run in FP8 (the time model still counts them
    bf16); ``optimizer_step``, Muon's own step (Newton-Schulz FLOPs, the owners' moves) on its busiest
    device, apart from flops_per_token and comm (model FLOPs, MFU): resolve/cost/optimizer_step.py."""
    from paralayer.resolve.fp8 import plan_section

    if cfg.train.precision == "fp8":
        plan.extra["fp8"] = plan_section(cfg, lay)
    if plan.valid and getattr(cfg.train, "optimizer", "adamw") == "muon":
        from paralayer.resolve.cost.optimizer_step import plan_section as muon_section

        plan.extra["optimizer_step"] = muon_section(cfg, lay)


def resolve(cfg: Config, *, weigh_v: bool = True) -> Plan:
    """Config → Plan. Never raises for a bad layout: problems land in ``errors``. ``weigh_v``: under a
    V schedule, also time the lighter-end splits (``balanced_v``); False for the resolves that time
    one of them, so that they do not weigh again."""
    lay = rules.check(cfg)
    mem = memory.memory(cfg, lay)
    params = memory.parameter_counts(cfg)
    fpt = cost.flops_per_token(cfg)
    bub = cost.bubble_fraction(lay.schedule, lay.pp, lay.microbatches, lay.vpp)
    notes = _notes(cfg, lay, mem)
    warnings = list(lay.warnings)
    if not mem.fits:
        warnings.append(Issue("memory", f"needs {memory.gib(mem.total)} per device on pipeline rank {mem.stage} but "
                              f"{memory.gib(mem.capacity)} - {cfg.cluster.memory_reserve_gib:g} GiB reserve is "
                              "available; try more pp/tp, zero=3, recompute=full or a smaller micro_batch"))
    gb = cfg.train.global_batch
    tokens = gb * cfg.model.seq_len
    dp_cp = lay.dp * lay.cp
    plan = Plan(
        world_size=lay.world,
        degrees={"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp},
        microbatches=lay.microbatches,
        bubble_fraction=bub,
        memory_per_device_bytes=mem.to_dict(),
        fits=mem.fits,
        parameters=params,
        comm=dict(cost.comm(cfg, lay, with_dp=False), dp=cost.plan_dp_entry(cfg, lay)),  # dp: the rank moving most
        flops_per_token=fpt,
        errors=[i.to_dict() for i in lay.errors],
        warnings=[i.to_dict() for i in warnings],
        notes=notes,
        valid=not lay.errors,
        schedule=lay.schedule,
        sequence_parallel=lay.sequence_parallel,
        padded_vocab_size=lay.padded_vocab,
        stage_layers=lay.stage_layers,
        chunk_ranks=[chunk_rank(c, lay.pp, lay.schedule) for c in range(lay.chunks)],
        device=lay.device,
        precision=lay.precision,
        peak_tflops=cfg.cluster.peak_tflops,
        peak_tflops_given=cfg.cluster.peak_tflops is not None,
        expert_grid={"ep": lay.ep, "edp": max(dp_cp // max(lay.ep, 1), 1)},
        spans=spans(lay),
        mesh={"dim_names": list(MESH_ORDER), "shape": [lay.pp, lay.dp, lay.cp, lay.tp]},
        nodes=lay.nodes,
        devices_per_node=lay.devices_per_node,
        memory_stage=mem.stage,
        memory_reserve_bytes=mem.reserve,
        zero=lay.zero,
        recompute=lay.recompute,
        micro_batch=lay.micro_batch,
        global_batch=gb,
        tokens_per_step=tokens,
        flops_per_step=fpt * tokens,
        recipe=cfg.recipe,
        tp_overlap=lay.tp_overlap,
        pp_overlap=lay.pp_overlap,
    )
    if plan.valid and not mem.fits:  # which saved tensor makes it too big (issue 45)
        from paralayer.resolve.memory.saved_parts import largest_saved

        plan.extra["activations_by_tensor"] = largest_saved(cfg, lay, mem.stage)
    _sections(cfg, lay, plan)  # fp8 (which GEMMs run in FP8), optimizer_step (Muon's)
    if plan.valid and lay.device != "cpu":
        # the calibrated GPU time model (resolve/cost/step_time.py): step_time_s, tokens_per_s, mfu and
        # the time and device-hours to train on train.tokens (or train.steps)
        from paralayer.resolve.cost.step_time import plan_timing

        plan.extra.update(plan_timing(cfg, plan))
        if plan.degrees["pp"] > 1:  # the busiest pipeline rank, and a V's lighter-end split (issue 45)
            from paralayer.resolve.planner.v_balance import busiest_and_balanced

            plan.extra.update(busiest_and_balanced(cfg, plan, lambda c: resolve(c, weigh_v=False), weigh_v))
    from paralayer.resolve import data_plan

    data_plan.apply(cfg, plan)  # the data section: tokens and epochs per source, bad shards
    return plan


def plan_dict(cfg: Config) -> dict[str, Any]:
    return resolve(cfg).to_dict()
