"""Which pipeline ranks the step time weighs: one per group of ranks alike in everything it charges.

Why: a pipeline step is paced by its slowest rank, and the ranks differ — the embedding and head
sit on the end ranks, a middle rank of a plain schedule sends across two boundaries where an end
rank sends across one, an uneven split or MoE layers starting after ``first_k_dense`` give some
ranks more FLOPs or more expert traffic. The dry run (``step_time.time_plan``) and the planner's
ranking take the max over the same ranks, so they agree; two ranks are alike when their chunks
hold layers of the same FLOPs, kind (MoE or not), attention window and recompute (with as many
reruns: a V schedule's split backwards rerun a fully recomputed chunk again), and they hold
the same ends (embedding, head) and the same pipeline boundaries — then their compute and every
axis's traffic are equal, so one of them (the lowest) stands for the group. Torch-free.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts
from paralayer.resolve.cost.comm_facts import chunk_facts, layout_cache
from paralayer.resolve.memory import is_moe_layer, rank_chunks
from paralayer.resolve.memory.states import input_pass_reruns
from paralayer.resolve.rules import V_SCHEDULES, Layout


def timing_ranks(cfg: Config, lay: Layout, work: list, head: float, prune: bool = False) -> tuple:
    """((rank, its FLOPs / the mean rank's, the group's ranks, (dense, MoE) blocks it runs), ...): one
    rank of each group (module docstring), lowest first; ``work``, ``head``: cost.split.layer_work.
    Cached per layout and per recompute_every k under recompute=full (a recompute that is the same on
    every layer changes no group). ``prune``: without the groups another group dominates (the
    planner's: they cannot be the slowest, :func:`_dominated`)."""
    k = lay.recompute_every if lay.recompute == "full" and lay.recompute_every > 1 else 0
    again = lay.recompute == "full" and lay.schedule in V_SCHEDULES and lay.pp > 1
    cache, key = layout_cache(cfg, lay, ("timing_ranks", k, again, prune))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers and hit[1] is cfg:
        return hit[2]
    total = sum(work) + head
    base = _chunk_keys(cfg, lay, work, head)
    seen: dict = {}
    for r in range(lay.pp):
        sig, w, n_moe, n = [], 0.0, 0, 0
        for c in rank_chunks(lay, r):
            keys, layers, cw, c_moe = base[c]
            sig.append((keys, tuple(i % k == 0 for i in layers)) if k else keys)
            if again:  # its split backwards rerun its layers again (at m = 2p: the grouping is m's)
                sig.append(input_pass_reruns(lay.schedule, lay.pp, 2 * lay.pp, c))
            w += cw
            n += len(layers)
            n_moe += c_moe
        facts = chunk_facts(lay, r)
        sig.append(facts)
        seen.setdefault(tuple(sig), (r, lay.pp * w / total, [], (n - n_moe, n_moe)))[2].append(r)
    out = tuple((r, share, tuple(members), kinds) for r, share, members, kinds in sorted(seen.values()))
    if prune and not (lay.schedule in V_SCHEDULES and lay.pp > 1):
        out = _undominated(cfg, lay, base, k, out)
    cache[key] = (lay.stage_layers, cfg, out)
    return out


def _undominated(cfg: Config, lay: Layout, base: list, k: int, groups: tuple) -> tuple:
    """The groups no other group dominates. B dominates A when B holds every layer A holds (the same
    keys, with as many of each), the same ends (embedding, head) and at least as many pipeline
    transfers, and at least A's FLOPs: then each of A's terms — its compute, its tp, cp and ep traffic
    (per layer), its pp sends — is at most B's, so A is never slower than B and the max over the rest
    is the max over all. Not under the V schedules (parallel.pp_overlap pairs a rank's two chunks,
    whose order matters)."""
    def bag(r: int) -> dict:
        out: dict = {}
        for c in rank_chunks(lay, r):
            keys, layers, _, _ = base[c]
            for q, i in zip(keys, layers):
                key = q + ((i % k == 0,) if k else ())
                out[key] = out.get(key, 0) + 1
        return out

    info = [(g, bag(g[0]), chunk_facts(lay, g[0])) for g in groups]

    def dominates(b, a) -> bool:
        (gb, bb, fb), (ga, ba, fa) = b, a
        return (fb[:2] == fa[:2] and fb[2] >= fa[2] and gb[1] >= ga[1]
                and all(bb.get(key, 0) >= n for key, n in ba.items()))

    keep = []
    for i, a in enumerate(info):
        # a strict dominator, or an equal one listed earlier (of two alike, keep one)
        if not any(j != i and dominates(b, a) and (not dominates(a, b) or j < i) for j, b in enumerate(info)):
            keep.append(a[0])
    return tuple(keep)


def _chunk_keys(cfg: Config, lay: Layout, work: list, head: float) -> list:
    """Per chunk: (its layers' (FLOPs, MoE, window) keys, its blocks (the MTP blocks on the last),
    its FLOPs per token, its MoE blocks), once per layout."""
    cache, key = layout_cache(cfg, lay, ("chunk_keys",))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers and hit[1] is cfg:
        return hit[2]
    last = lay.chunks - 1
    mtp = model_parts.mtp_layers(cfg)
    per = _layer_keys(cfg, work)
    out = []
    for c, stage in enumerate(lay.stage_layers):
        layers = tuple(stage) + (tuple(mtp) if c == last else ())
        keys = tuple(map(per.__getitem__, layers))
        out.append((keys, layers, sum(work[i] for i in stage) + (head if c == last else 0.0),
                    sum(1 for q in keys if q[1])))
    cache[key] = (lay.stage_layers, cfg, out)
    return out


def _layer_keys(cfg: Config, work: list) -> list:
    """Every block's (FLOPs, MoE, window) key (the MTP blocks' FLOPs -1), once per config and
    ``work`` (the same for every layout of a plan; kept on the config, checked by identity)."""
    hit = cfg.__dict__.get("_layer_keys")
    if hit is not None and hit[0] is work:
        return hit[1]
    n = cfg.model.n_layers + cfg.model.mtp.depth
    per = [(work[i] if i < len(work) else -1.0, is_moe_layer(cfg, i), model_parts.layer_window(cfg, i))
           for i in range(max(n, len(work)))]
    cfg.__dict__["_layer_keys"] = (work, per)
    return per


__all__ = ["timing_ranks"]
