"""``launch.py ... --rehearse`` and the pre-flight before a SLURM submission: the rehearsal as
tables or JSON, and its exit codes (0 every rank built, stepped and fits; 2 otherwise)."""
from __future__ import annotations

import json
import sys
from typing import Any, Optional

from paralayer.config import Config
from paralayer.rehearse.driver import MEM_KEYS, RanksError, parse_ranks, rank_of, rehearse


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _fmt_ratio(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.3f}"


def print_report(out: dict, file: Any = None) -> None:
    """The rehearsal as tables: per rank, measured beside planned, and the ratio."""
    from rich.console import Console
    from rich.table import Table

    con = Console(file=file or sys.stdout, width=120)
    con.print(f"rehearsal of world {out['world_size']}: {len(out['ranks'])} rank(s); "
              + ("[green]ok[/green]" if out["ok"] else "[red]FAILED[/red]"))
    for r in out["ranks"]:
        t = Table(title=f"rank {r['rank']} {r['coords']} ({r['seconds']:.1f} s)")
        for c in ("figure", "rehearsed", "plan", "ratio"):
            t.add_column(c, justify="left" if c == "figure" else "right")
        for k in MEM_KEYS:
            t.add_row(f"{k} GiB", _gib(r["memory_bytes"][k]), _gib(r["plan_memory_bytes"][k]),
                      _fmt_ratio(r["ratios"][k]))
        from paralayer.rehearse.comm import bytes_per_axis

        got = bytes_per_axis(r["collectives"], pairs=r.get("plan_comm_pairs", ()),
                             sends_only=r.get("plan_comm_sends_only", ("cp",)))
        for ax, ratio in r["ratios"]["comm"].items():
            t.add_row(f"comm {ax} GB/step", f"{got.get(ax, 0) / 1e9:.3f}",
                      f"{r['plan_comm'].get(ax, 0) / 1e9:.3f}", _fmt_ratio(ratio))
        t.add_row("TFLOP/step", f"{r['flops'] / 1e12:.2f}", f"{r['plan_flops'] / 1e12:.2f}",
                  _fmt_ratio(r["ratios"]["flops"]))
        con.print(t)
        n = sum(c["count"] for c in r["collectives"])
        con.print(f"  {n} collectives in the step; fits: {'yes' if r['fits'] else 'NO'}")
    for note in out["notes"]:
        con.print(f"[dim]note:[/dim] {note}")
    for e in out["errors"]:
        con.print(f"[red]error:[/red] {e}")


def run_cli(cfg: Config, plan: dict, ranks_spec: Optional[str], as_json: bool) -> int:
    """``--rehearse``: 0 when every rank built, stepped and fits; 2 otherwise (reason on stderr)."""
    try:
        ranks = parse_ranks(ranks_spec, plan)
    except RanksError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = rehearse(cfg, plan, ranks)
    except (RuntimeError, ValueError) as exc:  # the cut batch changed the layout: say so, no traceback
        print(f"error: rehearse: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(out))
    else:
        print_report(out)
    for e in out["errors"]:
        print(f"error: rehearse: {e}", file=sys.stderr)
    usable = out.get("usable_memory_bytes")
    for r in out["ranks"]:
        if not r["fits"]:
            print(f"error: rehearse: rank {r['rank']} needs {_gib(r['memory_bytes']['total'])} GiB but the device "
                  f"has {_gib(usable or 0)} GiB usable (capacity less cluster.memory_reserve_gib)", file=sys.stderr)
    return 0 if out["ok"] else 2


def preflight(cfg: Config, plan: dict) -> int:
    """Before a SLURM submission: rehearse the first and last pipeline rank and refuse a job that
    would fail at step 1 (``--no-rehearse`` skips it). Prints one line; returns 0 or 2."""
    d = plan["degrees"]
    ranks = sorted({0, rank_of(plan, pp=int(d["pp"]) - 1)})
    try:
        out = rehearse(cfg, plan, ranks)
    except (RuntimeError, ValueError) as exc:
        print(f"error: pre-flight rehearsal: {exc}; --no-rehearse submits anyway", file=sys.stderr)
        return 2
    if out["ok"]:
        secs = max((r["seconds"] for r in out["ranks"]), default=0.0)
        print(f"paralayer: pre-flight rehearsal of ranks {ranks} passed ({secs:.0f} s; --no-rehearse skips it)",
              file=sys.stderr)
        return 0
    for e in out["errors"]:
        print(f"error: pre-flight rehearsal: {e}", file=sys.stderr)
    for r in out["ranks"]:
        if not r["fits"]:
            print(f"error: pre-flight rehearsal: rank {r['rank']} needs {_gib(r['memory_bytes']['total'])} GiB, "
                  f"more than the device's usable {_gib(out['usable_memory_bytes'] or 0)} GiB", file=sys.stderr)
    print("error: not submitted (the job would fail at step 1); --no-rehearse submits anyway", file=sys.stderr)
    return 2
