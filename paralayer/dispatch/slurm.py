"""Dispatch prepared runs to SLURM through submitit.

One run  -> one job with ``nodes x devices_per_node`` tasks (one task per rank).
Several  -> one job array (one element per run), each element the same shape.

Each task exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT with
``submitit.helpers.TorchDistributedEnvironment`` and calls the entry point (default
``paralayer.runtime.train:main``) with the run directory. The task is ``Checkpointable``: on the
pre-timeout USR2 signal (or a preemption) rank 0 requeues the job, and the requeued call
passes the config override ``train.resume=auto`` to the entry (``main(run_dir, "train.resume=auto")``)
so the training code resumes from its latest checkpoint.

Usage::

    from paralayer.dispatch.slurm import submit
    res = submit([run_dir], cluster, folder=run_dir + "/slurm")
    print(res.hint)                 # job ids, logs, "follow with: tail -f ..."
    rc = res.wait(timeout_s=600)    # = follow(res, ...): 0 when all completed, 1 otherwise (prints the stderr tail)

This module imports submitit lazily (and never torch), so importing it is cheap.
"""
from __future__ import annotations

import importlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

DEFAULT_ENTRY = "paralayer.runtime.train:main"

# the variables TorchDistributedEnvironment sets; a copy inherited from the submitter
# (sbatch exports the caller's environment) must not leak into the ranks
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# rank 0's store listens below Linux's default ephemeral range (32768-60999), where the kernel hands
# out the ports of outgoing and port-0 sockets (every gloo pair): submitit's own choice, a port drawn
# from 20000-60000 by the job id, collided with one of them under load (EADDRINUSE at rank 0, and the
# job failed before any rank ran)
MASTER_PORT_RANGE = (20000, 32768)


def master_port(job_id: str) -> int:
    """The store's port for a SLURM job: every task of the job computes the same one from
    ``SLURM_JOB_ID`` (unique per array element too); consecutive jobs get consecutive ports."""
    lo, hi = MASTER_PORT_RANGE
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return lo + int(digits) % (hi - lo)

from paralayer.dispatch.errors import DispatchError, LaunchError  # noqa: E402,F401 - the front door catches them: one line, exit 2
from paralayer.dispatch.slurm_jobs import (  # noqa: E402 - SubmitResult and follow are this module's API too
    SubmitResult,
    follow,
)
from paralayer.dispatch.slurm_params import (  # noqa: E402,F401 - this module's API too
    CLUSTER_KEYS,
    REPO_ROOT,
    executor_parameters,
    normalize_cluster,
)

LOCAL_SLURM_CONF = os.path.join(os.environ.get("PARALAYER_SLURM_HOME", "/tmp/paralayer-slurm"), "etc", "slurm.conf")


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
    ``checkpoint()`` resubmits; the entry then gets the override ``train.resume=auto``.
    """

    def __init__(self, run_dir: str, entry: str = DEFAULT_ENTRY, resume: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.run_dir = str(run_dir)
        self.entry = entry
        self.resume = resume
        self.env = dict(env or {})

    def __call__(self) -> Any:
        import submitit.helpers

        from paralayer.runtime import startup_gc

        startup_gc.pause()  # through the rank's start-up: train() turns it back on
        for k in _DIST_VARS:
            os.environ.pop(k, None)
        os.environ.update(self.env)
        if "MASTER_PORT" not in os.environ and os.environ.get("SLURM_JOB_ID"):
            os.environ["MASTER_PORT"] = str(master_port(os.environ["SLURM_JOB_ID"]))
        resume = self.resume
        if not resume and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
            # requeued without our checkpoint() running (a bare `scontrol requeue`, a node failure,
            # a requeue by the admin): the batch script re-runs from its start with the original
            # pickled task, so resume from the newest periodic checkpoint of the run
            resume = "auto"
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True)
        from paralayer.dispatch import elastic

        want = _plan_world(self.run_dir)
        job_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or 1)
        if elastic.needs_replan(self.run_dir, job_nodes):
            # the job came back on fewer nodes (cluster.slurm.min_nodes): plan for the world it has
            want = elastic.replan(self.run_dir, job_nodes, dist_env.rank)
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
              f"run_dir={self.run_dir} resume={resume or '-'}", flush=True)
        _require_planned_device(self.run_dir, dist_env.rank)
        from paralayer.dispatch.rendezvous import check_rendezvous

        check_rendezvous(dist_env.rank, int(os.environ.get("SLURM_JOB_NUM_NODES") or 1))
        fn = resolve_entry(self.entry)
        out = fn(self.run_dir, f"train.resume={resume}") if resume else fn(self.run_dir)
        if isinstance(out, int) and not isinstance(out, bool) and out != 0:
            # a rank's exit status (2: bad input, reported as one line): the task and the job fail,
            # rather than submitit recording it as a successful result
            sys.exit(out)
        if out in (0, None):  # finished: a native abort in the interpreter's teardown cannot fail the job
            from paralayer.runtime import completion

            completion.exit_zero_at_exit(self.run_dir, dist_env.rank)
        return out

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on rank 0 at USR2 (timeout) or preemption: requeue with resume=auto."""
        import submitit.helpers

        nxt = RankTask(self.run_dir, self.entry, resume="auto", env=self.env)
        return submitit.helpers.DelayedSubmission(nxt, *args, **kwargs)

    def __repr__(self) -> str:
        return f"RankTask(run_dir={self.run_dir!r}, entry={self.entry!r}, resume={self.resume!r})"


def _require_planned_device(run_dir: str, rank: int) -> None:
    """A cuda plan on a node where this task sees no CUDA device stops here, naming the rank and the
    node, instead of training on the CPU (srun --kill-on-bad-exit ends the other tasks)."""
    import json

    try:
        with open(os.path.join(run_dir, "plan.json")) as f:
            device = json.load(f).get("device")
    except (OSError, ValueError, AttributeError):
        return
    if device != "cuda":
        return
    import socket

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"rank {rank} on {socket.gethostname()}: the plan runs on cuda but this task sees no CUDA "
                           f"device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, "
                           f"SLURM_JOB_GPUS={os.environ.get('SLURM_JOB_GPUS', 'unset')}); ask for GPUs with "
                           "cluster.slurm.gpus_per_node, or plan with cluster.device=cpu. Nothing was trained on CPU")


def _plan_world(run_dir: str) -> int | None:
    """world_size of the run's plan.json (None when the plan does not say)."""
    import json

    try:
        with open(os.path.join(run_dir, "plan.json")) as f:
            w = json.load(f).get("world_size")
        return int(w) if w else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


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
    if conf:  # the profile names its cluster (local-slurm-2node): it wins over $SLURM_CONF
        if not Path(conf).is_file():
            raise DispatchError(f"cluster.slurm.slurm_conf={conf}: no such file (is the cluster started? "
                                "cluster/local_slurm.sh start [--nodes N])")
        os.environ["SLURM_CONF"] = str(conf)
    elif (not os.environ.get("SLURM_CONF") and not os.path.isfile("/etc/slurm/slurm.conf")
            and os.path.isfile(LOCAL_SLURM_CONF)):
        os.environ["SLURM_CONF"] = LOCAL_SLURM_CONF  # the one-node SLURM of cluster/local_slurm.sh
    for tool in ("sbatch", "srun", "sacct"):
        if shutil.which(tool) is None:
            raise DispatchError(f"'{tool}' not found: SLURM client tools are required for cluster.backend=slurm")


def _log_folder(cluster: Mapping[str, Any], dirs: list[str], folder: str | None) -> str:
    """submitit's folder: as given, or a fresh one under cluster.slurm.folder (or beside the runs),
    made here so that a file in the way is one named error, never a traceback."""
    if folder is None:
        parent = cluster.get("folder") or os.path.join(
            os.path.commonpath([os.path.dirname(d) for d in dirs]),
            "slurm-logs")
        folder = os.path.join(str(parent), time.strftime("%Y%m%d-%H%M%S") + f"-{os.urandom(3).hex()}")
    folder = str(Path(folder).resolve())
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:  # under a file, or not writable: named, never a traceback
        raise DispatchError(f"cluster.slurm.folder: cannot make {folder} ({exc.strerror or exc}); valid: a folder, "
                            "or a name where one can be made") from None
    return folder


def _sbatch(executor: Any, tasks: list) -> list:
    """One job (one task) or one job array; sbatch's refusal as one DispatchError line."""
    import contextlib
    import io

    try:
        # sbatch's own stderr is echoed by submitit: kept out, its lines go into our one-line error
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
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
        text = "; ".join(msgs) if msgs else " ".join(str(e).split()) or type(e).__name__
        raise DispatchError(f"cluster.slurm: submission failed: {text[:500]}") from e
    return jobs


def submit(run_dirs: Sequence[str] | str, cluster: Mapping[str, Any], folder: str | None = None,
           wait: bool = False, *, entry: str | Callable[[str], Any] = DEFAULT_ENTRY,
           timeout_s: float | None = None, env: Mapping[str, str] | None = None,
           verbose: bool = True, since: float | None = None) -> SubmitResult:
    """Submit prepared run directories (each holding resolved.yaml and plan.json).

    One run -> one job; several -> one job array. ``cluster`` is a dict (see CLUSTER_KEYS; the
    ``slurm:`` section may be nested, a ClusterConfig or OmegaConf node works too).
    ``folder`` holds submitit's files and the task logs, used as given. Default: a fresh
    ``<cluster.slurm.folder or <parent of the run dirs>/slurm-logs>/<time>-<id>`` -- fresh, because
    submitit recognises results by job id and a wiped SLURM reuses ids from 1.
    ``entry`` is ``"module:function"``, called with the run directory in every task. ``env`` is
    exported in every task. With ``wait=True`` the jobs are followed to the end (``timeout_s``
    caps the wait) and ``.status`` is set; with one run and ``cluster.slurm.max_restarts`` > 0 a
    failed attempt is submitted again (dispatch/slurm_restart.py; ``since``: the launcher's start)."""
    since = since or time.time()
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [str(run_dirs)]
    dirs = _check_run_dirs(run_dirs)
    from paralayer.runtime import completion

    for d in dirs:  # only this submission's ranks can say they finished (runtime/completion.py)
        completion.clear(d)
    cluster = normalize_cluster(cluster)
    params = executor_parameters(cluster)
    _ensure_slurm(cluster)
    folder = _log_folder(cluster, dirs, folder)

    import submitit

    max_num_timeout = int(cluster.get("max_requeues") if cluster.get("max_requeues") is not None else 3)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_num_timeout)
    executor.update_parameters(**params)

    entry_str = entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"
    tasks = [RankTask(d, entry_str, resume=None, env=env) for d in dirs]
    jobs = _sbatch(executor, tasks)

    stdout, stderr = [], []
    for j in jobs:
        subs = getattr(j, "_sub_jobs", None) or [j]
        stdout.append([str(s.paths.stdout) for s in subs])
        stderr.append([str(s.paths.stderr) for s in subs])
    res = SubmitResult(job_ids=[str(j.job_id) for j in jobs], run_dirs=dirs, folder=folder,
                       stdout=stdout, stderr=stderr, array=len(jobs) > 1, jobs=jobs)
    if cluster.get("min_nodes") and int(cluster["min_nodes"]) < params["nodes"]:
        res.elastic = (int(cluster["min_nodes"]), params["nodes"], params["tasks_per_node"])
    if verbose:
        print(res.hint, flush=True)
    limit = int(cluster.get("max_restarts") or 0)
    if wait and limit > 0 and len(dirs) == 1:
        from paralayer.dispatch import slurm_restart

        again = RankTask(dirs[0], entry_str, resume="auto", env=env)
        resubmit = slurm_restart.resubmitter(params, folder, max_num_timeout, again, dirs[0], res, verbose)
        return slurm_restart.follow_with_restarts(
            res, dirs[0], limit, resubmit, lambda r: follow(r, timeout_s=timeout_s, verbose=verbose), since)
    if wait:
        follow(res, timeout_s=timeout_s, verbose=verbose)
    return res


def load_profile(path: str) -> dict:
    """``--profile FILE`` as untrusted input: a bounded, depth-checked YAML mapping (its top level or
    its ``cluster:`` key) whose keys and types the front door's schema accepts (the same loader as
    ``cluster=FILE``). BadInput naming --profile (and the field) otherwise."""
    import tempfile

    import yaml

    from paralayer import config as config_mod
    from paralayer.config import ConfigError
    from paralayer.inputs.depth import MAX_FILE_BYTES
    from paralayer.inputs.untrusted import BadInput, read_yaml, show

    prof = read_yaml(path, "--profile", MAX_FILE_BYTES)
    if not isinstance(prof, dict):
        raise BadInput("--profile", f"{show(path)}: must hold a mapping of cluster keys, got "
                       f"{type(prof).__name__ if prof is not None else 'nothing'}")
    cluster = prof["cluster"] if isinstance(prof.get("cluster"), dict) else prof
    with tempfile.TemporaryDirectory() as tmp:  # the schema's check, as cluster=FILE gets it
        f = os.path.join(tmp, "profile.yaml")
        with open(f, "w", encoding="utf-8") as out:
            yaml.safe_dump(cluster, out)
        try:
            config_mod.load_config(["recipe=tiny", f"cluster={f}"])
        except ConfigError as exc:
            raise BadInput("--profile", f"{show(path)}: {exc.field}: {exc.message}".replace(f, show(path))) from None
    return cluster


def _main(argv: Sequence[str] | None) -> int:
    from paralayer.inputs.untrusted import ArgParser, BadInput, check_dir, check_file

    ap = ArgParser(prog="python -m paralayer.dispatch.slurm", description=main.__doc__)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--profile", required=True, help="cluster profile YAML (its top level or its 'cluster:' key)")
    ap.add_argument("--folder", default=None)
    ap.add_argument("--entry", default=DEFAULT_ENTRY)
    ap.add_argument("--wait", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=None)
    a = ap.parse_args(argv)
    cluster = load_profile(a.profile)
    for d in a.run_dirs:
        check_dir(d, "RUN_DIR")
        for name in ("resolved.yaml", "plan.json"):
            check_file(os.path.join(d, name), "RUN_DIR", 16 << 20)
    if a.timeout_s is not None and not (0 < a.timeout_s < 10 ** 7):
        raise BadInput("--timeout-s", f"must be a number of seconds in (0, 1e7), got {a.timeout_s}")
    try:
        res = submit(a.run_dirs, cluster, a.folder, wait=a.wait, entry=a.entry, timeout_s=a.timeout_s)
    except DispatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return res.status or 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paralayer.dispatch.slurm RUN_DIR... --profile cluster/profiles/local-slurm.yaml``"""
    from paralayer.inputs.untrusted import guard

    return guard("resubmit", lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
