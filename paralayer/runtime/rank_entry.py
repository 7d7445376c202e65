"""What a rank does before its loop: the process group from the launcher's environment, the run
directory (resolved.yaml + plan.json, with the launcher's overrides), and bad input reported in
one line (paralayer/runtime/train.py ``main`` calls these)."""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Sequence

import torch.distributed as dist

from paralayer.config import Config
from paralayer.config import resolved as config_resolved
from paralayer.resolve.plan import Plan
from paralayer.runtime.build import as_plan


def init_distributed(device_type: str, timeout_s: float = 120.0) -> None:
    """The process group from the launcher's RANK/WORLD_SIZE/MASTER_* (torch's env:// init)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo") if os.environ.get("MASTER_ADDR", "127.0.0.1") in (
            "127.0.0.1", "localhost") else None
    else:  # NCCL's flight recorder: the watchdog dumps it beside a hang report (runtime/health/watchdog.py)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def load_run(run_dir: str, overrides: Sequence[str] = ()) -> tuple[Config, Plan]:
    """resolved.yaml with the launcher's ``key=value`` overrides (a requeued SLURM job passes
    ``train.resume=auto``), and plan.json as a :class:`Plan`."""
    cfg = config_resolved.read_resolved(os.path.join(run_dir, "resolved.yaml"))  # no OmegaConf (issue #36)
    if overrides:
        users = cfg.train.resume
        cfg = config_resolved.with_overrides(cfg, overrides)
        cfg.train.resume = restart_resume(cfg.train.resume, users, cfg.checkpoint.dir
                                          or os.path.join(run_dir, "checkpoints"))
    with open(os.path.join(run_dir, "plan.json")) as f:
        plan = as_plan(json.load(f))
    return cfg, plan


def restart_resume(resume: str, users: str, ckpt_root: str) -> str:
    """What a restarted attempt (``train.resume=auto`` from the launcher) loads: the newest
    checkpoint of the run, or, while the run has none yet, the checkpoint the user started it
    from (``train.resume=PATH``): a death before the first save must not drop the user's
    weights and start from step 1."""
    from paralayer.checkpoint.retention import list_checkpoints

    if resume != "auto" or users in ("auto", "none") or list_checkpoints(ckpt_root):
        return resume
    return users


def _report_input_error(exc: Exception, rank: int) -> None:
    """Bad data or checkpoints that do not load: one line. Under the local launcher each rank
    leaves it in torch elastic's error file (the launcher prints it once, exit 2); elsewhere
    (SLURM) rank 0 prints it and the other ranks stay quiet."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": str(exc), "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    elif rank == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)

