"""Ranks on this machine through torch's elastic launcher (what torchrun uses).

One process per rank runs ``python -m paralayer.runtime.train RUN_DIR``. When a rank fails the agent
stops the others at once (no restarts), and we name the rank and its error.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import uuid


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
    import signal

    def secondary(f) -> bool:
        msg = f.message if isinstance(f.message, str) else json.dumps(f.message)
        return f.exitcode == -int(signal.SIGTERM) or any(k in str(msg).lower() for k in _PEER_LOSS)

    return min(failures.items(), key=lambda kv: (secondary(kv[1]), kv[1].timestamp or 0, kv[0]))


def run_local(run_dir: str, plan: dict) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = int(plan["world_size"])
    env_cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, env_cores // world)))
    if plan["device"] == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = repo_root + os.pathsep + os.environ.get("PYTHONPATH", "")
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"paralayer-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
        monitor_interval=0.2, start_method="spawn",
    )
    import logging

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we name the failed rank below
    print(f"paralayer: {world} rank(s) on this machine; run dir {run_dir}", flush=True)
    error_file = os.path.join(run_dir, "error.txt")  # the failure's line, for the sweep report
    if os.path.exists(error_file):
        os.remove(error_file)
    from paralayer.dispatch.hang_monitor import HangMonitor
    from paralayer.runtime.watchdog import clear as clear_hang_reports

    clear_hang_reports(run_dir)
    monitor = HangMonitor(run_dir, world)  # a hang: names the stuck rank, ends the ranks
    try:
        elastic_launch(lc, sys.executable)("-u", "-m", "paralayer.runtime.train", run_dir)
    except ChildFailedError as exc:
        monitor.stop()
        if monitor.line is not None:
            print(monitor.line, file=sys.stderr, flush=True)
            with open(error_file, "w", encoding="utf-8") as f:
                f.write(monitor.line + "\n")
            return 1
        rank, failure = root_failure(exc.failures)
        msg = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
        if isinstance(failure.message, dict):
            msg = failure.message.get("message", msg)
        last = str(msg).strip().splitlines()[-1] if msg else f"exit code {failure.exitcode}"
        ranks = ", ".join(str(r) for r in sorted(exc.failures))
        if failure.exitcode == 2:  # bad input (data, checkpoints) the ranks reported as one line
            print(f"error: {last}", file=sys.stderr, flush=True)
            with open(error_file, "w", encoding="utf-8") as f:
                f.write(f"rank {rank} failed (exit code 2): {last}\n")
            return 2
        print(f"paralayer: rank {rank} failed (exit code {failure.exitcode}): {last}", file=sys.stderr, flush=True)
        with open(error_file, "w", encoding="utf-8") as f:
            f.write(f"rank {rank} failed (exit code {failure.exitcode}): {last}\n")
        if len(exc.failures) > 1:
            print(f"paralayer: ranks that ended with an error: {ranks}", file=sys.stderr, flush=True)
        return 1
    monitor.stop()
    print(f"paralayer: done; metrics in {os.path.join(run_dir, 'metrics.jsonl')}", flush=True)
    return 0
