"""Endpoint helpers shared by the daemon and the SDK: the default frontend, ipc:// paths, CURVE or not.

Standard library only, so the SDK (``llamapool.client``) needs nothing of the daemon's configuration.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_runtime_dir() -> Path:
    """systemd's RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/llamapool, else /tmp/llamapool-<uid>."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "llamapool"
    return Path(f"/tmp/llamapool-{os.getuid()}")


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint (None for other transports and abstract sockets)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        return endpoint[len("ipc://"):]
    return None


def needs_curve(endpoint: str) -> bool:
    """Whether an endpoint is reachable beyond filesystem permissions (anything but ipc:// and inproc://):
    such a socket uses CURVE unless ``security.insecure_tcp``."""
    return not endpoint.startswith(("ipc://", "inproc://"))


def default_frontend() -> str:
    """The daemon's default SDK endpoint: ``ipc://<runtime dir>/frontend.sock``."""
    return f"ipc://{default_runtime_dir() / 'frontend.sock'}"
