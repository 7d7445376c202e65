"""Where a restarted SLURM rank's "imports and process group" goes (issue #36): the CPU and wall time
of each piece it runs before ``train()``, in one process (world 1), in the order RankTask and
train.main run them. CPU time is what the rank itself costs; wall minus CPU is the wait for a core
(on a shared machine, most of it). Prints one line per piece; --json for one JSON object.

    python benchmarks/rank_startup.py [--run-dir DIR] [--json]

Without --run-dir a run directory is made first with a 1-step tiny run on the local launcher
(not timed). The pieces: submitit's task entry and paralayer.dispatch.slurm (the unpickled
RankTask), torch, the rest of paralayer.runtime.train's imports (DTensor, the runtime), load_run
(resolved.yaml + plan.json + the requeue's train.resume=auto), the gloo process group and its first
barrier, then train() itself up to the first step's forward (build, checkpoint load: the run
directory has a step-1 checkpoint, so this is a restart's path) and step 1 to the end of main
(the first optimizer step, which imported torch._dynamo before issue #36's change); --fresh drops
the checkpoint and saves none (a first attempt: no load, steps 1-2, no DCP; DCP's
get_model_state_dict imports torch._dynamo on any save or load). Each repeat is
a fresh process: a second import in one process is free.

    python benchmarks/rank_startup.py --trees BEFORE_TREE AFTER_TREE --repeats 5 --json

--trees: the same pieces with each tree on PYTHONPATH (e.g. a ``git worktree add`` of an older
commit), runs interleaved tree by tree within each repeat; medians per tree.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["recipe=tiny", "model.d_model=64", "model.seq_len=32", "model.ffn_hidden=128", "model.n_layers=2",
        "logging.wandb.mode=disabled", "train.steps=1", "train.threads=1", "parallel.tp=1", "parallel.dp=1",
        "cluster=local", "checkpoint.every=1"]


def make_run_dir(work: str) -> str:
    run_dir = os.path.join(work, "r")
    res = subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), *TINY, f"run.dir={run_dir}"],
                         cwd=work, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"the tiny run failed (rc {res.returncode}):\n{(res.stdout + res.stderr)[-2000:]}")
    return run_dir


def measure(run_dir: str, tree: str = REPO, extra: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Run the pieces in a fresh interpreter (nothing imported yet), with ``tree`` on PYTHONPATH,
    on a copy of ``run_dir`` (step 2 writes into it), and return their times."""
    work = tempfile.mkdtemp(prefix="paralayer-startup-m-")
    copy = os.path.join(work, "r")
    shutil.copytree(run_dir, copy)
    code = f"""
import json, os, socket, sys, time
out = {{}}
t = [time.process_time(), time.time()]
def mark(name):
    c, w = time.process_time(), time.time()
    out[name] = {{"cpu_s": c - t[0], "wall_s": w - t[1]}}; t[0], t[1] = c, w
import submitit.core._submit, submitit.helpers, paralayer.dispatch.slurm
try:  # RankTask's first act where the tree has it (issue #36: the collector off through start-up)
    from paralayer.runtime import startup_gc
    startup_gc.pause()
except ImportError:
    pass
mark("submitit + paralayer.dispatch.slurm")
import torch
mark("torch")
from paralayer.runtime import train
mark("paralayer.runtime.train (the rest)")
cfg, plan = train.load_run({copy!r}, ("train.resume=auto",))
mark("load_run")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
train.init_distributed("cpu", 30)
mark("init_process_group (gloo, world 1)")
train.dist.barrier()
mark("first barrier")
train.dist.destroy_process_group()
class Hooks(train.StepHooks):
    def before_forward(self, rank, step):
        if "train(): build, checkpoint load" not in out:
            mark("train(): build, checkpoint load")
rc = train.main({copy!r}, "train.resume=auto", "train.steps=2", *{list(extra)!r}, hooks=Hooks())
mark("the first step to main's end")
out["_dynamo_imported"] = "torch._dynamo" in sys.modules
out["_omegaconf_imported"] = "omegaconf" in sys.modules
out["_rc"] = rc
print(json.dumps(out))
"""
    env = dict(os.environ, PYTHONPATH=tree)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    try:
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                             cwd=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if res.returncode != 0:
        raise SystemExit(f"the measurement failed (rc {res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--trees", nargs="+", default=None, help="trees to put on PYTHONPATH (default: this one)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--fresh", action="store_true",
                    help="drop the run directory's checkpoint and save none (checkpoint.every=0): a first "
                         "attempt's path without DCP, which imports torch._dynamo itself")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in (args.trees or [REPO])]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    loads = [_load()]
    with tempfile.TemporaryDirectory(prefix="paralayer-startup-") as work:
        run_dir = args.run_dir or make_run_dir(work)
        if args.fresh:
            run_dir = shutil.copytree(run_dir, os.path.join(work, "fresh"))
            shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
        for _ in range(args.repeats):
            for t in trees:
                runs[t].append(measure(run_dir, t, ("checkpoint.every=0",) if args.fresh else ()))
                loads.append(_load())
    report = {}
    for t, reps in runs.items():
        pieces = [k for k in reps[0] if not k.startswith("_")]
        med = {k: {c: statistics.median(r[k][c] for r in reps) for c in ("cpu_s", "wall_s")} for k in pieces}
        totals = {c: [sum(r[k][c] for k in pieces) for r in reps] for c in ("cpu_s", "wall_s")}
        med["total"] = {c: statistics.median(v) for c, v in totals.items()}
        report[t] = {"median": med, "totals": totals, "dynamo_imported": [r["_dynamo_imported"] for r in reps],
                     "omegaconf_imported": [r.get("_omegaconf_imported") for r in reps],
                     "rc": [r["_rc"] for r in reps]}
    report["_loadavg"] = loads
    if args.json:
        print(json.dumps(report))
        return 0
    for t in trees:
        print(f"== {t} (medians of {args.repeats}; torch._dynamo imported: {report[t]['dynamo_imported']}; "
              f"omegaconf imported: {report[t]['omegaconf_imported']})")
        for name, v in report[t]["median"].items():
            print(f"{name:48s} cpu {v['cpu_s']:6.2f} s  wall {v['wall_s']:6.2f} s")
    print("load averages (1, 5, 15 min) before and after each run:", "; ".join(loads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
