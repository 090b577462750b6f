"""One daemon per runtime dir: a lock held for the daemon's whole life.

The lock is ``flock`` on ``<runtime dir>/llamapool.lock``, which holds the daemon's pid. The kernel
releases it when the process ends, however it ends (kill -9 included), so a stale file never blocks
the next start; a second daemon on the same runtime dir is refused before it binds any socket.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "llamapool.lock"


class AlreadyRunning(Exception):
    """Another daemon holds the runtime dir."""

    def __init__(self, runtime_dir: Path, pid: str):
        self.runtime_dir, self.pid = runtime_dir, pid
        who = f"pid {pid}" if pid else "a process whose pid is not written yet"
        super().__init__(
            f"another llamapool daemon ({who}) is running on the runtime dir {runtime_dir}: stop it first "
            f"({'kill -TERM ' + pid if pid else 'kill -TERM <pid>'}, or `systemctl stop llamapool`), "
            f"or give this one its own server.runtime_dir")


class RunLock:
    """The runtime dir's lock, held from ``acquire()`` until the process exits (or ``release()``)."""

    def __init__(self, runtime_dir: Path):
        self.runtime_dir = runtime_dir
        self.path = runtime_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        """Create the runtime dir (0700) and take its lock; AlreadyRunning names the holder."""
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise AlreadyRunning(self.runtime_dir, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
