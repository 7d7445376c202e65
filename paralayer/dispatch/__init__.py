"""Where a resolved run goes: ranks on this machine, or SLURM through submitit.

Both start from a prepared run directory (``resolved.yaml`` + ``plan.json``); every rank reads
only that, so a job that is requeued or re-run later trains exactly what was planned.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
from pathlib import Path
from typing import Any

from paralayer import config as config_mod
from paralayer.config import Config
from paralayer.dispatch.errors import LaunchError
from paralayer.inputs.echo import one_line
from paralayer.resolve.rules import auto_device


def check_inputs(cfg: Config) -> None:
    """Files a run here reads must exist before ranks start (a dry run plans for other machines and
    does not ask)."""
    for name, path in (("data.path", cfg.data.path), ("data.valid", getattr(cfg.data, "valid", None)),
                       ("data.tokenizer", cfg.data.tokenizer)):
        for p in path if isinstance(path, (list, tuple)) else [path]:  # data.format=indexed: a list of PREFIXes
            if p and not (Path(p).exists() or Path(f"{p}.idx").exists()):
                raise LaunchError(f"{name}: {p} does not exist on this machine; nothing was started")


def check_slurm_folder(cfg: Config) -> None:
    """``cluster.slurm.folder`` (where submitit's files and the task logs go) is a folder, or a name
    one can be made at, before anything is written or submitted; LaunchError naming the field."""
    folder = cfg.cluster.slurm.folder
    if not folder:
        return
    from paralayer.inputs.untrusted import BadInput, check_out

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise LaunchError(f"cluster.slurm.folder: {one_line(str(folder), 300)} is a file; valid: a folder, or a "
                          "name where one can be made")
    try:
        check_out(str(folder).rstrip("/") or str(folder), "cluster.slurm.folder")
    except BadInput as exc:
        raise LaunchError(str(exc)) from None


def check_devices(plans: list[Any]) -> None:
    """A cuda plan launched here needs the CUDA devices to be visible: never a silent CPU run.
    (Planning for a GPU cluster from a CPU machine, --dry-run/--plan/--rehearse, never gets here.)"""
    need = max((int(_plan_value(p, "world_size") or 1) for p in plans if _plan_value(p, "device") == "cuda"),
               default=0)
    if not need:
        return
    import os

    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise LaunchError(f"cluster.device: the plan runs {need} rank(s) on cuda but {have} CUDA device(s) are visible "
                          f"here (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={vis if vis is not None else 'unset'});"
                          " nothing was started. Use cluster.device=cpu to train on this machine's CPU, or a SLURM "
                          "profile to run on GPU nodes (--dry-run and --plan work from here)")


#: what a run leaves in run.dir: a folder holding one of these holds another run
RUN_FILES = ("resolved.yaml", "plan.json", "metrics.jsonl", "goodput.json", "error.txt", "placement.json",
             "checkpoints")


def refuse_reuse(run_dir: Path, resume: Any) -> None:
    """A run never reuses a folder that holds another run's files unless it resumes that run
    (``train.resume`` auto or a path): else its resolved.yaml, plan.json and metrics would be
    written over. LaunchError (exit 2) naming the folder and train.resume."""
    if resume not in (None, "", "none") or not run_dir.is_dir():
        return
    found = [n for n in RUN_FILES if (run_dir / n).exists()]
    if found:
        raise LaunchError(f"run.dir: {one_line(str(run_dir), 300)} holds another run's files ({', '.join(found)}); "
                          "choose a new run.dir, or set train.resume=auto to resume that run")


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary name renamed into place (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def prepare_run_dir(cfg: Config, plan: Any, suffix: str = "") -> str:
    """Create run.dir (default runs/<recipe>-<time>) holding resolved.yaml and plan.json."""
    if not cfg.run.dir:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        cfg.run.dir = str(Path("runs") / f"{cfg.recipe}-{stamp}{suffix}")
    run_dir = Path(cfg.run.dir)
    plan_dict = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
    refuse_reuse(run_dir, cfg.train.resume)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "resolved.yaml", config_mod.to_yaml(cfg))
        write_atomic(run_dir / "plan.json", json.dumps(plan_dict, indent=2) + "\n")
    except OSError as exc:
        raise LaunchError(f"run.dir: cannot write the run directory {run_dir}: {exc.strerror or exc}") from None
    return str(run_dir.resolve())


def launch(cfg: Config, plan: Any, args: Any) -> int:
    """Run one resolved recipe; returns the process exit code."""
    if getattr(args, "timeline", False):  # --timeline is logging.timeline=true
        cfg.logging.timeline = True
    if cfg.cluster.backend != "slurm":
        check_inputs(cfg)
        check_devices([plan])
    else:
        check_slurm_folder(cfg)
    run_dir = prepare_run_dir(cfg, plan)
    if cfg.cluster.backend == "slurm":
        from paralayer.dispatch import slurm
        from paralayer.metrics.goodput import process_start_time

        res = slurm.submit([run_dir], _slurm_settings(cfg, [plan]), folder=_slurm_folder(cfg, run_dir),
                           wait=bool(getattr(args, "wait", False)), since=process_start_time())
        return _slurm_rc(res)
    from paralayer.dispatch.local import run_local
    from paralayer.metrics.goodput import process_start_time

    # goodput counts from the launcher's own start (its imports and the resolve included)
    return run_local(run_dir, plan.to_dict() if hasattr(plan, "to_dict") else plan, since=process_start_time())


def launch_sweep(cfgs: list[Config], plans: list[Any], args: Any) -> int:
    """Run every element of a sweep: one SLURM job array, or one local run after another."""
    from paralayer.dispatch import sweep

    if cfgs[0].cluster.backend != "slurm":
        for cfg in cfgs:
            check_inputs(cfg)
        check_devices(plans)
    else:
        check_slurm_folder(cfgs[0])
    group = cfgs[0].logging.wandb.group or f"{cfgs[0].recipe}-sweep-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    sweep_dir = cfgs[0].run.dir or str(Path("runs") / group)
    overrides = sweep.differing(cfgs)
    names = sweep.run_names(overrides)  # runs named by what differs (tp2-pp2/); the index is in sweep.json
    for cfg, name in zip(cfgs, names):  # every folder checked before any is written
        refuse_reuse(Path(sweep_dir) / name, cfg.train.resume)
    run_dirs = []
    for cfg, plan, name in zip(cfgs, plans, names):
        cfg.logging.wandb.group = group
        cfg.run.dir = str(Path(sweep_dir) / name)
        run_dirs.append(prepare_run_dir(cfg, plan))
    sweep.write_metadata(sweep_dir, group, run_dirs, names, overrides, cfgs[0].cluster.backend)
    if cfgs[0].cluster.backend == "slurm":
        from paralayer.dispatch import slurm

        res = slurm.submit(run_dirs, _slurm_settings(cfgs[0], plans), folder=_slurm_folder(cfgs[0], run_dirs[0]),
                           wait=bool(getattr(args, "wait", False)))
        sweep.record_slurm(res)
        if getattr(args, "wait", False):
            sweep.report(sweep_dir, cfgs[0])  # the array has completed
        else:
            print(f"paralayer: when the array has run: python -m paralayer.report {sweep_dir}", flush=True)
        return _slurm_rc(res)
    from paralayer.dispatch.local import run_local

    worst = 0
    for run_dir, plan in zip(run_dirs, plans):
        worst = max(worst, run_local(run_dir, plan.to_dict() if hasattr(plan, "to_dict") else plan))
    sweep.report(sweep_dir, cfgs[0])
    return worst


def _slurm_rc(res: Any) -> int:
    """The exit status of a submission: SubmitResult.status after --wait (0 all completed, 1 one
    failed, 124 wait deadline), 0 when only submitted."""
    return int(getattr(res, "status", None) or 0)


def _plan_value(plan: Any, key: str) -> Any:
    d = plan.to_dict() if hasattr(plan, "to_dict") else (plan or {})
    return d.get(key)


def _slurm_settings(cfg: Config, plans: list[Any] | None = None) -> dict:
    """The cluster's SLURM settings for submit(). Tasks per node come from the plan(s): the
    profile's devices_per_node, or on CPU without one the product of the degrees (the resolver's
    rule). A job array has one shape: the largest element's; smaller elements leave the extra
    tasks idle (RankTask reads each run's plan.json)."""
    c = cfg.cluster
    s = config_mod.to_dict(cfg)["cluster"]["slurm"]
    dpn = [int(v) for v in (_plan_value(p, "devices_per_node") for p in (plans or [])) if v]
    devices = {d for d in (_plan_value(p, "device") for p in (plans or [])) if d}
    s.update(nodes=c.nodes, network_interface=c.network_interface,
             devices_per_node=max(dpn) if dpn else (c.devices_per_node or 1),
             device=devices.pop() if len(devices) == 1 else auto_device(c.device, c.peak_tflops))
    return s


def _slurm_folder(cfg: Config, run_dir: str) -> None:
    """None: submit() picks a fresh ``<cluster.slurm.folder or <parent of the run dirs>/slurm-logs>/
    <time>-<id>`` folder. Fresh matters: submitit finds results by job id, and a SLURM whose state
    was wiped (the local one in CI) hands out ids from 1 again, so a shared folder would hold a
    previous job's result files under the same names."""
    return None
