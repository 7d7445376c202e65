"""A node lost in the middle of a job: which node, which ranks, said by the launcher and recorded
on the job.

SLURM notices a dead node when its slurmd stops answering (SlurmdTimeout), ends the job's attempt
as NODE_FAIL and, the job being requeueable, queues it again. The surviving ranks have already
left (their collective with the dead ranks failed). What SLURM does not say is which ranks died:
``run.dir/placement.json`` (written by every run at start-up) maps ranks to hosts.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Optional


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError):
        return ""


def expand(nodelist: str) -> list[str]:
    """``n[1-2]`` -> ['n1', 'n2'] (scontrol's own expansion)."""
    if not nodelist or nodelist.startswith("None"):
        return []
    return _run(["scontrol", "show", "hostnames", nodelist]).split() or [nodelist]


def failed_attempts(job_id: str) -> int:
    """How many attempts of the job ended NODE_FAIL (sacct -D lists every attempt)."""
    rows = _run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job_id]).split()
    return sum(1 for s in rows if s.upper().startswith("NODE_FAIL"))


def lost_nodes(job_id: str) -> list[str]:
    """Nodes of the job's NODE_FAIL attempts that SLURM now has down (all of them, if none is)."""
    nodes: list[str] = []
    for line in _run(["sacct", "-n", "-X", "-D", "-P", "-o", "State,NodeList", "-j", job_id]).splitlines():
        state, _, nl = line.partition("|")
        if state.upper().startswith("NODE_FAIL"):
            nodes += [n for n in expand(nl.strip()) if n not in nodes]
    down = set()
    for line in _run(["sinfo", "-h", "-N", "-o", "%N|%T"]).splitlines():
        name, _, st = line.partition("|")
        if any(w in st.lower() for w in ("down", "fail", "no_respond")) or st.endswith("*"):
            down.add(name.strip())
    return [n for n in nodes if n in down] or nodes


def placement(run_dir: str) -> dict:
    """run.dir/placement.json ({rank: {host, local_rank}}), or {} when it is missing or unreadable."""
    try:
        with open(os.path.join(run_dir, "placement.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def ranks_on(run_dir: str, hosts: list[str]) -> list[int]:
    """The ranks placement.json puts on ``hosts``."""
    where = placement(run_dir)
    return sorted(int(r) for r, w in where.items() if isinstance(w, dict) and w.get("host") in hosts)


def hosts_of(run_dir: str, ranks: list[int]) -> list[str]:
    """The hosts placement.json gives ``ranks``."""
    place = placement(run_dir)
    return sorted({place[str(r)]["host"] for r in ranks if str(r) in place and "host" in place[str(r)]})


def describe(job_id: str, run_dir: str) -> Optional[str]:
    """One line naming the lost node(s) and their ranks, or None when no attempt ended NODE_FAIL.
    Also left on the job as its Comment (``scontrol show job``), so the job's record names them."""
    nodes = lost_nodes(job_id)
    if not nodes:
        return None
    ranks = ranks_on(run_dir, nodes)
    who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "its ranks"
    line = (f"node {', '.join(nodes)} lost (NODE_FAIL): {who} of {run_dir} died with it; the surviving ranks "
            "exited; SLURM requeues the job and it resumes from the newest complete checkpoint")
    _run(["scontrol", "update", f"JobId={job_id}", f"Comment=lost node {','.join(nodes)} ranks "
          f"{','.join(map(str, ranks)) or '?'}"])
    return line


def up_nodes() -> int:
    """How many nodes SLURM can give a job now (not down, drained or unresponsive)."""
    n = 0
    for line in _run(["sinfo", "-h", "-N", "-o", "%N|%T"]).splitlines():
        _, _, st = line.partition("|")
        st = st.strip().lower()
        if st and not st.endswith("*") and not any(w in st for w in ("down", "drain", "fail")):
            n += 1
    return n


def reopen(job_id: str, min_nodes: int, nodes: int, tasks_per_node: int) -> Optional[str]:
    """A job started on ``nodes`` nodes is requeued with that count fixed (SLURM narrows
    ``--nodes=MIN-MAX`` to the allocation, and NumTasks with it), so it would wait for the dead node.
    Ask again for what is up now, at least ``min_nodes`` (``cluster.slurm.min_nodes``)."""
    n = max(min_nodes, min(nodes, up_nodes()))
    if n >= nodes:
        return None
    r = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"NumTasks={n * tasks_per_node}",
                        f"NumNodes={min_nodes}-{n}"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"could not re-open the job to {n} node(s): {(r.stderr or r.stdout).strip()}"
    return (f"asked again for {n} node(s) x {tasks_per_node} task(s) (cluster.slurm.min_nodes={min_nodes}): "
            "it resumes on the smaller world")
