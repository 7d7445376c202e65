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
- :func:`mean_step`, the time model's (``optimizer_s``, the planner's ranking; unchanged): the MEAN
  owner's share of the stage's attention layers (1/(dp·cp) of the dense work at tp = 1, whole
  matrices on every tp rank at tp > 1; experts on their ep rank, over expert-dp under ZeRO 2/3) and
  the bytes through its link (ZeRO 0: (d−1)/d of the Muon matrices; ZeRO 2/3: two all-to-alls of
  (d−1)/d of its shard; ZeRO-1 none; tp > 1: (tp−1)/tp of each matrix). Where it and rank_step part:
  docs/planner.md "Muon's step in the plan".

Per matrix of m × n (k = min, K = max) one Newton-Schulz step is X Xᵀ (2k²K), its square (2k³) and
the product back (2k²K) FLOPs: ``ns_steps``·(4k²K + 2k³); moves are fp32 (4 B) per element.
QK-clip (``train.muon.qk_clip_tau``) adds its max-logit GEMM (:func:`max_logit_flops`) at the
attention core's rate.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple

from paralayer.config import Config

MOMENTUM_BYTES = 4


def _ns_flops(m: int, n: int, steps: int) -> float:
    k, big = min(m, n), max(m, n)
    return steps * (4.0 * k * k * big + 2.0 * k ** 3)


def layer_matrices(cfg: Config, moe: bool) -> tuple[list, list]:
    """(dense matrices, one expert's matrices) of an attention layer, as (rows, cols), before tp:
    :func:`block_matrices`' (the one list of Muon's matrices), the time model's per-layer terms."""
    mats = mixer_matrices(cfg, False) + ffn_matrices(cfg, moe, 1, biases=False)
    return [(x.rows, x.cols) for x in mats if not x.expert], [(x.rows, x.cols) for x in mats if x.expert]


def layer_terms(cfg: Config, moe: bool) -> tuple[float, float, float]:
    """(dense NS FLOPs, dense elements, one expert's NS FLOPs) of a layer, before tp."""
    steps = cfg.train.muon.ns_steps
    dense, expert = layer_matrices(cfg, moe)
    return (sum(_ns_flops(r, c, steps) for r, c in dense), float(sum(r * c for r, c in dense)),
            sum(_ns_flops(r, c, steps) for r, c in expert))


def mean_step(cfg: Config, degrees: dict, zero: int, n_dense: int, n_moe: int, terms: dict) -> dict:
    """The time model's Muon work on a rank holding ``n_dense`` dense and ``n_moe`` MoE layers
    (``terms``: {is_moe: :func:`layer_terms`}), the MEAN owner's (module docstring): ``flops`` and the
    bytes through this device's link, ``wire_bytes`` {tp, dp}. :func:`rank_step` is one device's exact
    figure (the rehearsal's, and the plan's ``optimizer_step``)."""
    tp, ep = int(degrees["tp"]), int(degrees["ep"])
    d = int(degrees["dp"]) * int(degrees["cp"])
    d_exp = max(d // max(ep, 1), 1)
    share = 1.0 if tp > 1 else 1.0 / d
    flops = elems_dense = 0.0
    for moe, n in ((False, n_dense), (True, n_moe)):
        if n:
            f_dense, elems, f_expert = terms[moe]
            flops += n * share * f_dense
            elems_dense += n * elems
            flops += n * f_expert * cfg.model.moe.num_experts / max(ep, 1) / (d_exp if zero >= 2 else 1)
    wire = {"tp": 0.0, "dp": 0.0}
    if tp > 1:
        wire["tp"] = MOMENTUM_BYTES * elems_dense * (tp - 1) / tp
    elif d > 1 and zero == 0:
        wire["dp"] = MOMENTUM_BYTES * elems_dense * (d - 1) / d
    elif d > 1 and zero >= 2:
        wire["dp"] = 2 * MOMENTUM_BYTES * elems_dense / d * (d - 1) / d
    return {"flops": flops, "wire_bytes": wire}


def muon_step_seconds(cfg: Config, degrees: dict, zero: int, n_dense: int, n_moe: int, terms: dict,
                      flop_s: float, dp_bandwidth: float, tp_bandwidth: float) -> float:
    """Seconds per step of :func:`mean_step`: ``flop_s`` the achieved FLOP/s, the bandwidths bytes/s
    of the dp and tp spans."""
    work = mean_step(cfg, degrees, zero, n_dense, n_moe, terms)
    seconds = work["flops"] / flop_s
    if int(degrees["tp"]) > 1:
        seconds += work["wire_bytes"]["tp"] / tp_bandwidth
    return seconds + work["wire_bytes"]["dp"] / dp_bandwidth


def plan_seconds(cfg: Config, degrees: dict, zero: int, stage_layers: list, mach, spans: dict) -> float:
    """:func:`muon_step_seconds` of the pipeline rank with the most matrices (chunk c on rank c mod pp),
    on ``mach`` (cost.machine.Machine) and the axes' ``spans``; 0 under AdamW."""
    if getattr(cfg.train, "optimizer", "adamw") != "muon":
        return 0.0
    from paralayer.resolve.model_parts import is_moe_layer

    pp = max(int(degrees["pp"]), 1)
    counts = [[0, 0] for _ in range(pp)]
    for c, layers in enumerate(stage_layers):
        for i in layers:
            counts[c % pp][1 if is_moe_layer(cfg, i) else 0] += 1
    terms = {moe: layer_terms(cfg, moe) for moe in (False, True)}
    flop_s = mach.peak_tflops * 1e12 * mach.efficiency
    attn_s = mach.peak_tflops * 1e12 * (mach.attention_efficiency or mach.efficiency)
    dp_bw, tp_bw = mach.bandwidth(spans.get("dp", "intra-node")), mach.bandwidth(spans.get("tp", "intra-node"))
    return max(muon_step_seconds(cfg, degrees, zero, nd, nm, terms, flop_s, dp_bw, tp_bw)
               + max_logit_flops(cfg, degrees, nd + nm) / attn_s for nd, nm in {tuple(c) for c in counts})


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
class Matrix(NamedTuple):
    """A matrix (or a stack of them) Muon steps on a pipeline rank, whole (before tp; an expert
    stack holds the rank's E/ep experts). ``tp``: how tensor parallel places it — "col"
    (ColwiseParallel: its rows split), "row" (RowwiseParallel: its columns split), "rep" (a Replicate
    DTensor: MLA's down-projections, MTP's projection, the delta rule's conv) or "" (a plain tensor:
    the MoE block, which tp leaves whole); ``expert``: held per ep rank."""

    stack: int
    rows: int
    cols: int
    tp: str
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.stack * self.rows * self.cols

    def flops(self, steps: int) -> float:
        return self.stack * _ns_flops(self.rows, self.cols, steps)

    @property
    def cost(self) -> int:  # paralayer/optim/owners.py ns_cost: the owners' balance
        return self.stack * self.rows * self.cols * min(self.rows, self.cols)


def mixer_matrices(cfg: Config, linear: bool) -> list:
    """The token mixer's Muon matrices, in the module's order: a Gated DeltaNet's
    (model/linear/gated_deltanet.py: its depthwise conv weight, C × 1 × K, a stack of 1 × K), MLA's or
    attention's (q with Qwen3-Next's gate rows under ``model.attn_gate``)."""
    m = cfg.model
    h = m.d_model
    if linear:
        li = m.linear
        hk, hv, dk, dv = li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim
        return [Matrix(1, 2 * hk * dk + 2 * hv * dv, h, "col"), Matrix(1, 2 * hv, h, "col"),
                Matrix(2 * hk * dk + hv * dv, 1, li.conv_kernel, "rep"), Matrix(1, h, hv * dv, "row")]
    if m.mla.kv_lora_rank > 0:
        a, nh = m.mla, m.n_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = ([Matrix(1, nh * qk, h, "col")] if a.q_lora_rank is None else
             [Matrix(1, a.q_lora_rank, h, "rep"), Matrix(1, nh * qk, a.q_lora_rank, "col")])
        return q + [Matrix(1, a.kv_lora_rank + a.qk_rope_head_dim, h, "rep"),
                    Matrix(1, nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, "col"),
                    Matrix(1, h, nh * a.v_head_dim, "row")]
    hd = m.head_dim or h // m.n_heads
    return [Matrix(1, (2 if m.attn_gate else 1) * m.n_heads * hd, h, "col"), Matrix(1, m.n_kv_heads * hd, h, "col"),
            Matrix(1, m.n_kv_heads * hd, h, "col"), Matrix(1, h, m.n_heads * hd, "row")]


def ffn_matrices(cfg: Config, moe: bool, ep: int, biases: bool = True) -> list:
    """The feed-forward's: the SwiGLU MLP's, or the MoE block's (model/moe.py: the expert stacks, E/ep
    of them, GPT-OSS's expert biases (2-D: E/ep × width, Muon's too), the router, the shared expert and
    its gate; ``biases=False``: without the biases, the time model's)."""
    m = cfg.model
    h = m.d_model
    if not moe:
        return [Matrix(1, m.ffn_hidden, h, "col"), Matrix(1, m.ffn_hidden, h, "col"), Matrix(1, h, m.ffn_hidden, "row")]
    e = m.moe
    fe, n_e = e.ffn_hidden or m.ffn_hidden, e.num_experts // max(ep, 1)
    out = [Matrix(n_e, fe, h, "", True), Matrix(n_e, fe, h, "", True), Matrix(n_e, h, fe, "", True),
           Matrix(1, e.num_experts, h, "")]
    if biases and e.expert_bias:
        out += [Matrix(1, n_e, fe, "", True), Matrix(1, n_e, fe, "", True), Matrix(1, n_e, h, "", True)]
    sh = e.shared_ffn_hidden
    if sh:
        out += [Matrix(1, sh, h, ""), Matrix(1, sh, h, ""), Matrix(1, h, sh, "")]
        if e.shared_gate:
            out.append(Matrix(1, 1, h, ""))
    return out


def block_matrices(cfg: Config, i: int, ep: int) -> list:
    """Layer ``i``'s Muon matrices (paralayer/optim/muon.py ``uses_muon``: every matrix of the block);
    an MTP block (i ≥ n_layers) adds its 2h → h projection."""
    from paralayer.resolve import model_parts as parts

    out = mixer_matrices(cfg, parts.is_linear_layer(cfg, i)) + ffn_matrices(cfg, parts.is_moe_layer(cfg, i), ep)
    if i >= cfg.model.n_layers:
        out.append(Matrix(1, cfg.model.d_model, 2 * cfg.model.d_model, "rep"))
    return out


def rank_matrices(cfg: Config, lay, r: int) -> list:
    """Pipeline rank ``r``'s Muon matrices: its chunks' blocks, and the MTP blocks on the last chunk's."""
    from paralayer.resolve import model_parts as parts
    from paralayer.resolve.memory.states import rank_chunks

    out = []
    for c in rank_chunks(lay, r):
        layers = list(lay.stage_layers[c]) + (parts.mtp_layers(cfg) if c == lay.chunks - 1 else [])
        for i in layers:
            out += block_matrices(cfg, i, lay.ep)
    return out


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


def _tp_numel(mx: Matrix, tp: int) -> int:
    return mx.numel // tp if (tp > 1 and mx.tp in ("col", "row")) else mx.numel


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


def _busiest_dp_index(cfg: Config, lay, r: int) -> int:
    """The place in dp·cp whose Newton-Schulz work on pipeline rank ``r`` is the most (ties: the lowest):
    its ZeRO-1 share's, or its owned matrices' over dp·cp and expert-dp."""
    steps, d, ep = cfg.train.muon.ns_steps, lay.dp * lay.cp, max(lay.ep, 1)
    if d == 1:
        return 0
    mats = rank_matrices(cfg, lay, r)
    work = [0.0] * d
    if lay.zero == 1:
        for mx, o in zip(mats, zero1_owners(cfg, lay, r, mats)):
            for j in (range(d) if o < 0 else (o,)):
                work[j] += mx.flops(steps)
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
