"""How the planner splits a model's layers into pipeline chunks: evenly where it divides, the
remainder kept off the ends, and the output head's FLOPs counted on the last chunk's rank (a
pipeline step is paced by its busiest rank). Torch-free, like the rest of ``paralayer.resolve``."""
from __future__ import annotations

from typing import Optional

from paralayer.config import Config
from paralayer.resolve import memory as mem_mod
from paralayer.resolve import model_parts
from paralayer.resolve.cost import terms as cost
from paralayer.resolve.rules import chunk_rank


def _fill(total: int, n: int) -> list[int]:
    """total layers over n chunks as evenly as possible; the extra layers go to the middle chunks
    first (not the first chunk, which also holds the embedding)."""
    base, rem = divmod(total, n)
    sizes = [base] * n
    order = list(range(1, n)) + [0]
    for i in order[:rem]:
        sizes[i] += 1
    return sizes


def balanced_split(n_layers: int, chunks: int) -> Optional[list[int]]:
    """Layers per chunk: even when it divides; else as even as possible with the remainder kept
    off the first and last chunk (they also hold the embedding and the output head — Meta's 405B
    split 7 + 14·8 + 7). None when there are more chunks than layers."""
    if chunks > n_layers or chunks < 1:
        return None
    base, rem = divmod(n_layers, chunks)
    if rem == 0:
        return [base] * chunks
    sizes = [base] * chunks
    order = list(range(1, chunks - 1)) + [0, chunks - 1] if chunks > 2 else list(range(chunks))
    for i in order[:rem]:
        sizes[i] += 1
    return sizes


def layer_work(cfg: Config) -> tuple[list[float], float]:
    """Training FLOPs per token of each layer and of the output head (the terms of
    cost.flops_per_token, split by where they run): a pipeline step is paced by its busiest rank."""
    m = cfg.model
    h = m.d_model
    attn = mem_mod.attn_params(cfg)
    out = []
    for i in range(m.n_layers):
        if mem_mod.is_moe_layer(cfg, i):
            n = (attn + m.moe.top_k * mem_mod.expert_params(cfg) + h * m.moe.num_experts
                 + 3 * h * m.moe.shared_ffn_hidden)
        else:
            n = attn + 3 * h * m.ffn_hidden
        out.append(6.0 * n + cost.layer_core_flops(cfg, i))
    # the head, and per MTP depth (on the last chunk) its block, projection and head pass
    head = 6.0 * h * m.vocab_size
    for i in model_parts.mtp_layers(cfg):
        n = attn + (m.moe.top_k * mem_mod.expert_params(cfg) + h * m.moe.num_experts
                    + 3 * h * m.moe.shared_ffn_hidden if mem_mod.is_moe_layer(cfg, i) else 3 * h * m.ffn_hidden)
        head += 6.0 * (n + 2 * h * h + h * m.vocab_size) + cost.layer_core_flops(cfg, i)
    return out, head


def rank_work(work: list[float], head: float, split: list[int], pp: int, schedule: str) -> list[float]:
    """FLOPs per token on each pipeline rank for a split (chunks mapped as the runtime maps them)."""
    ranks = [0.0] * pp
    start = 0
    n = len(split)
    for c, k in enumerate(split):
        r = chunk_rank(c, pp, schedule)
        ranks[r] += sum(work[start:start + k]) + (head if c == n - 1 else 0.0)
        start += k
    return ranks


def best_split(cfg: Config, work: list[float], head: float, pp: int, vpp: int,
               schedule: str) -> Optional[tuple[list[int], float]]:
    """The split of the layers into pp·vpp chunks that minimises the busiest rank's work (the
    output head counts on the last chunk's rank), and its imbalance = busiest / mean. Tries the
    even split and the ones that take 1–3 layers off the chunk holding the head."""
    L = len(work)
    chunks = pp * vpp
    even = balanced_split(L, chunks)
    if even is None:
        return None
    total = sum(work) + head
    if pp == 1:
        return even, 1.0
    cands = [even]
    base = L // chunks
    for k in range(max(1, base - 3), base + 1):
        rest = L - k
        if chunks - 1 <= rest:
            cands.append(_fill(rest, chunks - 1) + [k])
    best = None
    for s in cands:
        if min(s) < 1:
            continue
        mx = max(rank_work(work, head, s, pp, schedule))
        if best is None or mx < best[1] - 1e-9 * total:
            best = (s, mx)
    assert best is not None
    return best[0], pp * best[1] / total


def v_end_splits(work: list[float], head: float, pp: int, schedule: str, split: list[int],
                 keep: int = 2) -> list[tuple[list[int], float]]:
    """Splits for a V schedule (zbv, dualpipev: pp rank 0 holds the first chunk, with the embedding,
    and the last, with the head and the MTP blocks) that take layers off those two chunks, down to 0
    (parallel.pp_layout allows the end chunks empty), the other layers spread over ranks 1 … pp−1.
    Returns at most ``keep`` of them whose busiest rank has fewer FLOPs than ``split``'s, least
    first, each with its imbalance (busiest / mean); [] when none does (or not a V pipeline)."""
    chunks = len(split)
    if schedule not in ("zbv", "dualpipev") or pp < 2 or chunks != 2 * pp:
        return []
    L, total = len(work), sum(work) + head
    base = L // chunks
    # extras go one per middle rank first: its first-half chunk (ranks 1 … pp−1 or the reverse), then its second
    orders = (list(range(1, pp)) + list(range(2 * pp - 2, pp - 1, -1)),
              list(range(pp - 1, 0, -1)) + list(range(pp, 2 * pp - 1)))
    seen, cands = set(), []
    for a in range(base + 1):
        for b in range(base + 1):
            rest = L - a - b
            if rest < chunks - 2:
                continue
            mid, extra = divmod(rest, chunks - 2)
            for order in orders:
                s = [a] + [mid] * (chunks - 2) + [b]
                for c in (order * (extra // len(order) + 1))[:extra]:
                    s[c] += 1
                if tuple(s) not in seen:
                    seen.add(tuple(s))
                    dev = sum((k - L / chunks) ** 2 for k in s)
                    cands.append((max(rank_work(work, head, s, pp, schedule)), dev, s))
    limit = max(rank_work(work, head, split, pp, schedule)) * (1 - 1e-9)
    better = sorted(c for c in cands if c[0] < limit)
    return [(s, pp * mx / total) for mx, _, s in better[:keep]]
