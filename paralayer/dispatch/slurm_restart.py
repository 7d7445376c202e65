"""A SLURM job whose rank died is submitted again by the launcher that follows it (``--wait``).

SLURM requeues a job by itself on preemption, timeout (USR2, ``max_requeues``) and a lost node;
a rank that dies (a segfault, an OOM kill, a NCCL error, a hang the watchdog ends) leaves the job
FAILED. With ``cluster.slurm.max_restarts`` the launcher then submits the run again with
``train.resume=auto`` (the newest verified checkpoint), up to that many times, apart from
``max_requeues``. Bad input (a task exit status 2) never restarts. The ranks that died are the
tasks that left no result (unless srun's teardown killed them after another task's error) or
raised an error of their own (not a peer's lost connection);
placement.json names their hosts. A host on which ranks died in two attempts is excluded from
the next attempt (``--exclude`` in its sbatch arguments), said in one line. Each attempt is a
line of run.dir/attempts.jsonl, with SLURM's own start and end (sacct); goodput.json accounts
every attempt's wall time on the launcher's clock (metrics/goodput.py). Imports no torch.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Callable

from paralayer.dispatch import attempts as att
from paralayer.dispatch.node_loss import hosts_of

_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "distnetworkerror",
              "distbackenderror", "read error", "socket closed", "timed out")


def _sacct(job_id: str) -> dict:
    """State, exit code, start and end (epoch s), nodes of the job's last attempt."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode,Start,End,NodeList", "-j", job_id],
                             capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    rows = [x.split("|") for x in out.splitlines() if x.count("|") == 4]
    if not rows:
        return {}
    state, code, start, end, nodes = rows[-1]

    def when(s: str):
        try:
            return time.mktime(time.strptime(s.strip(), "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return None

    rc, _, sig = code.partition(":")
    return {"state": state.split()[0].upper() if state.split() else "UNKNOWN",
            "exit_code": int(rc) if rc.isdigit() else None, "signal": int(sig) if sig.isdigit() else None,
            "slurm_start_unix": when(start), "slurm_end_unix": when(end), "nodes": nodes.strip()}


_SRUN_TASK = re.compile(r"^srun: error: \S+: tasks? ([\d,\-]+): (.+)$")


def torn_down(lines: list[str]) -> set[int]:
    """Tasks that srun reported Killed once it had begun to end the step: after another task had
    exited with an error, or after its own "Terminating StepId" (``--kill-on-bad-exit``, when a
    task was killed). The teardown killed them before they could leave a result, so they did not
    die on their own (seen under load: rank 1 of a run whose rank 2 was SIGKILLed)."""
    out: set[int] = set()
    ended = False
    for line in lines:
        if "Terminating StepId" in line:
            ended = True
            continue
        m = _SRUN_TASK.match(line.strip())
        if m is None:
            continue
        if m.group(2).startswith("Exited with exit code"):
            ended = True
        elif ended and m.group(2).strip() == "Killed":
            out.update(_task_list(m.group(1)))
    return out


def _task_list(text: str) -> list[int]:
    """srun's task list: "2", "0-1", "0,2-3"."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def srun_lines(job: Any) -> list[str]:
    """srun's own lines about the step's tasks, from the batch's stderr (submitit's task-0 log)."""
    try:
        first = (getattr(job, "_sub_jobs", None) or [job])[0]
        with open(first.paths.stderr, errors="replace") as f:
            return [ln for ln in f if ln.startswith("srun: ")]
    except (OSError, AttributeError, IndexError):
        return []


def dead_ranks(outcomes: list, torn: set[int] | frozenset = frozenset()) -> list[int]:
    """Tasks that died on their own: no result (killed) unless ``torn`` down by srun after another
    task's error, or an error that is not a peer's loss. When that leaves none, every task without
    a result or with an error of its own; when every failed task only saw its peers vanish, all."""
    died = [t for t, o in enumerate(outcomes) if o is None]
    own = [t for t, o in enumerate(outcomes)
           if o is not None and o[0] == "error" and not any(k in str(o[1]).lower() for k in _PEER_LOSS)]
    return (sorted([t for t in died if t not in torn] + own) or sorted(died + own)
            or [t for t, o in enumerate(outcomes) if o is None or o[0] != "success"])


def exclude_after(history: list[dict]) -> list[str]:
    """Hosts on which ranks died in two attempts (or more)."""
    seen = Counter(h for a in history if a.get("cause") == "rank_died" for h in set(a.get("hosts") or []))
    return sorted(h for h, n in seen.items() if n >= 2)


def follow_with_restarts(res: Any, run_dir: str, limit: int, resubmit: Callable[[int, list[str]], Any],
                         follow: Callable[[Any], int], start: float, stream=None) -> Any:
    """Follow ``res`` (the first attempt, already submitted at ``start``); while an attempt fails
    for any reason but bad input, submit the next (``resubmit(attempt, exclude)``), up to
    ``limit`` restarts. Returns the last attempt's SubmitResult (its status is the run's)."""
    from paralayer.dispatch.slurm_jobs import _task_outcomes
    from paralayer.metrics import goodput

    stream = stream or sys.stderr
    att.clear(run_dir)
    attempt, history, exclude = 1, [], []
    while True:
        status = follow(res)
        end = time.time()
        job = res.jobs[0] if res.jobs else None
        info = _sacct(res.job_ids[0])
        if status == 0:
            cause = "done"
        elif info.get("exit_code") == att.EXIT_BAD_INPUT:
            cause = "bad_input"
        elif status == 124:
            cause = "wait_deadline"
        else:
            cause = "rank_died"
        ranks = dead_ranks(_task_outcomes(job, since=info.get("slurm_start_unix")), torn_down(srun_lines(job))) if (
            job is not None and cause == "rank_died") else []
        hosts = hosts_of(run_dir, ranks)
        restart = att.should_restart(cause, attempt, limit)
        rec = att.record(run_dir, attempt, cause, start, end, ranks=ranks, restart=restart,
                         host=",".join(hosts) or info.get("nodes"),
                         exit_code=info.get("exit_code"), hosts=hosts, job_id=res.job_ids[0],
                         slurm_state=info.get("state"), slurm_start_unix=info.get("slurm_start_unix"),
                         slurm_end_unix=info.get("slurm_end_unix"), nodes=info.get("nodes"), exclude=exclude,
                         line=None, signal=att.signal_name(-info["signal"]) if info.get("signal") else None)
        history.append(rec)
        goodput.account_attempt(run_dir, attempt, start, end, finished=cause == "done")
        if not restart:
            if cause == "rank_died" and limit > 0:
                print(att.limit_line(attempt, limit, "cluster.slurm.max_restarts"), file=stream, flush=True)
            return res
        new = [h for h in exclude_after(history) if h not in exclude]
        if new:
            exclude = sorted(set(exclude) | set(new))
            print(f"paralayer: node {', '.join(new)}: ranks died there in two attempts; excluded from attempt "
                  f"{attempt + 1} (sbatch --exclude={','.join(exclude)})", file=stream, flush=True)
        what = f"job {res.job_ids[0]} {info.get('state', 'FAILED')}, rank(s) {', '.join(map(str, ranks)) or '?'}" + (
            f" on {', '.join(hosts)}" if hosts else "")
        print(att.restart_line(attempt, limit, what), file=stream, flush=True)
        attempt, start = attempt + 1, end
        res = resubmit(attempt, exclude)


def resubmitter(params: dict, folder: str, max_num_timeout: int, task: Any, run_dir: str,
                first: Any, verbose: bool) -> Callable[[int, list[str]], Any]:
    """``resubmit(attempt, exclude)`` for :func:`follow_with_restarts`: ``task`` (slurm.RankTask
    with ``train.resume=auto``, handed in so this module never imports slurm.py) as a new job, its
    submitit files in ``folder/attempt-N``, ``exclude`` as ``sbatch --exclude``."""
    import contextlib
    import io

    import submitit

    from paralayer.dispatch.slurm_jobs import SubmitResult

    def resubmit(attempt: int, exclude: list[str]) -> Any:
        p = dict(params)
        extra = dict(p.get("slurm_additional_parameters") or {})
        if exclude:
            extra["exclude"] = ",".join(exclude)
        if extra:
            p["slurm_additional_parameters"] = extra
        from paralayer.runtime import completion

        completion.clear(run_dir)  # only the new attempt's ranks can say they finished
        ex = submitit.AutoExecutor(folder=os.path.join(folder, f"attempt-{attempt}"), cluster="slurm",
                                   slurm_max_num_timeout=max_num_timeout)
        ex.update_parameters(**p)
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            job = ex.submit(task)
        subs = getattr(job, "_sub_jobs", None) or [job]
        r = SubmitResult(job_ids=[str(job.job_id)], run_dirs=[run_dir], folder=str(ex.folder),
                         stdout=[[str(s.paths.stdout) for s in subs]], stderr=[[str(s.paths.stderr) for s in subs]],
                         array=False, jobs=[job], elastic=first.elastic)
        if verbose:
            print(f"paralayer: attempt {attempt}: submitted job {r.job_ids[0]}; logs in {r.folder}", flush=True)
        return r

    return resubmit
