"""Blocking client. One socket per thread, so one ``Client`` may be shared by many threads."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from llamapool.client.calls import (
    DEFAULT_TIMEOUT,
    KeySource,
    Pending,
    chat_prompt,
    check_endpoint,
    check_timeout,
    curve_keys,
    decode_reply,
    generate_frame,
    metrics_of,
    new_id,
    no_answer,
    not_connected,
    send_timeout_ms,
    status_of,
)
from llamapool.client.errors import LlamapoolError, RequestTimeoutError
from llamapool.client.types import Completion, StreamChunk
from llamapool.config import default_frontend
from llamapool.protocol import codec
from llamapool.protocol.messages import Cancel, Message, MetricsRequest, Prompt, StatusRequest


class _Conn:
    """A DEALER socket of one thread and the replies it holds for other requests."""

    def __init__(self, zctx: zmq.Context, endpoint: str, keys: tuple[bytes, bytes, bytes] | None = None):
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = keys
        self.sock.connect(endpoint)
        self.held: defaultdict[str, deque[Message]] = defaultdict(deque)
        self.dropped: set[str] = set()

    def recv_for(self, rid: str, deadline: float | None) -> Message:
        while True:
            if self.held.get(rid):
                return self.held[rid].popleft()
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise RequestTimeoutError("timeout", "no reply from llamapool before the deadline")
            if not self.sock.poll(None if wait is None else max(1, int(wait * 1000))):
                continue
            msg = decode_reply(self.sock.recv_multipart())
            mid = getattr(msg, "id", None)
            if mid == rid:
                return msg
            if mid is not None and mid not in self.dropped:
                self.held[mid].append(msg)


class Stream:
    """Iterator of :class:`StreamChunk`; ``completion`` is set once it is exhausted.

    Leaving the iteration early (``break``, ``close()``, or dropping the stream) cancels the
    request on the daemon. It holds no reference cycle, so a ``break`` out of
    ``for chunk in client.stream(...)`` cancels at once.
    """

    def __init__(self, client: Client, conn: _Conn, rid: str, deadline: float | None):
        self._client, self._conn, self._rid, self._deadline = client, conn, rid, deadline
        self._pending = Pending(1)
        self._open = True
        self.completion: Completion | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamChunk:
        if not self._open:
            raise StopIteration
        try:
            while not self._pending.done:
                chunk = self._pending.feed(self._conn.recv_for(self._rid, self._deadline))
                if chunk is not None:
                    return chunk
        except BaseException:
            self.close()
            raise
        self._open = False
        self.completion = self._pending.completions()[0]  # raises the final error, if any
        raise StopIteration

    def close(self) -> None:
        """Cancel the request if it has not finished."""
        if self._open:
            self._open = False
            self._client._cancel(self._conn, self._rid)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Blocking llamapool client: ``generate``, ``stream``, ``chat``, ``chat_stream``, ``generate_many``, ``status``.

    ``model``: the pool's model that calls without their own ``model=`` use (None: the pool's first).
    For a ``tcp://`` endpoint with CURVE, give ``server_public_key`` (the router's ``.pub`` file, or its
    Z85 or raw key as bytes) and ``client_key`` (your ``.key`` file from ``llamapool keygen``, or the
    secret key as bytes); the router must list your public key. They are ignored on ``ipc://``.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT,
                 server_public_key: KeySource | None = None, client_key: KeySource | None = None,
                 model: str | None = None):
        self.endpoint = endpoint or default_frontend()
        self.timeout = timeout
        self.model = model
        self._keys = curve_keys(self.endpoint, server_public_key, client_key)
        self._zctx = zmq.Context()
        self._local = threading.local()
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()

    def _conn(self) -> _Conn:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Conn(self._zctx, self.endpoint, self._keys)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _deadline(self, timeout: float | None) -> tuple[float | None, float | None]:
        t = check_timeout(self.timeout if timeout is None else timeout)
        return t, (None if t is None else time.monotonic() + t + 1.0)

    def _submit(self, prompts: list[Prompt], batch: bool, stream: bool, timeout: float | None,
                params: dict[str, Any], model: str | None) -> tuple[_Conn, str, float | None]:
        rid = new_id()
        t, deadline = self._deadline(timeout)
        frame = generate_frame(rid, prompts, batch, stream, t, params, self.model if model is None else model)
        check_endpoint(self.endpoint)
        conn = self._conn()
        self._send(conn, frame, t)
        return conn, rid, deadline

    def _send(self, conn: _Conn, frame: bytes, timeout: float | None) -> None:
        conn.sock.sndtimeo = send_timeout_ms(timeout)
        try:
            conn.sock.send(frame)
        except zmq.Again:
            raise not_connected(self.endpoint) from None

    def _collect(self, conn: _Conn, rid: str, pending: Pending, deadline: float | None) -> None:
        try:
            while not pending.done:
                pending.feed(conn.recv_for(rid, deadline))
        except RequestTimeoutError:
            self._cancel(conn, rid)
            raise

    def _cancel(self, conn: _Conn, rid: str) -> None:
        conn.dropped.add(rid)
        conn.held.pop(rid, None)
        with contextlib.suppress(zmq.ZMQError):  # the client may be closed already
            conn.sock.send(codec.encode(Cancel(rid)),
                           zmq.NOBLOCK)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
                 **params: Any) -> Completion:
        """Generate a completion for one prompt (text or token ids) with ``model`` (a name in the pool;
        None: the client's ``model``, else the pool's first)."""
        conn, rid, deadline = self._submit([prompt], False, False, timeout, params, model)
        pending = Pending(1)
        self._collect(conn, rid, pending, deadline)
        return pending.completions()[0]

    def stream(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
               **params: Any) -> Stream:
        """Stream a completion as text deltas."""
        conn, rid, deadline = self._submit([prompt], False, True, timeout, params, model)
        return Stream(self, conn, rid, deadline)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
             model: str | None = None, **params: Any) -> Completion:
        """The model's reply to a chat: ``messages`` are ``{"role": ..., "content": ...}`` maps, rendered
        on the worker with the model's chat template (the reply is the assistant's next turn)."""
        return self.generate(chat_prompt(messages), timeout=timeout, model=model, **params)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                    model: str | None = None, **params: Any) -> Stream:
        """:meth:`chat`, streamed as text deltas (like :meth:`stream`)."""
        return self.stream(chat_prompt(messages), timeout=timeout, model=model, **params)

    def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None,
                      return_exceptions: bool = False, model: str | None = None, **params: Any
                      ) -> list[Completion] | list[Completion | LlamapoolError]:
        """One micro-batch message; one result per prompt, in order."""
        conn, rid, deadline = self._submit(list(prompts), True, False, timeout, params, model)
        pending = Pending(len(prompts))
        self._collect(conn, rid, pending, deadline)
        if return_exceptions:
            return [r for r in pending.results if r is not None]
        return pending.completions()

    def status(self, *, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's view: ``models`` (name, workers, queued, running; the first is the default),
        ``workers`` (id, model, pid, device, state, slots, active, ...), the queue."""
        return status_of(self._query(StatusRequest(new_id()), timeout))

    def metrics(self, *, timeout: float = 5.0) -> str:
        """The daemon's Prometheus metrics, in the text exposition format (docs/metrics.md)."""
        return metrics_of(self._query(MetricsRequest(new_id()), timeout))

    def _query(self, request: StatusRequest | MetricsRequest, timeout: float) -> Message:
        """Send a one-reply request and wait for its reply."""
        conn = self._conn()
        self._send(conn, codec.encode(request), timeout)
        try:
            return conn.recv_for(request.id, time.monotonic() + timeout)
        except RequestTimeoutError:
            conn.dropped.add(request.id)
            raise no_answer(self.endpoint, timeout) from None

    def close(self) -> None:
        with self._lock:
            self._conns.clear()
        self._zctx.destroy(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
