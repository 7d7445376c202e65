"""Full recompute's transient per token: what a recomputed block holds beside the saved sets while
its backward runs, by the blocks' kinds; pure arithmetic over per-kind tables, so the resolver
(activations) and the planner (planner.memory) sum the same bytes through here.

Why its own module: activations.py is at the 500-line limit, and these rules take no config.
"""
from __future__ import annotations


def live_transient(blocks: list, none: tuple, full: tuple, extra: tuple = (0.0, 0.0, 0.0, 0.0)) -> float:
    """Full recompute's transient per token of blocks run in forward order, ``blocks`` their
    (kind, fully recomputed): a full backward reruns them top-down, freeing each block's saved set
    as it ends, so recomputed block i adds t_i = none − full + extra of its kind less the saved sets
    of the blocks above it: max over i, never below 0 (``none``, ``full``: elements per token by
    kind; ``extra``: under cp a Gated DeltaNet layer's rule rerun, activations.rerun_extra "full").
    Only each kind's topmost recomputed block can hold the max."""
    best = 0.0
    above_n, above_f, seen = [0] * len(none), [0] * len(none), set()
    for kind, rec in reversed(blocks):
        if rec and kind not in seen:
            seen.add(kind)
            gone = 0.0
            for k in range(len(none)):
                gone += above_f[k] * full[k] + above_n[k] * none[k]
            best = max(best, (none[kind] - full[kind] + extra[kind]) - gone)
        (above_f if rec else above_n)[kind] += 1
    return best


def split_transient(counts: tuple, tr: list) -> float:
    """A V schedule's split pass's transient: each fully recomputed block of its chunk (``counts`` by
    kind) holds its set less its input (``tr`` by kind), together (its graph is kept for the weight pass)."""
    out = 0.0
    for n, t in zip(counts, tr):
        out += n * t
    return out
