"""The front door: ``python launch.py recipe=NAME [key=value ...] [--dry-run] [--json] [-m]``.

Why it is shaped like this: everything that can be wrong with a recipe is found here, by the
torch-free resolver, in well under a second, and reported all at once (exit 2, one line per problem
on stderr, never a traceback). Only a valid plan reaches dispatch, which is imported lazily so a dry
run never pays for importing torch.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys
from typing import Any, Optional

from paralayer import config as config_mod
from paralayer.config import ConfigError, recipes
from paralayer.inputs.echo import markup_safe, one_line

EXIT_OK, EXIT_INVALID, EXIT_INTERNAL = 0, 2, 3
#: runs one sweep may hold (each is resolved before anything starts)
MAX_SWEEP = 256


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: exit 2, no traceback
        self.print_usage(sys.stderr)
        raise _ArgError(message)


class _ArgError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    from paralayer import commands

    epilog = (
        "recipes (recipe=NAME, or a path to a .yaml file), first folder first:\n" + recipes.describe("recipes") + "\n"
        "cluster profiles (cluster=NAME):\n" + recipes.describe("profiles") + "\n"
        "(your own: ./recipes, ./cluster/profiles, or folders in PARALAYER_RECIPES / PARALAYER_PROFILES)\n\n"
        "examples:\n"
        "  python launch.py                                   # the tiny recipe, here\n"
        "  python launch.py recipe=llama3-70b --dry-run       # the plan, as tables\n"
        "  python launch.py recipe=llama3-70b --dry-run --json\n"
        "  python launch.py recipe=tiny parallel.tp=1,2 -m    # a sweep, one run per value\n"
        "exit codes: 0 ok; 2 invalid recipe or layout, or it does not fit (reason on stderr)\n\n"
        + commands.help_text()
    )
    p = _Parser(prog="launch.py", description="Config-driven launcher for hybrid-parallel transformer training.",
                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="recipe=NAME, cluster=NAME, or any dotted key (e.g. parallel.tp=2)")
    p.add_argument("--dry-run", action="store_true", help="resolve and print the plan; start nothing")
    p.add_argument("--json", action="store_true", help="print the plan (or plans) as JSON")
    p.add_argument("--plan", action="store_true", help="every valid layout for the model on the cluster, ranked")
    p.add_argument("--top", type=int, default=None, metavar="N",
                   help="--plan: list only the best N layouts (degrees given as overrides narrow the search); "
                        "N above 100 is capped at 100, with a note on stderr")
    p.add_argument("-m", "--multirun", action="store_true", help="sweep: comma lists become one run per combination")
    p.add_argument("--wait", action="store_true", help="SLURM: wait for the job(s) and return their exit code")
    p.add_argument("--timeline", action="store_true", help="record a per-rank timeline of the step")
    p.add_argument("--rehearse", action="store_true",
                   help="one real step of the runtime for chosen ranks at the full world size (fake process "
                        "group and tensors): memory, collectives and FLOPs beside the plan's")
    p.add_argument("--ranks", default=None, metavar="SPEC",
                   help="with --rehearse: default (first and last pipeline rank, + an expert rank), "
                        "all-stages, or rank numbers and ranges (0,7,512-515)")
    p.add_argument("--no-rehearse", action="store_true",
                   help="SLURM: submit without the pre-flight rehearsal of the first and last pipeline rank")
    p.add_argument("--report", action="append", metavar="DIR",
                   help="the sweep report of DIR (a sweep folder or run folders; repeat for several): "
                        "predicted against measured, written as report.{csv,md,png}")
    return p


def _err(msg: str) -> None:
    """One error line on stderr: what the user typed is echoed escaped (inputs/echo.py)."""
    print(f"error: {one_line(msg)}", file=sys.stderr)


def dumps(obj: Any) -> str:
    """Strict JSON (NaN/inf as null)."""
    from paralayer.inputs.strict_json import dumps as strict

    return strict(obj)


def _report_errors(plan: Any, label: str = "") -> None:
    pre = f"[{label}] " if label else ""
    for e in plan.errors:
        _err(f"{pre}{e['field']}: {e['message']}")
    if plan.valid and not plan.fits:
        mem = plan.memory_per_device_bytes
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        if mem["activations"] >= states:
            part = (f"activations {mem['activations'] / 2**30:.2f} GiB (model.seq_len × train.micro_batch tokens × "
                    "model.d_model/model.ffn_hidden per layer; cut by parallel.recompute, parallel.cp, parallel.tp with "
                    "parallel.sequence_parallel)")
            top = plan.extra.get("activations_by_tensor") or {}
            if top.get("tensors"):
                t0 = top["tensors"][0]
                part += (f"; of the saved set of pipeline rank {top['pp_rank']}'s {top['layers']} {top['layer_kind']} "
                         f"layers (recompute={top['recompute']}, {top['bytes_per_token_per_layer']:,.0f} B a token "
                         f"each) the largest tensor is {t0['tensor']}, {t0['share']:.0%}")
        else:
            part = (f"weights, grads and optimizer {states / 2**30:.2f} GiB (model.d_model, model.n_layers, "
                    "model.ffn_hidden, model.vocab_size, model.moe.num_experts; split by parallel.tp, parallel.pp, "
                    "parallel.ep, parallel.zero)")
        _err(f"{pre}memory: needs {mem['total'] / 2**30:.2f} GiB per device, most of it {part}, but the device has "
             f"{mem['capacity'] / 2**30:.2f} GiB (cluster.device_memory_gib) minus a "
             f"{plan.memory_reserve_bytes / 2**30:.2f} GiB reserve (cluster.memory_reserve_gib); try more pp/tp, "
             "parallel.zero=3, parallel.recompute=full or a smaller train.micro_batch")


# ------------------------------------------------------------------ sweeps
def expand(overrides: list[str]) -> list[list[str]]:
    """Every combination of the comma lists (and the recipe's ``sweep:`` block), as override lists."""
    return _expand(overrides)[0]


def _expand(overrides: list[str]):
    """The combinations and the sweep's shared base (config/sweep_base.py), merged once."""
    from paralayer.config.sweep_base import SweepBase

    fixed = [o for o in overrides if not _is_list(o)]
    shared = SweepBase(fixed)
    base = shared.load([])
    axes = config_mod.sweep_axes(base.sweep, [o for o in overrides if _is_list(o)])
    return _combinations(fixed, axes), shared


def _combinations(fixed: list[str], axes: dict) -> list[list[str]]:
    if not axes:
        return [fixed]
    keys = list(axes)
    n = math.prod(len(v) for v in axes.values())
    if n > MAX_SWEEP:
        big = max(keys, key=lambda k: len(axes[k]))
        raise ConfigError(big, f"the sweep has {n:,} combinations; at most {MAX_SWEEP} (the bound)")
    return [fixed + [f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*(axes[k] for k in keys))]


def _is_list(ov: str) -> bool:
    _, _, value = ov.partition("=")
    return "," in value and not value.lstrip().startswith("[")


# ------------------------------------------------------------------ output
def print_plan(plan: Any, cfg: Any, console: Any = None) -> None:
    """Readable tables: degrees and spans, memory vs capacity, bubble, comm, warnings, errors."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console(file=sys.stdout, width=max(100, Console().width))
    d = plan.to_dict()
    deg = d["degrees"]
    head = (f"[bold]{markup_safe(d['recipe'])}[/bold] on {markup_safe(cfg.cluster.name)}: world {d['world_size']} = "
            f"{d['nodes']} node(s) × {d['devices_per_node']} device(s) ({d['device']}, {d['precision']}); "
            f"schedule {d['schedule']}, zero {d['zero']}, recompute {d['recompute']}, "
            f"sequence parallel {'on' if d['sequence_parallel'] else 'off'}")
    con.print(head)

    t = Table(title="Parallel degrees")
    for c in ("axis", "degree", "spans", "what it splits"):
        t.add_column(c)
    what = {"tp": "heads, FFN width, vocab (inside each layer)", "pp": "layers into stages",
            "vpp": "model chunks per pipeline rank", "cp": "the sequence (ring attention)",
            "ep": f"experts (grid {d['expert_grid']['ep']}×{d['expert_grid']['edp']} of dp·cp)",
            "dp": "the batch (ZeRO shards over dp·cp)"}
    for ax in ("tp", "pp", "vpp", "cp", "ep", "dp"):
        t.add_row(ax, str(deg[ax]), d["spans"].get(ax, "-"), what[ax])
    con.print(t)

    mem = d["memory_per_device_bytes"]
    cap = mem["capacity"]
    t = Table(title=f"Memory per device (pipeline rank {d['memory_stage']}, the most loaded)")
    t.add_column("part")
    t.add_column("GiB", justify="right")
    t.add_column("share", justify="right")
    for k in ("params", "grads", "optimizer", "activations", "total"):
        share = f"{100 * mem[k] / cap:.0f}%" if cap else "-"
        t.add_row(k, f"{mem[k] / 2**30:.2f}", share)
    t.add_row("capacity", "unknown" if cap is None else f"{cap / 2**30:.2f}", "")
    t.add_row("reserve", f"{d['memory_reserve_bytes'] / 2**30:.2f}", "")
    t.add_row("fits", "[green]yes[/green]" if d["fits"] else "[red]NO[/red]", "")
    con.print(t)

    t = Table(title="Step")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    p = d["parameters"]
    t.add_row("parameters (total / active)", f"{p['total'] / 1e9:.3f} B / {p['active'] / 1e9:.3f} B")
    if "mtp" in p:  # the MTP blocks, on the last pipeline stage (embedding and head shared)
        t.add_row("MTP parameters (total / active)", f"{p['mtp'] / 1e9:.3f} B / {p['mtp_active'] / 1e9:.3f} B")
    t.add_row("microbatches per pipeline (m)", str(d["microbatches"]))
    t.add_row("pipeline bubble", f"{d['bubble_fraction']:.4f}")
    t.add_row("FLOPs per token", f"{d['flops_per_token']:.4g}")
    t.add_row("tokens per step", f"{d['tokens_per_step']:,}")
    t.add_row("padded vocab", str(d["padded_vocab_size"]))
    t.add_row("layers per pipeline chunk", ", ".join(str(len(s)) for s in d["stage_layers"]))
    _time_rows(t, d, cfg)
    con.print(t)

    t = Table(title="Communication per device per step")
    for c in ("axis", "collective", "message", "count", "per step"):
        t.add_column(c, justify="right" if c in ("message", "count", "per step") else "left")
    for ax in ("tp", "pp", "cp", "ep", "dp"):
        c = d["comm"][ax]
        if c["collective"] == "none":
            t.add_row(ax, "-", "-", "-", "-")
        else:
            kind = c["collective"] + (" (by node)" if c.get("dispatch") == "node" else "")  # parallel/expert_node.py
            if ax == "dp" and d["degrees"]["pp"] > 1 and "pp_rank" in c:  # the pipeline rank moving the most
                kind += f" (pp rank {c['pp_rank']})"
            t.add_row(ax, kind, _bytes(c["message_bytes"]), f"{c['count_per_step']:,}", _bytes(c["bytes_per_step"]))
    con.print(t)

    for src in (d.get("data") or {}).get("sources", []):  # resolve/data_plan.py
        toks = "tokens unknown until prepared" if src["tokens"] is None else f"{src['tokens']:,} tokens"
        ep = "" if src["epochs"] is None else f", {src['epochs']:.3g} epochs in this run"
        con.print(f"data: {markup_safe(str(src['path']))}: {toks}, weight {src['weight']:.3g}{ep}")
    for n in d["notes"]:
        con.print(f"[dim]note:[/dim] {markup_safe(n)}")
    for w in d["warnings"]:
        con.print(f"[yellow]warning:[/yellow] {markup_safe(w['field'])}: {markup_safe(w['message'])}")
    for e in d["errors"]:
        con.print(f"[red]error:[/red] {markup_safe(e['field'])}: {markup_safe(e['message'])}")
    con.print("[green]valid[/green]" if plan.ok else "[red]not runnable[/red] (exit 2)")


def device_label(profile: str, calibrated: Optional[str]) -> str:
    """What the device-hours are hours of: the profile's GPU model (``h800-80gb-8x``: H800, whose
    time constants are the H100's), else the kind the planner calibrated with."""
    m = re.match(r"([a-z]+\d+[a-z]*)-\d+gb", (profile or "").lower())
    return (m.group(1) if m else calibrated or "device").upper()


def _time_rows(t: Any, d: dict, cfg: Any) -> None:
    """Muon's step (CPU plans too), then the calibrated GPU time model's prediction
    (resolve/cost/step_time.py), when the plan has one."""
    if d.get("optimizer_step"):  # train.optimizer=muon (resolve/cost/optimizer_step.py), apart from the model FLOPs
        o = d["optimizer_step"]
        moves = ", ".join(f"{ax} {_bytes(b)}" for ax, b in sorted(o["comm_bytes"].items())) or "none"
        where = f"{o['pp_rank']}/{o['dp_index']}/{o['tp_index']}"
        t.add_row("Muon's step, busiest device (pp/dp/tp place)",
                  f"{o['flops']:.4g} Newton-Schulz FLOPs, moves {moves} ({where})")
    if d.get("step_time_s") is None:
        return
    dev = device_label(cfg.cluster.name, d.get("gpu"))
    t.add_row("predicted step time", f"{d['step_time_s']:.3g} s")
    if d.get("optimizer_s") is not None:  # train.optimizer=muon: its step's seconds, part of the step time
        t.add_row("of which Muon's optimizer step", f"{d['optimizer_s']:.3g} s")
    if d.get("fp8_gain") is not None:  # train.precision=fp8: the split by precision (resolve/cost/fp8_time.py)
        s = d["step_time_by_precision"]
        t.add_row("step time by precision (busiest rank)",
                  f"FP8 GEMMs {s['fp8_gemm_s']:.3g} s, bf16 GEMMs {s['bf16_gemm_s']:.3g} s, casts {s['cast_s']:.3g} s, "
                  f"the rest {s['other_s']:.3g} s; {d['fp8_gain']:.3f}× the bf16 step ({d['bf16_step_time_s']:.3g} s)")
    if d.get("step_rank") is not None and len(d.get("rank_step_time_s") or ()) > 1:
        t.add_row("slowest pipeline rank (sets the step)", f"rank {d['step_rank']}")
    if d.get("busiest_rank_ratio") is not None:
        t.add_row("busiest pipeline rank's FLOPs / the mean", f"{d['busiest_rank_ratio']:.3f}")
    if d.get("balanced_v"):  # a V with lighter end chunks, predicted faster (planner/v_balance.py)
        b = d["balanced_v"]
        t.add_row("a balanced V split", f"step {b['step_time_s']:.3g} s, busiest rank {b['busiest_rank_ratio']:.3f}× "
                  f"the mean: {b['override']}")
    ov = d.get("comm_overlap") or {}
    for ax in ("tp", "pp", "cp", "ep"):
        o = ov.get(ax)
        if o and o["comm_s"] > 0:
            t.add_row(f"{ax} traffic of that rank: hidden / exposed",
                      f"{o['hidden_s']:.3g} s / {o['exposed_s']:.3g} s of {o['comm_s']:.3g} s")
    if d.get("comm_sm_slowdown_s"):
        t.add_row("compute slowed by communication kernels",
                  f"{d['comm_sm_slowdown_s']:.3g} s (cluster.comm_sm_fraction={d['comm_sm_fraction']:.3g})")
    t.add_row("predicted tokens/s", f"{d['tokens_per_s']:,.0f}")
    if d.get("mfu") is not None:
        t.add_row("predicted MFU", f"{100 * d['mfu']:.1f}%")
    basis = "train.tokens" if d.get("train_tokens_from") == "train.tokens" else "train.steps × tokens per step"
    t.add_row(f"time to train {d['train_tokens']:.4g} tokens ({basis})",
              f"{d['train_days']:.1f} days, {d['device_hours']:,.0f} {dev}-hours")
    if d.get("train_cost") is not None:
        t.add_row("cost (cluster.price_per_device_hour)",
                  f"{d['train_cost']:,.0f} ({cfg.cluster.price_per_device_hour:g} per {dev}-hour)")
    t.add_row("[dim]what the time includes[/dim]",
              "[dim]ideal steps only: no failures, restarts, checkpoint stalls, evaluation or queueing[/dim]")


def _bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------ entry points
def _resolve(overrides: list[str]):
    return _resolve_cfg(config_mod.load_config(overrides))


def _resolve_cfg(cfg: Any):
    from paralayer.resolve import resolve

    plan = resolve(cfg)
    _check_data(cfg, plan)
    return cfg, plan


def _check_data(cfg: Any, plan: Any) -> None:
    """Data problems that are known before launch (missing, unreadable or empty files) are plan errors."""
    from paralayer.data.preflight import check_data

    for fld, msg in check_data(cfg.data):
        plan.errors.append({"field": fld, "message": msg})
        plan.valid = False


def _run_planner(overrides: list[str], args: argparse.Namespace) -> int:
    from paralayer.resolve.planner import report as plan_report

    cfg = config_mod.load_config(overrides)
    return int(plan_report.run(cfg, args, plan_report.fixed_from_overrides(overrides, cfg)))


def main(argv: Optional[list[str]] = None) -> int:
    """Parse, resolve, print or dispatch; returns the exit code (never raises for a bad recipe)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from paralayer import commands  # report, export, prepare, slurm, resubmit: paralayer/commands.py

    if commands.is_command(argv):
        return commands.run(argv)
    argv = commands.strip_train(argv)
    parser = build_parser()
    try:
        # intermixed: `recipe=tiny -m parallel.dp=1,2 --wait` (overrides on both sides of a flag)
        args = parser.parse_intermixed_args(argv)
    except _ArgError as exc:
        _err(str(exc))
        return EXIT_INVALID
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    try:
        if args.report:
            from paralayer.metrics.report import main as report_main

            return report_main(args.report)
        if args.plan:
            return _run_planner(args.overrides, args)
        if args.multirun:
            return _multirun(args)
        cfg, plan = _resolve(args.overrides)
    except ConfigError as exc:
        _err(f"{exc.field}: {exc.message}")
        return EXIT_INVALID
    except Exception as exc:  # noqa: BLE001 - the promise is: no traceback for a bad recipe
        if os.environ.get("PARALAYER_DEBUG"):
            raise
        _err(f"internal error while resolving ({type(exc).__name__}: {exc}); rerun with PARALAYER_DEBUG=1 "
             "for the traceback")
        return EXIT_INTERNAL
    if args.rehearse:
        if not plan.valid:
            _report_errors(plan)
            return EXIT_INVALID
        from paralayer import rehearse

        return rehearse.run_cli(cfg, plan.to_dict(), args.ranks, args.json)
    if args.dry_run:
        if args.json:
            print(dumps(plan.to_dict()))
        else:
            print_plan(plan, cfg)
        if not plan.ok:
            _report_errors(plan)
        return EXIT_OK if plan.ok else EXIT_INVALID
    if not plan.ok:
        _report_errors(plan)
        return EXIT_INVALID
    from paralayer import dispatch

    if cfg.cluster.backend == "slurm" and not args.no_rehearse:
        from paralayer import rehearse

        if rehearse.preflight(cfg, plan.to_dict()) != 0:
            return EXIT_INVALID
    try:
        return int(dispatch.launch(cfg, plan, args) or 0)
    except dispatch.LaunchError as exc:  # sbatch refused, no CUDA device here: one line, no traceback
        _err(str(exc))
        return EXIT_INVALID


def _multirun(args: argparse.Namespace) -> int:
    """Resolve every combination first; dispatch nothing unless all are runnable."""
    combos, shared = _expand(args.overrides)
    given = set(args.overrides)
    cfgs, plans, rows, bad = [], [], [], 0
    for ovs in combos:
        extra = ovs[len(shared.fixed):]
        label = " ".join(o for o in ovs if o not in given or _is_list(o)) or " ".join(ovs)
        try:
            cfg, plan = _resolve_cfg(shared.load(extra))
        except ConfigError as exc:
            _err(f"[{label}] {exc.field}: {exc.message}")
            rows.append((label, None, f"{exc.field}: {exc.message}"))
            bad += 1
            continue
        cfgs.append(cfg)
        plans.append(plan)
        rows.append((label, plan, _first_problem(plan)))
        if not plan.ok:
            _report_errors(plan, label)
            bad += 1
    if args.dry_run:
        if args.json:
            print(dumps([p.to_dict() for p in plans]))
        else:
            print_sweep(rows)
        return EXIT_INVALID if bad else EXIT_OK
    if bad:
        _err(f"{bad} of {len(combos)} sweep runs are invalid; nothing was started")
        return EXIT_INVALID
    from paralayer import dispatch

    try:
        return int(dispatch.launch_sweep(cfgs, plans, args) or 0)
    except dispatch.LaunchError as exc:
        _err(str(exc))
        return EXIT_INVALID


def _first_problem(plan: Any) -> str:
    if plan.errors:
        e = plan.errors[0]
        return f"{e['field']}: {e['message']}"
    if plan.valid and not plan.fits:
        return "memory: does not fit (cluster.device_memory_gib)"
    return ""


def print_sweep(rows: list) -> None:
    """The sweep as one line per run (label, runnable, world, degrees, memory, first problem):
    plain text, linear in the runs (a rich table per run took ~25 ms each)."""
    ok = sum(1 for _, plan, _ in rows if plan is not None and plan.ok)
    lines = [f"sweep: {len(rows)} run(s), {ok} runnable, {len(rows) - ok} not (dry run: nothing started)",
             f"{'#':>4}  {'ok':<3} {'world':>6} {'tp':>4} {'pp':>4} {'cp':>4} {'ep':>4} {'dp':>6} {'mem GiB':>9}  "
             "run / first problem"]
    for i, (label, plan, problem) in enumerate(rows):
        if plan is None:
            lines.append(f"{i:>4}  {'NO':<3} {'-':>6} {'-':>4} {'-':>4} {'-':>4} {'-':>4} {'-':>6} {'-':>9}  "
                         f"{one_line(label, 200)}: {one_line(problem, 300)}")
            continue
        d = plan.degrees if hasattr(plan, "degrees") else plan.to_dict()["degrees"]
        mem = plan.memory_per_device_bytes["total"] / 2**30
        lines.append(f"{i:>4}  {'yes' if plan.ok else 'NO':<3} {plan.world_size:>6} {d['tp']:>4} {d['pp']:>4} "
                     f"{d['cp']:>4} {d['ep']:>4} {d['dp']:>6} {mem:>9.2f}  {one_line(label, 200)}"
                     + (f": {one_line(problem, 300)}" if problem else ""))
    sys.stdout.write("\n".join(lines) + "\n")


def entry() -> None:
    """Console script (pyproject: paralayer = paralayer.cli:entry)."""
    exit_process(main(sys.argv[1:]))


def exit_process(rc: int) -> None:
    """End the front door's process with ``rc``. After a run on this machine (torch imported) the
    interpreter's teardown of torch takes 0.5-1.5 s on a loaded machine after goodput.json's last
    account: everything is written and flushed by then, so skip it."""
    if "torch" in sys.modules:
        import logging

        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(int(rc or 0))
    sys.exit(rc)
