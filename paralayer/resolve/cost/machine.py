"""The machine the planner's cost model times a layout on: device peak and efficiency, link
bandwidths and latencies by span, dp overlap, per-layer dispatch, memory capacity — from a cluster
profile (GPUs) or from the ``local`` calibration fitted on this machine (CPU ranks, gloo).

Torch-free, like the rest of ``paralayer.resolve``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from paralayer.config import Config
from paralayer.resolve.cost.terms import tp_plain_collectives
from paralayer.resolve.memory import GIB, attn_params, expert_params
from paralayer.resolve.rules import resolve_device

# ------------------------------------------------------------------ named constants
#: The GPU calibration: fitted by benchmarks/calibrate_gpu.py on 27 published training runs
#: (benchmarks/published_runs.csv: Narayanan et al. 2021 Table 1, the Megatron-Core README's H100
#: weak-scaling table, torchtitan's Llama 3/3.1 runs, Llama 3 paper Table 4), the same way
#: LOCAL_CALIBRATION was fitted on this machine. docs/planner.md has the fit: median and worst
#: error, Spearman, leave-one-out, the order within each source table. The rows are timed as their
#: framework moved its traffic (step_time.Framework: Megatron's distributed optimizer, Megatron-LM
#: 2021's all-reduce after the backward and pipeline scatter/gather), so these constants are the
#: machine's, not a framework's. The terms (every one charged per step, per device):
#:
#: - ``efficiency``: the share of the dense bf16 peak that the model's matmuls reach, per GPU kind
#:   (H200 has H100's tensor cores: it uses H100's); the weights each microbatch streams through
#:   HBM are charged on top (Machine.layer_overhead, GPU_WEIGHT_PASSES, not fitted);
#: - ``attention_efficiency``: the same for the attention core's 12·L·h·s FLOPs per token (counted
#:   without the causal halving, as torchtitan and PaLM count them: a causal flash kernel skips half,
#:   so this share can exceed the matmuls'); the fit bounds it by FlashAttention-2's published rate
#:   (335 TFLOP/s on H100: at most 2·335/989 = 0.677), and only the 128K-context row pins it;
#: - ``elementwise_bytes``: bytes per token, per hidden unit and per layer that the kernels around
#:   the matmuls (norms, activations, rotary, residuals, softmax bookkeeping; forward + backward)
#:   move through HBM. Their time, at ``HBM_TBPS``, is why small hidden sizes reach a lower MFU
#:   (matmul FLOPs grow as h², these bytes as h); tp without sequence parallelism runs the norms,
#:   dropouts and residual adds whole on every tp rank (step_time.replicated_elementwise_seconds);
#: - ``latency_s``: per collective, inside a node / across nodes: held at NCCL's launch latency,
#:   not fitted (a free latency was the fit's knob for whatever the model lacked);
#: - ``bandwidth_eff``: the share of the profile's link bandwidth a ring collective reaches;
#: - ``dp_overlap`` / ``tp_overlap``: the share of the compute window that hides dp traffic / of a
#:   chunk GEMM that hides the next chunk's transfer (parallel.tp_overlap; the fit's 0.25 says the
#:   chunked GEMMs slow down beside the transfers — NCCL's kernels take SMs from them).
GPU_CALIBRATION: dict = {
    "efficiency": {"a100": 0.721, "h100": 0.643},
    "attention_efficiency": {"a100": 0.603, "h100": 0.488},
    "elementwise_bytes": 596.0,
    "latency_s": {"intra": 5e-06, "inter": 1e-05},
    "bandwidth_eff": {"intra": 1.0, "inter": 0.895},
    "dp_overlap": 1.0,
    "tp_overlap": 0.253,
}
#: Weight streams per matmul weight per microbatch: the forward GEMM and the input-grad GEMM read
#: it, the weight-grad GEMM writes its grad (2 bytes each, bf16). Not fitted: the HBM datasheet speed.
GPU_WEIGHT_PASSES = 3
#: HBM bandwidth per GPU kind, TB/s (datasheets: A100 80GB SXM 2.039, H100 SXM 3.35, H200 4.8,
#: B200 8.0; B200 takes H100's fitted efficiencies: none of its runs is in the table).
HBM_TBPS = {"a100": 2.039, "h100": 3.35, "h200": 4.8, "b200": 8.0}
#: The share of a GPU that communication kernels take while they run beside compute (the SMs NCCL's
#: or DeepEP's kernels occupy): DeepSeek-V3 gave 20 of the H800's 132 SMs to communication (arXiv
#: 2412.19437 §3.2.1). Not fitted: no published row runs parallel.pp_overlap. ``cluster.comm_sm_fraction``
#: overrides it; CPU ranks: 0 (gloo's threads were not measured taking cores from compute).
GPU_COMM_SM_FRACTION = 20.0 / 132.0
#: Kept for callers of the first GPU model (same meaning, now from GPU_CALIBRATION).
GPU_EFFICIENCY = GPU_CALIBRATION["efficiency"]["h100"]
GPU_LATENCY_S = GPU_CALIBRATION["latency_s"]
GPU_DP_OVERLAP = GPU_CALIBRATION["dp_overlap"]
GPU_TP_OVERLAP = GPU_CALIBRATION["tp_overlap"]


def gpu_kind(name: str, peak_tflops: Optional[float]) -> str:
    """'a100' | 'h100' | 'h200' | 'b200' from the profile's name, else from its peak (312 → A100)."""
    low = (name or "").lower()
    for kind in ("b200", "h200", "h100", "a100"):
        if kind in low:
            return kind
    return "a100" if peak_tflops is not None and peak_tflops < 500 else "h100"


#: The ``local`` calibration (CPU ranks, gloo over loopback), fitted by benchmarks/calibrate.py on
#: this machine — see docs/planner.md for the run and the fit. ``peak_tflops`` is the measured
#: fp32 GEMM peak of one rank's thread (metrics.measure_cpu_peak_tflops); ranks get
#: min(1, cores / ranks) of it (one thread each, sharing ``cores``: the effective cores, fitted;
#: None = os.cpu_count()); the links are gloo over loopback: a per-collective latency and a
#: bandwidth, the same inside and "across" nodes. ``cluster.peak_tflops`` overrides the peak.
LOCAL_CALIBRATION = {
    "peak_tflops": 0.1248,  # one-thread fp32 GEMM, measured at the start of the run
    "efficiency": 0.910,
    "cores": 2.0,  # effective cores the ranks got (the machine's cores are shared with other jobs)
    "latency_s": 0.0,  # per collective: fitted to 0 once dispatch is counted (the fit put it there)
    "bandwidth_gbps": 0.256,  # gloo over loopback
    "dp_overlap": 0.0,  # our CPU runtime reduces gradients after the backward, not under it
    # tp_overlap on CPU: gloo's send thread competes with the ranks' compute for the same cores,
    # so no transfer is counted as hidden (the planner does not offer tp_overlap here)
    "tp_overlap": 0.0,
    # eager dispatch per layer per microbatch (forward + backward) on one rank, on top of the
    # FLOPs: every layer; more under tp (DTensor redistributes); more per MoE layer (routing,
    # sort, the loop over experts). Fitted like the rest; GPUs: 0 (kernels launch ahead).
    "overhead_layer_s": 8.90e-3,
    "overhead_tp_s": 19.53e-3,
    "overhead_moe_s": 13.57e-3,
}


# ------------------------------------------------------------------ the machine model
@dataclasses.dataclass
class Machine:
    """What the cost model needs of the cluster, with its calibration."""

    world: int
    devices_per_node: int
    nodes: int
    peak_tflops: float
    efficiency: float
    intra_gbps: float
    inter_gbps: float
    latency_s: dict
    dp_overlap: float
    capacity: Optional[int]
    reserve: int
    kind: str  # "gpu" | "local"
    #: seconds per layer per microbatch: {"layer", "tp", "moe"} (see LOCAL_CALIBRATION)
    overhead_s: dict = dataclasses.field(default_factory=dict)
    #: share of a chunk GEMM that hides a chunk transfer under parallel.tp_overlap (0: none)
    tp_overlap: float = 0.0
    #: the attention core's efficiency (None: ``efficiency``)
    attention_efficiency: Optional[float] = None
    #: non-matmul kernels: bytes per token·layer·hidden unit and the HBM speed (0: not charged)
    elementwise_bytes: float = 0.0
    hbm_bytes_per_s: float = 0.0
    gpu: str = ""  # a100 | h100 | h200 on GPU profiles
    #: HBM bytes of a layer's matmul weights that every microbatch streams (dense, MoE layer; before
    #: the tp split): GPU_WEIGHT_PASSES × 2 bytes × its matmul parameters (0: not charged)
    weight_bytes_layer: tuple = (0.0, 0.0)
    #: the dense FP8 peak (cluster.peak_fp8_tflops, else 2 × peak_tflops); CPU: the peak (emulated)
    peak_fp8_tflops: float = 0.0
    #: the share of the device communication kernels take beside compute (cost/fb_overlap.py)
    comm_sm_fraction: float = 0.0

    def elementwise_seconds(self, tokens: float, n_layers: int, hidden: int) -> float:
        """Seconds per device for the non-matmul kernels of ``tokens`` tokens spread over the world."""
        if not self.elementwise_bytes or not self.hbm_bytes_per_s:
            return 0.0
        return self.elementwise_bytes * tokens * n_layers * hidden / (self.world * self.hbm_bytes_per_s)

    def layer_overhead(self, n_dense: int, n_moe: int, tp: int) -> float:
        """Seconds per microbatch of a rank holding these layers beyond their FLOPs: eager dispatch
        (CPU ranks) and, on GPUs, the matmul weights the microbatch streams through HBM (a GEMM's
        weight bytes are paid once per microbatch, so small microbatches — few tokens per weight —
        run their GEMMs further below peak)."""
        o = self.overhead_s
        per = o.get("layer", 0.0) + (o.get("tp", 0.0) if tp > 1 else 0.0)
        out = (n_dense + n_moe) * per + n_moe * o.get("moe", 0.0)
        if self.hbm_bytes_per_s and (self.weight_bytes_layer[0] or self.weight_bytes_layer[1]):
            wd, wm = self.weight_bytes_layer
            out += (n_dense * wd + n_moe * wm) / max(tp, 1) / self.hbm_bytes_per_s
        return out

    def bandwidth(self, span: str) -> float:
        return 1e9 * (self.intra_gbps if span == "intra-node" else self.inter_gbps)

    def latency(self, span: str) -> float:
        return self.latency_s["intra" if span == "intra-node" else "inter"]


def machine_for(cfg: Config, calibration: Optional[dict] = None) -> Machine:
    """The machine model for the config's cluster. CPU (``local``) uses LOCAL_CALIBRATION (or the
    given calibration); GPU profiles use the profile's peak and bandwidths with the GPU constants."""
    c = cfg.cluster
    device = resolve_device(cfg)
    if c.devices_per_node is None:
        p = cfg.parallel
        dpn = p.tp * p.pp * p.cp * (p.dp if isinstance(p.dp, int) else 1)
    else:
        dpn = c.devices_per_node
    cap = int(c.device_memory_gib * GIB) if c.device_memory_gib is not None else None
    reserve = int(c.memory_reserve_gib * GIB)
    if device == "cpu":
        cal = dict(LOCAL_CALIBRATION, **(calibration or {}))
        bw = cal["bandwidth_gbps"]
        # one thread per rank; ranks on one machine share its cores (2 ranks on 2 cores each get a
        # core, 4 ranks get half of one): the per-rank peak is the one-thread peak × min(1, cores/ranks)
        cores = cal.get("cores") or os.cpu_count() or 1
        share = min(1.0, cores / max(dpn, 1))
        peak = float(c.peak_tflops or cal["peak_tflops"] * share)
        # dispatch is CPU work too: ranks sharing a core share its time
        ovh = {k: cal.get(f"overhead_{k}_s", 0.0) / share for k in ("layer", "tp", "moe")}
        return Machine(c.nodes * dpn, dpn, c.nodes, peak, cal["efficiency"],
                       bw, bw, {"intra": cal["latency_s"], "inter": cal["latency_s"]}, cal["dp_overlap"],
                       cap, reserve, "local", ovh, cal.get("tp_overlap", 0.0),
                       comm_sm_fraction=float(c.comm_sm_fraction or 0.0))
    return _gpu_machine(cfg, dpn, cap, reserve, calibration or {})


def _gpu_machine(cfg: Config, dpn: int, cap: Optional[int], reserve: int, cal: dict) -> Machine:
    """A GPU profile's machine: its peak and links with GPU_CALIBRATION (``cal`` overrides any
    key; ``efficiency`` may be one number or {kind: number})."""
    c = cfg.cluster
    kind = gpu_kind(c.name, c.peak_tflops)
    g = dict(GPU_CALIBRATION, **cal)
    eff, att = (_per_kind(g.get(k), kind) for k in ("efficiency", "attention_efficiency"))
    bw = dict(GPU_CALIBRATION["bandwidth_eff"], **(g.get("bandwidth_eff") or {}))
    return Machine(c.nodes * dpn, dpn, c.nodes, float(c.peak_tflops or 989.0), eff,
                   float(c.intra_node_gbps) * bw["intra"], float(c.inter_node_gbps) * bw["inter"],
                   dict(g["latency_s"]), float(g["dp_overlap"]), cap, reserve, "gpu",
                   tp_overlap=float(g["tp_overlap"]), elementwise_bytes=float(g["elementwise_bytes"]),
                   hbm_bytes_per_s=1e12 * HBM_TBPS.get(kind, HBM_TBPS["h100"]), gpu=kind,
                   attention_efficiency=att if "efficiency" not in cal or "attention_efficiency" in cal else eff,
                   weight_bytes_layer=_weight_bytes_layer(cfg),
                   peak_fp8_tflops=float(c.peak_fp8_tflops or 2.0 * float(c.peak_tflops or 989.0)),
                   comm_sm_fraction=float(GPU_COMM_SM_FRACTION if c.comm_sm_fraction is None else c.comm_sm_fraction))


def _weight_bytes_layer(cfg: Config) -> tuple[float, float]:
    """HBM bytes per microbatch of one dense / one MoE layer's matmul weights (before tp): the
    attention's q, k, v, o and the MLP (a MoE layer: the router, the shared expert and top_k
    experts' worth — each token's experts; a rank's other local experts are read too when its
    tokens reach them, which this lower count leaves out)."""
    m = cfg.model
    h = m.d_model
    attn = attn_params(cfg)
    dense = attn + 3 * h * m.ffn_hidden
    moe = attn + m.moe.top_k * expert_params(cfg) + h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden
    b = 2.0 * GPU_WEIGHT_PASSES
    return b * dense, b * moe


def _per_kind(value, kind: str) -> float:
    """A calibration entry: one number, or {kind: number} (H200 falls back to H100)."""
    if isinstance(value, dict):
        return float(value.get(kind, value.get("h100")))
    return float(value)


def wire_factor(collective: str, n: int) -> float:
    """Bytes each device moves per payload byte, ring algorithms (see the module docstring)."""
    if n <= 1 or collective == "none":
        return 0.0
    if collective == "all-reduce":
        return 2.0 * (n - 1) / n
    if collective in ("send/recv", "ring send/recv (K,V)"):
        return 1.0
    return (n - 1) / n  # all-gather, reduce-scatter, all-to-all, and their pairs (bytes counted per half)


def comm_seconds(entry: dict, span: str, mach: Machine, axis: str = "") -> float:
    """Time of one axis's traffic per step from a resolver comm entry (``plan.comm[axis]``):
    count · latency + bytes · wire / bandwidth. The planner computes the same in closed form.

    tp under sequence parallel counts one all-gather + reduce-scatter PAIR per all-reduce it
    replaces (same volume), so its wire factor is the all-reduce's whatever the collective's name.
    An ep all-to-all across nodes moves its intra-node and inter-node shares (``cost.ep_bytes``) at
    once, each on its own link: the slower of the two; the two-stage dispatch by node (``dispatch``
    node) sends its network rows, then fans them out inside the node: the sum of the two."""
    if entry["collective"] == "none" or entry["group_size"] <= 1:
        return 0.0
    n = entry["group_size"]
    count = entry["count_per_step"]
    if entry.get("dispatch") == "node" and span == "inter-node":
        # the two-stage dispatch (parallel/expert_node.py): the network stage, then the NVLink fan-out
        return count * mach.latency(span) + entry["inter_node_bytes_per_step"] / mach.bandwidth(span) + \
            entry["intra_node_bytes_per_step"] / mach.bandwidth("intra-node")
    if "inter_node_bytes_per_step" in entry and span == "inter-node":
        # the ep all-to-all by destination (cost/ep_bytes.py): its NVLink and network shares move at once
        return count * mach.latency(span) + max(entry["inter_node_bytes_per_step"] / mach.bandwidth(span),
                                                entry["intra_node_bytes_per_step"] / mach.bandwidth("intra-node"))
    if "wire_bytes_per_step" in entry:
        return count * mach.latency(span) + entry["wire_bytes_per_step"] / mach.bandwidth(span)
    wf = wire_factor("all-reduce" if axis == "tp" else entry["collective"], n)
    return count * mach.latency(span) + entry["bytes_per_step"] * wf / mach.bandwidth(span)


def rerun_seconds(entry: dict, span: str, mach: Machine, axis: str = "") -> float:
    """:func:`comm_seconds` of the share of ``entry`` the split backwards' second reruns move
    (``split_rerun_*_per_step``, cost.terms): the same collective at its count and bytes (each
    byte field scaled alike), 0 without any."""
    count = entry.get("split_rerun_count_per_step", 0)
    if not count or not entry["bytes_per_step"]:
        return 0.0
    f = entry["split_rerun_bytes_per_step"] / entry["bytes_per_step"]
    part = dict(entry, count_per_step=count)
    for k in ("bytes_per_step", "wire_bytes_per_step", "inter_node_bytes_per_step", "intra_node_bytes_per_step"):
        if k in entry:
            part[k] = entry[k] * f
    return comm_seconds(part, span, mach, axis)


def tp_overlap_seconds(ring_flops: tuple[list[float], list[float]], n_dense: int, n_moe: int, tokens: float,
                       mm: int, tp: int, h: int, act_bytes: int, full_recompute: bool, mach: Machine,
                       span: str) -> float:
    """tp seconds on the critical path per step under parallel.tp_overlap.

    Each fused ring (``cost.tp_ring_flops``) is tp − 1 steps of one chunk's GEMM beside the next
    chunk's transfer; a step costs the longer of the two, so a ring shows
    (tp − 1)·max(0, hop − overlap·GEMM/tp) beyond its GEMMs. The MoE blocks' plain all-gathers
    (``cost.TP_PLAIN_MOE``) show whole. ``tokens``: the gathered sequence of one microbatch."""
    if tp <= 1:
        return 0.0
    flop_s = 1.0 / (mach.peak_tflops * 1e12 * mach.efficiency)
    hop = mach.latency(span) + tokens * h * act_bytes / tp / mach.bandwidth(span)
    hide = mach.tp_overlap * flop_s * tokens / tp
    per_mb = 0.0
    for flops, n in zip(ring_flops, (n_dense, n_moe)):
        if n:
            per_mb += n * sum(max(0.0, hop - hide * f) for f in flops)
    per_mb *= tp - 1
    if n_moe:
        plain = tp_plain_collectives(n_moe, full_recompute)
        per_mb += plain * (mach.latency(span) + tokens * h * act_bytes * (tp - 1) / tp / mach.bandwidth(span))
    return per_mb * mm


def dp_exposed_seconds(t_dp: float, t_reduce: float, zero: int, pp: int, window: float, mm: int,
                       mach: Machine) -> float:
    """dp seconds on the critical path, as our runtime moves them (``window``: the step's compute on
    the busiest rank, ``mm`` microbatches). ZeRO 0–1: the grads' all-reduce starts bucket by bucket
    during the last microbatch's backward (about 2/3 of a microbatch's compute hides it,
    parallel/grad_sync.py); ZeRO-1's broadcasts follow the optimizer step and show whole. ZeRO 2–3
    (FSDP2) without pp: gathers and reduce-scatters per unit and microbatch, hidden by up to
    ``overlap × window``. Under pp each stage reduce-scatters every microbatch's grads too
    (parallel/pipeline.py ``reduce_each_microbatch``): torch's REDUCE_GRAD waits only for the last
    microbatch's (``t_reduce / mm`` shows whole), the rest hides like the gathers."""
    if zero <= 1:
        return max(0.0, t_reduce - mach.dp_overlap * window * 2.0 / 3.0 / max(mm, 1)) + (t_dp - t_reduce)
    if pp > 1:
        last = t_reduce / max(mm, 1)
        return last + max(0.0, t_dp - last - mach.dp_overlap * window)
    return max(0.0, t_dp - mach.dp_overlap * window)


def dp_exposed_max(pairs: tuple, zero: int, pp: int, window: float, mm: int, mach: Machine) -> tuple[float, float]:
    """(exposed, seconds on the wire) of the pipeline rank whose dp shows the most: ``pairs`` holds each
    timed rank's (dp seconds, grad reduce seconds), :func:`dp_exposed_seconds` of each (the planner's
    twin of cost/step_time.py's max over ranks: where the exposed seconds tie, the one moving the most)."""
    best = (-1.0, 0.0)
    for t_dp, t_red in pairs:
        x = (dp_exposed_seconds(t_dp, t_red, zero, pp, window, mm, mach), t_dp)
        if x > best:
            best = x
    return best


def distopt_dp_seconds(params: float, d: int, span: str, mach: Machine, window_s: float, mm: int,
                       bubble_s: float, chunks: int) -> float:
    """dp seconds on the critical path under Megatron's distributed optimizer with
    ``--overlap-grad-reduce --overlap-param-gather`` (a published row's framework, not our runtime:
    the calibration times such rows with it, benchmarks/calibrate_gpu.py ``dp_sync``).

    Traffic per step: the grads reduce-scattered in fp32 (Megatron accumulates and reduces bf16
    runs' grads in fp32) and the updated bf16 weights all-gathered, each (d−1)/d of the rank's
    ``params`` on the wire. Both go chunk by chunk (a layer; under pp a virtual stage: NeMo's
    "Communication Overlap" guide): the reduce-scatter under the last microbatch's backward and the
    flush's idle half of the bubble, the gather under the first microbatch's forward and the
    warm-up's half. At least one chunk of each shows; at most what its window cannot hide."""
    if d <= 1 or params <= 0:
        return 0.0
    ring = (d - 1) / d
    bw = mach.bandwidth(span)
    t_rs = mach.latency(span) * chunks + ring * 4.0 * params / bw
    t_ag = mach.latency(span) * chunks + ring * 2.0 * params / bw
    per_mb = window_s / max(mm, 1)
    k = max(chunks, 1)
    return (max(t_rs / k, t_rs - mach.dp_overlap * (per_mb * 2.0 / 3.0 + bubble_s / 2.0))
            + max(t_ag / k, t_ag - mach.dp_overlap * (per_mb / 3.0 + bubble_s / 2.0)))


def dp_reduce_seconds(entry: dict, span: str, mach: Machine) -> float:
    """The grad reduce-scatter's share of a ZeRO 2–3 dp entry (``cost.comm``): one per unit."""
    wire = entry.get("reduce_wire_bytes_per_step", 0)
    if not wire or entry["group_size"] <= 1:
        return 0.0
    return entry.get("reduce_count_per_step", 0) * mach.latency(span) + wire / mach.bandwidth(span)
