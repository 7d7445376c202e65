"""The planner's records: the numbers one plan shares (Totals), one layout structure and what is
computed once for it (Structure), and one weighed layout before it becomes a row (Candidate); a
pipeline rank the memory fast path weighs (RankInfo).

Why its own module: the search (``planner``), its memory and communication fast paths
(``planner.memory``, ``planner.comm``) and the rows (``planner.rows``) all read them.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from paralayer.resolve.rules import Layout


class RankInfo(NamedTuple):
    """A pipeline rank that can be the most loaded one."""

    rank: int
    dense: float  # parameters held (after tp sharding)
    expert: float
    n_dense: int  # layers held
    n_moe: int
    last: bool  # holds the output head
    #: (global layer index, kind) of the layers held (recompute_every's choice; kind:
    #: memory.layer_kind, MoE and Gated DeltaNet)
    layers: tuple = ()
    #: per chunk held, (RoPE tables, window masks) it keeps per microbatch (memory.chunk_tables)
    tables: tuple = ((1, 0),)
    #: under a split backward (zbv, dualpipev) the (global index, kind) blocks of each chunk
    #: held, MTP's with the last: a chunk's recomputed sets are live together (memory.recompute_transient)
    split_chunks: tuple = ()
    chunk_counts: tuple = ()  # per chunk of split_chunks or il_chunks: its blocks by kind
    zero1_dense: float = 0.0  # ZeRO-1's busiest data rank's share times d (memory.zero1.busiest_dense)
    muon: tuple = ()  # train.optimizer=muon: (dense, expert) parameters Muon steps (memory.muon_states)
    kinds: tuple = ()  # layers held by kind (memory.layer_kind)
    #: under the interleaved schedule (pp > 1) the (global index, kind) blocks of each chunk held:
    #: each chunk is weighed by the microbatches it holds (memory.interleaved_flight)
    il_chunks: tuple = ()


class MemPick(NamedTuple):
    """The most loaded device of a layout: bytes and the pipeline rank."""

    total: int
    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int


class Totals(NamedTuple):
    """Model- and cluster-wide numbers every structure shares (computed once per plan)."""

    wb: int  # bytes per parameter: weights, grads, optimizer
    gbb: int
    ob: int
    ab: int  # bytes per activation element
    gb: int  # global batch (sequences)
    seq: int
    h: int
    compute: float  # seconds of the step's FLOPs (+ non-matmul kernels) per device
    flops_step: float  # model FLOPs of a step
    rc_frac: dict  # recompute mode -> extra FLOPs / step FLOPs
    avail: Optional[float]  # bytes a device may fill (capacity - reserve), None = unknown


@dataclasses.dataclass
class Structure:
    """One choice of (tp, cp, pp, dp, ep, schedule, vpp) and what is computed once for it."""

    lay: Layout
    split: list
    imbalance: float
    spans: dict
    degrees: dict
    prefix: list  # the overrides that select it
    bound: float  # a lower bound on any of its layouts' step time
    # (overlap, recompute, FSDP's bf16: fsdp_key) -> {axis: (fixed, per m)}
    per_ax: dict = dataclasses.field(default_factory=dict)
    first_pts: Optional[list] = None  # comm at recompute=none, zero first_zero (for the refined bound)
    least_bubble: float = 0.0  # the bubble at the most microbatches the global batch allows
    optimizer_s: dict = dataclasses.field(default_factory=dict)  # zero -> Muon's step (cost.optimizer_step)
    # (recompute, FSDP key) -> (cost.rank_groups.timing_ranks, {rank: {axis or n_ep/n_pp: (fixed, per m)}})
    rank_lines: dict = dataclasses.field(default_factory=dict)
    work_head: tuple = ()  # cost.split.layer_work, once per structure
    fb_facts: dict = dataclasses.field(default_factory=dict)  # rank -> step_time.fb_overlap_facts (pp_overlap)
    rank_memo: dict = dataclasses.field(default_factory=dict)  # planner.comm.comm_points' per-rank seconds
    inner_memo: dict = dataclasses.field(default_factory=dict)  # planner.rank_time.inner_of's per-m seconds
    #: the same degrees with other splits (planner.v_balance: a V's end chunks lighter); each layout
    #: is listed once, with the split of the least predicted step
    variants: list = dataclasses.field(default_factory=list)

    @property
    def pp_layout(self) -> Optional[list]:
        return self.split if (self.lay.pp > 1 and len(set(self.split)) > 1) else None


class Candidate(NamedTuple):
    """One listed layout before it becomes the output dict (``_materialise``)."""

    step: float
    key: int  # index of its Structure
    zero: int
    mb: int
    mm: int
    recompute: str
    mem: MemPick
    fixed: float  # tp + pp + cp + ep seconds: the part independent of m (tp_overlap's included)
    per_m: float  # ... and per microbatch
    t_dp: float
    dp_exposed: float
    bubble: float
    recomp: float
    bubble_s: float
    imb_s: float
    ovh: float
    overlap: bool
    t_tp: float
    every: int = 1  # recompute=full: parallel.recompute_every (1: every layer)
    fp8: Optional[tuple] = None  # train.precision=fp8: (bf16 step, bf16 work + recompute, fp8_time.Fp8Step)

