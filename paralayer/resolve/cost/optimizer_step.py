"""The optimizer step's own time under ``train.optimizer=muon`` (torch-free): the Newton-Schulz GEMMs
a rank runs as owner, plus the moves that bring its matrices whole and give the parts back
(paralayer/optim/owners.py). AdamW's step is elementwise and not charged (0 here, as before).

Per matrix of m × n (k = min, K = max) one Newton-Schulz step is X Xᵀ (2k²K), its square (2k³) and
the product back (2k²K) FLOPs: ``ns_steps``·(4k²K + 2k³). Where it runs, as the runtime does:
- tp = 1: each dense matrix once per dp·cp group, on its owner (balanced: 1/(dp·cp) of the work);
  experts on their ep rank, split over expert-dp under ZeRO 2/3 (FSDP's row shards), whole otherwise;
- tp > 1: the whole matrices on every tp rank (DTensor's gather; tp's column shards are owned over
  tp in the runtime, so this is an upper bound).
Moves, fp32 (4 B) per element, one device's share: ZeRO 0 receives the other owners' updates
((d−1)/d of the stage's Muon matrices, by broadcast); ZeRO 2/3 two all-to-alls of (d−1)/d of its
shard; ZeRO-1 none beyond AdamW's (its owners broadcast whole parameters already); tp > 1 gathers
(tp−1)/tp of each matrix over tp.
QK-clip (``train.muon.qk_clip_tau``) adds its max-logit GEMM (:func:`max_logit_flops`) at the
attention core's rate.
"""
from __future__ import annotations

from paralayer.config import Config

MOMENTUM_BYTES = 4


def _ns_flops(m: int, n: int, steps: int) -> float:
    k, big = min(m, n), max(m, n)
    return steps * (4.0 * k * k * big + 2.0 * k ** 3)


def layer_matrices(cfg: Config, moe: bool) -> tuple[list, list]:
    """(dense matrices, one expert's matrices) of a layer, as (rows, cols), before tp."""
    m = cfg.model
    h = m.d_model
    if m.mla.kv_lora_rank > 0:
        a = m.mla
        qk, nh = a.qk_nope_head_dim + a.qk_rope_head_dim, m.n_heads
        q = [(nh * qk, h)] if a.q_lora_rank is None else [(a.q_lora_rank, h), (nh * qk, a.q_lora_rank)]
        attn = q + [(a.kv_lora_rank + a.qk_rope_head_dim, h),
                    (nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), (h, nh * a.v_head_dim)]
    else:
        hd = m.head_dim or h // m.n_heads
        attn = [(m.n_heads * hd, h), (m.n_kv_heads * hd, h), (m.n_kv_heads * hd, h), (h, m.n_heads * hd)]
    if not moe:
        return attn + [(m.ffn_hidden, h), (m.ffn_hidden, h), (h, m.ffn_hidden)], []
    e = m.moe
    sh = e.shared_ffn_hidden
    shared = [(sh, h), (sh, h), (h, sh)] if sh else []
    return attn + [(e.num_experts, h)] + shared, [(e.ffn_hidden, h), (e.ffn_hidden, h), (h, e.ffn_hidden)]


def layer_terms(cfg: Config, moe: bool) -> tuple[float, float, float]:
    """(dense NS FLOPs, dense elements, one expert's NS FLOPs) of a layer, before tp."""
    steps = cfg.train.muon.ns_steps
    dense, expert = layer_matrices(cfg, moe)
    return (sum(_ns_flops(r, c, steps) for r, c in dense), float(sum(r * c for r, c in dense)),
            sum(_ns_flops(r, c, steps) for r, c in expert))


def muon_step_seconds(cfg: Config, degrees: dict, zero: int, n_dense: int, n_moe: int, terms: dict,
                      flop_s: float, dp_bandwidth: float, tp_bandwidth: float) -> float:
    """Seconds per step of Muon's own work on a rank holding ``n_dense`` dense and ``n_moe`` MoE layers
    (``terms``: {is_moe: :func:`layer_terms`}); ``flop_s`` the achieved FLOP/s, the bandwidths
    bytes/s of the dp and tp spans."""
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
    seconds = flops / flop_s
    moved = 0.0
    if tp > 1:
        seconds += MOMENTUM_BYTES * elems_dense * (tp - 1) / tp / tp_bandwidth
    elif d > 1 and zero == 0:
        moved = MOMENTUM_BYTES * elems_dense * (d - 1) / d
    elif d > 1 and zero >= 2:
        moved = 2 * MOMENTUM_BYTES * elems_dense / d * (d - 1) / d
    return seconds + moved / dp_bandwidth


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
