"""Which rank the others waited for: the straggler a rank slowed anywhere cannot hide.

A rank's own clocks cannot tell a slow peer from its own slowness: a rank stopped (a throttled
GPU, a noisy neighbour, SIGSTOP) while it is inside a collective or between timed regions counts
the stop as its own waiting, exactly like the peers that wait for it, and a stop just after a
collective's data arrived makes its own wait look long. What it cannot hide is when it ARRIVED:
each blocking collective on a matched group (paralayer/parallel/comm_trace.py ``arrivals``: our
own, FSDP2's, DTensor's on the layout's dp·cp, tp and pp groups) charges every member the time
from its arrival to the last member's arrival, to that last member; each point-to-point wait
(pipeline, cp ring) charges the peer the time from when this rank began to wait to when the peer
posted its side (a receive waits for the send; on gloo and NCCL a send also waits for the receive
to be posted); zero if the peer posted first. Sends and receives between two ranks with one tag
pair up in order of posting, as gloo and NCCL pair them.

Arrivals are ``time.monotonic()`` readings: ranks on one host share that clock; a rank on another
host is put on rank 0's clock by an offset measured at start-up (:func:`clock_offsets`, the
median over a few barrier releases; the same for every rank of a host).

At a logged step each matched group exchanges its members' arrivals and P2P posts (all_gathers of
:data:`CAP` arrivals and :data:`PCAP` posts per member, as many rounds as the largest member
needs: the counts travel in the first), then the world gather of paralayer/metrics/rank_timing.py
carries each rank's total and its :data:`SLOTS` largest charges. A rank's score is what the
others waited for it less what it waited for others (``net``): a rank that kept a peer waiting
only because it was itself waiting for a third one nets about zero.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from paralayer.compat import all_gather_single

CAP = 64  # collective arrivals per member per exchange round
PCAP = 32  # point-to-point operations per member per exchange round
SLOTS = 8
WIDTH = 1 + 2 * SLOTS  # the row this module adds to each rank's world-gather row
ROUNDS = 5  # barrier releases timed for the clock offsets


def match_layout(trace: Any, meshes: Any, hosts: Sequence[str]) -> None:
    """Tell the trace which groups' collectives to match: dp·cp (the gradient reduction, the loss,
    FSDP2), tp (DTensor), pp (the pipeline's barrier and loss broadcast); the gradient-norm sum
    (axis "pp_ep_tp") on pp, else on tp without ep (with ep it spans two groups: not matched)."""
    size = meshes.size
    axes = {a: meshes[a].get_group() for a in ("dp_cp", "tp", "pp") if size(a) > 1}
    if size("pp") > 1:
        axes["pp_ep_tp"] = axes["pp"]
    elif size("tp") > 1 and size("ep") == 1:
        axes["pp_ep_tp"] = axes["tp"]
    trace.match(axes)
    if len(set(hosts)) > 1:
        trace.offsets = clock_offsets(hosts)


def clock_offsets(hosts: Sequence[str]) -> dict[int, float]:
    """Each rank's monotonic clock minus rank 0's (world collectives, every rank calls it): the
    median over :data:`ROUNDS` barrier releases, then one value per host (rank 0's host: 0)."""
    world = dist.get_world_size()
    diffs: list[list[float]] = [[] for _ in range(world)]
    for _ in range(ROUNDS):
        dist.barrier()
        out: list = [None] * world
        dist.all_gather_object(out, time.monotonic())
        for r in range(world):
            diffs[r].append(out[r] - out[0])
    per_rank = [statistics.median(d) for d in diffs]
    by_host = {h: statistics.median(per_rank[r] for r in range(world) if hosts[r] == h) for h in set(hosts)}
    by_host[hosts[0]] = 0.0
    return {r: by_host[hosts[r]] for r in range(world)}


def _message(arrivals: Sequence[float], sends: Sequence[tuple], rnd: int) -> torch.Tensor:
    """One exchange round: [arrival count, P2P count, CAP arrivals, PCAP (peer, tag, send, posted)]."""
    out = torch.zeros(2 + CAP + 4 * PCAP, dtype=torch.float64)
    out[0], out[1] = len(arrivals), len(sends)
    part = list(arrivals[rnd * CAP:(rnd + 1) * CAP])
    out[2:2 + len(part)] = torch.tensor(part, dtype=torch.float64)
    flat = [x for s in sends[rnd * PCAP:(rnd + 1) * PCAP] for x in s]
    out[2 + CAP:2 + CAP + len(flat)] = torch.tensor(flat, dtype=torch.float64)
    return out


def _exchange(trace: Any, key: tuple, group: Any, device: torch.device) -> tuple[list, list, list]:
    """Every member's arrivals, P2P posts (peer, tag, send, time) and counts, on rank 0's clock."""
    arrivals = trace.arrivals.get(key, [])
    sends = [(e[0], e[1], float(e[2]), e[3]) for e in trace.p2p if e[0] in key]
    got_a: list[list[float]] = [[] for _ in key]
    got_s: list[list[tuple]] = [[] for _ in key]
    counts: list = []
    rnd, rounds = 0, 1
    while rnd < rounds:
        mine = _message(arrivals, sends, rnd).to(device)
        allv = torch.zeros(len(key) * mine.numel(), dtype=torch.float64, device=device)
        all_gather_single(allv, mine, group=group)
        table = allv.view(len(key), -1).cpu().tolist()
        if rnd == 0:
            counts = [(int(t[0]), int(t[1])) for t in table]
            rounds = max(max(-(-a // CAP), -(-s // PCAP)) for a, s in counts) or 1
        for m, t in enumerate(table):
            off = trace.offsets.get(key[m], 0.0)
            na = min(CAP, counts[m][0] - rnd * CAP)
            got_a[m] += [x - off for x in t[2:2 + max(0, na)]]
            ns = min(PCAP, counts[m][1] - rnd * PCAP)
            got_s[m] += [(int(t[2 + CAP + 4 * i]), int(t[3 + CAP + 4 * i]), bool(t[4 + CAP + 4 * i]),
                          t[5 + CAP + 4 * i] - off) for i in range(max(0, ns))]
        rnd += 1
    return got_a, got_s, counts


def owed(trace: Any, device: torch.device) -> dict[int, float]:
    """Seconds this rank waited on each other rank this step (global rank -> seconds), from the
    exchanges of its matched groups."""
    out: dict[int, float] = {}
    me = dist.get_rank()
    mine_off = trace.offsets.get(me, 0.0)
    done: set = set()  # receives charged already (a peer in two matched groups)
    for key, group in trace.matched:
        got_a, got_s, counts = _exchange(trace, key, group, device)
        i_me = key.index(me)
        if counts and len({c[0] for c in counts}) == 1 and counts[0][0] > 0:  # else: not the same collectives
            arr = torch.tensor(got_a, dtype=torch.float64)
            last = arr.argmax(dim=0)
            late = arr.gather(0, last[None])[0] - arr[i_me]
            per = torch.zeros(len(key), dtype=torch.float64).index_add_(0, last, late)
            for m, s in enumerate(per.tolist()):
                if m != i_me and s > 0:
                    out[key[m]] = out.get(key[m], 0.0) + s
        seen: dict[tuple, int] = {}
        for j, (peer, tag, send, _, t_wait) in enumerate(trace.p2p):
            if peer not in key or j in done:
                continue
            done.add(j)
            k = seen[(peer, tag, send)] = seen.get((peer, tag, send), -1) + 1
            # the peer's k-th operation of the other kind with me and that tag is this one's partner
            posted = [t for p, g, s, t in got_s[key.index(peer)] if p == me and g == tag and s != send]
            if k < len(posted) and t_wait == t_wait:  # waited on
                late = posted[k] - (t_wait - mine_off)
                if late > 0:
                    out[peer] = out.get(peer, 0.0) + late
    return out


def row(charged: dict[int, float]) -> list[float]:
    """This rank's part of the world gather: its total wait on others, then the :data:`SLOTS`
    largest (rank, seconds) pairs (rank -1: empty)."""
    top = sorted(charged.items(), key=lambda kv: -kv[1])[:SLOTS]
    out = [float(sum(charged.values()))]
    for i in range(SLOTS):
        peer, s = top[i] if i < len(top) else (-1, 0.0)
        out += [float(peer), float(s)]
    return out


def net(rows: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """From every rank's :func:`row` (by rank): (seconds the others waited for each rank, that
    less the seconds the rank itself waited for others)."""
    caused = [0.0] * len(rows)
    for r in rows:
        for i in range(SLOTS):
            peer = int(r[1 + 2 * i])
            if 0 <= peer < len(rows):
                caused[peer] += r[2 + 2 * i]
    return caused, [c - r[0] for c, r in zip(caused, rows)]
