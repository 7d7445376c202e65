"""The data cache's file primitives: atomic writes and a cross-process lock that leaves no file.

Ranks that build the same cached dataset at once take :func:`file_lock` on it: one builds, the
others wait and then read. The lock is ``flock`` on ``PATH.lock``; the holder deletes the lock
file before releasing it, and a waiter that wakes up on a deleted file takes the lock again on the
new one (the usual unlink-safe pattern), so nothing is left in the cache afterwards. While it holds
the lock a process turns SIGTERM into ``SystemExit``: the local launcher stops the other ranks with
SIGTERM when one fails (bad data), and a rank stopped mid-build must still remove its lock file
and the temporary files of the build.
"""
from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from typing import Iterator


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file + rename: readers never see a partial file."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive lock named ``path`` (created, then removed by the holder on release)."""
    import fcntl

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the holder before us removed this file: lock the new one
    try:
        with _sigterm_exits():
            yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit inside the block (so ``finally`` clauses run); the previous handler after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
