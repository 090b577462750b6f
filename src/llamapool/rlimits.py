"""Process limits every daemon process sets for itself at start."""

from __future__ import annotations

import resource


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the new soft limit.

    The router holds a few ZeroMQ sockets a worker and a client, and the gateway one a connection:
    at a login shell's 1,024 (or a unit's lower limit) ZeroMQ aborts the process on EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
