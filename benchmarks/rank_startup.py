"""Where a restarted SLURM rank's "imports and process group" goes (issue #36): the CPU and wall time
of each piece it runs before ``train()``, in one process (world 1), in the order RankTask and
train.main run them. CPU time is what the rank itself costs; wall minus CPU is the wait for a core
(on a shared machine, most of it). Prints one line per piece; --json for one JSON object.

    python benchmarks/rank_startup.py [--run-dir DIR] [--json]

Without --run-dir a run directory is made first with a 1-step tiny run on the local launcher
(not timed). The pieces: submitit's task entry and paralayer.dispatch.slurm (the unpickled
RankTask), torch, the rest of paralayer.runtime.train's imports (DTensor, the runtime), load_run
(resolved.yaml + plan.json + the requeue's train.resume=auto), the gloo process group and its first
barrier. Run it in a fresh process per repeat: a second import in one process is free.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["recipe=tiny", "model.d_model=64", "model.seq_len=32", "model.ffn_hidden=128", "model.n_layers=2",
        "logging.wandb.mode=disabled", "train.steps=1", "train.threads=1", "parallel.tp=1", "parallel.dp=1",
        "cluster=local"]


def make_run_dir(work: str) -> str:
    run_dir = os.path.join(work, "r")
    res = subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), *TINY, f"run.dir={run_dir}"],
                         cwd=work, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"the tiny run failed (rc {res.returncode}):\n{(res.stdout + res.stderr)[-2000:]}")
    return run_dir


def measure(run_dir: str) -> dict[str, dict[str, float]]:
    """Run the pieces in a fresh interpreter (nothing imported yet) and return their times."""
    code = f"""
import json, os, socket, sys, time
out = {{}}
t = [time.process_time(), time.time()]
def mark(name):
    c, w = time.process_time(), time.time()
    out[name] = {{"cpu_s": c - t[0], "wall_s": w - t[1]}}; t[0], t[1] = c, w
import submitit.core._submit, submitit.helpers, paralayer.dispatch.slurm
mark("submitit + paralayer.dispatch.slurm")
import torch
mark("torch")
from paralayer.runtime import train
mark("paralayer.runtime.train (the rest)")
cfg, plan = train.load_run({run_dir!r}, ("train.resume=auto",))
mark("load_run")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
train.init_distributed("cpu", 30)
mark("init_process_group (gloo, world 1)")
train.dist.barrier()
mark("first barrier")
train.dist.destroy_process_group()
print(json.dumps(out))
"""
    env = dict(os.environ, PYTHONPATH=REPO)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"the measurement failed (rc {res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="paralayer-startup-") as work:
        pieces = measure(args.run_dir or make_run_dir(work))
    if args.json:
        print(json.dumps(pieces))
        return 0
    for name, t in pieces.items():
        print(f"{name:40s} cpu {t['cpu_s']:6.2f} s  wall {t['wall_s']:6.2f} s")
    print(f"{'total':40s} cpu {sum(t['cpu_s'] for t in pieces.values()):6.2f} s  "
          f"wall {sum(t['wall_s'] for t in pieces.values()):6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
