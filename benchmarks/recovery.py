"""Recovery time (issue #36): one rank SIGKILLed mid-run on the two-node local SLURM, and the time
from its death to the first step of the next attempt, split into its parts. Writes the "Recovery
time" section of docs/BENCHMARKS.md.

    python benchmarks/recovery.py [--repeats 1] [--out docs/BENCHMARKS.md] [--label before|after]

The run: recipe=tiny (dp2 x tp2 on n1, n2), 8 steps, a checkpoint every 4, rank 2 (on n2) killed
with SIGKILL before the forward of step 6 (tests/fault_hook.py ``kill1``), cluster.slurm.
max_restarts=1, --wait. The clocks: the fault hook prints the death's unix time in the task's log;
run.dir/attempts.jsonl holds the launcher's times and sacct's (1 s resolution); goodput.json's
second attempt holds rank 0's process start and its start-up marks (train.py: imports and the
process group, the model built, the checkpoint loaded, the first step done). The parts:
- detection and teardown: death -> SLURM ends the failed job (sacct End; srun sees the task die
  and ends the step, KillWait);
- the launcher notices: sacct End -> the launcher's follow returns;
- requeue and start: the launcher submits again -> the new job starts (sacct Start);
- task start: job start -> rank 0's Python process starts (srun, submitit);
- imports and process group: process start -> train() begins;
- model build: -> the model, optimizer and data are built;
- checkpoint load: -> resume() returned;
- replay of lost steps: the first step of the new attempt (a step the dead one had already run).
Requires the two-node SLURM (cluster/local_slurm.sh start --nodes 2) and root.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_sections import write_named_section  # noqa: E402

CONF = "/tmp/paralayer-slurm-2node/etc/slurm.conf"
ARGS = ["recipe=tiny", "model.d_model=64", "model.seq_len=32", "model.ffn_hidden=128", "model.n_layers=2",
        "logging.wandb.mode=disabled", "train.collective_timeout_s=30", "train.steps=8", "checkpoint.every=4",
        "cluster=local-slurm-2node", "cluster.slurm.max_restarts=1", "--no-rehearse", "--wait"]
PARTS = ("detection and teardown", "the launcher notices", "requeue and start", "task start",
         "imports and process group", "model build", "checkpoint load", "replay of lost steps")


def one_run(work: str) -> dict:
    from tests.fault_hook import fault_env

    run_dir = os.path.join(work, "r")
    env = fault_env(os.path.join(work, "fault"), "kill1:2:6", dict(os.environ, SLURM_CONF=CONF))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(k, None)
    t = time.time()
    res = subprocess.run([sys.executable, os.path.join(REPO, "launch.py"), *ARGS, f"run.dir={run_dir}"], cwd=work,
                         env=env, capture_output=True, text=True, timeout=900)
    wall = time.time() - t
    if res.returncode != 0:
        raise SystemExit(f"the run failed (rc {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    death = None
    for p in glob.glob(os.path.join(work, "**", "*_log.err"), recursive=True):
        m = re.search(r"injecting kill -9 on rank 2 at step 6 at unix time (\d+\.\d+)", open(p, errors="replace").read())
        if m:
            death = float(m.group(1))
    a = [json.loads(x) for x in open(os.path.join(run_dir, "attempts.jsonl"))]
    g = json.load(open(os.path.join(run_dir, "goodput.json")))
    second = g["attempts"][1]
    mk = second["marks"]
    ends = [death, a[0]["slurm_end_unix"], a[0]["end_unix"], a[1]["slurm_start_unix"], second["t0_unix"],
            mk["train_start"], mk["setup"], mk["loaded"], mk["first_step"]]
    parts = dict(zip(PARTS, [max(0.0, b - e) for e, b in zip(ends, ends[1:])]))
    return {"parts": parts, "total": mk["first_step"] - death, "wall": wall,
            "lost_steps": g["attempts"][0].get("lost_steps"), "goodput_wall": g["totals"]["goodput_wall_s"]}


def table(runs: list[dict], label: str, cmd: str) -> str:
    med = {p: statistics.median(r["parts"][p] for r in runs) for p in PARTS}
    total = statistics.median(r["total"] for r in runs)
    rows = "\n".join(f"| {p} | {med[p]:.1f} | {100 * med[p] / total:.0f}% |" for p in PARTS)
    return (f"### {label}\n\n| part | seconds (median of {len(runs)}) | share |\n|---|---|---|\n{rows}\n"
            f"| **death → first step of the next attempt** | **{total:.1f}** | 100% |\n\n"
            f"Lost steps {runs[0]['lost_steps']}; the launcher's wall {statistics.median(r['wall'] for r in runs):.1f} s, "
            f"goodput.json's {statistics.median(r['goodput_wall'] for r in runs):.1f} s. Command: `{cmd}`.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default="before")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="paralayer-recovery-") as work:
            runs.append(one_run(work))
            print(json.dumps(runs[-1]), flush=True)
    cmd = "python benchmarks/recovery.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = table(runs, args.label, cmd.strip())
    print(md)
    if args.out:
        head = "## Recovery time: a rank killed on the two-node SLURM (issue #36)"
        old = open(args.out).read()
        keep = ""
        if head in old:  # keep the other label's table
            sect = old[old.index(head):]
            nxt = sect.find("\n## ", 1)
            sect = sect[:nxt] if nxt > 0 else sect
            for part in sect.split("\n### ")[1:]:
                if not part.startswith(args.label):
                    keep += "### " + part.rstrip() + "\n\n"
        intro = (f"{head}\n\nbenchmarks/recovery.py: rank 2 (node n2) SIGKILLed before step 6 of 8 (checkpoint "
                 "every 4), `cluster.slurm.max_restarts=1`; the time from the death to the first step of the "
                 "next attempt, by part (see the script's docstring for the clocks; sacct's are whole seconds). "
                 "2 CPU cores shared with other work: loaded timings are upper bounds.\n\n")
        write_named_section(args.out, head, intro + keep + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
