"""The multi-node rendezvous traps, caught before a task imports torch.

A job of more than one node whose ranks meet on loopback never meets: gloo's connectFullMesh
times out after minutes ("Connect timeout"), NCCL hangs. The two classic causes:
- ``MASTER_ADDR`` resolves to 127.x (the first node's hostname maps to loopback in /etc/hosts, as
  many images ship it), so every other node dials its own loopback;
- the interface the process group binds is ``lo`` (``GLOO_SOCKET_IFNAME=lo``, or no interface set
  and this node's hostname resolving to 127.x: gloo binds the address of the hostname).
Each is one line naming the variable and the fix, and the task exits 2 before any collective.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import Callable, Mapping, Optional

FIX = ("set cluster.network_interface to the interface that joins the nodes (e.g. eth0, ib0: "
       "`ip -4 addr` on a node), which exports GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for every task")


def _loopback(host: str, resolve: Callable[[str], list[str]]) -> Optional[str]:
    """The first loopback address ``host`` resolves to, or None."""
    try:
        addrs = resolve(host)
    except OSError:
        return None
    for a in addrs:
        try:
            if ipaddress.ip_address(a.split("%")[0]).is_loopback:
                return a
        except ValueError:
            continue
    return None


def _resolve(host: str) -> list[str]:
    return [ai[4][0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]


def rendezvous_trap(nodes: int, env: Mapping[str, str], hostname: str,
                    resolve: Callable[[str], list[str]] = _resolve) -> Optional[str]:
    """Why ranks of a ``nodes``-node job would not meet (one line), or None. Pure: the environment,
    this node's hostname and a resolver are passed in."""
    if nodes <= 1:
        return None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        names = [n.strip() for n in (env.get(var) or "").lstrip("=^").split(",") if n.strip()]
        if names and all(n == "lo" or n.startswith("lo:") for n in names):
            return f"{var}={env[var]} on a job of {nodes} nodes: the ranks would meet on loopback; {FIX}"
    master = env.get("MASTER_ADDR")
    if master:
        lo = _loopback(master, resolve)
        if lo:
            return (f"MASTER_ADDR={master} resolves to the loopback address {lo} on a job of {nodes} nodes: the "
                    "other nodes cannot reach it; map the first node's hostname to its network address (not "
                    f"127.x) in /etc/hosts or DNS, or {FIX}")
    if not env.get("GLOO_SOCKET_IFNAME") and not env.get("NCCL_SOCKET_IFNAME"):
        lo = _loopback(hostname, resolve)
        if lo:
            return (f"GLOO_SOCKET_IFNAME is unset and this node's hostname {hostname} resolves to {lo}: the process "
                    f"group would bind lo on a job of {nodes} nodes; {FIX}")
    return None


def check_rendezvous(rank: int, nodes: int) -> None:
    """In each SLURM task, after MASTER_ADDR is exported: a trap is one line on stderr and exit 2."""
    host = socket.gethostname()
    why = rendezvous_trap(nodes, os.environ, host)
    if why:
        print(f"error: rank {rank} on {host}: {why}", file=sys.stderr, flush=True)
        sys.exit(2)
