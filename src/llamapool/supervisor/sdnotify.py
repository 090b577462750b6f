"""A minimal sd_notify(3) client: readiness, status, reload, stop and watchdog messages to systemd.

Only the main process talks to systemd; workers get an environment without systemd's variables
(:func:`scrub_env`). Without ``NOTIFY_SOCKET`` every call is a cheap no-op that returns False.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping

SYSTEMD_ENV_VARS = (
    "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES",
)


def scrub_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the variables by which systemd hands a process its socket and fds."""
    return {k: v for k, v in env.items() if k not in SYSTEMD_ENV_VARS}


def _socket_address(value: str) -> bytes | None:
    """NOTIFY_SOCKET as an AF_UNIX address: an absolute path, or ``@name`` for the abstract namespace."""
    if value.startswith("/"):
        return os.fsencode(value)
    if value.startswith("@") and len(value) > 1:
        return b"\0" + os.fsencode(value[1:])
    return None  # unset, relative, or a kind we do not speak (vsock:...)


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    """WATCHDOG_USEC when it is meant for this process (WATCHDOG_PID unset or ours), else None."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec


class Notifier:
    """Sends sd_notify datagrams to ``NOTIFY_SOCKET``; never raises when systemd is not listening."""

    __slots__ = ("_address", "_sock", "_watchdog_usec")

    def __init__(self, address: bytes | None = None, watchdog_usec: int | None = None) -> None:
        self._address = address
        self._watchdog_usec = watchdog_usec if address is not None else None
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Notifier:
        """Read NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID from ``env``."""
        return cls(_socket_address(env.get("NOTIFY_SOCKET", "")), _watchdog_usec(env))

    @property
    def enabled(self) -> bool:
        """True when there is a notification socket to send to."""
        return self._address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings (half of WATCHDOG_USEC), or None without a watchdog."""
        return None if self._watchdog_usec is None else self._watchdog_usec / 2e6

    def send(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram; False when disabled or the socket is gone or full."""
        if self._address is None or not lines:
            return False
        data = "\n".join(lines).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # close-on-exec by default
                sock.setblocking(False)  # never stall the event loop on a full queue
                self._sock = sock
            self._sock.sendto(data, self._address)
        except OSError:
            return False
        return True

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` fields in one datagram, e.g. ``notify(READY=1, STATUS="up")``."""
        return self.send(*(f"{k}={_one_line(v)}" for k, v in fields.items()))

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``, with an optional ``STATUS=`` in the same datagram."""
        if status is None:
            return self.send("READY=1")
        return self.send("READY=1", f"STATUS={_one_line(status)}")

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``; follow with :meth:`ready` when the reload is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        """``STOPPING=1``: the service has begun shutting down."""
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        """``STATUS=text``, shown by ``systemctl status``."""
        return self.send(f"STATUS={_one_line(text)}")

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: the current start/stop/reload step needs ``seconds`` more from now."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1`` keep-alive; only sent when a watchdog is configured for this process."""
        if self._watchdog_usec is None:
            return False
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        """Close the socket; a later send opens a new one."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def _one_line(value: object) -> str:
    """One message field per line: newlines in a value would start a new field."""
    return str(value).replace("\r", " ").replace("\n", " ")
