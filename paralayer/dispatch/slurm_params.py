"""The cluster profile as submitit's SLURM parameters (nodes, tasks, GPUs, partition, srun
arguments, each task's setup lines): pure mapping, no submitit and no torch, so the front door and
the tests read them without a cluster."""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any, Mapping

from paralayer.dispatch.errors import DispatchError
from paralayer.resolve.rules import auto_device  # the one rule for device: auto

REPO_ROOT = Path(__file__).resolve().parents[2]

# cluster keys this module understands (others are ignored, so a whole cluster profile can be
# passed). The lead's schema nests the SLURM ones under ``slurm:``; flat dicts work too.
CLUSTER_KEYS = (
    "nodes", "devices_per_node", "device", "gpus_per_node", "cpus_per_task", "mem_gb", "partition",
    "account", "qos", "time_min", "constraint", "sbatch_extra", "srun_args", "setup", "job_name",
    "max_requeues", "signal_delay_s", "array_parallelism", "folder", "slurm_conf", "network_interface",
    "min_nodes", "max_restarts",
)

def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, (str, bytes)):
        return [x]
    return list(x)


def normalize_cluster(cluster: Any) -> dict[str, Any]:
    """A plain flat dict from a dict, a ClusterConfig dataclass or an OmegaConf node; the nested
    ``slurm:`` section is lifted to the top level (it wins over top-level duplicates)."""
    if cluster is None:
        return {}
    if dataclasses.is_dataclass(cluster) and not isinstance(cluster, type):
        cluster = dataclasses.asdict(cluster)
    elif not isinstance(cluster, Mapping):
        try:
            from omegaconf import OmegaConf

            cluster = OmegaConf.to_container(cluster, resolve=True)
        except Exception as e:  # noqa: BLE001
            raise DispatchError(f"cluster settings must be a mapping, got {type(cluster).__name__}") from e
    flat = {k: v for k, v in dict(cluster).items() if k != "slurm"}
    nested = cluster.get("slurm") or {}
    if dataclasses.is_dataclass(nested) and not isinstance(nested, type):
        nested = dataclasses.asdict(nested)
    flat.update({k: v for k, v in dict(nested).items()})
    if "max_num_timeout" in flat and "max_requeues" not in flat:
        flat["max_requeues"] = flat.pop("max_num_timeout")
    return flat


def _sbatch_value(v: Any) -> Any:
    if isinstance(v, str) and v.lower() in ("true", "yes"):
        return True
    if isinstance(v, str) and v.lower() in ("false", "no"):
        return False
    return v


def executor_parameters(cluster: Mapping[str, Any], *, job_name: str = "paralayer") -> dict[str, Any]:
    """Map our cluster settings onto submitit AutoExecutor parameters (cluster="slurm")."""
    cluster = normalize_cluster(cluster)
    nodes = int(cluster.get("nodes") or 1)
    tasks_per_node = int(cluster.get("devices_per_node") or 1)
    if nodes < 1 or tasks_per_node < 1:
        raise DispatchError(f"cluster.nodes={nodes}, cluster.devices_per_node={tasks_per_node}: must be >= 1")
    device = str(cluster.get("device") or "auto").lower()
    if device == "auto":
        device = auto_device(device, cluster.get("peak_tflops"))
    if device not in ("cpu", "cuda", "gpu"):
        raise DispatchError(f"cluster.device={device!r}: expected one of 'cpu', 'cuda'")
    time_min = int(cluster.get("time_min") or 60)
    if time_min < 1:
        raise DispatchError(f"cluster.time_min={time_min}: must be >= 1")

    params: dict[str, Any] = {
        "nodes": nodes,
        "tasks_per_node": tasks_per_node,
        "timeout_min": time_min,
        "name": str(cluster.get("job_name") or job_name),
    }
    gpus = cluster.get("gpus_per_node")
    if device in ("cuda", "gpu"):
        params["gpus_per_node"] = int(gpus) if gpus else tasks_per_node
    elif gpus:
        params["gpus_per_node"] = int(gpus)
    cpus_per_task = cluster.get("cpus_per_task")
    if cpus_per_task:
        params["cpus_per_task"] = int(cpus_per_task)
    if cluster.get("mem_gb"):
        params["mem_gb"] = cluster["mem_gb"]
    for ours, theirs in (("partition", "slurm_partition"), ("account", "slurm_account"),
                         ("qos", "slurm_qos"), ("constraint", "slurm_constraint")):
        if cluster.get(ours):
            params[theirs] = str(cluster[ours])
    if cluster.get("signal_delay_s") is not None:
        params["slurm_signal_delay_s"] = int(cluster["signal_delay_s"])
    if cluster.get("array_parallelism") is not None:
        params["slurm_array_parallelism"] = int(cluster["array_parallelism"])

    extra = dict(cluster.get("sbatch_extra") or {})
    min_nodes = cluster.get("min_nodes")
    if min_nodes:  # an elastic job: SLURM may start (or requeue) it on fewer nodes, down to min_nodes
        if not 1 <= int(min_nodes) <= nodes:
            raise DispatchError(f"cluster.slurm.min_nodes={min_nodes}: must be between 1 and cluster.nodes={nodes}")
        if int(min_nodes) < nodes:
            extra["nodes"] = f"{int(min_nodes)}-{nodes}"
    if extra:
        extra = {str(k).replace("_", "-"): _sbatch_value(v) for k, v in extra.items()}
        extra = {k: v for k, v in extra.items() if v is not False and v is not None}
        if extra:
            params["slurm_additional_parameters"] = extra

    # one rank failing ends the step instead of leaving its peers blocked in a collective
    srun_args = [str(a) for a in _as_list(cluster.get("srun_args"))]
    if not any(a.startswith(("--kill-on-bad-exit", "-K")) for a in srun_args):
        srun_args = ["--kill-on-bad-exit=1", *srun_args]
    params["slurm_srun_args"] = srun_args

    threads = int(cpus_per_task or 1)
    setup = [
        f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}",
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}",
    ]
    ifname = cluster.get("network_interface")
    if ifname:  # the interface every task's process group uses (gloo on CPU, NCCL's bootstrap on GPUs)
        q = shlex.quote(str(ifname))
        setup.append(f"export GLOO_SOCKET_IFNAME={q} NCCL_SOCKET_IFNAME={q}")
    elif device == "cpu":
        setup.append("export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}" if nodes == 1 else ":")
    setup += [str(s) for s in _as_list(cluster.get("setup"))]
    params["slurm_setup"] = setup
    return params
