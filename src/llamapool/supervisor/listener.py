"""The HTTP gateways' listening socket: the supervisor binds it once and every gateway process it
spawns inherits it, as nginx and gunicorn do.

All the gateway processes accept from the one kernel queue, so a reload loses nothing: the old
gateways stop accepting while the new ones go on taking connections from the same queue (each
gateway binding its own SO_REUSEPORT socket instead, a connection queued on an old one's socket
would be reset when that socket closed). The socket lives for as long as ``[http] listen`` names
its address; the supervisor closes its copy once no gateway is to accept from it any more, and the
kernel closes the socket when the last gateway holding it has closed its own.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

BACKLOG = 2048  # connections the kernel queues before any gateway accepts them (uvicorn's default)


def split(listen: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:8000`` for IPv6) as a host and a port."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(eq=False)
class Listener:
    """One listening socket of the supervisor's, and the ``[http] listen`` that named it."""

    listen: str
    sock: socket.socket

    @classmethod
    def bind(cls, listen: str) -> Listener:
        """Bind and listen on ``listen``; OSError when the address is taken or not this host's."""
        host, port = split(listen)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # SO_REUSEPORT: a reload that moves to another host on the same port binds it next to the
            # old socket, and a daemon restarted after a kill -9 binds while the killed one's gateways
            # still hold theirs (for a second, until they notice)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        return cls(listen, sock)

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    @property
    def host(self) -> str:
        return split(self.listen)[0]

    @property
    def port(self) -> int:
        """The port bound (the kernel's choice when ``listen`` says port 0)."""
        return int(self.sock.getsockname()[1])

    def serves(self, listen: str) -> bool:
        """Whether ``listen`` names this socket's address (written the same way, or resolving to it)."""
        if listen == self.listen:
            return True
        host, port = split(listen)
        try:
            found = socket.getaddrinfo(host, port, self.sock.family, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        here = self.sock.getsockname()[:2]
        return port != 0 and any(addr[4][:2] == here for addr in found)

    def close(self) -> None:
        """Close the supervisor's copy (the gateways that hold the socket keep it open until they close theirs)."""
        with contextlib.suppress(OSError):
            self.sock.close()
