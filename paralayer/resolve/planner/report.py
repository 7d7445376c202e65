"""The planner's answer for people: each layout's reason for losing to the first, the rich table,
and the ``--plan`` CLI entry."""
from __future__ import annotations

import sys
from typing import Any, Optional

from paralayer.config import Config
from paralayer.inputs import strict_json
from paralayer.inputs.echo import markup_safe
from paralayer.resolve.cost.machine import Machine, machine_for
from paralayer.resolve.memory import GIB
from paralayer.resolve.planner.search import plan_layouts


def finish(plans: list[dict], cfg: Config, mach: Optional[Machine] = None, upto: Optional[int] = None) -> None:
    """Fill in ``why`` (how each layout loses to the first) for the first ``upto`` layouts (all by
    default)."""
    if not plans:
        return
    mach = mach or machine_for(cfg)
    best = plans[0]
    for d in plans[:upto]:
        d["why"] = "fastest" if d is best else why_slower(d, best, mach)


# ------------------------------------------------------------------ explaining the ranking
def why_slower(d: dict, best: dict, mach: Machine) -> str:
    """One line: how much slower than the first, and the term that accounts for most of it."""
    pct = 100.0 * (d["step_time_s"] / best["step_time_s"] - 1)
    head = f"+{pct:.1f}% step time" if pct >= 0.05 else "ties on step time"
    if d["spans"]["tp"] == "inter-node" and d["degrees"]["tp"] > 1:
        ratio = mach.intra_gbps / mach.inter_gbps if mach.inter_gbps else float("inf")
        return f"{head}: tp spans nodes: tp comm {ratio:.1f}× slower ({d['comm_time_s']['tp']:.3g} s)"
    if pct < 0.05:
        diffs = [k for k in ("zero", "micro_batch", "recompute", "schedule", "tp_overlap") if d.get(k) != best.get(k)]
        return head + (f" (differs in {', '.join(diffs)}; more memory)" if diffs and
                       d["memory"]["total"] > best["memory"]["total"] else "")
    terms = {
        "bubble": (d["bubble_s"] - best["bubble_s"], f"pp bubble {d['bubble']:.3f}"),
        "imbalance": (d["imbalance_s"] - best["imbalance_s"],
                      f"pp stage imbalance {d['imbalance']:.3f} (busiest stage / mean)"),
        "recompute": (d["recompute_s"] - best["recompute_s"], f"recompute={d['recompute']}"),
        "dp": (d["dp_exposed_s"] - best["dp_exposed_s"], f"dp sync exposed {d['dp_exposed_s']:.3g} s"),
    }
    for ax in ("tp", "pp", "cp", "ep"):
        inter = d["spans"][ax] == "inter-node" and d["degrees"][ax] > 1
        unhidden = ax == "tp" and d["degrees"]["tp"] > 1 and not d.get("tp_overlap") and best.get("tp_overlap")
        terms[ax] = (d["comm_time_s"][ax] - best["comm_time_s"][ax],
                     f"{ax} comm {d['comm_time_s'][ax]:.3g} s" + (" (spans nodes)" if inter else "")
                     + (" (tp_overlap off)" if unhidden else ""))
    _, (delta, text) = max(terms.items(), key=lambda kv: kv[1][0])
    if delta <= 0:
        return head
    return f"{head}: {text} (+{delta:.3g} s)"


# ------------------------------------------------------------------ CLI
#: overrides that narrow ``--plan``: dotted key -> the planner's ``fixed`` name
NARROWING = {"parallel.tp": "tp", "parallel.pp": "pp", "parallel.vpp": "vpp", "parallel.cp": "cp",
             "parallel.ep": "ep", "parallel.dp": "dp", "parallel.schedule": "schedule", "parallel.zero": "zero",
             "parallel.recompute": "recompute", "parallel.recompute_every": "recompute_every",
             "parallel.tp_overlap": "tp_overlap", "train.micro_batch": "micro_batch"}
#: rows of the table when --top is not given
# --plan --json without --top: the best JSON_ROWS layouts, so the answer stays within seconds on
# clusters with a hundred thousand valid layouts (--top N asks for more).
JSON_ROWS = 100
TABLE_ROWS = 15
#: the most layouts --plan lists: a larger --top is capped to it (a note on stderr says so). The
#: planner's search grows with the rows asked for; printing is linear in the rows printed.
MAX_TOP = 100
#: tables longer than this are written as plain aligned text (rich takes ~2 ms a row)
RICH_ROWS = 50


def fixed_from_overrides(overrides: list[str], cfg: Config) -> dict:
    """The layout settings given on the command line (their typed values from ``cfg``): ``--plan``
    lists only layouts with them. The recipe's own degrees do not narrow (they are what is being
    planned); ``parallel.dp=auto`` does not either."""
    fixed = {}
    for ov in overrides:
        key = ov.partition("=")[0].strip()
        if key in NARROWING:
            section, _, name = key.partition(".")
            value = getattr(getattr(cfg, section), name)
            if value != "auto":
                fixed[NARROWING[key]] = value
    return fixed


def run(cfg: Config, args: Any, fixed: Optional[dict] = None) -> int:  # noqa: D401
    """``launch.py --plan [--json] [--top N] [parallel.tp=8 ...]``: the ranked layouts (by time to
    train: every layout trains the same tokens per step, so by step time), narrowed to the degrees
    given as overrides; exit 0 if any layout fits, else 2."""
    top = getattr(args, "top", None)
    if top is not None and top < 1:
        print(f"error: --top: must be a whole number >= 1, got {top}", file=sys.stderr)
        return 2
    if top is not None and top > MAX_TOP:
        print(f"note: --top {top:,} capped at {MAX_TOP:,}, the most layouts --plan lists", file=sys.stderr)
        top = MAX_TOP
    as_json = getattr(args, "json", False)
    stats: dict = {}
    limit = top or (JSON_ROWS if as_json else TABLE_ROWS)
    plans = plan_layouts(cfg, stats=stats, top=limit, fixed=fixed)
    finish(plans, cfg)
    if not plans:  # say so on stderr, with the closest layouts and why each fails (exit 2 below)
        from paralayer.resolve.planner import no_fit

        no_fit.report(cfg, stats, fixed)
    if as_json:
        print(strict_json.dumps(plans))
        if top is None and len(plans) == JSON_ROWS:
            print(f"note: the best {JSON_ROWS:,} layouts; --top N lists more (or fewer)", file=sys.stderr)
        if stats["work_bound_hit"]:
            print(f"warning: {stats['unexplored']:,} layout structures not explored (more than "
                  f"{stats['considered']:,}); narrow with overrides or use --top", file=sys.stderr)
        return 0 if plans else 2
    print_plans(cfg, plans, stats, top=top or TABLE_ROWS)
    return 0 if plans else 2


def _header(cfg: Config, stats: dict, con: Any) -> None:
    mach = stats["machine"]
    con.print(f"[bold]{markup_safe(cfg.recipe)}[/bold] on {markup_safe(cfg.cluster.name)}: {mach['nodes']} node(s) × "
              f"{mach['devices_per_node']} = {mach['world']} devices; peak {mach['peak_tflops']:g} TFLOP/s × "
              f"efficiency {mach['efficiency']:.3g}; links {mach['intra_gbps']:.4g} GB/s in a node, "
              f"{mach['inter_gbps']:.4g} GB/s across (effective)")
    fixed = stats.get("fixed") or {}
    if fixed:
        con.print("fixed on the command line: " + markup_safe(", ".join(f"{k}={v}" for k, v in fixed.items()))
                  + " (only layouts with these are listed)")
    why = ("the planner's work bound was reached: narrow with overrides, e.g. parallel.tp=8" if stats.get("work_bound_hit")
           else "their lower bound on step time cannot reach the listed ones")
    more = f"; {stats['unexplored']:,} structures not explored ({why})" if stats.get("unexplored") else ""
    con.print(f"{stats['considered']:,} layout structures evaluated, {stats['listed']:,} layouts fit{more}; "
              f"planned in {stats['seconds']:.2f} s CPU")


def print_plans(cfg: Config, plans: list[dict], stats: dict, top: int = TABLE_ROWS, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console(file=sys.stdout, width=max(210, Console().width))
    _header(cfg, stats, con)
    priced = cfg.cluster.price_per_device_hour is not None
    basis = plans[0]["train_tokens_from"] if plans else "train.tokens"
    t = Table(title=f"Top {min(top, len(plans))} layouts, ranked by time to train "
                    f"({plans[0]['train_tokens']:.3g} tokens from {basis})" if plans else "No layout")
    fp8 = bool(plans) and "fp8_gain" in plans[0]  # train.precision=fp8 on a GPU: each row's gain over its bf16
    cols = ["#", "tp", "ovl", "pp", "vpp", "cp", "ep", "dp", "schedule", "zero", "recompute", "mb", "step s",
            *(["fp8 gain"] if fp8 else []), "tok/s", "MFU", "bubble", "mem GiB", "days", "device-h"] \
        + (["cost"] if priced else []) + ["why it loses to #1"]
    for c in cols:
        why = c == "why it loses to #1"
        t.add_column(c, justify="left" if c in ("schedule", "recompute") or why else "right",
                     no_wrap=not why, min_width=24 if why else None)
    rows = [_row(d, priced) for d in plans[:top]]
    if len(rows) > RICH_ROWS:  # linear and fast: plain aligned text
        con.file.write(plain_table(str(t.title), cols, rows))
    else:
        for r in rows:
            t.add_row(*r)
        con.print(t)
    if stats["dropped"]:
        t = Table(title="Dropped layouts, by reason")
        t.add_column("reason")
        t.add_column("count", justify="right")
        for reason, n in sorted(stats["dropped"].items(), key=lambda kv: -kv[1]):
            t.add_row(reason, f"{n:,}")
        con.print(t)
    if plans:
        con.print("[dim]time to train: ideal steps only (no failures, restarts, checkpoint stalls, evaluation)[/dim]")
        con.print("run the first: python launch.py recipe=" + markup_safe(cfg.recipe + " " + " ".join(plans[0]["overrides"])))
    else:
        con.print("[red]no layout fits[/red]" + (" with the degrees fixed on the command line" if stats.get("fixed")
                                                  else ""))


def _row(d: dict, priced: bool) -> list[str]:
    g = d["degrees"]
    return [str(d["rank"]), str(g["tp"]), "yes" if d.get("tp_overlap") else "-",
            *(str(g[a]) for a in ("pp", "vpp", "cp", "ep", "dp")), d["schedule"],
            str(d["zero"]), _recompute_label(d),
            str(d["micro_batch"]), f"{d['step_time_s']:.3g}",
            *([f"{d['fp8_gain']:.3f}×"] if "fp8_gain" in d else []), f"{d['tokens_per_s']:,.0f}", f"{100 * d['mfu']:.1f}%", f"{d['bubble']:.3f}",
            f"{d['memory']['total'] / GIB:.1f}", f"{d['train_days']:.3g}", f"{d['device_hours']:,.0f}",
            *([f"{d['train_cost']:,.0f}"] if priced else []), d["why"]]


def plain_table(title: str, cols: list[str], rows: list[list[str]]) -> str:
    """A title, a header and one line per row, columns aligned: time linear in the text written."""
    widths = [len(c) for c in cols]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))
    left = {"schedule", "recompute", "why it loses to #1"}
    fmt = [(lambda c, w=w: c.ljust(w)) if name in left else (lambda c, w=w: c.rjust(w))
           for name, w in zip(cols, widths)]
    out = [title, "  ".join(f(c) for f, c in zip(fmt, cols)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(f(c) for f, c in zip(fmt, r)).rstrip() for r in rows]
    return "\n".join(out) + "\n"


__all__ = ["finish", "why_slower", "print_plans", "run", "fixed_from_overrides"]


def _recompute_label(d: dict) -> str:
    """The table's recompute column: the mode, and full/k where only every k-th layer is recomputed."""
    k = d.get("recompute_every", 1)
    return d["recompute"] + (f"/{k}" if k > 1 else "")
