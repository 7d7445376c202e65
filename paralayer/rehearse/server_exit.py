"""Imported only by the fork server (fork_server.PRELOAD): the server ends without tearing torch down.

The server holds the launcher's stdout and stderr, so whoever reads the launcher's output waits for
its end too; an interpreter with torch loaded takes 0.5-1.5 s to tear down, time no clock of the
run sees (goodput.json's wall is the launcher's). The server writes nothing of its own, so when it
exits (its "alive" pipe closed) it skips the teardown. A rank forked from it inherits the hook but
is another process: the hook only acts in the process that imported this module."""
from __future__ import annotations

import atexit
import os
import sys


def _exit_now(pid: int) -> None:
    if os.getpid() == pid:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


atexit.register(_exit_now, os.getpid())
