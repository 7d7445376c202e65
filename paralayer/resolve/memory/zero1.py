"""ZeRO-1's optimizer share of one data rank, exactly as the runtime deals it (torch-free).

Why: the runtime's ZeRO-1 (paralayer/parallel/data.py ``ZeroOneOptimizer``) deals WHOLE parameters,
largest first, to the least-loaded data rank, so a rank's share is not exactly 1/d of the
parameters; the memory model's n/d is the average. The rehearsal compares each rank with the
plan, exactly: this replays the deal on the parameter sizes the layout gives a pipeline rank.
"""
from __future__ import annotations

import functools
import heapq

from paralayer.config import Config
from paralayer.resolve import model_parts
from paralayer.resolve.memory.states import is_moe_layer, rank_chunks
from paralayer.resolve.rules import Layout


def attn_sizes(cfg: Config, t: int) -> list[int]:
    """Element counts of one attention block's parameters on a tp rank (model_parts' widths):
    GQA q, k, v, o (+ the q and k norms of head_dim under qk_norm); MLA q_a, its norm, q_b (or one
    q), kv_a, its norm, kv_b, o — the down-projections and norms whole, the rest split by heads."""
    m = cfg.model
    h = m.d_model
    if model_parts.attention_kind(cfg) == "mla":
        a = m.mla
        n, dqk = m.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
        out = [a.q_lora_rank * h, a.q_lora_rank, n * dqk * a.q_lora_rank // t] if a.q_lora_rank \
            else [n * dqk * h // t]
        return out + [(a.kv_lora_rank + a.qk_rope_head_dim) * h, a.kv_lora_rank,
                      n * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank // t, h * n * a.v_head_dim // t]
    hd = model_parts.head_dim(cfg)
    q = (2 if m.attn_gate else 1) * m.n_heads  # Qwen3-Next's gated layers: q_proj makes [q | gate]
    out = [q * hd * h // t, m.n_kv_heads * hd * h // t, m.n_kv_heads * hd * h // t, h * m.n_heads * hd // t]
    if m.attn_bias:  # GPT-OSS: q, k, v biases split with the heads, o's whole
        out += [m.n_heads * hd // t, m.n_kv_heads * hd // t, m.n_kv_heads * hd // t, h]
    if m.attn_sinks:
        out.append(m.n_heads // t)
    return out + ([hd, hd] if m.qk_norm else [])


def linear_sizes(cfg: Config, t: int) -> list[int]:
    """One Gated DeltaNet layer's parameters on a tp rank (model/linear/gated_deltanet.py):
    in_proj_qkvz, in_proj_ba, dt_bias, A_log and out_proj split by heads, the conv weight and the
    gated norm's gain whole (model_parts.linear_rank_params counts the same)."""
    h, li = cfg.model.d_model, cfg.model.linear
    hk, hv, dk, dv = li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim
    return [(2 * hk * dk + 2 * hv * dv) * h // t, 2 * hv * h // t, (2 * hk * dk + hv * dv) * li.conv_kernel,
            hv // t, hv // t, dv, h * hv * dv // t]


def dense_sizes(cfg: Config, lay: Layout, r: int) -> list[int]:
    """Element counts of the parameters pipeline rank ``r`` deals out (after tp sharding); experts
    only when ep = 1 (under ep each rank keeps its own experts' states). The last chunk's rank
    also holds the MTP blocks with their two input norms, projection and head norm."""
    m = cfg.model
    h, t = m.d_model, lay.tp
    vocab = lay.padded_vocab * h // t
    attn, linear = attn_sizes(cfg, t), linear_sizes(cfg, t)
    out: list[int] = []
    for c in rank_chunks(lay, r):
        if c == 0:
            out.append(vocab)
        layers = list(lay.stage_layers[c])
        if c == lay.chunks - 1:
            layers += model_parts.mtp_layers(cfg)
        for i in layers:
            mixer = linear if model_parts.is_linear_layer(cfg, i) else attn
            out += [h] + mixer + [h] * (model_parts.layer_norm_count(cfg) - 1)
            if i >= m.n_layers:  # an MTP block's own norms and projection
                out += [h, h, 2 * h * h, h]
            if is_moe_layer(cfg, i):
                mo = m.moe
                fe = mo.ffn_hidden or m.ffn_hidden
                out.append(mo.num_experts * h)  # the router
                if mo.router_bias:
                    out.append(mo.num_experts)
                if lay.ep == 1:
                    out += [mo.num_experts * fe * h] * 3
                    if mo.expert_bias:  # GPT-OSS: gate, up, down biases
                        out += [mo.num_experts * fe] * 2 + [mo.num_experts * h]
                if mo.shared_ffn_hidden:
                    out += [mo.shared_ffn_hidden * h] * 3
                    if model_parts.shared_gate_params(cfg):
                        out.append(model_parts.shared_gate_params(cfg))
            else:
                out += [m.ffn_hidden * h // t] * 3
        if c == lay.chunks - 1:
            out += [h, vocab]
            if m.mtp.depth and lay.pp > 1:
                out.append(vocab)  # MTP's embedding copy on the last chunk under pp (model/mtp.py)
    return out


def deal(sizes: list[int], d: int) -> list[int]:
    """Elements each of ``d`` data ranks owns after the deal (largest first, to the least loaded
    rank, ties to the lowest index: ``ZeroOneOptimizer``'s order); a heap, as d reaches thousands."""
    if d < 1:
        raise ValueError(f"ZeRO-1 deals over at least one data rank, not {d}")
    heap = [(0, k) for k in range(d)]  # sorted: already a heap
    for s in sorted(sizes, reverse=True):
        load, k = heapq.heappop(heap)
        heapq.heappush(heap, (load + s, k))
    loads = [0] * d
    for load, k in heap:
        loads[k] = load
    return loads


def share(sizes: list[int], d: int, index: int) -> int:
    """Elements data rank ``index`` of ``d`` owns after the deal."""
    return deal(sizes, d)[index]


@functools.lru_cache(maxsize=4096)
def largest_load(sizes: tuple, d: int) -> int:
    """The busiest rank's elements after :func:`deal` (the planner asks it for thousands of layouts
    that share a pipeline rank's tensors: cached; with no more tensors than ranks, the largest)."""
    return max(sizes) if len(sizes) <= d else max(deal(list(sizes), d))


def busiest_dense(cfg: Config, lay: Layout, r: int) -> int:
    """The busiest data rank's ZeRO-1 share on pipeline rank ``r``, times d: the dense element count
    whose average share (n/d, what ``state_bytes`` divides) is that rank's. The plan's optimizer
    figure is this rank's, not the average: whole tensors are dealt, and the rank that takes the
    embedding (DeepSeek-V3's 926M elements on pp rank 0) holds 9.53 GiB of state where n/d gives 2.85."""
    d = lay.dp * lay.cp
    return largest_load(tuple(sorted(dense_sizes(cfg, lay, r), reverse=True)), d) * d
