"""The balanced V (issue 45): under zbv and dualpipev pp rank 0 holds the first chunk (the
embedding) and the last (the final norm, the head and the MTP blocks), so with layers on both it is
the busiest rank (deepseek-v3's published split: 1.39× the mean rank's FLOPs). Beside the split
``cost.split.best_split`` picks, a V structure weighs the split that takes layers off those two
chunks, down to 0, with the fewest busiest-rank FLOPs (``cost.split.v_end_splits``, only if below
best_split's; the dry run times two); each layout (zero, micro-batch, recompute, tp_overlap) is
listed once, with the split of the least predicted step (ties keep the first split), so the listing
changes only where a lighter end wins. Torch-free."""
from __future__ import annotations

import copy
from typing import Any, Callable

from paralayer.resolve.cost.split import v_end_splits
from paralayer.resolve.planner.types import Structure
from paralayer.resolve.rules import stage_layers as make_stage_layers


def add_variants(st: Structure, cache: dict, bound_of: Callable[[Any, float], float],
                 optimizer_of: Callable[[Any], dict]) -> None:
    """Give a V structure its lighter-end splits (``st.variants``) and lower ``st.bound`` to the
    least of theirs (the group's lower bound). ``cache``: per pp, the splits (the same for every
    structure of that depth); ``bound_of(lay, imbalance)``: search's structure bound;
    ``optimizer_of(lay)``: Muon's step per ZeRO stage ({} under AdamW)."""
    lay = st.lay
    key = ("v_ends", lay.pp, lay.schedule, tuple(st.split))
    if key not in cache:
        work, head = st.work_head
        cache[key] = v_end_splits(work, head, lay.pp, lay.schedule, st.split, keep=1)
    for split, imbalance in cache[key]:
        v_lay = copy.copy(lay)
        v_lay.stage_layers = make_stage_layers(len(st.work_head[0]), split)
        prefix = [f"parallel.pp_layout=[{','.join(map(str, split))}]" if o.startswith("parallel.pp_layout=") else o
                  for o in st.prefix]
        v = Structure(v_lay, list(split), imbalance, st.spans, st.degrees, prefix, bound_of(v_lay, imbalance),
                      least_bubble=st.least_bubble, work_head=st.work_head, optimizer_s=optimizer_of(v_lay))
        st.variants.append(v)
    if st.variants:
        st.inner_memo["own_bound"] = st.bound
        st.bound = min([st.bound] + [v.bound for v in st.variants])


def _refined(refined: Callable[[Structure], float], st: Structure) -> float:
    """search's refined bound of one split, once per structure."""
    if "refined" not in st.inner_memo:
        st.inner_memo["refined"] = refined(st)
    return st.inner_memo["refined"]


def group_exceeds(refined: Callable[[Structure], float], st: Structure, bar: float) -> bool:
    """Whether the refined bound of the structure and of each of its variants exceeds ``bar`` (then
    none of their layouts can be listed; the base is asked first, the variants only if it exceeds)."""
    if not st.variants:
        return refined(st) > bar
    return all(_refined(refined, s) > bar for s in [st] + st.variants)


def _quiet(ctx: Any) -> Any:
    """``ctx`` for a variant: its drops not counted (the base's layouts again). Every ZeRO stage is
    weighed: the step charges each rank's own dp (the max over ranks, issue 45 item 5), so a split
    that moves layers onto ranks that then move more dp is timed with their traffic (until 7 Dec the
    step charged rank 0's, and such a split was left out where rank 0 did not move the most)."""
    return ctx._replace(drop=lambda *a, **kw: None)


def plan_group(plan_structure: Callable, ctx: Any, key: int, st: Structure, recs: list, bar: float,
               extra: list, n_structs: int, refined: Callable[[Structure], float]) -> None:
    """``plan_structure`` of a structure and of each of its variants (appended to ``extra``, their
    keys n_structs + their index there, for the rows); per layout the fastest split is kept. A split
    whose bound exceeds ``bar`` is skipped (the group was kept for another). The counts of layouts
    that fit (``ctx.fits``) stay per layout, not per split."""
    if not st.variants:
        plan_structure(ctx, key, st, recs, bar)
        return
    best: dict = {}
    fits, base_keys = list(ctx.fits), set()
    for i, s in enumerate([st] + st.variants):
        own = s.inner_memo["own_bound"] if i == 0 else s.bound
        if bar < float("inf") and (own > bar or _refined(refined, s) > bar):
            continue  # none of this split's layouts can be listed
        c_ctx = ctx if i == 0 else _quiet(ctx)
        k = key
        if i:
            k = n_structs + len(extra)
            extra.append(s)
        sub: list = []
        plan_structure(c_ctx, k, s, sub, bar)
        if i == 0:
            fits = list(ctx.fits)
            base_keys = {(c.zero, c.mb, c.recompute, c.every, c.overlap) for c in sub}
        for c in sub:
            lk = (c.zero, c.mb, c.recompute, c.every, c.overlap)
            if lk not in best or c.step < best[lk].step:
                best[lk] = c
    ctx.fits[:] = fits  # a variant's layouts are the base's (one more where only a variant fits)
    ctx.fits[0] += sum(1 for lk in best if lk not in base_keys)
    recs.extend(best.values())


def busiest_and_balanced(cfg: Any, plan: Any, resolve: Callable[[Any], Any], weigh: bool = True) -> dict:
    """The dry run's pipeline balance (a timed plan with pp > 1): ``busiest_rank_ratio``, the FLOPs
    of the busiest pipeline rank over the mean rank's (the head, MTP and embedding counted where
    they sit), and under zbv / dualpipev, where a split with lighter end chunks is predicted faster
    (each rank's dp charged, the max: no split is timed on rank 0's alone), ``balanced_v``
    {pp_layout, busiest_rank_ratio, step_time_s, override}: the before and after of issue 45.
    ``resolve``: resolve/plan.py's, passed in (that module imports this one), that does not weigh
    again; ``weigh`` False: the ratio alone (this plan is itself one of the splits being timed)."""
    import dataclasses

    from paralayer.resolve.cost.split import layer_work, rank_work

    pp = plan.degrees["pp"]
    work, head = layer_work(cfg)
    split = [len(s) for s in plan.stage_layers]
    total = sum(work) + head
    out = {"busiest_rank_ratio": pp * max(rank_work(work, head, split, pp, plan.schedule)) / total}
    if not weigh or plan.extra.get("step_time_s") is None:
        return out
    best = None
    for s, ratio in v_end_splits(work, head, pp, plan.schedule, split):
        cfg_v = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_layout=list(s)))
        p_v = resolve(cfg_v)
        if not p_v.valid or not p_v.fits or p_v.extra.get("step_time_s") is None:
            continue
        t = p_v.extra["step_time_s"]
        if t < plan.extra["step_time_s"] and (best is None or t < best["step_time_s"]):
            best = {"pp_layout": list(s), "busiest_rank_ratio": ratio, "step_time_s": t,
                    "override": f"parallel.pp_layout=[{','.join(map(str, s))}]"}
    if best is not None:
        out["balanced_v"] = best
    return out


__all__ = ["add_variants", "busiest_and_balanced", "group_exceeds", "plan_group"]
