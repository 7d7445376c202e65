"""Per-rank step time, split, and the straggler it reveals.

Every logged step each rank contributes five floats (its step time split into compute, time
blocked in our collectives, pipeline idle and data wait; see paralayer/parallel/comm_trace.py for
what "collectives" covers) to one small all_gather over the world. A synchronous step takes as
long on every rank (the fast ones wait in collectives), so ranks are compared on the time they
spend working: ``busy`` = compute + data wait. metrics.jsonl gains ``slowest_rank``,
``slowest_host`` and ``rank_time_spread`` (max busy over the median). A rank whose busy time
exceeds the median by more than ``logging.straggler_pct`` for :data:`STREAK` logged steps in a
row gets one console warning naming it, its host, and the part that is slow.
"""
from __future__ import annotations

import socket
import statistics
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from paralayer.compat import all_gather_single

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
        busy = [row[0] + row[3] for row in table]
        med = statistics.median(busy)
        slow = max(range(len(busy)), key=lambda r: (busy[r], -r))
        spread = busy[slow] / med if med > 0 else 1.0
        for r, b in enumerate(busy):
            over = med > 0 and b > med * (1 + self.pct / 100)
            self.runs[r] = self.runs[r] + 1 if over else 0
            if self.runs[r] >= self.streak and r not in self.warned:
                self.warned.add(r)
                self.printer(self.warning(table, r, busy, med, step))
        return {"slowest_rank": slow, "slowest_host": self.hosts[slow], "rank_time_spread": spread,
                "rank_busy_max_s": busy[slow], "rank_busy_median_s": med}

    def warning(self, table, r: int, busy, med: float, step: int) -> str:
        medians = [statistics.median(row[i] for row in table) for i in range(len(PARTS))]
        part = max((0, 3), key=lambda i: table[r][i] - medians[i])  # compute or data wait
        return (f"paralayer: straggler: rank {r} (host {self.hosts[r]}) is {100 * (busy[r] / med - 1):.0f}% "
                f"slower than the median rank for {self.runs[r]} logged steps in a row (to step {step}); "
                f"slow part: {PARTS[part]} {table[r][part]:.3f} s vs median {medians[part]:.3f} s")


def maybe_fields(watch: Optional[StragglerWatch], parts: Sequence[float], device, step: int) -> dict:
    """The gather and the fields (every rank calls it on a logged step; only rank 0 warns)."""
    if watch is None:
        return {}
    return watch.fields(gather(parts, device), step)
