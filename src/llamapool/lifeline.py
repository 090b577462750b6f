"""A child process (worker, gateway) dies with its supervisor at once, even when frozen.

``die_with_parent()`` asks the kernel for SIGKILL when the parent exits (Linux ``PR_SET_PDEATHSIG``;
SIGKILL also ends a process stopped with SIGSTOP). The supervisor puts its pid in the child's
environment (``LLAMAPOOL_PARENT_PID``): a parent that died before the call is seen at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "LLAMAPOOL_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def report(event: str, busy_for: float = 0.0, detail: str = "") -> None:
    """Tell the supervisor ``event`` (protocol/control.py ChildReport) on this process's output pipe."""
    from llamapool.protocol import codec
    from llamapool.protocol.control import ChildReport

    with contextlib.suppress(OSError):  # the supervisor is gone: it will not read it anyway
        print(codec.report_line(ChildReport(event, busy_for, detail)), file=sys.stderr, flush=True)


def parent_env() -> dict[str, str]:
    """The environment entry a supervisor gives each child it spawns."""
    return {PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits; exit now if the parent is already gone."""
    want = os.environ.get(PARENT_PID_ENV, "")
    if not want.isdigit():
        return  # started by hand, not by a supervisor
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(f"llamapool: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    if os.getppid() != int(want):  # the parent died before prctl: nobody would kill us
        os._exit(1)
