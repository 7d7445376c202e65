"""The planner at ``train.precision=fp8``: which layouts the FP8 path takes, a lower bound that
stays a bound once FP8 shortens the GEMMs, and each layout's FP8 change (cost/fp8_time.py).

Why its own module: the search (``planner.search``) stays one walk for every precision; at bf16
none of this runs (every function here answers "nothing to change"), so no bf16 plan moves.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from paralayer.config import Config
from paralayer.resolve.cost import fp8_time
from paralayer.resolve.cost.machine import Machine
from paralayer.resolve.cost.split import layer_work, rank_work
from paralayer.resolve.cost.step_time import fp8_fields, matmul_share
from paralayer.resolve.fp8 import check_fp8, fp8_layers
from paralayer.resolve.memory.autocast import autocast_copy_terms, fp8_copy_terms
from paralayer.resolve.planner.comm import tp_overlap_options
from paralayer.resolve.rules import Issue, chunk_rank


def fp8_planned(cfg: Config, mach: Machine) -> bool:
    """FP8 changes the ranking: train.precision=fp8 on a GPU profile (CPU casts are emulated)."""
    return cfg.train.precision == "fp8" and mach.kind == "gpu"


def refusal(cfg: Config, lay) -> Optional[str]:
    """Why resolve/fp8.check_fp8 refuses this layout at FP8 (None: it takes it, or bf16)."""
    if cfg.train.precision != "fp8":
        return None
    probe = dataclasses.replace(lay, tp_overlap=False, errors=[], warnings=[], notes=[])
    check_fp8(cfg, probe, Issue)
    if not probe.errors:
        return None
    return re.sub(r"=\d+", "=N", probe.errors[0].message.split(":")[0].split(" (")[0])  # one reason per rule


def overlaps(cfg: Config, options: tuple) -> tuple:
    """tp_overlap's options: the fused ring GEMMs have no FP8 cast (check_fp8 refuses them)."""
    if cfg.train.precision != "fp8":
        return options
    return tuple(o for o in options if not o) or (False,)


def bound_scale(cfg: Config, mach: Machine) -> float:
    """What multiplies a structure's bf16 lower bound so that it bounds the FP8 step too: an FP8
    GEMM takes at least min(the FLOP-time ratio, ½) of its bf16 time (fp8_time.pass_seconds: its
    operand bytes halve at most) and the casts only add, so no step shrinks below that share."""
    if not fp8_planned(cfg, mach):
        return 1.0
    eff = fp8_time.FP8_CALIBRATION["gemm_efficiency"]
    b16, b8 = fp8_time.peaks(mach)
    return min(0.5, min(b16 * eff[r] / (b8 * eff["bf16"]) for r in fp8_time.CAST_BYTES))


def busiest_layers(cfg: Config, lay) -> list[int]:
    """The blocks of the pipeline rank with the most FLOPs (the one whose work paces the step)."""
    work, head = layer_work(cfg)
    split = [len(s) for s in lay.stage_layers]
    rw = rank_work(work, head, split, lay.pp, lay.schedule)
    r = max(range(len(rw)), key=rw.__getitem__)
    return [i for c, layers in enumerate(lay.stage_layers) if chunk_rank(c, lay.pp, lay.schedule) == r
            for i in layers]


def change_fn(cfg: Config, lay, mach: Machine, seq: int) -> Optional[Callable]:
    """(micro_batch, microbatches, recompute, recompute_every) → the FP8 change of a layout of this
    structure (fp8_time.Fp8Step, cached), or None at bf16 / on CPU."""
    if not fp8_planned(cfg, mach):
        return None
    layers = busiest_layers(cfg, lay)
    b16, b8 = fp8_time.peaks(mach)
    cache: dict = {}

    def at(mb: int, mm: int, recompute: str, every: int = 1) -> fp8_time.Fp8Step:
        key = (mb, mm, recompute, every)
        if key not in cache:
            cache[key] = fp8_time.step_change(cfg, layers, lay.tp, mb * seq / lay.cp, mm,
                                              fp8_time.full_layers(recompute, every, layers), mach.efficiency,
                                              b16, b8, mach.hbm_bytes_per_s)
        return cache[key]

    return at


def setup(cfg: Config, lay, mach: Machine, seq: int) -> tuple[tuple, Optional[Callable]]:
    """A structure's tp_overlap options (planner.comm.tp_overlap_options, none at FP8) and its FP8
    change function (``change_fn``)."""
    options = tp_overlap_options(lay, mach, cfg.model.mla.kv_lora_rank > 0)
    return overlaps(cfg, options), change_fn(cfg, lay, mach, seq)


def less(change, work: float, rc_frac: float) -> tuple[float, float]:
    """(work, recompute = work · rc_frac) less what FP8 saves on them (``change`` None: as they are)."""
    if change is None:
        return work, work * rc_frac
    return work - change.save_work, work * rc_frac - change.save_recompute


def copy_saving_fn(cfg: Config, lay, zero: int) -> Optional[Callable]:
    """rank → bytes of held weights FSDP's FP8 all-gather saves (fp8_time.fp8_copy_saving), or None."""
    if cfg.train.precision != "fp8" or not fp8_time.fp8_copy_saving(cfg, lay, range(cfg.model.n_layers), zero):
        return None
    return lambda rk: fp8_time.fp8_copy_saving(cfg, lay, [i for i, _ in rk.layers], zero)


def fp8_copies_fn(cfg: Config, lay) -> Optional[Callable]:
    """(rank, head bytes) → autocast's weight copies on that rank (bytes) unless fully recomputed,
    and fully recomputed, where its FP8 blocks' Float8Linear GEMMs keep none
    (memory.autocast_copy_params with autocast.fp8_copy_terms, per held block); None at bf16."""
    if cfg.train.precision != "fp8" or not fp8_layers(cfg):
        return None
    fp8 = set(fp8_layers(cfg))
    base, f8 = autocast_copy_terms(cfg, lay)[1:], fp8_copy_terms(cfg, lay)[1:]

    def copies(rk, head: float) -> tuple[int, int]:
        per = [2 * (f8 if i in fp8 else base)[kind] for i, kind in rk.layers]
        return int(head + sum(per)), int(max([head, *per]))

    return copies


def row_fields(cfg: Config, fp8: tuple, step: float, mach: Machine, tot) -> dict:
    """A listed layout's FP8 columns: its bf16 step, the gain, the split by precision."""
    bf16_step, bf16_work, change = fp8
    share = matmul_share_tot(cfg, mach, tot)
    return fp8_fields(step, bf16_step, change, bf16_work, share)


def matmul_share_tot(cfg: Config, mach: Machine, tot) -> float:
    """matmul_share from the planner's totals (the step's FLOPs and tokens)."""
    plan = type("P", (), {"tokens_per_step": tot.gb * tot.seq, "flops_per_step": tot.flops_step})()
    return matmul_share(cfg, plan, mach)


__all__ = ["fp8_planned", "refusal", "overlaps", "bound_scale", "busiest_layers", "change_fn", "setup", "less",
           "copy_saving_fn", "fp8_copies_fn", "row_fields"]
