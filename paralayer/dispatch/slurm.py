"""Dispatch prepared runs to SLURM through submitit.

One run  -> one job with ``nodes x devices_per_node`` tasks (one task per rank).
Several  -> one job array (one element per run), each element the same shape.

Each task exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT with
``submitit.helpers.TorchDistributedEnvironment`` and calls the entry point (default
``paralayer.train:main``) with the run directory. The task is ``Checkpointable``: on the
pre-timeout USR2 signal (or a preemption) rank 0 requeues the job, and the requeued call
runs with ``PARALAYER_RESUME=auto`` so the training code resumes from its latest checkpoint.

Usage::

    from paralayer.dispatch.slurm import submit
    res = submit([run_dir], cluster, folder=run_dir + "/slurm")
    print(res.hint)                 # job ids, logs, "follow with: tail -f ..."
    rc = res.wait(timeout_s=600)    # = follow(res, ...): 0 when all completed, 1 otherwise (prints the stderr tail)

This module imports submitit lazily (and never torch), so importing it is cheap.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ENTRY = "paralayer.train:main"
RESUME_ENV = "PARALAYER_RESUME"

# sacct states after which a job will not run again
_TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
    "DEADLINE", "REVOKED", "SPECIAL_EXIT",
}
# the variables TorchDistributedEnvironment sets; a copy inherited from the submitter
# (sbatch exports the caller's environment) must not leak into the ranks
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# cluster keys this module understands (others are ignored, so a whole cluster profile can be
# passed). The lead's schema nests the SLURM ones under ``slurm:``; flat dicts work too.
CLUSTER_KEYS = (
    "nodes", "devices_per_node", "device", "gpus_per_node", "cpus_per_task", "mem_gb", "partition",
    "account", "qos", "time_min", "constraint", "sbatch_extra", "srun_args", "setup", "job_name",
    "max_requeues", "signal_delay_s", "array_parallelism", "folder", "slurm_conf",
)
LOCAL_SLURM_CONF = os.path.join(os.environ.get("PARALAYER_SLURM_HOME", "/tmp/paralayer-slurm"), "etc", "slurm.conf")


class DispatchError(RuntimeError):
    """Bad cluster settings or run directories, or sbatch refused the job."""


def resolve_entry(entry: str | Callable[[str], Any]) -> Callable[[str], Any]:
    """``"pkg.module:function"`` (or ``"pkg.module.function"``) -> the function; callables pass through."""
    if callable(entry):
        return entry
    if ":" in entry:
        mod_name, _, attr = entry.partition(":")
    else:
        mod_name, _, attr = entry.rpartition(".")
    if not mod_name or not attr:
        raise DispatchError(f"entry {entry!r}: expected 'module:function'")
    fn: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise DispatchError(f"entry {entry!r} is not callable")
    return fn


def _checkpointable_base() -> type:
    try:
        import submitit.helpers

        return submitit.helpers.Checkpointable
    except ImportError:  # the module stays importable without submitit
        return object


class RankTask(_checkpointable_base()):  # type: ignore[misc]
    """What each SLURM task runs: export the torch.distributed variables, call the entry point.

    Picklable: holds only strings. ``resume`` is set to ``"auto"`` on the copy that
    ``checkpoint()`` resubmits, and exported as ``PARALAYER_RESUME`` before the entry runs.
    """

    def __init__(self, run_dir: str, entry: str = DEFAULT_ENTRY, resume: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.run_dir = str(run_dir)
        self.entry = entry
        self.resume = resume
        self.env = dict(env or {})

    def __call__(self) -> Any:
        import submitit.helpers

        for k in _DIST_VARS:
            os.environ.pop(k, None)
        os.environ.update(self.env)
        if self.resume:
            os.environ[RESUME_ENV] = self.resume
        elif int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
            # requeued without our checkpoint() running (a bare `scontrol requeue`, a node failure,
            # a requeue by the admin): the batch script re-runs from its start with the original
            # pickled task, so resume from the newest periodic checkpoint of the run
            os.environ[RESUME_ENV] = "auto"
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True)
        want = _plan_world(self.run_dir)
        if want and want < dist_env.world_size:
            # a job array has one shape for all elements: an element whose plan needs fewer ranks
            # than the array's tasks runs on the first `want` tasks, the others stay idle
            if dist_env.rank >= want:
                print(f"[paralayer.slurm] task {dist_env.rank}: idle (the plan of {self.run_dir} has "
                      f"{want} rank(s), the job {dist_env.world_size} tasks)", flush=True)
                return None
            # LOCAL_WORLD_SIZE stays the job's tasks per node: each task was allocated its
            # cpus_per_task share and train.main sizes its threads by it (seen: a 1-rank element
            # taking both cores of the 2-core node ran 20x slower per step under load)
            dist_env.world_size = want
            os.environ["WORLD_SIZE"] = str(want)
        print(f"[paralayer.slurm] rank {dist_env.rank}/{dist_env.world_size} "
              f"(local {dist_env.local_rank}) master {dist_env.master_addr}:{dist_env.master_port} "
              f"run_dir={self.run_dir} resume={os.environ.get(RESUME_ENV, '-')}", flush=True)
        fn = resolve_entry(self.entry)
        return fn(self.run_dir)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on rank 0 at USR2 (timeout) or preemption: requeue with resume=auto."""
        import submitit.helpers

        os.environ[RESUME_ENV] = "auto"
        nxt = RankTask(self.run_dir, self.entry, resume="auto", env=self.env)
        return submitit.helpers.DelayedSubmission(nxt, *args, **kwargs)

    def __repr__(self) -> str:
        return f"RankTask(run_dir={self.run_dir!r}, entry={self.entry!r}, resume={self.resume!r})"


def _plan_world(run_dir: str) -> int | None:
    """world_size of the run's plan.json (None when the plan does not say)."""
    import json

    try:
        with open(os.path.join(run_dir, "plan.json")) as f:
            w = json.load(f).get("world_size")
        return int(w) if w else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


@dataclasses.dataclass
class SubmitResult:
    """What ``submit`` returns. ``jobs`` are submitit Job objects (one per run)."""

    job_ids: list[str]
    run_dirs: list[str]
    folder: str
    stdout: list[list[str]]   # per run, per task
    stderr: list[list[str]]   # per run, per task
    array: bool
    jobs: list[Any] = dataclasses.field(repr=False, default_factory=list)
    status: int | None = None  # set by wait(): 0 all completed, 1 failed, 124 wait deadline passed
    states: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def hint(self) -> str:
        kind = f"job array {self.job_ids[0].split('_')[0]}" if self.array else f"job {self.job_ids[0]}"
        lines = [f"submitted {kind} ({len(self.job_ids)} run(s)) ; submitit folder {self.folder}"]
        for jid, rd in zip(self.job_ids, self.run_dirs):
            lines.append(f"  {jid}: {rd}  (metrics: {os.path.join(rd, 'metrics.jsonl')})")
        lines.append(f"logs: {self.folder} (<job id>_<task>_log.out / .err, one pair per rank)")
        lines.append(f"follow with: tail -f {' '.join(self.stdout[0][:1] + self.stderr[0][:1])}")
        lines.append(f"status: squeue -j {self.job_ids[0].split('_')[0]} ; "
                     f"sacct -j {self.job_ids[0].split('_')[0]}")
        return "\n".join(lines)

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0, verbose: bool = True,
             stream=None) -> int:
        return follow(self, timeout_s=timeout_s, poll_s=poll_s, verbose=verbose, stream=stream)


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
        device = "cuda" if int(cluster.get("gpus_per_node") or 0) > 0 else "cpu"
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
    if device == "cpu":
        setup.append("export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}" if nodes == 1 else ":")
    setup += [str(s) for s in _as_list(cluster.get("setup"))]
    params["slurm_setup"] = setup
    return params


def _check_run_dirs(run_dirs: Sequence[str]) -> list[str]:
    if not run_dirs:
        raise DispatchError("no run directories to submit")
    out = []
    for rd in run_dirs:
        p = Path(rd).resolve()
        missing = [f for f in ("resolved.yaml", "plan.json") if not (p / f).is_file()]
        if missing:
            raise DispatchError(f"run directory {p} lacks {', '.join(missing)}")
        out.append(str(p))
    return out


def _ensure_slurm(cluster: Mapping[str, Any]) -> None:
    conf = cluster.get("slurm_conf")
    if (not conf and not os.environ.get("SLURM_CONF") and not os.path.isfile("/etc/slurm/slurm.conf")
            and os.path.isfile(LOCAL_SLURM_CONF)):
        conf = LOCAL_SLURM_CONF  # the one-node SLURM of cluster/local_slurm.sh
    if conf and not os.environ.get("SLURM_CONF"):
        if not Path(conf).is_file():
            raise DispatchError(f"cluster.slurm_conf={conf}: no such file (is the cluster started? "
                                "cluster/local_slurm.sh start)")
        os.environ["SLURM_CONF"] = str(conf)
    for tool in ("sbatch", "srun", "sacct"):
        if shutil.which(tool) is None:
            raise DispatchError(f"'{tool}' not found: SLURM client tools are required for cluster.backend=slurm")


def submit(run_dirs: Sequence[str] | str, cluster: Mapping[str, Any], folder: str | None = None,
           wait: bool = False, *, entry: str | Callable[[str], Any] = DEFAULT_ENTRY,
           timeout_s: float | None = None, env: Mapping[str, str] | None = None,
           verbose: bool = True) -> SubmitResult:
    """Submit prepared run directories (each holding resolved.yaml and plan.json).

    One run -> one job; several -> one job array. ``cluster`` is a dict (see CLUSTER_KEYS; the
    ``slurm:`` section may be nested, a ClusterConfig or OmegaConf node works too).
    ``folder`` holds submitit's files and the task logs, used as given. Default: a fresh
    ``<cluster.slurm.folder or <parent of the run dirs>/slurm-logs>/<time>-<id>`` -- fresh, because
    submitit recognises results by job id and a wiped SLURM reuses ids from 1.
    ``entry`` is ``"module:function"``, called with the run directory in every task. ``env`` is
    exported in every task. With ``wait=True`` the jobs are followed to the end (``timeout_s``
    caps the wait) and ``.status`` is set.
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [str(run_dirs)]
    dirs = _check_run_dirs(run_dirs)
    cluster = normalize_cluster(cluster)
    params = executor_parameters(cluster)
    _ensure_slurm(cluster)
    if folder is None:
        parent = cluster.get("folder") or os.path.join(
            os.path.commonpath([os.path.dirname(d) for d in dirs]),
            "slurm-logs")
        folder = os.path.join(str(parent), time.strftime("%Y%m%d-%H%M%S") + f"-{os.urandom(3).hex()}")
    folder = str(Path(folder).resolve())
    os.makedirs(folder, exist_ok=True)

    import submitit

    max_num_timeout = int(cluster.get("max_requeues") if cluster.get("max_requeues") is not None else 3)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_num_timeout)
    executor.update_parameters(**params)

    entry_str = entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"
    tasks = [RankTask(d, entry_str, resume=None, env=env) for d in dirs]
    try:
        if len(tasks) == 1:
            jobs = [executor.submit(tasks[0])]
        else:
            with executor.batch():
                pending = [executor.submit(t) for t in tasks]
            jobs = list(pending)
    except Exception as e:  # sbatch refused: bad partition, account, ...
        import re

        msgs = list(dict.fromkeys(m.strip() for m in re.findall(r"sbatch: error: [^\n]*?(?=sbatch: error:|\n|$)",
                                                                 str(e))))
        raise DispatchError("submission failed: " + ("; ".join(msgs) if msgs else str(e))) from e

    stdout, stderr = [], []
    for j in jobs:
        subs = getattr(j, "_sub_jobs", None) or [j]
        stdout.append([str(s.paths.stdout) for s in subs])
        stderr.append([str(s.paths.stderr) for s in subs])
    res = SubmitResult(job_ids=[str(j.job_id) for j in jobs], run_dirs=dirs, folder=folder,
                       stdout=stdout, stderr=stderr, array=len(jobs) > 1, jobs=jobs)
    if verbose:
        print(res.hint, flush=True)
    if wait:
        follow(res, timeout_s=timeout_s, verbose=verbose)
    return res


def _task_outcomes(job: Any, since: float | None = None) -> list[tuple[str, Any] | None]:
    """Per task: ("success", value) / ("error", traceback) from submitit's result pickle, or None.
    ``since``: the start (epoch s) of the job's current attempt; older pickles were left by an
    attempt that was requeued and do not count."""
    from submitit.core import utils

    out: list[tuple[str, Any] | None] = []
    for s in (getattr(job, "_sub_jobs", None) or [job]):
        p = s.paths.result_pickle
        try:
            stale = since is not None and p.stat().st_mtime < since - 1.0
        except OSError:
            stale = False
        if p.exists() and not stale:
            try:
                out.append(tuple(utils.pickle_load(p)))  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - half-written pickle, unpicklable result...
                out.append(("error", f"could not read {p}: {e}"))
        else:
            out.append(None)
    return out


def _sacct_states(job_ids: Sequence[str], starts: dict[str, float] | None = None) -> dict[str, str]:
    """job id (incl. array element ids like 12_0) -> sacct State (first word, upper case).
    ``starts``, when given, is filled with the start (epoch s) of each job's current attempt."""
    base = sorted({j.split("_")[0] for j in job_ids})
    cmd = ["sacct", "-n", "-X", "-P", "-o", "JobID,State,Start"] + [a for b in base for a in ("-j", b)]
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 2:
            continue
        jid, state = parts[0].strip(), parts[1]
        states[jid] = state.split()[0].upper() if state.split() else "UNKNOWN"
        if starts is not None and len(parts) > 2:
            try:
                starts[jid] = time.mktime(time.strptime(parts[2].strip(), "%Y-%m-%dT%H:%M:%S"))
            except ValueError:  # "Unknown" / "None" while pending
                pass
    return states


def _squeue_states(job_ids: Sequence[str]) -> dict[str, str]:
    """job id -> state from slurmctld (squeue): live, where sacct lags behind slurmdbd by seconds —
    a short job can go from PENDING to COMPLETED between two sacct answers. Only queued or
    running jobs are listed."""
    base = sorted({j.split("_")[0] for j in job_ids})
    cmd = ["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(base)]
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 2 and parts[1]:
            states[parts[0]] = parts[1].upper()
    return states


# PENDING reasons that mean the job can never start as submitted
_NEVER_REASONS = {
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
    "InvalidQOS", "DependencyNeverSatisfied", "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob",
    "QOSMaxNodePerJobLimit", "AssocMaxCpuPerJobLimit", "AssocMaxNodesPerJobLimit",
}


def _pending_reasons(job_ids: Sequence[str]) -> dict[str, str]:
    """job id -> squeue reason, for jobs PENDING with a reason in _NEVER_REASONS."""
    base = sorted({j.split("_")[0] for j in job_ids})
    try:
        text = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T|%r", "-j", ",".join(base)],
                              capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[1] == "PENDING" and parts[2] in _NEVER_REASONS:
            out[parts[0]] = parts[2]
    return out


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no file)\n"


# states in which the job is not running its current attempt: result pickles seen now were left by
# an attempt that was requeued (scontrol requeue, preemption, timeout) and say nothing yet
_NOT_RUNNING_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESIZING",
                       "PREEMPTED", "CONFIGURING"}


class _LogEcho:
    """Echo the lines rank 0 appends to its stdout log (the training progress) while waiting."""

    def __init__(self, result: SubmitResult, stream) -> None:
        self.paths = [(jid, out[0]) for jid, out in zip(result.job_ids, result.stdout) if out]
        self.prefix = len(self.paths) > 1
        self.offsets = {p: 0 for _, p in self.paths}
        self.partial = {p: "" for _, p in self.paths}
        self.stream = stream

    def poll(self) -> None:
        for jid, p in self.paths:
            try:
                with open(p, errors="replace") as f:
                    f.seek(self.offsets[p])
                    chunk = f.read()
                    self.offsets[p] = f.tell()
            except OSError:
                continue
            if not chunk:
                continue
            text = self.partial[p] + chunk
            lines = text.split("\n")
            self.partial[p] = lines.pop()
            for line in lines:
                line = line.rstrip("\r")
                if line.strip():
                    print(f"[{jid}] {line}" if self.prefix else line, file=self.stream, flush=True)


def follow(result: SubmitResult, timeout_s: float | None = None, poll_s: float = 1.0,
           verbose: bool = True, stream=None, echo_logs: bool | None = None) -> int:
    """See _follow. Ctrl-C stops following (exit status 130); the jobs keep running."""
    try:
        return _follow(result, timeout_s, poll_s, verbose, stream, echo_logs)
    except KeyboardInterrupt:
        base = result.job_ids[0].split("_")[0]
        print(f"\n[paralayer.slurm] stopped following; the job keeps running (squeue -j {base}; "
              f"scancel {base} to stop it)", file=stream or sys.stderr, flush=True)
        result.status = 130
        return 130


def _follow(result: SubmitResult, timeout_s: float | None = None, poll_s: float = 1.0,
            verbose: bool = True, stream=None, echo_logs: bool | None = None) -> int:
    """Follow the jobs to the end. Returns 0 when every run completed, 1 when one failed
    (printing its stderr tail), 124 when ``timeout_s`` passed first (jobs left running).

    ``verbose`` prints each job's state changes (PENDING, RUNNING, REQUEUED, ...) and, unless
    ``echo_logs=False``, the lines rank 0 writes to its stdout log. A requeued job is followed
    through its requeue to the end of its last attempt."""
    stream = stream or sys.stderr
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ids = result.job_ids
    last_sacct = 0.0
    states: dict[str, str] = {}
    starts: dict[str, float] = {}
    shown: dict[str, str] = {}
    done: dict[str, bool] = {}
    outcomes: dict[str, list] = {}
    never: dict[str, str] = {}
    echo = _LogEcho(result, stream) if (verbose if echo_logs is None else echo_logs) else None
    while True:
        now = time.monotonic()
        live = _squeue_states(ids)
        states.update(live)
        if now - last_sacct >= max(2.0, poll_s):
            states.update(_sacct_states(ids, starts))
            states.update(live)  # slurmctld knows first; sacct fills in what has left the queue
            last_sacct = now
            for jid, reason in _pending_reasons([j for j in ids if not done.get(j)]).items():
                if jid in ids and not done.get(jid):
                    never[jid] = reason
                    done[jid] = True
                    subprocess.run(["scancel", jid], capture_output=True, timeout=30)
                    if verbose:
                        print(f"[paralayer.slurm] job {jid} can never start as submitted (PENDING, reason "
                              f"{reason}): cancelled it", file=stream, flush=True)
        if verbose:
            for jid in ids:
                st = states.get(jid)
                if st and st != shown.get(jid) and st not in _TERMINAL_STATES:
                    shown[jid] = st
                    print(f"[paralayer.slurm] job {jid}: {st}", file=stream, flush=True)
        if echo is not None:
            echo.poll()
        for jid, job in zip(ids, result.jobs):
            if done.get(jid):
                continue
            st = states.get(jid, "UNKNOWN")
            oc = _task_outcomes(job, since=starts.get(jid))
            if st in _NOT_RUNNING_STATES:
                oc = [None] * len(oc)
            outcomes[jid] = oc
            # every task returned: done (sacct lags a moment behind). A task that raised is not
            # the end by itself: a requeue (scontrol requeue, preemption) can make ranks fail on
            # the way down and the job runs again, so wait for SLURM to call the job finished
            if all(o is not None and o[0] == "success" for o in oc) or st in _TERMINAL_STATES:
                done[jid] = True
        if all(done.get(j) for j in ids):
            break
        if deadline is not None and time.monotonic() >= deadline:
            result.states = {j: states.get(j, "UNKNOWN") for j in ids}
            result.status = 124
            if verbose:
                print(f"[paralayer.slurm] gave up waiting after {timeout_s:.0f}s; still running: "
                      f"{[j for j in ids if not done.get(j)]} (scancel {ids[0].split('_')[0]} to stop)",
                      file=stream, flush=True)
            return 124
        time.sleep(poll_s)

    if echo is not None:
        echo.poll()
    final = _sacct_states(ids)
    failed = []
    for jid in ids:
        if jid in never:
            result.states[jid] = f"PENDING({never[jid]})"
            failed.append(jid)
            continue
        oc = outcomes[jid]
        ok = all(o is not None and o[0] == "success" for o in oc)
        st = final.get(jid, states.get(jid, "UNKNOWN"))
        if ok and st in _TERMINAL_STATES - {"COMPLETED"}:
            ok = False
        result.states[jid] = st if not (ok and st not in _TERMINAL_STATES) else "COMPLETED"
        if not ok:
            failed.append(jid)
    result.status = 1 if failed else 0
    if verbose:
        for jid in ids:
            print(f"[paralayer.slurm] job {jid}: {result.states[jid]}", file=stream, flush=True)
        for jid in [j for j in failed if j not in never][:3]:
            i = ids.index(jid)
            oc = outcomes[jid]
            bad = [t for t, o in enumerate(oc) if o is None or o[0] != "success"] or [0]
            t = next((t for t in bad if oc[t] is not None), bad[0])
            print(f"[paralayer.slurm] job {jid} failed ({result.states[jid]}); run {result.run_dirs[i]}",
                  file=stream, flush=True)
            if oc[t] is not None and oc[t][0] == "error":
                print(f"--- task {t} traceback ---\n{oc[t][1]}", file=stream, flush=True)
            print(f"--- tail of {result.stderr[i][t]} ---\n{_tail(result.stderr[i][t])}",
                  file=stream, flush=True)
    return result.status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paralayer.dispatch.slurm RUN_DIR... --profile cluster/profiles/local-slurm.yaml``"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m paralayer.dispatch.slurm", description=main.__doc__)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--profile", required=True, help="cluster profile YAML (its top level or its 'cluster:' key)")
    ap.add_argument("--folder", default=None)
    ap.add_argument("--entry", default=DEFAULT_ENTRY)
    ap.add_argument("--wait", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=None)
    a = ap.parse_args(argv)
    import yaml

    with open(a.profile) as f:
        prof = yaml.safe_load(f) or {}
    cluster = prof["cluster"] if isinstance(prof.get("cluster"), dict) else prof
    try:
        res = submit(a.run_dirs, cluster, a.folder, wait=a.wait, entry=a.entry, timeout_s=a.timeout_s)
    except DispatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return res.status or 0


if __name__ == "__main__":
    sys.exit(main())
