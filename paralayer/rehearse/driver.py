"""The rehearsal's driver: one real step of the runtime for chosen ranks of the full world.

Why: the plan is formulas; before a cluster-week queues, the user needs to know that the real
code builds this model in this layout, that it fits, and that it communicates what the plan says.
Each chosen rank runs in its own process (``paralayer.rehearse.rank``) on torch's fake
process group and fake tensors: the training runtime's own build and step, at the full world
size, with no weight allocated. Beside every measured figure stands the plan's prediction for
that rank, and their ratio.

Like for like: a step of m microbatches repeats the same microbatch; the rehearsal runs the
fewest that reach the schedule's steady state (2 without a pipeline: the first and the last,
whose backward starts the gradient buckets; pp under 1F1B and GPipe, 2·pp under interleaved and
the V schedules) and resolves the plan again for that
batch, so plan and rehearsal are compared on the same step. ``microbatches`` and
``microbatches_full`` say which.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import warnings
from typing import Any, Optional

from paralayer import config as config_mod
from paralayer.config import Config
from paralayer.rehearse import fork_server

#: Fields of the contract's memory objects.
MEM_KEYS = ("params", "grads", "optimizer", "activations", "total")
#: Agreement the acceptance asks for: exact for states, 5% activations and comm, 2% FLOPs.
TOLERANCE = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.05, "comm": 0.05, "flops": 0.02}
RANK_TIMEOUT_S = float(os.environ.get("PARALAYER_REHEARSE_TIMEOUT_S", "600"))


class RanksError(ValueError):
    """A --ranks spec that names no valid rank (exit 2 with the valid forms)."""


# ------------------------------------------------------------------ which ranks
def rank_of(plan: dict, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """Global rank at mesh coordinates (pp, dp, cp, tp), tp fastest (paralayer/parallel/mesh.py)."""
    d = plan["degrees"]
    return ((pp * int(d["dp"]) + dp) * int(d["cp"]) + cp) * int(d["tp"]) + tp


def default_ranks(plan: dict) -> list[int]:
    """The first and the last pipeline rank; with experts, also the last expert rank of the first
    stage (a different expert shard and a different all-to-all peer set)."""
    d = plan["degrees"]
    out = [0, rank_of(plan, pp=int(d["pp"]) - 1)]
    ep = int(d["ep"])
    if ep > 1:
        j = ep - 1  # flattened (dp, cp) index of the last ep rank of the first expert group
        out.append(rank_of(plan, dp=j // int(d["cp"]), cp=j % int(d["cp"])))
    return sorted(set(out))


def parse_ranks(spec: Optional[str], plan: dict) -> list[int]:
    """``None``/``default``; ``all-stages`` (the first rank of every pipeline stage); or rank numbers
    and ranges, ``0,7,512-515``."""
    world = int(plan["world_size"])
    if spec in (None, "", "default"):
        return default_ranks(plan)
    if spec == "all-stages":
        return [rank_of(plan, pp=p) for p in range(int(plan["degrees"]["pp"]))]
    out: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                out += list(range(a, b + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise RanksError(f"--ranks: {part!r} is not a rank; valid: default, all-stages, or rank numbers "
                             f"and ranges in 0..{world - 1} (e.g. 0,{world - 1})") from None
    bad = [r for r in out if not 0 <= r < world]
    if bad or not out:
        raise RanksError(f"--ranks: {bad or spec} outside the world; valid: ranks 0..{world - 1}, default, all-stages")
    return sorted(set(out))


# ------------------------------------------------------------------ the batch that is rehearsed
def rehearsal_microbatches(plan: dict) -> int:
    """Fewest microbatches that show a full step's steady state (see the module docstring)."""
    m = int(plan["microbatches"])
    pp = int(plan["degrees"]["pp"])
    if pp == 1:
        want = 2
    elif plan["schedule"] in ("1f1b", "gpipe"):
        want = pp  # rank 0 holds pp in flight from m = pp on (gpipe: every one, as the plan says)
    else:
        want = 2 * pp  # interleaved's and the V schedules' warm-up reaches its peak only by 2·pp
    return max(1, min(m, want))


def rehearsal_config(cfg: Config, plan: dict) -> tuple[Config, int]:
    """The recipe with the global batch cut to :func:`rehearsal_microbatches` (and real-weight
    loading off: fake tensors have nothing to load into). Returns (config, microbatches)."""
    m_run = rehearsal_microbatches(plan)
    d = config_mod.to_dict(cfg)
    dp = int(plan["degrees"]["dp"])
    d["train"]["global_batch"] = m_run * int(cfg.train.micro_batch) * dp
    d["parallel"]["dp"] = dp
    if str(d["model"].get("init", "")).startswith("hf:"):
        d["model"]["init"] = "random"
    # the precision the plan resolved for its device (auto: bf16 on GPUs), not this CPU's. An FP8
    # plan is rehearsed in FP8 (emulated) inside the plan's base precision (bf16 for a GPU plan:
    # train.fp8.base_precision), so that its weight casts, wire rows and saved inputs are a GPU's
    if cfg.train.precision == "fp8":
        d["train"]["fp8"]["base_precision"] = plan["precision"]
    else:
        d["train"]["precision"] = plan["precision"]
    return config_mod.from_dict(d), m_run


# ------------------------------------------------------------------ the plan's figures per rank
def plan_figures(cfg: Config, pp_rank: int, dp_index: int = 0, cp_index: int | None = None,
                 tp_index: int = 0) -> dict:
    """What the resolver predicts for one device of pipeline rank ``pp_rank`` (torch-free);
    ``dp_index`` (its place in dp·cp) picks its exact ZeRO-1 share (resolve/memory/zero1.py), ``cp_index``
    its cp ring's sends and core blocks (a window's differ per cp rank; None: the busiest's). Under
    Muon its optimizer step (resolve/cost/optimizer_step.py ``rank_step``: the Newton-Schulz of the
    matrices this device owns, at ``dp_index`` and ``tp_index``, and the owners' moves) joins
    ``plan_flops`` and ``plan_comm``, and stands alone in ``plan_optimizer_step``."""
    from paralayer.resolve import cost, memory, rules
    from paralayer.resolve.memory import zero1

    lay = rules.check(cfg)
    p, g, o, a = memory.rank_memory(cfg, lay, pp_rank)
    d = lay.dp * lay.cp
    if lay.zero == 1 and d > 1:
        dense, expert, _ = memory.rank_params(cfg, lay, pp_rank)
        mine = zero1.share(zero1.dense_sizes(cfg, lay, pp_rank), d, dp_index)
        kept = expert if lay.ep > 1 else 0.0  # under ep each rank steps its own experts
        o = memory.state_bytes(mine * d, kept, d, max(d // max(lay.ep, 1), 1), 1, lay.pp, lay.precision,
                               lay.schedule)[2]
        if cfg.train.optimizer == "muon":  # one momentum for the share's Muon matrices (memory/muon_states.py)
            from paralayer.resolve.cost.optimizer_step import zero1_muon_elements
            from paralayer.resolve.memory import muon_states

            split = (zero1_muon_elements(cfg, lay, pp_rank, dp_index) * d, kept,
                     muon_states.qk_clip_bytes(cfg, lay, pp_rank))
            o = muon_states.optimizer_bytes(o, split, lay, 1)
        o = int(o)
    comm = cost.comm(cfg, lay, pp_rank, cp_rank=cp_index)
    out = {
        "plan_memory_bytes": {"params": p, "grads": g, "optimizer": o, "activations": a, "total": p + g + o + a},
        "plan_comm": {ax: int(e["bytes_per_step"]) for ax, e in comm.items() if e["bytes_per_step"]},
        "plan_flops": float(cost.rank_flops(cfg, lay, pp_rank, cp_rank=cp_index)),
        # the plan counts tp's sequence-parallel all-gather + reduce-scatter as one all-reduce's
        # payload per pair (resolve/cost/terms.py; machine.comm_seconds); ZeRO-2/3's pairs count each
        "plan_comm_pairs": [ax for ax, e in comm.items()
                            if ax == "tp" and e["collective"] == "all-gather+reduce-scatter"],
        # rings (cp's K/V, tp_overlap's fused chunks) are counted by their sends
        "plan_comm_sends_only": [ax for ax, e in comm.items() if "ring" in e["collective"]],
    }
    if cfg.train.optimizer == "muon":
        from paralayer.resolve.cost.optimizer_step import rank_step

        step = rank_step(cfg, lay, pp_rank, dp_index, tp_index)
        moved: dict = {}
        for row in step["collectives"]:  # in bytes_per_axis's convention: a pair axis's gathers count half
            half = row["axis"] in out["plan_comm_pairs"] and row["kind"] == "all-gather"
            # ep over all of dp·cp is dp·cp's process group: its all-to-alls read as ep's (rehearse/comm.py)
            ax = "ep" if row["axis"] == "dp" and row["kind"] == "all-to-all" and lay.ep == d > 1 else row["axis"]
            moved[ax] = moved.get(ax, 0) + row["message_bytes"] * row["count"] * (0.5 if half else 1)
        out["plan_optimizer_step"] = {"flops": step["flops"], "comm_bytes": {ax: int(b) for ax, b in moved.items()}}
        out["plan_flops"] += step["flops"]
        for ax, b in moved.items():
            if b:
                out["plan_comm"][ax] = out["plan_comm"].get(ax, 0) + int(b)
    return out


def _ratio(measured: float, planned: float) -> Optional[float]:
    if planned:
        return measured / planned
    return None if measured else 1.0


def compare(rank: dict) -> dict:
    """Ratios measured / planned, and whether each is within :data:`TOLERANCE`."""
    mem, pmem = rank["memory_bytes"], rank["plan_memory_bytes"]
    ratios: dict[str, Any] = {k: _ratio(mem[k], pmem[k]) for k in MEM_KEYS}
    from paralayer.rehearse.comm import bytes_per_axis

    got = bytes_per_axis(rank["collectives"], pairs=rank.get("plan_comm_pairs", ()),
                         sends_only=rank.get("plan_comm_sends_only", ("cp",)))
    axes = sorted(set(got) | set(rank["plan_comm"]))
    ratios["comm"] = {ax: _ratio(got.get(ax, 0), rank["plan_comm"].get(ax, 0)) for ax in axes}
    ratios["flops"] = _ratio(rank["flops"], rank["plan_flops"])
    agree = {}
    for k in ("params", "grads", "optimizer", "activations", "flops"):
        r = ratios[k]
        agree[k] = r is not None and abs(r - 1) <= TOLERANCE[k] + 1e-12
    agree["comm"] = all(r is not None and abs(r - 1) <= TOLERANCE["comm"] for r in ratios["comm"].values())
    return {"ratios": ratios, "agrees": agree}


# ------------------------------------------------------------------ running the ranks
def _rank_child(run_dir: str, rank: int, env: dict) -> None:
    """A forked rank: the caller's environment, its output to DIR/rank-RANK.log (read back for the
    error line), then ``paralayer.rehearse.rank``'s main; its exit status is main's."""
    os.environ.clear()
    os.environ.update(env)
    warnings.simplefilter("ignore")
    fd = os.open(os.path.join(run_dir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from paralayer.rehearse import rank as rank_mod

    sys.exit(rank_mod.main([run_dir, str(rank)]))


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def _spawn(run_dir: str, rank: int) -> mp.Process:
    ctx = fork_server.context()
    proc = ctx.Process(target=_rank_child, args=(run_dir, rank, dict(os.environ, OMP_NUM_THREADS="1")),
                       daemon=True)
    with fork_server.bare_main():
        proc.start()
    return proc


def run_ranks(cfg: Config, plan: dict, ranks: list[int], parallel: int = 0) -> tuple[list[dict], list[str]]:
    """One process per rank, forked from the fork server (at most ``parallel`` at once, default
    the cores); returns the ranks' results and the one-line errors of those that failed."""
    parallel = parallel or max(1, min(len(ranks), os.cpu_count() or 1))
    results, errors = [], []
    with tempfile.TemporaryDirectory(prefix="paralayer-rehearse-") as tmp:
        with open(os.path.join(tmp, "resolved.yaml"), "w") as f:
            f.write(config_mod.to_yaml(cfg))
        with open(os.path.join(tmp, "plan.json"), "w") as f:
            json.dump(plan, f)
        pending, running = list(ranks), []
        while pending or running:
            while pending and len(running) < parallel:
                r = pending.pop(0)
                running.append((r, _spawn(tmp, r), time.monotonic()))
            r, proc, t0 = running.pop(0)
            proc.join(timeout=max(1.0, RANK_TIMEOUT_S - (time.monotonic() - t0)))
            if proc.is_alive():
                proc.kill()
                proc.join()
                errors.append(f"rank {r}: rehearsal did not finish in {RANK_TIMEOUT_S:g} s")
                continue
            path = os.path.join(tmp, f"rank-{r}.json")
            if proc.exitcode == 0 and os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                err = _read(os.path.join(tmp, f"rank-{r}.log"))
                lines = [ln for ln in err.strip().splitlines() if ln.strip()]
                mine = [ln for ln in lines if ln.startswith(f"rank {r}:")]
                errors.append(mine[-1] if mine else f"rank {r}: exited {proc.exitcode}: "
                              f"{lines[-1] if lines else 'no message'}")
    return sorted(results, key=lambda x: x["rank"]), errors


def rehearse(cfg: Config, plan: dict, ranks: Optional[list[int]] = None, parallel: int = 0) -> dict:
    """Rehearse ``ranks`` (default :func:`default_ranks`) of the plan; the contract's JSON object."""
    from paralayer.resolve import resolve

    ranks = default_ranks(plan) if ranks is None else ranks
    cfg_run, m_run = rehearsal_config(cfg, plan)
    plan_run = resolve(cfg_run).to_dict()
    if plan_run["degrees"] != plan["degrees"] or int(plan_run["microbatches"]) != m_run:
        raise RuntimeError(f"rehearsal batch changed the layout: {plan_run['degrees']} m={plan_run['microbatches']}")
    results, errors = run_ranks(cfg_run, plan_run, ranks, parallel)
    mem = plan["memory_per_device_bytes"]
    cap = mem.get("capacity")
    usable = None if cap is None else int(cap) - int(plan["memory_reserve_bytes"])
    out_ranks = []
    for res in results:
        res = beside_the_plan(cfg_run, plan, res)
        res["fits"] = usable is None or res["memory_bytes"]["total"] <= usable
        out_ranks.append(res)
    ok = not errors and all(r["fits"] for r in out_ranks)
    return {
        "ok": ok, "world_size": int(plan["world_size"]), "ranks": out_ranks, "errors": errors,
        "microbatches": m_run, "microbatches_full": int(plan["microbatches"]),
        "usable_memory_bytes": usable,
        "agrees": bool(out_ranks) and all(all(r["agrees"].values()) for r in out_ranks),
        "notes": _notes(cfg, plan, m_run),
    }


def beside_the_plan(cfg_run: Config, plan: dict, res: dict) -> dict:
    """A rank's measured figures with the plan's for the same rank and batch (``cfg_run``, from
    :func:`rehearsal_config`) and their ratios: the parent's side of the rehearsal, so a test can
    judge one set of measured ranks against a changed plan without stepping them again."""
    c = res["coords"]
    res = {**res, **plan_figures(cfg_run, int(c["pp"]), int(c["dp"]) * int(plan["degrees"]["cp"]) + int(c["cp"]),
                                 int(c["cp"]), int(c["tp"]))}
    res.update(compare(res))
    return res


def _notes(cfg: Config, plan: dict, m_run: int) -> list[str]:
    notes = [f"rehearsed {m_run} of the step's {plan['microbatches']} microbatches per pipeline "
             f"(global_batch {m_run * cfg.train.micro_batch * int(plan['degrees']['dp'])}); the plan "
             "figures beside them are for the same batch",
             "synthetic tokens; fake process group and fake tensors: nothing is allocated or sent"]
    if cfg.model.moe.num_experts > 0:
        notes.append("MoE: the router spreads tokens evenly over the experts (all-to-all split sizes are "
                     "data; the rehearsal uses balanced ones)")
    return notes
