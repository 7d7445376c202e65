"""Ranks on this machine through torch's elastic launcher (what torchrun uses).

One process per rank runs ``paralayer.runtime.train``'s main on RUN_DIR, forked from a server that
imported the runtime once (rehearse/fork_server.py). When a rank fails the agent
stops the others at once, and we name the rank and its error. The agent's own restarts stay off:
:func:`run_local` restarts the whole run itself (``cluster.max_restarts``), with a fresh rendezvous,
``train.resume=auto`` and a line in run.dir/attempts.jsonl per attempt.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from typing import Optional


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Errors a rank raises because a PEER went away (the collective's connection dropped), not its own.
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "distnetworkerror",
              "distbackenderror", "communicator was aborted", "read error", "socket closed")


def root_failure(failures: dict) -> tuple:
    """(rank, failure) that caused the stop. The agent reports every rank that ended badly, with
    whole-second timestamps, so "earliest" alone can name a rank that only saw its peer vanish
    (gloo raises on the dropped connection before the agent's next poll) or one the agent stopped
    (SIGTERM). Those come after a rank that failed on its own: killed by another signal, or an
    error of its own making."""
    return min(failures.items(), key=lambda kv: (_secondary(kv[1]), kv[1].timestamp or 0, kv[0]))


def _secondary(f) -> bool:
    """A rank stopped by the agent (SIGTERM) or one that only saw its peer vanish."""
    import signal

    msg = f.message if isinstance(f.message, str) else json.dumps(f.message)
    return f.exitcode == -int(signal.SIGTERM) or any(k in str(msg).lower() for k in _PEER_LOSS)


def run_local(run_dir: str, plan: dict, max_restarts: Optional[int] = None, since: Optional[float] = None) -> int:
    """Run the ranks here; a rank that dies (anything but bad input, exit 2) restarts the run from
    the newest verified checkpoint, up to ``cluster.max_restarts`` times (read from resolved.yaml
    when not given). Each attempt is a line of run.dir/attempts.jsonl; goodput.json then accounts
    every attempt's wall time on this launcher's clock (metrics/goodput.py), the first from ``since``
    (the launcher process's start for a single run; now, by default)."""
    from paralayer.dispatch import attempts as att
    from paralayer.metrics import goodput

    launcher_t0 = since or time.time()
    limit = _max_restarts(run_dir) if max_restarts is None else int(max_restarts)
    att.clear(run_dir)
    attempt, start, rc = 1, launcher_t0, 1
    while True:
        rc, cause, info = _attempt(run_dir, plan, attempt)
        end = time.time()
        restart = att.should_restart(cause, attempt, limit)
        att.record(run_dir, attempt, cause, start, end, restart=restart, **info)
        goodput.account_attempt(run_dir, attempt, start, end, finished=cause == "done")
        if not restart:
            if cause in ("rank_died", "hang") and limit > 0:
                print(att.limit_line(attempt, limit, "cluster.max_restarts"), file=sys.stderr, flush=True)
            break
        print(att.restart_line(attempt, limit, info.get("line") or cause), file=sys.stderr, flush=True)
        attempt, start = attempt + 1, end
    totals = goodput.read_totals(run_dir)
    if totals and attempt > 1:
        line = goodput.summary_line(totals).replace("paralayer: goodput", "paralayer: goodput of every attempt "
                                                                          "(the launcher's clock)", 1)
        print(line, flush=True)
    if rc == 0:
        print(f"paralayer: done; metrics in {os.path.join(run_dir, 'metrics.jsonl')}", flush=True)
    return rc


def _max_restarts(run_dir: str) -> int:
    from paralayer import config as config_mod

    try:
        return int(config_mod.from_yaml_file(os.path.join(run_dir, "resolved.yaml")).cluster.max_restarts)
    except Exception:  # noqa: BLE001 - a run dir written by hand (tests): no restarts
        return 0


def _attempt(run_dir: str, plan: dict, attempt: int) -> tuple[int, str, dict]:
    """One launch of every rank: (exit code, cause, what attempts.jsonl records of it)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = int(plan["world_size"])
    env_cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, env_cores // world)))
    if plan["device"] == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.environ.get("PYTHONPATH", "").startswith(repo_root + os.pathsep):
        os.environ["PYTHONPATH"] = repo_root + os.pathsep + os.environ.get("PYTHONPATH", "")
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"paralayer-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
        monitor_interval=0.2, start_method="forkserver",
    )
    import logging

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):  # we name the failed rank below
        logging.getLogger(name).setLevel(logging.CRITICAL)
    again = f" (attempt {attempt})" if attempt > 1 else ""
    print(f"paralayer: {world} rank(s) on this machine; run dir {run_dir}{again}", flush=True)
    error_file = os.path.join(run_dir, "error.txt")  # the failure's line, for the sweep report
    if os.path.exists(error_file):
        os.remove(error_file)
    from paralayer.dispatch.hang_monitor import HangMonitor
    from paralayer.rehearse import fork_server
    from paralayer.runtime import completion
    from paralayer.runtime.health.watchdog import clear as clear_hang_reports

    clear_hang_reports(run_dir)
    completion.clear(run_dir)  # only this attempt's ranks can say they finished
    overrides = ["train.resume=auto"] if attempt > 1 else []  # the newest verified checkpoint (none: step 1)
    fork_server.context()
    monitor = HangMonitor(run_dir, world)  # a hang: names the stuck rank, ends the ranks
    try:
        with fork_server.bare_main():
            elastic_launch(lc, fork_server.run_rank)(run_dir, dict(os.environ), *overrides)
    except ChildFailedError as exc:
        monitor.stop()
        failed = sorted(exc.failures)
        if completion.all_done(run_dir, world):  # every rank finished first: how it exited does not undo that
            own = {r: f for r, f in exc.failures.items() if not _secondary(f)} or exc.failures
            codes = {r: f.exitcode for r, f in own.items()}
            line = completion.exit_line(codes)
            print(line, file=sys.stderr, flush=True)
            return 0, "done", {"exit_code": 0, "line": line, "ranks_failed": failed,
                               "after_done": {str(r): f.exitcode for r, f in sorted(exc.failures.items())}}
        if monitor.line is not None:
            print(monitor.line, file=sys.stderr, flush=True)
            with open(error_file, "w", encoding="utf-8") as f:
                f.write(monitor.line + "\n")
            return 1, "hang", {"line": monitor.line, "ranks": _named_ranks(monitor.line), "ranks_failed": failed,
                               "exit_code": 1}
        rank, failure = root_failure(exc.failures)
        msg = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
        if isinstance(failure.message, dict):
            msg = failure.message.get("message", msg)
        last = str(msg).strip().splitlines()[-1] if msg else f"exit code {failure.exitcode}"
        ranks = ", ".join(str(r) for r in failed)
        info = {"ranks": [rank], "ranks_failed": failed, "exit_code": failure.exitcode,
                "host": getattr(failure, "hostname", None)}
        if failure.exitcode == 2:  # bad input (data, checkpoints) the ranks reported as one line
            print(f"error: {last}", file=sys.stderr, flush=True)
            with open(error_file, "w", encoding="utf-8") as f:
                f.write(f"rank {rank} failed (exit code 2): {last}\n")
            return 2, "bad_input", dict(info, line=f"error: {last}")
        line = f"paralayer: rank {rank} failed (exit code {failure.exitcode}): {last}"
        print(line, file=sys.stderr, flush=True)
        with open(error_file, "w", encoding="utf-8") as f:
            f.write(f"rank {rank} failed (exit code {failure.exitcode}): {last}\n")
        if len(exc.failures) > 1:
            print(f"paralayer: ranks that ended with an error: {ranks}", file=sys.stderr, flush=True)
        return 1, "rank_died", dict(info, line=line)
    monitor.stop()
    return 0, "done", {"exit_code": 0}


def _named_ranks(line: str) -> list[int]:
    """The ranks a hang diagnosis names ("rank 1 never entered", "ranks 1, 3 never entered")."""
    import re

    m = re.search(r"ranks? ([\d, ]+) never entered", line)
    return [int(r) for r in m.group(1).replace(" ", "").split(",") if r] if m else []
