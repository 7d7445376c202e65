"""Memory per device: each pipeline rank's states and activations added up, and the most loaded
rank picked (usually the first stage).

Why: a layout that does not fit should be rejected before minutes of start-up, and the planner
needs the number for thousands of layouts, so this is plain arithmetic on the config (no torch).
The terms are their own modules in this package (see ``paralayer.resolve.memory``, the public face).
"""
from __future__ import annotations

from dataclasses import dataclass

from paralayer.config import Config
from paralayer.resolve.memory import muon_states, zero1
from paralayer.resolve.memory.activations import rank_activations
from paralayer.resolve.memory.autocast import autocast_copy_params
from paralayer.resolve.memory.states import rank_params, state_bytes
from paralayer.resolve.rules import Layout

GIB = 1024 ** 3


@dataclass
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int
    capacity: int | None
    reserve: int
    stage: int
    activations_saved: int = 0  # what the forward leaves for backward (activations less the recompute peak)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity - self.reserve

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total, "capacity": self.capacity,
                "activations_saved": self.activations_saved}


def rank_memory(cfg: Config, lay: Layout, r: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, activations) bytes on pipeline rank r.

    ZeRO shards over the ranks that hold the same weights: dp·cp for dense weights, the
    expert-data-parallel group dp·cp/ep for experts. Stage 1 shards the optimizer, 2 also the grads,
    3 also the weights. bf16 as the runtime runs it (:func:`precision_mode`): autocast (ZeRO 0/1)
    Z0 4+4+8, Z1 4+4+8/d, plus 2 B per weight whose bf16 copy it keeps (:func:`autocast_copy_params`);
    FSDP2 mixed precision Z2 2+4/d + (4+8)/d, Z3 (4+4+8)/d bytes per param;
    fp32 under FSDP2 Z2 4+4/d + (4+8)/d (the gathered copy beside the shard)."""
    dense, expert, _ = rank_params(cfg, lay, r)
    d_dense = lay.dp * lay.cp
    d_exp = max(d_dense // max(lay.ep, 1), 1)
    z = lay.zero

    params, grads, opt = state_bytes(dense, expert, d_dense, d_exp, z, lay.pp, lay.precision, lay.schedule)
    if z == 1 and d_dense > 1:  # the busiest data rank's share (zero1.busiest_dense): experts under ep kept apart
        opt = state_bytes(zero1.busiest_dense(cfg, lay, r), expert if lay.ep > 1 else 0.0, d_dense, d_exp, z,
                          lay.pp, lay.precision, lay.schedule)[2]
    opt = muon_states.optimizer_bytes(opt, muon_states.muon_split(cfg, lay, r), lay, z)  # train.optimizer=muon
    params = int(params) + int(2 * autocast_copy_params(cfg, lay, r))  # as the planner adds them
    if cfg.train.precision == "fp8":  # FSDP's FP8 all-gather keeps those weights gathered at 1 byte
        from paralayer.resolve.fp8 import fp8_copy_saving
        from paralayer.resolve.memory.states import rank_layers

        params -= int(fp8_copy_saving(cfg, lay, rank_layers(cfg, lay, r)))

    acts, _ = rank_activations(cfg, lay, r)
    return int(params), int(grads), int(opt), acts


def memory(cfg: Config, lay: Layout) -> Memory:
    """The most loaded pipeline rank's memory (max over ranks; ties go to the first stage)."""
    best = None
    for r in range(lay.pp):
        parts = rank_memory(cfg, lay, r)
        if best is None or sum(parts) > sum(best[1]):
            best = (r, parts)
    assert best is not None
    r, (pa, gr, op, ac) = best
    cap = cfg.cluster.device_memory_gib
    capacity = int(cap * GIB) if cap is not None else None
    reserve = int(cfg.cluster.memory_reserve_gib * GIB)
    return Memory(pa, gr, op, ac, capacity, reserve, r, rank_activations(cfg, lay, r)[1])


def gib(n: float | None) -> str:
    return "unknown" if n is None else f"{n / GIB:.2f} GiB"

