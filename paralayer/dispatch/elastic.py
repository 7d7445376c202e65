"""Elastic resume: a job that comes back on fewer nodes than it was planned for.

With ``cluster.slurm.min_nodes`` the job asks SLURM for ``min_nodes-nodes`` nodes, so after a node
is lost the requeued attempt starts on what is left instead of waiting for the dead node. Its
ranks re-plan the run for the nodes they got (``parallel.dp=auto`` takes the smaller world), and
the newest checkpoint is loaded under the new layout, as a local resume from 4 to 2 ranks does.
Every task re-plans the same way (the resolver is deterministic and torch-free) and writes the
same plan.json / resolved.yaml atomically, so each rank reads the new plan after its own write.
The first plan is kept as ``plan.nodes<N>.json``.
"""
from __future__ import annotations

import json
import os
import sys

from paralayer import config as config_mod
from paralayer.resolve import resolve


def needs_replan(run_dir: str, job_nodes: int) -> bool:
    """The job runs on fewer nodes than the run was first planned for (plan.json, or the first plan
    kept by an earlier re-plan): every task asks, so every task re-plans and says so."""
    import glob

    planned = []
    for p in [os.path.join(run_dir, "plan.json"), *glob.glob(os.path.join(run_dir, "plan.nodes*.json"))]:
        try:
            with open(p) as f:
                planned.append(int(json.load(f).get("nodes") or 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return bool(planned) and job_nodes < max(planned)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def replan(run_dir: str, nodes: int, rank: int) -> int:
    """Re-plan ``run_dir`` for ``nodes`` nodes; the new world size. A layout that does not fit the
    smaller world is one line and exit 2."""
    cfg = config_mod.from_yaml_file(os.path.join(run_dir, "resolved.yaml"))
    old_nodes = cfg.cluster.nodes
    if str(cfg.parallel.dp) != "auto":
        _refuse(rank, f"the job came back on {nodes} of {old_nodes} nodes, but parallel.dp={cfg.parallel.dp} fixes "
                      "the world size; parallel.dp=auto lets it resume on the smaller world")
    cfg.cluster.nodes = nodes
    plan = resolve(cfg)
    d = plan.to_dict()
    if d.get("errors"):
        e = d["errors"][0]
        _refuse(rank, f"the job came back on {nodes} of {old_nodes} nodes and the run does not fit there: "
                      f"{e.get('field')}: {e.get('message')}")
    keep = os.path.join(run_dir, f"plan.nodes{old_nodes}.json")
    if not os.path.exists(keep):
        try:
            os.link(os.path.join(run_dir, "plan.json"), keep)
        except OSError:
            pass
    _write(os.path.join(run_dir, "plan.json"), json.dumps(d, indent=2) + "\n")
    _write(os.path.join(run_dir, "resolved.yaml"), config_mod.to_yaml(cfg))
    print(f"[paralayer.slurm] rank {rank}: elastic resume on {nodes} node(s): re-planned for {d['world_size']} "
          f"rank(s), degrees {d['degrees']}", flush=True)
    return int(d["world_size"])


def _refuse(rank: int, why: str) -> None:
    print(f"error: rank {rank}: {why}", file=sys.stderr, flush=True)
    sys.exit(2)
