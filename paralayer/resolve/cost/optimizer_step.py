"""The optimizer step's own work under ``train.optimizer=muon`` (torch-free): the Newton-Schulz GEMMs
a rank runs as owner, plus the moves that bring its matrices whole and give the parts back
(paralayer/optim/owners.py). AdamW's step is elementwise and not charged (0 here, as before).

One list of Muon's matrices (:func:`block_matrices`: every matrix of a block, as optim/muon.py's
``uses_muon`` picks them, with how tp places each) feeds two figures:

- :func:`rank_step`, one device's EXACT step, as the runtime runs it (optim/muon.py ``_kind``):
  replicas owned over dp·cp and broadcast (ZeRO 0), FSDP's row shards sent to their owner and back
  by two all-to-alls (ZeRO 2/3; experts over expert-dp), ZeRO-1's whole-parameter shares (no move
  of Muon's own), tp's column-parallel rows owned over tp (two all-to-alls), its row-parallel and
  FSDP·tp matrices gathered whole on every rank; owners dealt by cost, largest first, per group.
  Its FLOPs and per-axis bytes are the plan's ``optimizer_step`` (the busiest device) and what the
  rehearsal compares per rank, beside (never inside) ``flops_per_token`` and ``comm``.
- :func:`plan_seconds`, the time model's ``optimizer_s`` (inside ``step_time_s``; the planner ranks
  Muon layouts with it): the same step of the BUSIEST device timed — its FLOPs at the achieved
  rate, each collective's bytes × wire_factor over its group's bandwidth (:func:`rank_seconds`, the
  max over every pipeline rank, dp·cp place and tp place). Before it was the MEAN owner's
  share with tp's matrices whole on every tp rank (docs/planner.md "Muon's step in the plan").

Per matrix of m × n (k = min, K = max) one Newton-Schulz step is X Xᵀ (2k²K), its square (2k³) and
the product back (2k²K) FLOPs: ``ns_steps``·(4k²K + 2k³); moves are fp32 (4 B) per element.
QK-clip (``train.muon.qk_clip_tau``) adds its max-logit GEMM (:func:`max_logit_flops`) at the
attention core's rate.
"""
from __future__ import annotations

import collections
import functools
import heapq

from paralayer.config import Config
from paralayer.resolve.memory.muon_states import (  # noqa: F401 - the matrix list, re-exported
    Matrix,
    _ns_flops,
    _tp_numel,
    block_matrices,
    ffn_matrices,
    mixer_matrices,
    rank_matrices,
)

MOMENTUM_BYTES = 4


class PerZero(dict):
    """{zero: :func:`plan_seconds`}, each computed when first asked (the planner times few of a
    structure's ZeRO stages); ``of(zero)`` the seconds."""

    def __init__(self, of) -> None:
        super().__init__()
        self.of = of

    def __missing__(self, zero: int) -> float:
        self[zero] = self.of(zero)
        return self[zero]

    def get(self, zero: int, default: float = 0.0) -> float:
        return self[zero]


def plan_seconds(cfg: Config, lay, zero: int, mach, spans: dict, cache: dict | None = None) -> float:
    """Muon's step in the step time (``optimizer_s``): the BUSIEST device's :func:`rank_step` timed
    (:func:`rank_seconds`, the max over pipeline ranks, each over every dp·cp and tp place), plus
    QK-clip's max logit of that rank's attentions (:func:`max_logit_flops`) at the attention core's
    rate; ``lay`` the layout (its chunk → rank map, MTP on the last chunk's rank) with ``zero`` for
    its ZeRO stage, on ``mach`` (cost.machine.Machine) and the axes' ``spans``; 0 under AdamW.
    ``cache``: {key: seconds} per distinct pipeline rank (the planner's, over its structures)."""
    if getattr(cfg.train, "optimizer", "adamw") != "muon":
        return 0.0
    import copy

    from paralayer.resolve import model_parts as parts
    from paralayer.resolve.memory.states import rank_chunks

    if lay.zero != zero:
        lay = copy.copy(lay)
        lay.zero = zero
    flop_s = mach.peak_tflops * 1e12 * mach.efficiency
    attn_s = mach.peak_tflops * 1e12 * (mach.attention_efficiency or mach.efficiency)
    inter = "inter-node" in (spans.get("dp"), spans.get("cp"))  # the dp·cp group's span
    wire_s = {"dp": 1.0 / mach.bandwidth("inter-node" if inter else "intra-node"),
              "tp": 1.0 / mach.bandwidth(spans.get("tp", "intra-node"))}
    cache = {} if cache is None else cache
    best = 0.0
    for r in range(max(lay.pp, 1)):
        held = [(c, i) for c in rank_chunks(lay, r) for i in list(lay.stage_layers[c])
                + (parts.mtp_layers(cfg) if c == lay.chunks - 1 else [])]
        if "kinds" not in cache:  # what a block's matrices and ZeRO-1's sizes depend on
            cache["kinds"] = [(parts.is_linear_layer(cfg, i), parts.is_moe_layer(cfg, i), i >= cfg.model.n_layers)
                              for i in range(cfg.model.n_layers + len(parts.mtp_layers(cfg)))]
        key = (tuple((c == 0, c == lay.chunks - 1, cache["kinds"][i]) for c, i in held), lay.tp, lay.dp, lay.cp,
               lay.ep, zero, lay.pp > 1, lay.padded_vocab, flop_s, tuple(wire_s.values()))
        if key not in cache:
            attentions = sum(1 for _, i in held if not parts.is_linear_layer(cfg, i))  # QK-clip's, MTP's too
            cache[key] = (rank_seconds(cfg, lay, r, flop_s, wire_s, cache)
                          + max_logit_flops(cfg, {"tp": lay.tp, "dp": lay.dp, "cp": lay.cp}, attentions) / attn_s)
        best = max(best, cache[key])
    return best


def max_logit_flops(cfg: Config, degrees: dict, n_layers: int) -> float:
    """QK-clip's (``train.muon.qk_clip_tau``) extra work per step on a rank holding ``n_layers``: the
    max logit's q·kᵀ (paralayer/model/max_logit.py), the whole s × s of each of its heads (the mask
    is applied after, no causal half skipped), once per sequence of its data share; 0 when off. Its
    all-reduce (one float per head and layer), the K all-gather under cp and the rescale of W_q/W_k
    rows are not charged."""
    if getattr(cfg.train.muon, "qk_clip_tau", None) is None:
        return 0.0
    m = cfg.model
    d_qk = (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim if m.mla.kv_lora_rank > 0
            else (m.head_dim or m.d_model // m.n_heads))
    seqs = cfg.train.global_batch / max(int(degrees["dp"]), 1)
    cp = max(int(degrees.get("cp", 1)), 1)  # the rank's s/cp queries against the whole sequence's keys
    return n_layers * seqs * 2.0 * (m.n_heads / int(degrees["tp"])) * m.seq_len ** 2 / cp * d_qk


# ------------------------------------------------------------------ one device's exact figures
def placement(mx: Matrix, lay, zero: int) -> tuple[str, str]:
    """(kind, group) of paralayer/optim/muon.py ``_kind`` for ``mx`` on this layout: "local" (its
    Newton-Schulz on every holder), "replicas" (one owner of dp·cp, broadcast), "rows" (one owner of
    the group, two all-to-alls: FSDP's row shards, tp's column-parallel rows) or "gather" (whole on
    every rank: DTensor's full_tensor over the group's axes, "dp+tp" for FSDP over tp's shards)."""
    d = lay.dp * lay.cp
    fsdp = zero >= 2 and d > 1
    if lay.tp > 1 and mx.tp:
        if fsdp:
            return ("gather", "dp" if mx.tp == "rep" else "dp+tp")
        return {"col": ("rows", "tp"), "row": ("gather", "tp")}.get(mx.tp, ("local", ""))
    if mx.expert and lay.ep > 1:
        return ("rows", "edp") if fsdp and d // lay.ep > 1 else ("local", "")
    if d == 1 or zero == 1:
        return ("local", "")
    return ("rows", "dp") if fsdp else ("replicas", "dp")


def owners(costs: list, world: int) -> list:
    """paralayer/optim/owners.py ``assign_owners``: largest cost first, to the least loaded rank
    (ties to the lower rank, then the earlier matrix); a heap, as groups reach thousands of ranks."""
    heap = [(0, k) for k in range(world)]
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, k = heapq.heappop(heap)
        out[i] = k
        heapq.heappush(heap, (load + costs[i], k))
    return out


def zero1_owners(cfg: Config, lay, r: int, mats: list) -> list:
    """ZeRO-1: the data rank whose share holds each matrix of ``mats`` (-1: every rank's, the experts
    under ep), dealt as the runtime deals whole parameters (paralayer/parallel/data.py
    ZeroOneOptimizer: by local size, largest first, in parameter order, to the least loaded rank;
    resolve/memory/zero1.py lists the sizes). Each matrix takes the first free parameter of its size
    in that list: exact unless two tensors of one size differ in kind."""
    from paralayer.resolve.memory import zero1

    sizes = zero1.dense_sizes(cfg, lay, r)
    dealt = [0] * len(sizes)
    heap = [(0, k) for k in range(lay.dp * lay.cp)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, k = heapq.heappop(heap)
        dealt[i] = k
        heapq.heappush(heap, (load + sizes[i], k))
    free: dict = {}
    for i, s in enumerate(sizes):
        free.setdefault(s, []).append(i)
    out = []
    for mx in mats:
        if mx.expert and lay.ep > 1:
            out.append(-1)
            continue
        slots = free.get(_tp_numel(mx, lay.tp))
        if not slots:
            raise ValueError(f"muon: {mx} has no parameter of its size on pipeline rank {r} (resolve/memory/zero1.py)")
        out.append(dealt[slots.pop(0)])
    return out


def _rows_numel(mx: Matrix, world: int, k: int) -> int:
    """Elements of rank ``k``'s row shard (dim 0: a stack's experts, a matrix's rows), torch.chunk's
    split as FSDP2's Shard(0) and tp's column-parallel weights deal them (owners.py row_range)."""
    dims = (mx.stack, mx.rows, mx.cols) if mx.stack > 1 else (mx.rows, mx.cols)
    size = -(-dims[0] // world)
    a, b = min(k * size, dims[0]), min((k + 1) * size, dims[0])
    return (b - a) * (mx.numel // dims[0])


def rank_step(cfg: Config, lay, r: int, dp_index: int = 0, tp_index: int = 0) -> dict:
    """Muon's step on ONE device of pipeline rank ``r`` (``dp_index`` its place in dp·cp, ``tp_index``
    in tp), as paralayer/optim/muon.py runs it: ``flops`` (the Newton-Schulz GEMMs, what the
    rehearsal's counter sees) and ``collectives`` [{axis, kind, message_bytes, count}] in the
    rehearsal's convention (a broadcast's buffer, an all-to-all's input, a gather's whole tensor;
    fp32, as the momentum update). Owners are dealt over the matrices' costs per group (owners.py)."""
    steps, d, tp, zero = cfg.train.muon.ns_steps, lay.dp * lay.cp, lay.tp, lay.zero
    mats = rank_matrices(cfg, lay, r)
    if zero == 1 and d > 1:
        mats = [mx for mx, o in zip(mats, zero1_owners(cfg, lay, r, mats)) if o in (dp_index, -1)]
    kinds: dict = {}
    for mx in mats:
        kinds.setdefault(placement(mx, lay, zero), []).append(mx)
    ep = max(lay.ep, 1)
    where = {"dp": (d, dp_index), "edp": (max(d // ep, 1), dp_index // ep), "tp": (tp, tp_index)}
    flops, rows = 0.0, {}

    def add(axis: str, kind: str, elems: float) -> None:
        key = (axis, kind, int(MOMENTUM_BYTES * elems))
        rows[key] = rows.get(key, 0) + 1

    for (kind, group), ms in kinds.items():
        if kind in ("local", "gather"):
            flops += sum(mx.flops(steps) for mx in ms)
        if kind == "gather":  # DTensor's full_tensor: an all-gather per sharded axis, the whole on the last
            for mx in ms:
                if group == "dp+tp":  # FSDP's rows of tp's shard: a column-parallel one gathers dp first
                    first, last = ("dp", "tp") if mx.tp == "col" else ("tp", "dp")
                    add(first, "all-gather", mx.numel / (tp if first == "dp" else d))
                    add(last, "all-gather", mx.numel)
                else:
                    add("tp" if group == "tp" else "dp", "all-gather", mx.numel)
        if kind in ("local", "gather"):
            continue
        world, me = where[group]
        own = owners([mx.cost for mx in ms], world)
        flops += sum(mx.flops(steps) for mx, o in zip(ms, own) if o == me)
        axis = "tp" if group == "tp" else "dp"
        if kind == "replicas":  # one broadcast per owner with matrices, on every rank of the group
            for k in sorted(set(own)):
                add(axis, "broadcast", sum(mx.numel for mx, o in zip(ms, own) if o == k))
        else:  # its row shards to the owners, then its owned matrices' rows back to every rank
            add(axis, "all-to-all", sum(_rows_numel(mx, world, me) for mx in ms))
            add(axis, "all-to-all", sum(mx.numel for mx, o in zip(ms, own) if o == me))
    return {"flops": flops, "collectives": [{"axis": a, "kind": k, "message_bytes": b, "count": n}
                                            for (a, k, b), n in sorted(rows.items())]}


@functools.lru_cache(maxsize=256)
def _wire(kind: str, n: int) -> float:
    from paralayer.resolve.cost.machine import wire_factor

    return MOMENTUM_BYTES * wire_factor(kind, n)


@functools.lru_cache(maxsize=4096)  # the planner meets one group's matrices on many layouts
def _index_seconds(ms: tuple, kind: str, world: int, steps: int, flop_s: float, wire_s: float) -> tuple:
    """Seconds of each place k of a group's owners (:func:`rank_step`'s "replicas"/"rows" terms): its
    owned matrices' Newton-Schulz, and its moves' bytes through its link (wire_factor) — a broadcast
    per owner (every place carries all), or its row shards and its owned matrices (two all-to-alls)."""
    out = [0.0] * world
    own = owners([mx.cost for mx in ms], world)
    for mx, o in zip(ms, own):
        out[o] += mx.flops(steps) / flop_s
    if kind == "replicas":
        moved = _wire("broadcast", world) * sum(mx.numel for mx in ms) * wire_s
        return tuple(x + moved for x in out)
    w = _wire("all-to-all", world) * wire_s
    shard = [0.0] * (world + 1)  # torch.chunk's row shards (_rows_numel), as a difference array
    for mx, o in zip(ms, own):
        out[o] += mx.numel * w
        dim0 = mx.stack if mx.stack > 1 else mx.rows
        size, per = -(-dim0 // world), mx.numel // dim0
        full = dim0 // size
        shard[0] += size * per * w
        shard[full] -= size * per * w
        if full < world:
            shard[full] += (dim0 - full * size) * per * w
            shard[full + 1] -= (dim0 - full * size) * per * w
    run = 0.0
    for k in range(world):
        run += shard[k]
        out[k] += run
    return tuple(out)


def _mats_seconds(mats: list, lay, steps: int, flop_s: float, wire_s: dict) -> float:
    """The most seconds of any device holding ``mats`` (one pipeline rank's, or one ZeRO-1 share's):
    what every device runs and moves, plus the busiest dp·cp place's owned work (dp and expert-dp
    together: place j is expert-dp place j // ep) and the busiest tp place's (independent of j)."""
    d, tp, ep = lay.dp * lay.cp, lay.tp, max(lay.ep, 1)
    common, groups, place = 0.0, {}, {}
    for mx in mats:
        if mx not in place:
            place[mx] = placement(mx, lay, lay.zero)
        kind, group = place[mx]
        if kind in ("replicas", "rows"):
            groups.setdefault((kind, group), []).append(mx)
    for mx, count in collections.Counter(mats).items():  # what every device runs and moves, per shape
        kind, group = place[mx]
        if kind not in ("local", "gather"):
            continue
        each = mx.flops(steps) / flop_s
        if group == "dp+tp":  # a gather
            first = "dp" if mx.tp == "col" else "tp"
            each += _wire("all-gather", d) * mx.numel / (tp if first == "dp" else 1) * wire_s["dp"]
            each += _wire("all-gather", tp) * mx.numel / (1 if first == "dp" else d) * wire_s["tp"]
        elif kind == "gather":
            n, ax = (tp, "tp") if group == "tp" else (d, "dp")
            each += _wire("all-gather", n) * mx.numel * wire_s[ax]
        common += count * each
    size = {"dp": d, "edp": max(d // ep, 1), "tp": tp}
    per = {g: _index_seconds(tuple(ms), k, size[g], steps, flop_s, wire_s["tp" if g == "tp" else "dp"])
           for (k, g), ms in groups.items()}
    dp, edp, tps = per.get("dp"), per.get("edp"), per.get("tp", (0.0,))
    data = (max(dp[j] + edp[j // ep] for j in range(d)) if dp and edp else max(dp or edp or (0.0,)))
    return common + data + max(tps)


def rank_seconds(cfg: Config, lay, r: int, flop_s: float, wire_s: dict, memo: dict | None = None) -> float:
    """The most seconds of :func:`rank_step` over every device of pipeline rank ``r``: its FLOPs at
    ``flop_s`` and each collective's bytes through the device's link (``wire_s``: seconds per byte
    of the dp·cp and tp groups). Exact, without stepping every device: the dp·cp and tp places part
    additively (each group's owners dealt once), except ZeRO-1's shares, taken one by one."""
    steps, d = cfg.train.muon.ns_steps, lay.dp * lay.cp
    mats = rank_matrices(cfg, lay, r, memo)
    if lay.zero != 1 or d == 1:
        return _mats_seconds(mats, lay, steps, flop_s, wire_s)
    shares: dict = {}  # ZeRO-1: place j's share (-1: the experts under ep, every place's, all local)
    for mx, o in zip(mats, zero1_owners(cfg, lay, r, mats)):
        shares.setdefault(o, []).append(mx)
    if lay.tp == 1:  # every matrix local: a share's own Newton-Schulz, no move
        load = {o: sum(mx.flops(steps) for mx in ms) for o, ms in shares.items()}
        return (load.pop(-1, 0.0) + max(load.values(), default=0.0)) / flop_s
    every = _mats_seconds(shares.pop(-1, []), lay, steps, flop_s, wire_s)
    return every + max([_mats_seconds(list(ms), lay, steps, flop_s, wire_s)  # alike shares once
                        for ms in {tuple(v) for v in shares.values()}] + [0.0])


def _busiest_dp_index(cfg: Config, lay, r: int) -> int:
    """The place in dp·cp whose busiest device on pipeline rank ``r`` runs the most Newton-Schulz FLOPs
    (ties: the lowest): its ZeRO-1 share's on its busiest tp place (the share's row-parallel matrices
    run whole on every tp rank, its column-parallel ones are owned over tp: not the share's sum), or
    its owned matrices' over dp·cp and expert-dp (apart from tp's places: they add)."""
    steps, d, ep = cfg.train.muon.ns_steps, lay.dp * lay.cp, max(lay.ep, 1)
    if d == 1:
        return 0
    mats = rank_matrices(cfg, lay, r)
    work = [0.0] * d
    if lay.zero == 1:  # the experts under ep (-1) are every place's: left out of the comparison
        shares: dict = {}
        for mx, o in zip(mats, zero1_owners(cfg, lay, r, mats)):
            shares.setdefault(o, []).append(mx)
        for j, ms in shares.items():
            if j >= 0:
                work[j] = _mats_seconds(ms, lay, steps, 1.0, {"dp": 0.0, "tp": 0.0})
        return max(range(d), key=lambda j: (work[j], -j))
    for group, world, index in (("dp", d, lambda j: j), ("edp", max(d // ep, 1), lambda j: j // ep)):
        ms = [mx for mx in mats if placement(mx, lay, lay.zero)[1] == group
              and placement(mx, lay, lay.zero)[0] in ("replicas", "rows")]
        if not ms:
            continue
        loads = [0.0] * world
        for mx, o in zip(ms, owners([mx.cost for mx in ms], world)):
            loads[o] += mx.flops(steps)
        for j in range(d):
            work[j] += loads[index(j)]
    return max(range(d), key=lambda j: (work[j], -j))


def plan_section(cfg: Config, lay) -> dict:
    """The plan's ``optimizer_step`` under Muon: :func:`rank_step` of the busiest device (the most
    Newton-Schulz FLOPs: over the pipeline ranks, its busiest dp·cp place, then tp place), its
    ``flops``, ``comm_bytes`` {axis: payload bytes per step} and where it is. Kept apart from
    ``flops_per_token`` and ``comm``: MFU stays model FLOPs."""
    best = None
    for r in range(lay.pp):
        j = _busiest_dp_index(cfg, lay, r)
        for t in range(lay.tp):
            s = rank_step(cfg, lay, r, j, t)
            if best is None or s["flops"] > best[0]["flops"]:
                best = (s, r, j, t)
    s, r, j, t = best
    comm: dict = {}
    for row in s["collectives"]:
        comm[row["axis"]] = comm.get(row["axis"], 0) + row["message_bytes"] * row["count"]
    return {"flops": s["flops"], "comm_bytes": comm, "pp_rank": r, "dp_index": j, "tp_index": t,
            "ns_steps": cfg.train.muon.ns_steps}


def zero1_muon_elements(cfg: Config, lay, r: int, index: int) -> int:
    """ZeRO-1: the elements (after tp) of the Muon matrices in data rank ``index``'s share on pipeline
    rank ``r`` (:func:`zero1_owners`; the experts kept under ep apart): what holds one momentum
    instead of AdamW's two moments (the rehearsal's exact share, resolve/memory/muon_states.py)."""
    mats = rank_matrices(cfg, lay, r)
    return sum(_tp_numel(mx, lay.tp) for mx, o in zip(mats, zero1_owners(cfg, lay, r, mats)) if o == index)
