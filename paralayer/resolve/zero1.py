"""ZeRO-1's optimizer share of one data rank, exactly as the runtime deals it (torch-free).

Why: the runtime's ZeRO-1 (paralayer/parallel/data.py ``ZeroOneOptimizer``) deals WHOLE parameters,
largest first, to the least-loaded data rank, so a rank's share is not exactly 1/d of the
parameters; the memory model's n/d is the average. The rehearsal compares each rank with the
plan, exactly: this replays the deal on the parameter sizes the layout gives a pipeline rank.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve.memory import is_moe_layer, rank_chunks
from paralayer.resolve.rules import Layout


def dense_sizes(cfg: Config, lay: Layout, r: int) -> list[int]:
    """Element counts of the parameters pipeline rank ``r`` deals out (after tp sharding); experts
    only when ep = 1 (under ep each rank keeps its own experts' states)."""
    m = cfg.model
    h, t = m.d_model, lay.tp
    hd = h // m.n_heads
    vocab = lay.padded_vocab * h // t
    out: list[int] = []
    for c in rank_chunks(lay, r):
        if c == 0:
            out.append(vocab)
        for i in lay.stage_layers[c]:
            out += [h, m.n_heads * hd * h // t, m.n_kv_heads * hd * h // t, m.n_kv_heads * hd * h // t,
                    h * m.n_heads * hd // t, h]
            if is_moe_layer(cfg, i):
                mo = m.moe
                fe = mo.ffn_hidden or m.ffn_hidden
                out.append(mo.num_experts * h)  # the router
                if lay.ep == 1:
                    out += [mo.num_experts * fe * h] * 3
                if mo.shared_ffn_hidden:
                    out += [mo.shared_ffn_hidden * h] * 3
            else:
                out += [m.ffn_hidden * h // t] * 3
        if c == lay.chunks - 1:
            out += [h, vocab]
    return out


def share(sizes: list[int], d: int, index: int) -> int:
    """Elements data rank ``index`` of ``d`` owns after the deal (largest first, least loaded
    rank, ties to the lowest index: ``ZeroOneOptimizer``'s order)."""
    loads = [0] * d
    for s in sorted(sizes, reverse=True):
        j = min(range(d), key=lambda k: loads[k])
        loads[j] += s
    return loads[index]
