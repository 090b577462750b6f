"""Blocking client. One socket per thread, so one ``Client`` may be shared by many threads.

Lifetime: every client of the process uses one ZeroMQ context (:func:`shared_context`), which is never
terminated; a client closes only its own sockets, with :meth:`Client.close` or, when it is dropped
unclosed, from the finaliser of each socket. Nothing here waits without a deadline, so no call, finaliser
or garbage collection can hang another thread (issue 20).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import zmq

from llamapool.client.calls import (
    DEFAULT_TIMEOUT,
    EmbedInputs,
    KeySource,
    Params,
    Pending,
    TaskPending,
    chat_prompt,
    check_endpoint,
    check_timeout,
    choices,
    curve_keys,
    decode_reply,
    embed_inputs,
    generate_frame,
    given,
    metrics_of,
    model_action_of,
    new_id,
    no_answer,
    not_connected,
    rerank_documents,
    rerank_top_n,
    send_timeout_ms,
    status_of,
    task_frame,
)
from llamapool.client.errors import LlamapoolError, RequestTimeoutError, UnavailableError
from llamapool.client.types import Completion, Embeddings, Reranking, StreamChunk
from llamapool.protocol import codec
from llamapool.protocol.endpoints import default_frontend
from llamapool.protocol.messages import (
    Cancel,
    Detokenize,
    Embed,
    LoadAdapter,
    Message,
    MetricsRequest,
    ModelAction,
    Prompt,
    Rerank,
    StatusRequest,
    Tokenize,
)
from llamapool.protocol.params import SamplingParams

WAIT_SLICE = 0.25  # seconds: the longest single wait on a socket, after which a call sees a close()
CLOSE_LINGER_MS = 1000  # a closed socket's last messages (a cancel) may still leave this long; never waited for
MAX_SOCKETS = 16384  # of all clients of the process together (libzmq's default is 1023 per context)


class _Shared:
    """The process's one SDK context, made on first use and made anew in a forked child (the parent's
    must not be used there). Never terminated: terminating waits for every socket of every client, so
    a finaliser that terminates can hang whichever thread it runs in."""

    lock = threading.Lock()
    pid = 0
    current: zmq.Context[Any] | None = None
    inherited: list[Any] = []  # a forked child's copies of its parents' contexts: never used, never freed

    @classmethod
    def get(cls) -> zmq.Context[Any]:
        current = cls.current
        if current is None or cls.pid != os.getpid():
            with cls.lock:
                if cls.current is None or cls.pid != os.getpid():
                    if cls.current is not None:
                        cls.inherited.append(cls.current)
                    ctx: zmq.Context[Any] = zmq.Context()
                    ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
                    cls.current, cls.pid = ctx, os.getpid()
                current = cls.current
        return current

    @classmethod
    def after_fork(cls) -> None:
        cls.lock = threading.Lock()  # a thread of the parent may have held it


os.register_at_fork(after_in_child=_Shared.after_fork)


def shared_context() -> zmq.Context[Any]:
    """The ZeroMQ context of every SDK client in this process (a new one in a forked child)."""
    return _Shared.get()


def closed_error(what: str = "Client") -> UnavailableError:
    return UnavailableError("closed", f"this {what} is closed: make a new one")


def forked_error(what: str) -> UnavailableError:
    return UnavailableError("closed", f"this {what} was started before a fork(), in the parent process: "
                            f"its socket cannot be used in the child; start it again here")


class _Flag:
    """A client's ``closed`` flag, shared with its connections (which hold no reference to the client)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False


class _Conn:
    """A DEALER socket of one thread and the replies it holds for other requests.

    Its thread uses the socket holding ``lock``. Other threads (``Client.close``, a dropped stream's
    cancel, a finaliser run by the garbage collector in any thread) only try the lock without waiting,
    and otherwise leave the work to the owner. Dropping the last reference closes the socket.
    """

    def __init__(self, endpoint: str, keys: tuple[bytes, bytes, bytes] | None, closed: _Flag):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.closed = closed
        self.inflight: set[str] = set()  # requests sent and not finished: close() cancels them
        self.cancels: deque[str] = deque()  # cancels that another thread could not send: the owner sends them
        self.held: defaultdict[str, deque[Message]] = defaultdict(deque)
        self.dropped: set[str] = set()
        self.sock: zmq.Socket[bytes] = shared_context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        if keys is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = keys
        self.sock.connect(endpoint)

    def acquire(self, deadline: float | None = None) -> None:
        """Hold the socket for one step of a call (then :meth:`release`); a closed client, or the parent's
        socket in a forked child, raises."""
        if self.pid != os.getpid():
            raise forked_error("request")
        if not self.lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise RequestTimeoutError("timeout", "this thread's socket was busy until the deadline")
        if self.closed.value:
            self.release()
            raise closed_error()
        if self.cancels:
            self._send_cancels()

    def release(self) -> None:
        self.lock.release()
        if self.closed.value:  # closed from another thread while this one held the socket: closed here
            self.close()

    @contextlib.contextmanager
    def use(self, deadline: float | None = None) -> Iterator[None]:
        """:meth:`acquire` and :meth:`release` around a block."""
        self.acquire(deadline)
        try:
            yield
        finally:
            self.release()

    def recv_for(self, rid: str, deadline: float | None) -> Message:
        """The next reply to ``rid`` (the caller holds :meth:`use`); waits until ``deadline`` at most, in
        slices, so that a ``close()`` from another thread ends the wait within one slice."""
        while True:
            if self.held.get(rid):
                return self.held[rid].popleft()
            if self.closed.value:
                raise closed_error()
            if self.cancels:
                self._send_cancels()
            wait = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
            if wait <= 0:
                raise RequestTimeoutError("timeout", "no reply from llamapool before the deadline")
            if not self.sock.poll(max(1, int(wait * 1000))):
                continue
            msg = decode_reply(self.sock.recv_multipart())
            mid = getattr(msg, "id", None)
            if mid == rid:
                return msg
            if mid is not None and mid not in self.dropped:
                self.held[mid].append(msg)

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s replies from now on (any thread)."""
        self.inflight.discard(rid)
        self.dropped.add(rid)
        self.held.pop(rid, None)

    def cancel(self, rid: str, locked: bool = False) -> None:
        """Drop ``rid`` and ask the daemon to stop it; never waits. ``locked``: the caller holds :meth:`use`."""
        if rid not in self.inflight:
            return
        self.drop(rid)
        self.cancels.append(rid)
        if locked:
            self._send_cancels()
        elif self.pid == os.getpid() and self.lock.acquire(blocking=False):
            try:
                self._send_cancels()
            finally:
                self.lock.release()

    def _send_cancels(self) -> None:
        while self.cancels and not self.sock.closed:
            rid = self.cancels.popleft()
            with contextlib.suppress(zmq.ZMQError):  # not connected: nothing runs there to cancel
                self.sock.send(codec.encode(Cancel(rid)), zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket unless its thread is using it (that thread closes it when done); never waits."""
        if self.pid == os.getpid() and self.lock.acquire(blocking=False):
            try:
                self._close_locked()
            finally:
                self.lock.release()

    def _close_locked(self) -> None:
        if not self.sock.closed:
            for rid in list(self.inflight):
                self.drop(rid)
                self.cancels.append(rid)
            self._send_cancels()
            self.sock.close()  # LINGER lets the cancels leave; nothing waits for them

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _Conns:
    """A client's connections, one per thread. Holds no reference to the client, and the connections
    none to it: dropping the client frees them, and each closes its socket."""

    def __init__(self, endpoint: str, keys: tuple[bytes, bytes, bytes] | None):
        self.endpoint, self.keys = endpoint, keys
        self.closed = _Flag()
        self._fresh()

    def _fresh(self) -> None:
        self.pid = os.getpid()
        self.local = threading.local()
        self.lock = threading.Lock()  # guards only the replacement of ``every``
        self.every: tuple[weakref.ref[_Conn], ...] = ()

    def mine(self) -> _Conn:
        """This thread's connection (a new one in a forked child: the parent's sockets are never used)."""
        if self.closed.value:
            raise closed_error()
        if self.pid != os.getpid():
            self._fresh()
        conn: _Conn | None = getattr(self.local, "conn", None)
        if conn is None:
            conn = _Conn(self.endpoint, self.keys, self.closed)
            self.local.conn = conn
            with self.lock:  # held only here, by a thread of this client that is not in a finaliser
                self.every = (*(r for r in self.every if r() is not None), weakref.ref(conn))
        return conn

    def close(self) -> None:
        self.closed.value = True
        for ref in self.every:  # a tuple replaced whole, so reading it needs no lock
            conn = ref()
            if conn is not None:
                conn.close()


class Stream:
    """Iterator of :class:`StreamChunk`; ``completion`` is set once it is exhausted.

    Leaving the iteration early (``break``, ``close()``, or dropping the stream) cancels the
    request on the daemon. It holds no reference cycle, so a ``break`` out of
    ``for chunk in client.stream(...)`` cancels at once.
    """

    def __init__(self, conn: _Conn, rid: str, deadline: float | None, n: int = 1):
        self._conn, self._rid, self._deadline = conn, rid, deadline
        self._pending = Pending(n)  # one reply per choice (``n``): chunks carry their ``index``
        self._open = True
        self.completion: Completion | None = None
        self.completions: list[Completion] = []  # every choice's, in index order, once it is exhausted

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamChunk:
        if not self._open:
            raise StopIteration
        conn = self._conn
        try:
            conn.acquire(self._deadline)
            try:
                while not self._pending.done:
                    chunk = self._pending.feed(conn.recv_for(self._rid, self._deadline))
                    if chunk is not None:
                        return chunk
            finally:
                conn.release()
        except BaseException:
            self.close()
            raise
        self._open = False
        self._conn.inflight.discard(self._rid)
        self.completions = self._pending.completions()  # raises the final error, if any
        self.completion = self.completions[0]
        raise StopIteration

    def close(self) -> None:
        """Cancel the request if it has not finished (from any thread; never waits)."""
        if self._open:
            self._open = False
            self._conn.cancel(self._rid)

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

    ``close()`` (or ``with Client() as c:``) closes its sockets at once; a client dropped unclosed closes
    them when it is freed. A client made before ``fork()`` works in the child with sockets of its own.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT,
                 server_public_key: KeySource | None = None, client_key: KeySource | None = None,
                 model: str | None = None):
        self.endpoint = endpoint or default_frontend()
        self.timeout = timeout
        self.model = model
        self._conns = _Conns(self.endpoint, curve_keys(self.endpoint, server_public_key, client_key))

    @property
    def closed(self) -> bool:
        return self._conns.closed.value

    def _deadline(self, timeout: float | None) -> tuple[float | None, float | None]:
        t = check_timeout(self.timeout if timeout is None else timeout)
        return t, (None if t is None else time.monotonic() + t + 1.0)

    def _submit(self, prompts: list[Prompt], batch: bool, stream: bool, timeout: float | None,
                params: Params, model: str | None, who: tuple[str | None, str | None] = (None, None)
                ) -> tuple[_Conn, str, float | None]:
        rid = new_id()
        t, deadline = self._deadline(timeout)
        frame = generate_frame(rid, prompts, batch, stream, t, params, self.model if model is None else model, *who)
        check_endpoint(self.endpoint)
        conn = self._conns.mine()
        with conn.use(deadline):
            self._send(conn, frame, t)
            conn.inflight.add(rid)
        return conn, rid, deadline

    def _send(self, conn: _Conn, frame: bytes, timeout: float | None) -> None:
        conn.sock.sndtimeo = send_timeout_ms(timeout)
        try:
            conn.sock.send(frame)
        except zmq.Again:
            raise not_connected(self.endpoint) from None

    def _collect(self, conn: _Conn, rid: str, pending: Pending, deadline: float | None) -> None:
        with conn.use(deadline):
            try:
                while not pending.done:
                    pending.feed(conn.recv_for(rid, deadline))
            except BaseException:  # the deadline, a close() from another thread, KeyboardInterrupt
                conn.cancel(rid, locked=True)
                raise
            conn.inflight.discard(rid)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
                 sampling: SamplingParams | None = None, tenant: str | None = None, priority: str | None = None,
                 **params: Any) -> Completion:
        """Generate a completion for one prompt (text or token ids) with ``model`` (a name in the pool;
        None: the client's ``model``, else the pool's first). The parameters are keywords, or
        ``sampling``: a :class:`~llamapool.protocol.params.SamplingParams` built once, sent as it is.
        ``tenant``: the tenant it is counted under (its limits and share: docs/http.md); ``priority``:
        its class, ``"priority"``, ``"default"`` or ``"flex"``."""
        p = given(params, sampling)
        choices(p, one=True)
        conn, rid, deadline = self._submit([prompt], False, False, timeout, p, model, (tenant, priority))
        pending = Pending(1)
        self._collect(conn, rid, pending, deadline)
        return pending.completions()[0]

    def stream(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
               sampling: SamplingParams | None = None, tenant: str | None = None, priority: str | None = None,
               **params: Any) -> Stream:
        """Stream a completion as text deltas."""
        p = given(params, sampling)
        conn, rid, deadline = self._submit([prompt], False, True, timeout, p, model, (tenant, priority))
        return Stream(conn, rid, deadline, choices(p))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
             model: str | None = None, sampling: SamplingParams | None = None, tenant: str | None = None,
             priority: str | None = None, **params: Any) -> Completion:
        """The model's reply to a chat: ``messages`` are ``{"role": ..., "content": ...}`` maps, rendered
        on the worker with the model's chat template (the reply is the assistant's next turn)."""
        return self.generate(chat_prompt(messages), timeout=timeout, model=model, sampling=sampling, tenant=tenant,
                             priority=priority, **params)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                    model: str | None = None, sampling: SamplingParams | None = None, tenant: str | None = None,
                    priority: str | None = None, **params: Any) -> Stream:
        """:meth:`chat`, streamed as text deltas (like :meth:`stream`)."""
        return self.stream(chat_prompt(messages), timeout=timeout, model=model, sampling=sampling, tenant=tenant,
                           priority=priority, **params)

    def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None,
                      return_exceptions: bool = False, model: str | None = None,
                      sampling: SamplingParams | None = None, tenant: str | None = None, priority: str | None = None,
                      **params: Any) -> list[Completion] | list[Completion | LlamapoolError]:
        """One micro-batch message; one result per prompt, in order (with ``n``: ``n`` per prompt, the
        choices of prompt ``i`` at ``i * n`` to ``i * n + n - 1``)."""
        p = given(params, sampling)
        conn, rid, deadline = self._submit(list(prompts), True, False, timeout, p, model, (tenant, priority))
        pending = Pending(len(prompts) * choices(p))
        self._collect(conn, rid, pending, deadline)
        if return_exceptions:
            return [r for r in pending.results if r is not None]
        return pending.completions()

    def embed(self, inputs: EmbedInputs, *, timeout: float | None = None, model: str | None = None) -> Embeddings:
        """The embedding of each input (a text, a list of token ids, or a list of them) by ``model``, an
        embedding model of the pool (``embedding = true``): one L2-normalised vector per input, in order
        (an :class:`Embeddings` list, with ``prompt_tokens`` and ``model``). Its worker computes the
        inputs together in one ``llama_decode``."""
        items = embed_inputs(inputs)
        model = self.model if model is None else model
        return self._task(lambda rid, t: Embed(rid, items, t, model), len(items), timeout).embeddings()

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None, max_tokens_per_doc: int = 0,
               timeout: float | None = None, model: str | None = None) -> Reranking:
        """How relevant each document is to ``query``, by ``model``, a reranker of the pool (``task =
        "rerank"``): a :class:`Reranking` list of ``RerankResult(index, relevance_score, document)``
        sorted by score, highest first, the first ``top_n`` (None: all), with ``prompt_tokens`` and
        ``model``. Each pair is formatted as llama-server formats it; a document longer than
        ``max_tokens_per_doc`` tokens (0: no limit), or than a slot's context leaves beside the query,
        is cut to its first tokens. The worker scores the pairs of every request it holds together."""
        docs = rerank_documents(documents)
        n = rerank_top_n(top_n, len(docs))
        model = self.model if model is None else model
        pending = self._task(lambda rid, t: Rerank(rid, query, docs, max_tokens_per_doc, t, model),
                             len(docs), timeout)
        return pending.reranking(docs, n)

    def tokenize(self, text: str, *, model: str | None = None, add_special: bool = False, parse_special: bool = True,
                 with_pieces: bool = False, timeout: float | None = None) -> list[Any]:
        """``text``'s token ids by ``model``'s tokenizer, as llama-server's ``/tokenize`` gives them
        (``add_special``: BOS as the model adds it; ``with_pieces``: ``{"id", "piece"}`` maps). Answered
        at once by a worker of the model, even one busy generating."""
        model = self.model if model is None else model
        return self._task(lambda rid, t: Tokenize(rid, text, add_special, parse_special, with_pieces, t, model), 1,
                          timeout).tokens()

    def detokenize(self, tokens: Sequence[int], *, model: str | None = None, timeout: float | None = None) -> str:
        """The text of ``tokens`` by ``model``'s tokenizer (llama-server's ``/detokenize``)."""
        model = self.model if model is None else model
        ids = list(tokens)
        return self._task(lambda rid, t: Detokenize(rid, ids, t, model), 1, timeout).text()

    def _task(self, build: Callable[[str, float | None], Embed | Rerank | Tokenize | Detokenize], n: int,
              timeout: float | None) -> TaskPending:
        """Send an embed, rerank, tokenize or detokenize request and gather its ``n`` final replies."""
        rid = new_id()
        t, deadline = self._deadline(timeout)
        frame = task_frame(build(rid, t))
        check_endpoint(self.endpoint)
        conn = self._conns.mine()
        pending = TaskPending(n)
        with conn.use(deadline):
            self._send(conn, frame, t)
            conn.inflight.add(rid)
            try:
                while not pending.done:
                    pending.feed(conn.recv_for(rid, deadline))
            except BaseException:
                conn.cancel(rid, locked=True)
                raise
            conn.inflight.discard(rid)
        return pending

    def status(self, *, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's view: ``models`` (name, workers, queued, running; the first is the default),
        ``workers`` (id, model, pid, device, state, slots, active, ...), the queue."""
        return status_of(self._query(StatusRequest(new_id()), timeout))

    def load_model(self, model: str, *, wait: bool = False, timeout: float = 5.0) -> dict[str, Any]:
        """Load ``model`` now (a model of ``load = "on_demand"``; the pool places it by free memory, evicting
        an idle model if it must); ``wait=True`` waits up to ``timeout`` for it to be loaded. Returns
        ``{"model", "action", "state", "message"}``; an unknown model raises ``BadRequestError``."""
        return self._model_action("load", model, wait, timeout)

    def unload_model(self, model: str, *, timeout: float = 5.0) -> dict[str, Any]:
        """Unload ``model``: its workers finish the requests they run, then exit (see ``load_model``). A LoRA
        adapter's name unloads the adapter: no new request takes it, and its workers free it once the requests
        using it have finished (state ``unloading``)."""
        return self._model_action("unload", model, False, timeout)

    def load_adapter(self, name: str, path: str, *, model: str | None = None, scale: float = 1.0,
                     timeout: float = 60.0) -> dict[str, Any]:
        """Load the LoRA adapter GGUF ``path`` (absolute, on the workers' host) into every running worker of
        ``model`` (default: the pool's first) as ``name``, which requests then name as their model or in
        ``lora`` (at ``scale`` unless they give one); workers that start later load it too. Returns once every
        worker has it (``{"model": name, "action": "load", "state": "loaded", "message"}``); a bad name, path or
        scale raises ``BadRequestError`` naming it, an unknown model ``UnknownModelError``. ``unload_model(name)``
        unloads it."""
        return model_action_of(self._query(LoadAdapter(new_id(), name, path, model, scale), timeout))

    def pin_model(self, model: str, pinned: bool = True, *, timeout: float = 5.0) -> dict[str, Any]:
        """Pin ``model`` (load it; never evict it or unload it when idle), or unpin it (``pinned=False``)."""
        return self._model_action("pin" if pinned else "unpin", model, False, timeout)

    def _model_action(self, action: str, model: str, wait: bool, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        reply = model_action_of(self._query(ModelAction(new_id(), action, model), timeout))
        while wait and reply["state"] != "loaded" and time.monotonic() < deadline:
            time.sleep(0.1)
            models = (self.status(timeout=max(0.1, deadline - time.monotonic())))["models"]
            row: dict[str, Any] = next((m for m in models if m["name"] == model), {})
            reply["state"] = row.get("state", reply["state"])
            if reply["state"] == "failed":
                raise UnavailableError("unavailable", str(row.get("reason") or f"model {model!r} failed to load"))
        return reply

    def metrics(self, *, timeout: float = 5.0) -> str:
        """The daemon's Prometheus metrics, in the text exposition format (docs/metrics.md)."""
        return metrics_of(self._query(MetricsRequest(new_id()), timeout))

    def _query(self, request: StatusRequest | MetricsRequest | ModelAction | LoadAdapter,
                timeout: float) -> Message:
        """Send a one-reply request and wait for its reply."""
        conn = self._conns.mine()
        deadline = time.monotonic() + timeout
        with conn.use(deadline):
            self._send(conn, codec.encode(request), timeout)
            try:
                return conn.recv_for(request.id, deadline)
            except RequestTimeoutError:
                conn.drop(request.id)
                raise no_answer(self.endpoint, timeout) from None

    def close(self) -> None:
        """Close the client's sockets; calls in flight in other threads end with an error within a
        fraction of a second. Idempotent, safe from any thread, never waits."""
        self._conns.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
