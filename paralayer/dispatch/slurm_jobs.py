"""Following submitted SLURM jobs to their end: states from slurmctld (squeue, live) and
slurmdbd (sacct, final), each task's result pickle, rank 0's log echoed as it grows, requeues
followed through, a job that can never start cancelled, and the failing task's tail printed.

``SubmitResult`` is what ``paralayer.dispatch.slurm.submit`` returns; ``follow`` (or its
``wait()``) is what ``--wait`` runs.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Any, Sequence

# sacct states after which a job will not run again
_TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
    "DEADLINE", "REVOKED", "SPECIAL_EXIT",
}

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
    elastic: tuple | None = None  # (min_nodes, nodes, tasks_per_node) with cluster.slurm.min_nodes
    finished_at_exit: dict[str, str] = dataclasses.field(default_factory=dict)  # job id -> the line (issue 48)

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


def _lines(cmd: list[str]) -> list[str]:
    """A SLURM query's output lines; none when the command fails or is missing."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (subprocess.SubprocessError, OSError):
        return []


def _sacct_states(job_ids: Sequence[str], starts: dict[str, float] | None = None) -> dict[str, str]:
    """job id (incl. array element ids like 12_0) -> sacct State (first word, upper case).
    ``starts``, when given, is filled with the start (epoch s) of each job's current attempt."""
    base = sorted({j.split("_")[0] for j in job_ids})
    states: dict[str, str] = {}
    for line in _lines(["sacct", "-n", "-X", "-P", "-o", "JobID,State,Start"] + [a for b in base for a in ("-j", b)]):
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
    states: dict[str, str] = {}
    for line in _lines(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(base)]):
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


def _names_error(path: str) -> bool:
    """Whether a task's stderr holds a rank's one-line error (``error: ...``)."""
    return any(line.startswith("error: ") for line in _tail(path, 200).splitlines())


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


@dataclasses.dataclass
class _Watch:
    """What :func:`_follow` knows about the jobs between polls."""

    ids: list
    states: dict = dataclasses.field(default_factory=dict)    # job id -> SLURM state
    starts: dict = dataclasses.field(default_factory=dict)    # job id -> start of its last attempt
    shown: dict = dataclasses.field(default_factory=dict)     # job id -> state last printed
    done: dict = dataclasses.field(default_factory=dict)      # job id -> finished (or given up)
    outcomes: dict = dataclasses.field(default_factory=dict)  # job id -> per-task (status, payload)
    never: dict = dataclasses.field(default_factory=dict)     # job id -> why it can never start
    last_sacct: float = 0.0
    run_dirs: dict = dataclasses.field(default_factory=dict)  # job id -> run directory
    node_fails: dict = dataclasses.field(default_factory=dict)  # job id -> NODE_FAIL attempts reported
    elastic: tuple | None = None


def _follow(result: SubmitResult, timeout_s: float | None = None, poll_s: float = 1.0,
            verbose: bool = True, stream=None, echo_logs: bool | None = None) -> int:
    """Follow the jobs to the end. Returns 0 when every run completed, 1 when one failed
    (printing its stderr tail), 124 when ``timeout_s`` passed first (jobs left running).

    ``verbose`` prints each job's state changes (PENDING, RUNNING, REQUEUED, ...) and, unless
    ``echo_logs=False``, the lines rank 0 writes to its stdout log. A requeued job is followed
    through its requeue to the end of its last attempt."""
    stream = stream or sys.stderr
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    w = _Watch(result.job_ids, run_dirs=dict(zip(result.job_ids, result.run_dirs)), elastic=result.elastic)
    echo = _LogEcho(result, stream) if (verbose if echo_logs is None else echo_logs) else None
    while True:
        _poll_states(w, poll_s, verbose, stream)
        if echo is not None:
            echo.poll()
        _mark_finished(w, result)
        if all(w.done.get(j) for j in w.ids):
            break
        if deadline is not None and time.monotonic() >= deadline:
            result.states = {j: w.states.get(j, "UNKNOWN") for j in w.ids}
            result.status = 124
            if verbose:
                print(f"[paralayer.slurm] gave up waiting after {timeout_s:.0f}s; still running: "
                      f"{[j for j in w.ids if not w.done.get(j)]} (scancel {w.ids[0].split('_')[0]} to stop)",
                      file=stream, flush=True)
            return 124
        time.sleep(poll_s)
    if echo is not None:
        echo.poll()
    failed = _final_states(w, result)
    result.status = 1 if failed else 0
    for line in result.finished_at_exit.values():
        print(line, file=stream, flush=True)
    if verbose:
        _report_end(w, result, failed, stream)
    return result.status


def _poll_states(w: _Watch, poll_s: float, verbose: bool, stream) -> None:
    """squeue every poll, sacct (and the never-starting check) every few seconds; print changes."""
    now = time.monotonic()
    live = _squeue_states(w.ids)
    w.states.update(live)
    if now - w.last_sacct >= max(2.0, poll_s):
        w.states.update(_sacct_states(w.ids, w.starts))
        w.states.update(live)  # slurmctld knows first; sacct fills in what has left the queue
        w.last_sacct = now
        for jid, reason in _pending_reasons([j for j in w.ids if not w.done.get(j)]).items():
            if jid in w.ids and not w.done.get(jid):
                w.never[jid] = reason
                w.done[jid] = True
                subprocess.run(["scancel", jid], capture_output=True, timeout=30)
                if verbose:
                    print(f"[paralayer.slurm] job {jid} can never start as submitted (PENDING, reason "
                          f"{reason}): cancelled it", file=stream, flush=True)
    if verbose:
        for jid in w.ids:
            st = w.states.get(jid)
            if st and st != w.shown.get(jid) and st not in _TERMINAL_STATES:
                if w.shown.get(jid) == "RUNNING":
                    _report_node_loss(w, jid, stream)
                w.shown[jid] = st
                print(f"[paralayer.slurm] job {jid}: {st}", file=stream, flush=True)


def _report_node_loss(w: _Watch, jid: str, stream) -> None:
    """A running job left RUNNING: if an attempt more ended NODE_FAIL, name the node and ranks."""
    from paralayer.dispatch import node_loss

    n = node_loss.failed_attempts(jid)
    if n > w.node_fails.get(jid, 0):
        w.node_fails[jid] = n
        line = node_loss.describe(jid, w.run_dirs.get(jid, "?"))
        if line:
            print(f"[paralayer.slurm] job {jid}: {line}", file=stream, flush=True)
        if w.elastic:
            again = node_loss.reopen(jid, *w.elastic)
            if again:
                print(f"[paralayer.slurm] job {jid}: {again}", file=stream, flush=True)


def _mark_finished(w: _Watch, result: SubmitResult) -> None:
    """A job is done when every task returned success, or SLURM calls it finished."""
    for jid, job in zip(w.ids, result.jobs):
        if w.done.get(jid):
            continue
        st = w.states.get(jid, "UNKNOWN")
        oc = _task_outcomes(job, since=w.starts.get(jid))
        if st in _NOT_RUNNING_STATES:
            oc = [None] * len(oc)
        w.outcomes[jid] = oc
        # every task returned: done (sacct lags a moment behind). A task that raised is not
        # the end by itself: a requeue (scontrol requeue, preemption) can make ranks fail on
        # the way down and the job runs again, so wait for SLURM to call the job finished
        if all(o is not None and o[0] == "success" for o in oc) or st in _TERMINAL_STATES:
            w.done[jid] = True


def _final_states(w: _Watch, result: SubmitResult) -> list:
    """Each job's final state into ``result.states``; the ids of the jobs that failed."""
    final = _sacct_states(w.ids)
    failed = []
    for jid in w.ids:
        if jid in w.never:
            result.states[jid] = f"PENDING({w.never[jid]})"
            failed.append(jid)
            continue
        oc = w.outcomes[jid]
        st = final.get(jid, w.states.get(jid, "UNKNOWN"))
        ok = all(o is not None and o[0] == "success" for o in oc)
        if not ok and st == "COMPLETED" and oc and oc[0] is not None and oc[0][0] == "success":
            # an elastic attempt on fewer nodes (cluster.slurm.min_nodes) never ran the last tasks
            ok = all(o is None or o[0] == "success" for o in oc)
        if ok and st in _TERMINAL_STATES - {"COMPLETED"}:
            ok = False
        if not ok and _finished(w.run_dirs.get(jid)):  # every rank finished first: a task's end does not undo it
            ok = True
            result.finished_at_exit[jid] = (f"paralayer: job {jid} ended {st} after every rank finished every step "
                                            f"(a task failed at exit); the run is complete")
        result.states[jid] = st if not (ok and st not in _TERMINAL_STATES) else "COMPLETED"
        if not ok:
            failed.append(jid)
    return failed


def _finished(run_dir: str | None) -> bool:
    """Every rank of the run wrote its done marker (paralayer/runtime/completion.py)."""
    from paralayer.runtime import completion

    return bool(run_dir) and completion.all_done(run_dir, completion.plan_world(run_dir))


def _report_end(w: _Watch, result: SubmitResult, failed: list, stream) -> None:
    """Every job's final state; for up to three failed ones, the traceback and stderr tail."""
    ids = w.ids
    for jid in ids:
        print(f"[paralayer.slurm] job {jid}: {result.states[jid]}", file=stream, flush=True)
    for jid in [j for j in failed if j not in w.never][:3]:
        i = ids.index(jid)
        oc = w.outcomes[jid]
        bad = [t for t, o in enumerate(oc) if o is None or o[0] != "success"] or [0]
        t = next((t for t in bad if oc[t] is not None), bad[0])
        if oc[t] is None:  # no traceback: the task whose log names the error (a rank's one line,
            # ``error: rank N on HOST: ...``) rather than one that srun terminated before it wrote
            t = next((u for u in range(len(result.stderr[i])) if _names_error(result.stderr[i][u])), t)
        print(f"[paralayer.slurm] job {jid} failed ({result.states[jid]}); run {result.run_dirs[i]}",
              file=stream, flush=True)
        if oc[t] is not None and oc[t][0] == "error":
            print(f"--- task {t} traceback ---\n{oc[t][1]}", file=stream, flush=True)
        print(f"--- tail of {result.stderr[i][t]} ---\n{_tail(result.stderr[i][t])}",
              file=stream, flush=True)


