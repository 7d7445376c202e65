"""report.png: measured against predicted step time, one labelled point per layout with the
y = x line; beside it, memory per device the same way. A point above the line is a run slower (or
bigger) than predicted. Runs with nothing measured are named under the plots, not dropped."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence


def _axis(ax: Any, pts: List[tuple], title: str, xlabel: str, ylabel: str, scale: float = 1.0) -> None:
    """Scatter (predicted, measured, label) points with a y = x line over their range; log axes
    when the values span more than 20×."""
    if not pts:
        ax.text(0.5, 0.5, "no run has both a prediction\nand a measurement", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_title(title)
        return
    xs = [p[0] / scale for p in pts]
    ys = [p[1] / scale for p in pts]
    lo, hi = min(xs + ys), max(xs + ys)
    log = lo > 0 and hi / lo > 5
    if log:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        lo, hi = lo / 1.5, hi * 1.5
        ax.set_xscale("log")
        ax.set_yscale("log")
        for a in (ax.xaxis, ax.yaxis):
            a.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            a.set_minor_formatter(NullFormatter())
    else:
        pad = 0.08 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1e-12)
        lo, hi = max(0.0, lo - pad), hi + pad
    ax.plot([lo, hi], [lo, hi], color="0.6", linestyle="--", linewidth=1, label="y = x (as predicted)")
    ax.scatter(xs, ys, s=36, zorder=3)
    _labels(ax, xs, ys, [p[2] for p in pts])
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


#: where a label may sit beside its point (offset in points, horizontal alignment), in order of preference
_PLACES = [((6, 5), "left"), ((6, -12), "left"), ((-6, 5), "right"), ((-6, -12), "right"), ((0, 10), "center"),
           ((0, -18), "center"), ((10, 16), "left"), ((-10, -24), "right")]


def _labels(ax: Any, xs: List[float], ys: List[float], labels: List[str]) -> None:
    """Label each point at the first place where its text overlaps no point and no label placed
    before it (points close together otherwise print their labels over each other)."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    dots = [ax.transData.transform((x, y)) for x, y in zip(xs, ys)]
    taken: List[Any] = []
    for x, y, label in zip(xs, ys, labels):
        text = None
        for offset, ha in _PLACES:
            if text is not None:
                text.remove()
            text = ax.annotate(label, (x, y), textcoords="offset points", xytext=offset, ha=ha, fontsize=8)
            box = text.get_window_extent(renderer).expanded(1.05, 1.2)
            if not any(box.overlaps(b) for b in taken) and not any(box.contains(*d) for d in dots):
                break
        taken.append(text.get_window_extent(renderer))


def _points(rows: Sequence[Any], key: str) -> List[tuple]:
    out = []
    for r in rows:
        p, m = r.predicted.get(key), r.measured.get(key)
        if p is not None and m is not None and p > 0 and m > 0:
            out.append((p, m, r.label))
    return out


def plot(rows: Sequence[Any], path: str, title: Optional[str] = None) -> str:
    """Write report.png for the report's rows (see :class:`paralayer.metrics.report.Row`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5.4))
    _axis(a1, _points(rows, "step_time_s"), "step time: measured vs predicted",
          "predicted step time (s)", "measured step time (s, median)")
    cpu = any(getattr(r, "device", "") == "cpu" for r in rows)
    _axis(a2, _points(rows, "memory_bytes"), "memory per device: measured vs predicted" +
          ("\n(CPU: measured is the whole process's peak RSS)" if cpu else ""),
          "predicted (MiB, most loaded device)", "measured (MiB, rank 0 peak)", scale=2.0 ** 20)
    missing = [f"{r.label} ({r.state})" for r in rows
               if r.measured.get("step_time_s") is None or r.state != "completed"]
    fig.suptitle(title or f"paralayer sweep report: {len(rows)} run(s)")
    if missing:
        fig.text(0.5, 0.01, "not completed: " + ", ".join(missing), ha="center", fontsize=8, color="firebrick")
    fig.tight_layout(rect=(0, 0.04 if missing else 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
