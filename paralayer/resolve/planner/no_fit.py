"""When ``--plan`` finds no layout that fits: the closest layouts and why each fails.

Why: an empty list (``[]``) tells a user nothing. The leanest layouts (ZeRO-3, full recompute,
micro-batch 1) for each tp·pp·cp split of the world are resolved with the same resolver a dry
run uses, and the few that come nearest (valid and least over the memory, else fewest rule
errors) are named with their reason, so the user sees what to change: more nodes, a larger
device, a shorter sequence. Torch-free; bounded by the divisors of the world (a few hundred
resolutions at most, milliseconds each).
"""
from __future__ import annotations

import copy
from typing import Optional

from paralayer.config import Config
from paralayer.resolve.memory import GIB
from paralayer.resolve.rules import divisors, valid_tp

#: resolutions tried at most (the leanest settings per degree split)
MAX_CANDIDATES = 240


def _candidates(cfg: Config, world: int, fixed: dict) -> list[dict]:
    m = cfg.model
    out = []
    tps = [fixed["tp"]] if "tp" in fixed else [t for t in valid_tp(cfg, world) if world % t == 0] or [1]
    for tp in tps:
        cps = [fixed["cp"]] if "cp" in fixed else [c for c in divisors(world // tp) if c == 1 or
                                                    m.seq_len % (2 * c) == 0][:4]
        for cp in cps:
            if world % (tp * cp):
                continue
            pps = [fixed["pp"]] if "pp" in fixed else [p for p in divisors(world // (tp * cp)) if p <= m.n_layers]
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                out.append({"tp": tp, "cp": cp, "pp": pp, "dp": dp,
                            "zero": fixed.get("zero", 3 if dp * cp > 1 else 0),
                            "recompute": fixed.get("recompute", "full"),
                            "micro_batch": fixed.get("micro_batch", 1),
                            "schedule": fixed.get("schedule", "1f1b" if pp == 1 else "gpipe"),
                            "ep": fixed.get("ep", 1)})
                if len(out) >= MAX_CANDIDATES:
                    return out
    return out


def _apply(cfg: Config, cand: dict) -> Config:
    c = copy.deepcopy(cfg)
    p = c.parallel
    p.tp, p.pp, p.cp, p.dp, p.ep, p.vpp = cand["tp"], cand["pp"], cand["cp"], cand["dp"], cand["ep"], 1
    p.zero, p.recompute, p.schedule, p.pp_layout = cand["zero"], cand["recompute"], cand["schedule"], None
    c.train.micro_batch = cand["micro_batch"]
    if c.model.moe.num_experts and p.ep == 1 and "ep_fixed" not in cand:
        # the most expert sharding the dp·cp grid allows
        grid = cand["dp"] * cand["cp"]
        p.ep = max([d for d in divisors(c.model.moe.num_experts) if grid % d == 0] or [1])
    return c


def describe(cand: dict) -> str:
    return " ".join(f"parallel.{k}={cand[k]}" for k in ("tp", "pp", "cp", "dp", "ep", "zero", "recompute")) + \
        f" train.micro_batch={cand['micro_batch']}"


def closest_layouts(cfg: Config, world: int, fixed: Optional[dict] = None, k: int = 3) -> list[tuple[str, str]]:
    """Up to k (layout, why it fails) pairs, nearest to fitting first."""
    from paralayer.resolve.plan import resolve

    scored = []
    for cand in _candidates(cfg, world, dict(fixed or {})):
        c = _apply(cfg, cand)
        cand["ep"] = c.parallel.ep
        plan = resolve(c)
        mem = plan.memory_per_device_bytes
        if plan.errors:
            e = plan.errors[0]
            scored.append(((1, len(plan.errors), 0.0), cand, f"{e['field']}: {e['message']}"))
        elif not plan.fits:
            avail = mem["capacity"] - plan.memory_reserve_bytes
            over = mem["total"] / max(avail, 1)
            scored.append(((0, 0, over), cand, f"needs {mem['total'] / GIB:.2f} GiB per device, "
                           f"{avail / GIB:.2f} GiB available (cluster.device_memory_gib="
                           f"{cfg.cluster.device_memory_gib:g} minus cluster.memory_reserve_gib="
                           f"{cfg.cluster.memory_reserve_gib:g})"))
        else:
            scored.append(((0, 0, 0.0), cand, "fits under the resolver, but the planner dropped it "
                           "(see the dropped reasons)"))
    scored.sort(key=lambda t: t[0])
    return [(describe(c), why) for _, c, why in scored[:k]]


#: the planner's names of fixed settings -> the field the user typed
FIELDS = {"tp": "parallel.tp", "pp": "parallel.pp", "vpp": "parallel.vpp", "cp": "parallel.cp", "ep": "parallel.ep",
          "dp": "parallel.dp", "schedule": "parallel.schedule", "zero": "parallel.zero",
          "recompute": "parallel.recompute", "recompute_every": "parallel.recompute_every",
          "tp_overlap": "parallel.tp_overlap", "micro_batch": "train.micro_batch"}


def headline(cfg: Config, stats: dict, fixed: dict, closest: list[tuple[str, str]]) -> str:
    """The first line, beginning with the field to change: a degree fixed on the command line, else
    the cluster's size (nodes × devices per node), with what failed."""
    mach = stats.get("machine") or {}
    world = int(mach.get("world") or 1)
    nodes, per = mach.get("nodes", cfg.cluster.nodes), mach.get("devices_per_node", cfg.cluster.devices_per_node)
    size = f"cluster.nodes={nodes} × cluster.devices_per_node={per} = {world} devices"
    dropped = sorted((stats.get("dropped") or {}).items(), key=lambda kv: -kv[1])[:3]
    tail = ("; dropped: " + "; ".join(f"{r} ({n:,})" for r, n in dropped)) if dropped else ""
    if fixed:
        given = ", ".join(f"{FIELDS.get(k, k)}={v}" for k, v in fixed.items())
        spelled = ", ".join(f"{k} = {v}" for k, v in fixed.items())
        odd = [f"{k} = {v} does not divide {world}" for k, v in fixed.items()
               if k in ("tp", "pp", "cp", "ep", "dp") and isinstance(v, int) and v > 0 and world % v]
        return (f"{given}: no layout with {spelled} of {cfg.recipe} fits {cfg.cluster.name} ({size}"
                + (f"; {', '.join(odd)}" if odd else "") + f"){tail}")
    memory = any("GiB per device" in why for _, why in closest)
    if memory or not closest:
        return (f"{size}: no layout of {cfg.recipe} fits in cluster.device_memory_gib="
                f"{cfg.cluster.device_memory_gib:g} per device on {cfg.cluster.name} (more nodes or a larger "
                f"device){tail}")
    return f"{size}: no layout of {cfg.recipe} divides {world} devices into valid degrees{tail}"


def report(cfg: Config, stats: dict, fixed: Optional[dict] = None, file=None) -> None:
    """Print to stderr: the field to change and why nothing fits, the planner's drop reasons, the
    closest layouts and why each fails (every line one line: echoed text is escaped)."""
    import sys

    from paralayer.inputs.echo import one_line

    out = file or sys.stderr
    world = int((stats.get("machine") or {}).get("world") or 1)
    closest = closest_layouts(cfg, world, fixed)
    print(f"error: {one_line(headline(cfg, stats, dict(fixed or {}), closest))}", file=out)
    for desc, why in closest:
        print(f"error: closest: {one_line(desc)}: {one_line(why)}", file=out)
