"""Per-rank step time, split, and the straggler: the rank the others waited for.

Every logged step each rank contributes its step time split into compute, time blocked in
collectives, pipeline idle and data wait (see paralayer/parallel/comm_trace.py for what
"collectives" covers), and what paralayer/metrics/waited_for.py measured (the seconds it waited
on each other rank), to one small all_gather over the world. ``busy`` = compute + data wait.
The straggler (``slowest_rank``, ``slowest_host``) is the rank with the largest net wait charged
to it (what the others waited for it less what it waited for them): a rank slowed anywhere,
inside a collective too, is named (its own busy time may not show it). ``rank_time_spread``
stays max busy over the median; ``waited_for_slowest_s`` / ``waited_for_slowest_net_s`` are
the named rank's charge. A rank whose net charge exceeds ``logging.straggler_pct`` percent of
the median busy time for :data:`STREAK` logged steps in a row gets one console warning naming
it, its host, and the part that is slow. Without the wait rows (a caller with no trace) the
straggler is the rank with the largest busy time, as before.
"""
from __future__ import annotations

import socket
import statistics
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from paralayer.compat import all_gather_single
from paralayer.metrics import waited_for

PARTS = ("compute", "collectives", "pipeline_idle", "data_wait")
STREAK = 3


def hostnames() -> list[str]:
    """Every rank's host name, by rank (one object gather, at start-up)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, socket.gethostname())
    return out


def split(step_s: float, data_s: float, collectives_s: float, idle_s: float) -> list[float]:
    """This rank's parts (in PARTS order): compute is what is left of the step."""
    compute = max(0.0, step_s - data_s - collectives_s - idle_s)
    return [compute, collectives_s, idle_s, data_s]


def gather(parts: Sequence[float], device: torch.device) -> list[list[float]]:
    """Every rank's parts, by rank (one all_gather of len(PARTS) floats per rank)."""
    world = dist.get_world_size()
    mine = torch.tensor(list(parts), dtype=torch.float64, device=device)
    out = torch.zeros(world * len(parts), dtype=torch.float64, device=device)
    all_gather_single(out, mine)
    return out.view(world, len(parts)).cpu().tolist()


class StragglerWatch:
    """Turns gathered tables into metrics fields, and warns once per straggling rank."""

    def __init__(self, pct: float, hosts: Sequence[str], streak: int = STREAK, printer=print):
        self.pct = float(pct)
        self.hosts = list(hosts)
        self.streak = streak
        self.printer = printer
        self.runs = [0] * len(self.hosts)
        self.warned: set[int] = set()

    def fields(self, table: Sequence[Sequence[float]], step: int) -> dict:
        """``table``: every rank's PARTS, then (optionally) its waited_for.row."""
        busy = [row[0] + row[3] for row in table]
        med = statistics.median(busy)
        waits = len(table[0]) > len(PARTS)
        caused, score = waited_for.net([row[len(PARTS):] for row in table]) if waits else (None, busy)
        nobody = waits and not any(caused)
        if nobody:
            score = busy  # nobody waited on anybody (one rank): the busiest
        slow = max(range(len(busy)), key=lambda r: (score[r], busy[r], -r))
        out = {"slowest_rank": slow, "slowest_host": self.hosts[slow],
               "rank_time_spread": max(busy) / med if med > 0 else 1.0,
               "rank_busy_max_s": max(busy), "rank_busy_median_s": med}
        if waits:
            out.update(waited_for_slowest_s=caused[slow], waited_for_slowest_net_s=score[slow])
        for r in range(len(busy)):
            # one rank has no straggler; where nobody waited on anybody, the busy-time rule decides
            by_wait = waits and not nobody
            over = med > 0 and len(busy) > 1 and (
                score[r] > med * self.pct / 100 if by_wait else busy[r] > med * (1 + self.pct / 100))
            self.runs[r] = self.runs[r] + 1 if over else 0
            if self.runs[r] >= self.streak and r not in self.warned:
                self.warned.add(r)
                self.printer(self.warning(table, r, busy, med, step, caused if by_wait else None))
        return out

    def warning(self, table, r: int, busy, med: float, step: int, caused=None) -> str:
        medians = [statistics.median(row[i] for row in table) for i in range(len(PARTS))]
        part = max((0, 3), key=lambda i: table[r][i] - medians[i])  # compute or data wait
        how = (f"kept the other ranks waiting {caused[r]:.3f} s" if caused is not None else
               f"is {100 * (busy[r] / med - 1):.0f}% slower than the median rank")
        return (f"paralayer: straggler: rank {r} (host {self.hosts[r]}) {how} (median rank busy {med:.3f} s) "
                f"for {self.runs[r]} logged steps in a row (to step {step}); "
                f"slow part: {PARTS[part]} {table[r][part]:.3f} s vs median {medians[part]:.3f} s")


def maybe_fields(watch: Optional[StragglerWatch], parts: Sequence[float], device, step: int,
                 trace: Any = None) -> dict:
    """The gathers and the fields (every rank calls it on a logged step; only rank 0 warns).
    With ``trace`` (paralayer/parallel/comm_trace.py) the straggler is the rank waited for."""
    if watch is None:
        return {}
    extra = waited_for.row(waited_for.owed(trace, device)) if trace is not None else []
    return watch.fields(gather(list(parts) + extra, device), step)
