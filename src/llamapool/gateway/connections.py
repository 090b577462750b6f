"""Connection hygiene for the gateway's HTTP server: timeouts, a cap on open connections, and
clients that stop reading.

uvicorn's httptools protocol closes a keep-alive connection after ``timeout_keep_alive``, but never
one that sends nothing or stops half-way through a request (slowloris), has no cap below the fd
limit (past it, accept() fails and every new client is locked out), and its ``send`` waits for a
client that does not read for ever, while that stream's replies pile up in the gateway. This module
subclasses that protocol (uvicorn takes the class as ``Config(http=...)``) and adds:

- ``idle_timeout``: a connection with no request in progress (before its first, between two) is closed;
- ``read_timeout``: a request's head and body must arrive within it from its first byte (else 408
  and close, or a disconnect when the body is late);
- ``max_connections``: past it, a new connection closes the oldest idle one (no request in
  progress, or one still arriving); when every one has a request in progress, the new one gets 503;
- ``send_buffer_bytes``: each connection's kernel send buffer is fixed at this size (rather than
  autotuned up to 4 MiB), and the gateway holds at most as much again for a client: the app's writes
  are not held back meanwhile (so a stream's replies never queue up in the gateway), and past it
  the client is disconnected, which cancels its request on the worker;
- ``send_timeout``: a client that has taken none of its waiting reply for this long (checked every
  second from TCP_INFO: bytes acked, bytes not yet sent) is disconnected too;
- a graceful stop (SIGTERM: the daemon stops, or a reload retires this process) closes a connection
  only between two requests: one accepted whose request has not arrived, or not all of it (it may be
  in the kernel's buffer still), is served, then closed (uvicorn would close it at once, which a
  request already sent sees as a reset); one accepted that sends nothing is closed after
  ``SHUTDOWN_GRACE`` seconds.

Sheds, refusals and disconnects are logged, at most one line per reason every 10 s (with the count).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

RESERVED_FDS = 64  # for the router connection, the listening socket, stdio, uvloop's own
AUTO_MAX_CONNECTIONS = 4096  # per gateway process when the fd limit allows more
LOG_QUIET = 10.0  # seconds between two lines of one kind
SHUTDOWN_GRACE = 5.0  # seconds a connection accepted just before a graceful stop has to send its request
# Linux's struct tcp_info: the offsets of tcpi_bytes_acked (u64, since 4.1) and tcpi_notsent_bytes (u32, 4.6)
TCPI_BYTES_ACKED, TCPI_NOTSENT_BYTES = 120, 144


@dataclass(frozen=True)
class ConnectionLimits:
    """The ``[http]`` settings this module enforces (docs/security.md)."""

    idle_timeout: float = 30.0
    read_timeout: float = 30.0
    max_connections: int = 0  # 0: the fd limit less RESERVED_FDS, at most AUTO_MAX_CONNECTIONS
    send_timeout: float = 30.0
    send_buffer_bytes: int = 256 * 1024

    def resolved(self, fd_limit: int) -> tuple[ConnectionLimits, str]:
        """These limits with ``max_connections`` fitted under ``fd_limit``, and a warning ("" if none)."""
        room = max(1, fd_limit - RESERVED_FDS)
        if not self.max_connections:
            n, warning = min(room, AUTO_MAX_CONNECTIONS), ""
        elif self.max_connections > room:
            n, warning = room, (f"http.max_connections = {self.max_connections} does not fit the fd limit "
                                f"({fd_limit}, {RESERVED_FDS} kept for the gateway itself): using {room}")
        else:
            n, warning = self.max_connections, ""
        return ConnectionLimits(self.idle_timeout, self.read_timeout, n, self.send_timeout,
                                self.send_buffer_bytes), warning


class Phase(enum.Enum):
    IDLE = "idle"  # no request in progress (before the first, between two)
    READING = "reading"  # a request's first byte has come, not all of it yet
    ACTIVE = "active"  # a request read whole, its response not finished


class Notes:
    """Rate-limited log lines: the first of a kind at once, then one every ``LOG_QUIET`` seconds
    saying how many more there were."""

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn
        self.quiet: dict[str, int] = {}  # kind -> events since its last line, while its quiet period runs

    def note(self, kind: str, line: str, summary: Callable[[int], str]) -> None:
        if kind in self.quiet:
            self.quiet[kind] += 1
            return
        self.warn(line)
        self.quiet[kind] = 0
        asyncio.get_running_loop().call_later(LOG_QUIET, self._flush, kind, summary)

    def _flush(self, kind: str, summary: Callable[[int], str]) -> None:
        n = self.quiet.pop(kind, 0)
        if n:
            self.warn(summary(n))


class Tracker:
    """This process's open connections; the idle ones (and those whose request is still arriving)
    in the order they became so, oldest first."""

    def __init__(self, limits: ConnectionLimits, warn: Callable[[str], None]):
        self.limits = limits
        self.notes = Notes(warn)
        self.open: set[GuardedProtocol] = set()
        self.idle: dict[GuardedProtocol, None] = {}  # insertion-ordered
        self.tick = min(1.0, limits.send_timeout / 4)  # how often answering connections are checked
        self.sweeper: asyncio.TimerHandle | None = None

    def admit(self, conn: GuardedProtocol) -> bool:
        """A new connection, idle; False: refused (503), every other one has a request in progress."""
        if self.sweeper is None:
            self._sweep()
        self.open.add(conn)
        self.idle[conn] = None
        cap = self.limits.max_connections
        while len(self.open) > cap:
            victim = next(iter(self.idle))
            if victim is conn:
                self.forget(conn)
                self.notes.note("refused", f"refused a connection from {conn.peer}: {cap} connections open, each "
                                f"with a request in progress (http.max_connections)",
                                lambda n: f"refused {n} more connections in the last {LOG_QUIET:.0f} s: "
                                          f"{cap} busy connections open (http.max_connections)")
                conn.refuse()
                return False
            self.notes.note("shed", f"{cap} connections open (http.max_connections): closed the oldest idle one, "
                            f"from {victim.peer}, {victim.phase.value} for {victim.age():.1f} s",
                            lambda n: f"closed {n} more idle connections in the last {LOG_QUIET:.0f} s to stay "
                                      f"within http.max_connections = {cap}")
            victim.drop()
        return True

    def _sweep(self) -> None:
        """Every ``tick``: the connections answering a request check that their client reads."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [c for c in self.open if c.phase is Phase.ACTIVE]:
            conn.check_progress(now)
        self.sweeper = loop.call_later(self.tick, self._sweep)

    def forget(self, conn: GuardedProtocol) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def phase(self, conn: GuardedProtocol, old: Phase, new: Phase) -> None:
        if new is Phase.ACTIVE:
            self.idle.pop(conn, None)
        elif new is Phase.IDLE or old is Phase.ACTIVE:  # a new idle period: to the back of the line
            self.idle.pop(conn, None)
            if conn in self.open:
                self.idle[conn] = None


class BoundedFlow(FlowControl):
    """uvicorn's flow control, except that the app's writes are not held back while the client's
    unread bytes stay within ``limit`` (a stream's replies then wait here as bytes, never as
    replies queued in the gateway); past it ``overflow`` is called once and writes stop for good.

    uvicorn's response cycle reads ``write_paused`` before each write, and then awaits ``drain``."""

    def __init__(self, transport: asyncio.Transport, limit: int, overflow: Callable[[], None]):
        self.behind = False  # the transport's buffer is over its high-water mark
        self.cut = False
        self.limit, self.overflow = limit, overflow
        super().__init__(transport)

    @property  # type: ignore[override]
    def write_paused(self) -> bool:
        if not self.cut and self.behind and self._transport.get_write_buffer_size() > self.limit:
            self.cut = True
            self._is_writable_event.clear()  # drain() waits for release()
            self.overflow()
        return self.cut

    @write_paused.setter
    def write_paused(self, value: bool) -> None:  # FlowControl.__init__
        pass

    def pause_writing(self) -> None:
        self.behind = True

    def resume_writing(self) -> None:  # by the transport; uvicorn's connection_lost() too
        self.behind = False

    def release(self) -> None:
        """The connection is gone: a write waiting in drain() goes on (and finds it gone)."""
        self._is_writable_event.set()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under this process's :class:`Tracker` (see :func:`protocol_class`)."""

    tracker: ClassVar[Tracker]
    phase: Phase = Phase.IDLE
    peer = "?"
    stopping = False  # the server stops: the request in progress, or the first one, is the last

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.tracker.limits
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a fixed kernel buffer: past it, unread bytes show in the transport's
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
        high = min(64 * 1024, limits.send_buffer_bytes // 4)
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self.flow = BoundedFlow(transport, limits.send_buffer_bytes, self._overflow)
        self.peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        self.phase, self.begun, self.responded = Phase.IDLE, 0, 0
        self.reading = self.head_done = False
        self.since = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None
        self.token: int | None = None  # the client's progress at the last tick (see check_progress)
        self.progress_at = self.since
        self.what = ""  # the request being answered, for the log
        if self.tracker.admit(self):
            self._arm(limits.idle_timeout, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.tracker.forget(self)
        super().connection_lost(exc)  # marks the request's cycle disconnected
        if isinstance(self.flow, BoundedFlow):
            self.flow.release()

    def age(self) -> float:
        return self.loop.time() - self.since

    # ---------------------------------------------------------------- phases

    def _update(self) -> None:
        answering = self.begun - self.responded - self.reading  # requests read whole, not yet answered
        new = Phase.ACTIVE if answering > 0 else Phase.READING if self.reading else Phase.IDLE
        if new is self.phase:
            return
        old, self.phase, self.since = self.phase, new, self.loop.time()
        self.tracker.phase(self, old, new)
        limits = self.tracker.limits
        if new is Phase.IDLE:
            self._arm(limits.idle_timeout, self._idle_expired)
        elif new is Phase.READING:
            self._arm(limits.read_timeout, self._read_expired)
        else:
            self._arm(None, None)
            self.token, self.progress_at = None, self.since

    def _arm(self, delay: float | None, then: Callable[[], None] | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None if delay is None or then is None else self.loop.call_later(delay, then)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.reading, self.head_done = True, False
        self.begun += 1
        self._update()

    def on_headers_complete(self) -> None:
        self.head_done = True
        super().on_headers_complete()
        self.what = f"{self.scope.get('method', '?')} {self.scope.get('path', '?')}"
        if self.stopping and self.cycle is not None:  # closed once answered
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.reading = False
        self._update()

    def on_response_complete(self) -> None:
        self.responded += 1
        super().on_response_complete()
        self._update()

    # ---------------------------------------------------------------- closing

    def shutdown(self) -> None:
        """A graceful stop (uvicorn calls it on each connection once it has stopped accepting): a
        request in progress, or one still arriving, is answered, and the connection then closes; a
        keep-alive connection between two requests closes now; one accepted that has not sent its
        first request yet (it may be in the kernel's buffer) gets ``SHUTDOWN_GRACE`` seconds to."""
        self.stopping = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        if self.phase is Phase.READING:
            return
        if self.phase is Phase.IDLE and not self.begun:
            self._arm(min(SHUTDOWN_GRACE, self.tracker.limits.idle_timeout), self._idle_expired)
            return
        super().shutdown()

    def _idle_expired(self) -> None:
        if self.transport.get_write_buffer_size():  # the end of a reply the client does not read
            self._reset()
        else:
            self.transport.close()

    def _read_expired(self) -> None:
        limits, notes = self.tracker.limits, self.tracker.notes
        notes.note("read_timeout", f"closed a connection from {self.peer}: its request did not arrive within "
                   f"{limits.read_timeout:g} s of its first byte (http.read_timeout)",
                   lambda n: f"closed {n} more connections in the last {LOG_QUIET:.0f} s whose request did not "
                             f"arrive within {limits.read_timeout:g} s (http.read_timeout)")
        if not self.head_done:
            self._answer(408, "Request Timeout", f"the request did not arrive within {limits.read_timeout:g} s "
                         "(http.read_timeout)", "request_timeout")
        else:  # the app reads the body: it sees the client go
            self.transport.abort()

    def _answer(self, status: int, reason: str, message: str, code: str, extra: str = "") -> None:
        """A JSON error in OpenAI's shape, then close (only while no response has started)."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n{extra}\r\n").encode()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()

    def refuse(self) -> None:
        self._answer(503, "Service Unavailable", "too many connections, each with a request in progress "
                     "(http.max_connections): try again", "too_many_connections", "retry-after: 1\r\n")

    def drop(self) -> None:
        """Shed: close at once (nothing is owed to an idle connection)."""
        self.tracker.forget(self)
        self._reset()

    def _reset(self) -> None:
        """Close with a reset: what waits for the client in the kernel is dropped with the descriptor
        (a plain close would leave the kernel sending it to a client that does not read)."""
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(AttributeError, OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def check_progress(self, now: float) -> None:
        """Every tick while a request is answered: cut a client that has taken none of its waiting
        reply for ``send_timeout`` (progress: TCP_INFO's bytes acked, else the buffer shrinking)."""
        acked, unsent = self._tcp_progress()
        buffered = self.transport.get_write_buffer_size()
        token = acked if acked is not None else -buffered
        if not (buffered or unsent) or self.token is None or token > self.token:
            self.progress_at = now
        self.token = token
        t = self.tracker.limits.send_timeout
        if now - self.progress_at >= t:
            self._disconnect("send_timeout", f"it took none of its reply for {t:g} s while "
                             f"{(buffered + unsent) / 1024:.0f} KiB waited (http.send_timeout)",
                             lambda n: f"disconnected {n} more clients in the last {LOG_QUIET:.0f} s that took "
                                       f"none of their reply for {t:g} s (http.send_timeout)")

    def _tcp_progress(self) -> tuple[int | None, int]:
        """The bytes the client's side has taken and those not yet sent to it, from TCP_INFO
        (``None, 0`` where unknown: not Linux, not TCP)."""
        sock = self.transport.get_extra_info("socket")
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCPI_NOTSENT_BYTES + 4)
            return (int(struct.unpack_from("Q", info, TCPI_BYTES_ACKED)[0]),
                    int(struct.unpack_from("I", info, TCPI_NOTSENT_BYTES)[0]))
        except (AttributeError, OSError, struct.error):
            return None, 0

    def _overflow(self) -> None:
        limit = self.tracker.limits.send_buffer_bytes
        waiting = self.transport.get_write_buffer_size() / 1024
        self._disconnect("send_buffer", f"{waiting:.0f} KiB of its reply waited unread, over "
                         f"http.send_buffer_bytes = {limit}",
                         lambda n: f"disconnected {n} more clients in the last {LOG_QUIET:.0f} s "
                                   f"whose unread reply passed http.send_buffer_bytes = {limit}")

    def _disconnect(self, kind: str, why: str, summary: Callable[[int], str]) -> None:
        """Cut a client that does not read: the app sees it go (and cancels its request)."""
        self.tracker.notes.note(kind, f"disconnected {self.peer} ({self.what or 'no request'}): {why}; its "
                                "request is cancelled", summary)
        self._reset()


def protocol_class(tracker: Tracker) -> type[GuardedProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``), bound to this process's tracker."""
    attrs: dict[str, Any] = {"tracker": tracker}
    return type("GuardedProtocol", (GuardedProtocol,), attrs)
