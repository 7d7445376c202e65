"""The pipeline's measured timeline: the bubble from every stage's recorded actions, and the
picture (one row per stage, as in Narayanan et al.'s schedule figures)."""
from __future__ import annotations

from typing import Optional, Sequence


def busy_seconds(events: Sequence[dict]) -> float:
    """Seconds covered by one rank's actions: the union of their intervals (dualpipev's
    overlapped forward and backward run at once; their shared seconds count once)."""
    busy, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["start"]):
        if e["end"] > end:
            busy += e["end"] - max(e["start"], end)
            end = e["end"]
    return busy


def bubble_from_timelines(events_by_stage: Sequence[Sequence[dict]]) -> float:
    """The bubble definition of the runner's docstring, from gathered timelines."""
    evs = [e for row in events_by_stage for e in row]
    window = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    busy = [busy_seconds(row) for row in events_by_stage]
    mean_busy = sum(busy) / len(busy)
    return (window - mean_busy) / mean_busy


# ------------------------------------------------------------------ the picture
_COLOURS = {"F": ("#4C72B0", "#9DB7DD"), "B": ("#55A868", "#A5D6A7"),
            "W": ("#DD8452", "#F2C09F")}
_IDLE = "#E6E6E6"


def plot_timeline(events_by_stage: Sequence[Sequence[dict]], path: str, title: Optional[str] = None) -> str:
    """One row per pp rank: forward (blue), backward (green; input-grad under zero-bubble), weight
    grad (orange), idle (grey); the lighter shade marks a rank's later chunk (interleaved / V).
    Microbatch numbers (1-based, as in Narayanan et al.) sit on the blocks. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [list(r or []) for r in events_by_stage]
    evs = [e for r in rows for e in r]
    if not evs:
        raise ValueError("no events to plot (was measure=False?)")
    t0 = min(e["start"] for e in evs)
    t1 = max(e["end"] for e in evs)
    span = max(t1 - t0, 1e-9)
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.35 * len(evs) / max(1, len(rows)) + 6)),
                                    0.6 * len(rows) + 1.4))
    for r, row in enumerate(rows):
        y = len(rows) - 1 - r
        ax.barh(y, span * 1e3, left=0, height=0.8, color=_IDLE, edgecolor="none")
        chunks = sorted({e["chunk"] for e in row})
        for e in row:
            shade = 0 if chunks.index(e["chunk"]) == 0 else 1
            colour = _COLOURS.get(e["action"], ("#999999", "#CCCCCC"))[shade]
            left, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            ax.barh(y, width, left=left, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
            if width > span * 1e3 / 120:
                ax.text(left + width / 2, y, str(e["mb"] + 1), ha="center", va="center", fontsize=7,
                        color="white" if shade == 0 else "black")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {len(rows) - 1 - i}" for i in range(len(rows))])
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span * 1e3)
    ax.set_title(title or "pipeline timeline")
    ax.legend(handles=[Patch(color=_COLOURS["F"][0], label="forward"),
                       Patch(color=_COLOURS["B"][0], label="backward (input grad under ZB)"),
                       Patch(color=_COLOURS["W"][0], label="weight grad"),
                       Patch(color=_IDLE, label="idle")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
