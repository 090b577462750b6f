"""asyncio client: the same calls as :class:`llamapool.Client`, as coroutines.

Lifetime as for the blocking client: the process's one ZeroMQ context
(:func:`llamapool.client.sync.shared_context`), never terminated; a client closes its own socket,
which the event loop watches through its descriptor (no ``zmq.asyncio`` futures: see ``_Link``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, TypeVar

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
from llamapool.client.errors import LlamapoolError, OverloadedError, RequestTimeoutError, UnavailableError
from llamapool.client.sync import CLOSE_LINGER_MS, closed_error, shared_context
from llamapool.client.types import Completion, Embeddings, Reranking, StreamChunk
from llamapool.protocol import codec
from llamapool.protocol.endpoints import default_frontend
from llamapool.protocol.messages import (
    Cancel,
    Detokenize,
    Embed,
    Error,
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

P = TypeVar("P", Pending, TaskPending)  # what a request's replies are folded into
_CLOSED = Error(None, "closed", "")  # put in the queue of each waiting request by close(): raises closed_error


_BEHIND = Error(None, "overloaded", "")  # put in a request's queue when its caller fell max_queued replies behind
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # plain ints: an IntFlag's ``&`` runs Python code


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Link:
    """An AsyncClient's socket and its requests' queues. The socket is a plain one, watched by the
    event loop's reader callback (:meth:`on_events`), which hands each reply to the queue of the
    request that waits for it: a reply costs a ``recv`` and a ``put_nowait``, with no future or task
    of its own. It holds no reference to the client, so a client dropped unclosed is freed, and its
    finaliser closes this: from the loop's thread at once, from another thread through the loop,
    never waiting."""

    def __init__(self, endpoint: str, keys: tuple[bytes, bytes, bytes] | None, max_queued: int | None = None):
        self.pid = os.getpid()
        self.max_queued = max_queued
        self.closed = False
        self.sock: zmq.Socket[bytes] = shared_context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        if keys is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = keys
        self.sock.connect(endpoint)
        self.fd: int = self.sock.FD
        self.waiting: dict[str, asyncio.Queue[Message]] = {}
        self.inflight: set[str] = set()  # generate requests sent and not finished: close() cancels them
        self.loop: asyncio.AbstractEventLoop | None = None
        self.room: list[asyncio.Future[None]] = []  # sends waiting for a connection to the router

    def start(self) -> zmq.Socket[bytes]:
        """The socket, watched by this loop; a closed client raises."""
        if self.pid != os.getpid():
            raise UnavailableError("closed", "this AsyncClient was made before a fork(), in the parent process: "
                                   "its socket and event loop cannot be used in the child; make a new one here")
        if self.closed:
            raise closed_error("AsyncClient")
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            if self.loop is not None and not self.loop.is_closed():
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(self.fd)
            self.loop = loop
            loop.add_reader(self.fd, self.on_events)
        return self.sock

    def on_events(self) -> None:
        """The socket's descriptor signalled (edge-triggered: every reply waiting is taken now), or a
        send may have taken its signal: dispatch the replies, wake the sends waiting for room."""
        sock = self.sock
        while not sock.closed:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # Again: nothing more
                break
            with contextlib.suppress(codec.ProtocolError):  # not a reply: nobody waits for it
                self._dispatch(decode_reply(frames))
        if self.room and not sock.closed:
            events = int(sock.get(zmq.EVENTS))  # type: ignore[call-overload]
            if events & POLLOUT:
                self._wake()
            if events & POLLIN and self.loop is not None:  # the check took the descriptor's signal of it
                self.loop.call_soon(self.on_events)

    def _dispatch(self, msg: Message) -> None:
        rid = getattr(msg, "id", None) or ""
        q = self.waiting.get(rid)
        if q is None:
            return
        if self.max_queued is not None and q.qsize() >= self.max_queued:
            self.fell_behind(rid, q)
        else:
            q.put_nowait(msg)

    def _wake(self) -> None:
        for f in self.room:
            if not f.done():
                f.set_result(None)
        self.room.clear()

    def sent(self, frame: bytes) -> bool:
        """Send ``frame`` now if the socket has room (a connection); False if not. A send may take the
        descriptor's signal of replies that came meanwhile: those are taken at once."""
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            if not self.sock.closed and self.sock.get(zmq.EVENTS) & POLLIN:  # type: ignore[operator]
                self.on_events()
        return True

    async def send(self, frame: bytes, timeout: float) -> None:
        """Send ``frame``, waiting up to ``timeout`` seconds for a connection (zmq.Again past it)."""
        self.start()
        if self.sent(frame):
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            room = loop.create_future()
            self.room.append(room)
            try:
                async with asyncio.timeout_at(end):
                    await room
            except TimeoutError:
                raise zmq.Again from None
            if self.closed:
                raise closed_error("AsyncClient")
            if self.sent(frame):
                return

    def cancel(self, rid: str) -> None:
        """Ask the daemon to stop ``rid`` if it has not finished; never waits."""
        self.waiting.pop(rid, None)
        if rid in self.inflight:
            self.inflight.discard(rid)
            if not self.sock.closed and self.pid == os.getpid():
                self.sent(codec.encode(Cancel(rid)))  # not connected: nothing runs there to cancel

    def fell_behind(self, rid: str, q: asyncio.Queue[Message]) -> None:
        """``rid``'s caller has ``max_queued`` replies it has not taken: cancel it, and tell the caller."""
        q.put_nowait(_BEHIND)
        self.cancel(rid)

    def close(self) -> None:
        """Stop watching the socket, close it and end the calls waiting on it. Idempotent; from any
        thread; never waits."""
        if self.closed:
            return
        self.closed = True
        if self.pid != os.getpid():
            return
        loop = self.loop
        if loop is None or loop.is_closed() or loop is _running_loop():
            self._close_here()
            return
        try:
            loop.call_soon_threadsafe(self._close_here)
        except RuntimeError:  # the loop closed meanwhile: nothing of it runs any more
            self._close_here()

    def _close_here(self) -> None:
        """In the loop's thread, or anywhere once the loop is gone (each step may find it closed)."""
        with contextlib.suppress(Exception):
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_reader(self.fd)
            for q in self.waiting.values():
                q.put_nowait(_CLOSED)
            self._wake()
        if self.inflight and not self.sock.closed:
            for rid in self.inflight:
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.send(codec.encode(Cancel(rid)), zmq.NOBLOCK)
        self.inflight.clear()
        with contextlib.suppress(Exception):
            self.sock.close()  # LINGER lets the cancels leave; nothing waits for them


class AsyncStream:
    """Async iterator of :class:`StreamChunk`; ``completion`` is set once it is exhausted.

    Leaving the iteration early (``break``, ``await aclose()``, or ``async with``) cancels the
    request on the daemon.
    """

    def __init__(self, chunks: AsyncGenerator[StreamChunk, None], done: list[Completion]):
        self._chunks = chunks
        self._done = done  # filled by the generator; no reference back to this object, so a
        # ``break`` drops the generator at once and its finaliser sends the cancel

    @property
    def completion(self) -> Completion | None:
        return self._done[0] if self._done else None

    @property
    def completions(self) -> list[Completion]:
        """Every choice's completion (``n``), in index order, once the stream is exhausted."""
        return list(self._done)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """Cancel the request if it has not finished."""
        await self._chunks.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient:
    """One DEALER socket; a reader task hands each reply to the request that waits for it.

    ``model``, ``server_public_key`` and ``client_key``: as for :class:`llamapool.Client`. ``max_queued``: the
    most replies held for a request whose caller has not taken them (a stream not iterated, a loop too
    busy); past it the request is cancelled and its call raises :class:`OverloadedError` (default: no
    bound). ``await close()``
    (or ``async with``) closes the socket and ends the calls waiting on it; a client dropped unclosed
    closes it when it is freed. It cannot be used in a process forked after it was made.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT,
                 server_public_key: KeySource | None = None, client_key: KeySource | None = None,
                 model: str | None = None, max_queued: int | None = None):
        self.endpoint = endpoint or default_frontend()
        self.timeout = timeout
        self.model = model
        if max_queued is not None and (isinstance(max_queued, bool) or not isinstance(max_queued, int)
                                       or max_queued < 1):
            raise ValueError(f"max_queued must be a positive integer or None, got {max_queued!r}")
        self._link = _Link(self.endpoint, curve_keys(self.endpoint, server_public_key, client_key), max_queued)
        weakref.finalize(self, self._link.close).atexit = False

    @property
    def closed(self) -> bool:
        return self._link.closed

    async def _open(self, frame: bytes, rid: str, timeout: float | None = None,
                    generate: bool = False) -> asyncio.Queue[Message]:
        link = self._link
        link.start()
        q: asyncio.Queue[Message] = asyncio.Queue()
        link.waiting[rid] = q
        try:
            await link.send(frame, send_timeout_ms(timeout) / 1000)
        except zmq.Again:
            link.waiting.pop(rid, None)
            raise not_connected(self.endpoint) from None
        except BaseException:
            link.waiting.pop(rid, None)
            raise
        if generate:
            link.inflight.add(rid)
        return q

    def _budget(self, timeout: float | None) -> tuple[float | None, float | None]:
        t = check_timeout(self.timeout if timeout is None else timeout)
        check_endpoint(self.endpoint)
        return t, (None if t is None else t + 1.0)

    async def _next(self, q: asyncio.Queue[Message], wait: float | None) -> Message:
        """The next reply in ``q``, within ``wait`` seconds: one already there is taken at once, else
        awaited under a timer (no task of its own, as ``wait_for`` would make on every reply)."""
        if not q.empty() and (wait is None or wait > 0):
            msg = q.get_nowait()
        else:
            try:
                async with asyncio.timeout(wait):
                    msg = await q.get()
            except TimeoutError:
                raise RequestTimeoutError("timeout", "no reply from llamapool before the deadline") from None
        if msg is _CLOSED:
            raise closed_error("AsyncClient")
        if msg is _BEHIND:
            raise OverloadedError("overloaded", f"this client fell {self._link.max_queued} replies behind the request "
                                  "(AsyncClient max_queued): it was cancelled")
        return msg

    async def _run(self, prompts: list[Prompt], batch: bool, timeout: float | None,
                   params: Params, model: str | None, who: tuple[str | None, str | None] = (None, None)) -> Pending:
        rid = new_id()
        t, wait = self._budget(timeout)
        frame = generate_frame(rid, prompts, batch, False, t, params, self.model if model is None else model, *who)
        q = await self._open(frame, rid, t, generate=True)
        return await self._collect(q, rid, Pending(len(prompts) * choices(params)), wait)

    async def _collect(self, q: asyncio.Queue[Message], rid: str, pending: P, wait: float | None) -> P:
        """Feed ``pending`` every reply of request ``rid`` until it has them all (or ``wait`` seconds
        pass: a timeout, and the request is cancelled)."""
        loop = asyncio.get_running_loop()
        end = None if wait is None else loop.time() + wait
        try:
            while not pending.done:
                pending.feed(await self._next(q, None if end is None else end - loop.time()))
        except BaseException:
            self._cancel(rid)
            raise
        finally:
            self._link.waiting.pop(rid, None)
        self._link.inflight.discard(rid)
        return pending

    def _cancel(self, rid: str) -> None:
        """Ask the daemon to stop ``rid``; never waits."""
        self._link.cancel(rid)

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
                       sampling: SamplingParams | None = None, tenant: str | None = None, priority: str | None = None,
                       **params: Any) -> Completion:
        p = given(params, sampling)
        choices(p, one=True)
        return (await self._run([prompt], False, timeout, p, model, (tenant, priority))).completions()[0]

    async def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None,
                            return_exceptions: bool = False, model: str | None = None,
                            sampling: SamplingParams | None = None, tenant: str | None = None,
                            priority: str | None = None, **params: Any
                            ) -> list[Completion] | list[Completion | LlamapoolError]:
        pending = await self._run(list(prompts), True, timeout, given(params, sampling), model, (tenant, priority))
        if return_exceptions:
            return [r for r in pending.results if r is not None]
        return pending.completions()

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                   model: str | None = None, sampling: SamplingParams | None = None, tenant: str | None = None,
                   priority: str | None = None, **params: Any) -> Completion:
        """The model's reply to a chat (see :meth:`llamapool.Client.chat`)."""
        return await self.generate(chat_prompt(messages), timeout=timeout, model=model, sampling=sampling,
                                   tenant=tenant, priority=priority, **params)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                    model: str | None = None, sampling: SamplingParams | None = None, tenant: str | None = None,
                    priority: str | None = None, **params: Any) -> AsyncStream:
        """:meth:`chat`, streamed: ``async for chunk in client.chat_stream(...)``."""
        return self.stream(chat_prompt(messages), timeout=timeout, model=model, sampling=sampling, tenant=tenant,
                           priority=priority, **params)

    def stream(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
               sampling: SamplingParams | None = None, tenant: str | None = None, priority: str | None = None,
               **params: Any) -> AsyncStream:
        """Async iterator of chunks (``completion`` is set at the end); leaving it early cancels the request.

        The request is sent when the iteration starts.
        """
        done: list[Completion] = []
        return AsyncStream(self._stream(prompt, timeout, given(params, sampling), done,
                                        self.model if model is None else model, (tenant, priority)), done)

    async def _stream(self, prompt: Prompt, timeout: float | None, params: Params, done: list[Completion],
                      model: str | None, who: tuple[str | None, str | None]) -> AsyncGenerator[StreamChunk, None]:
        rid = new_id()
        t, wait = self._budget(timeout)
        q = await self._open(generate_frame(rid, [prompt], False, True, t, params, model, *who), rid, t,
                             generate=True)
        pending = Pending(choices(params))
        loop = asyncio.get_running_loop()
        end = None if wait is None else loop.time() + wait
        finished = False
        try:
            while not pending.done:
                chunk = pending.feed(await self._next(q, None if end is None else end - loop.time()))
                if chunk is not None:
                    yield chunk
            finished = True
            self._link.inflight.discard(rid)
            done.extend(pending.completions())  # every choice's, or raise the final error
        finally:
            if not finished:
                self._cancel(rid)
            self._link.waiting.pop(rid, None)

    async def embed(self, inputs: EmbedInputs, *, timeout: float | None = None,
                    model: str | None = None) -> Embeddings:
        """The embedding of each input (see :meth:`llamapool.Client.embed`)."""
        items = embed_inputs(inputs)
        model = self.model if model is None else model
        return (await self._task(lambda rid, t: Embed(rid, items, t, model), len(items), timeout)).embeddings()

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
                     max_tokens_per_doc: int = 0, timeout: float | None = None,
                     model: str | None = None) -> Reranking:
        """Each document's relevance to ``query``, sorted (see :meth:`llamapool.Client.rerank`)."""
        docs = rerank_documents(documents)
        n = rerank_top_n(top_n, len(docs))
        model = self.model if model is None else model
        pending = await self._task(lambda rid, t: Rerank(rid, query, docs, max_tokens_per_doc, t, model),
                                   len(docs), timeout)
        return pending.reranking(docs, n)

    async def tokenize(self, text: str, *, model: str | None = None, add_special: bool = False,
                       parse_special: bool = True, with_pieces: bool = False,
                       timeout: float | None = None) -> list[Any]:
        """``text``'s tokens (see :meth:`llamapool.Client.tokenize`)."""
        model = self.model if model is None else model
        return (await self._task(lambda rid, t: Tokenize(rid, text, add_special, parse_special, with_pieces, t,
                                                         model), 1, timeout)).tokens()

    async def render(self, prompt: str | list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                     model: str | None = None, timeout: float | None = None) -> list[int]:
        """The tokens a generation of ``prompt`` (a text, or chat messages with ``tools``) puts in the KV cache,
        BOS and chat template included: what vLLM's render endpoints answer."""
        model = self.model if model is None else model
        messages = prompt if isinstance(prompt, list) else None
        text = prompt if isinstance(prompt, str) else ""
        return (await self._task(lambda rid, t: Tokenize(rid, text, timeout=t, model=model, render=True,
                                                         messages=messages, tools=tools), 1, timeout)).tokens()

    async def infill(self, input_prefix: str | list[str | int], input_suffix: str | list[str | int], *,
                     input_extra: Sequence[tuple[str, str]] | None = None, prompt: str = "", n_predict: int = -1,
                     model: str | None = None, timeout: float | None = None) -> list[int]:
        """The tokens of a fill-in-the-middle prompt, as llama-server's ``/infill`` lays them out for the model's
        FIM tokens: ``input_extra`` the repo's other files (filename, text; None: no repo-level context, as
        ``suffix`` has it), ``prompt`` text after the prefix (worker/infill.py). A model without FIM tokens is a
        ``BadRequestError`` with ``field == "model"``."""
        model = self.model if model is None else model
        parts: dict[str, Any] = {"input_prefix": input_prefix, "input_suffix": input_suffix, "prompt": prompt,
                                 "n_predict": n_predict}
        if input_extra is not None:
            parts["input_extra"] = [[f, t] for f, t in input_extra]
        return (await self._task(lambda rid, t: Tokenize(rid, "", timeout=t, model=model, infill=parts), 1,
                                 timeout)).tokens()

    async def detokenize(self, tokens: Sequence[int], *, model: str | None = None,
                         timeout: float | None = None) -> str:
        """The text of ``tokens`` (see :meth:`llamapool.Client.detokenize`)."""
        model = self.model if model is None else model
        ids = list(tokens)
        return (await self._task(lambda rid, t: Detokenize(rid, ids, t, model), 1, timeout)).text()

    async def _task(self, build: Callable[[str, float | None], Embed | Rerank | Tokenize | Detokenize], n: int,
                    timeout: float | None) -> TaskPending:
        rid = new_id()
        t, wait = self._budget(timeout)
        q = await self._open(task_frame(build(rid, t)), rid, t, generate=True)
        return await self._collect(q, rid, TaskPending(n), wait)

    async def status(self, *, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's view (see ``Client.status``)."""
        return status_of(await self._query(StatusRequest(new_id()), timeout))

    async def load_model(self, model: str, *, wait: bool = False, timeout: float = 5.0) -> dict[str, Any]:
        """Load ``model`` now (a model of ``load = "on_demand"``; the pool places it by free memory, evicting
        an idle model if it must); ``wait=True`` waits up to ``timeout`` for it to be loaded. Returns
        ``{"model", "action", "state", "message"}``; an unknown model raises ``BadRequestError``."""
        return await self._model_action("load", model, wait, timeout)

    async def unload_model(self, model: str, *, timeout: float = 5.0) -> dict[str, Any]:
        """Unload ``model``: its workers finish the requests they run, then exit (see ``load_model``). A LoRA
        adapter's name unloads the adapter: no new request takes it, and its workers free it once the requests
        using it have finished (state ``unloading``)."""
        return await self._model_action("unload", model, False, timeout)

    async def load_adapter(self, name: str, path: str, *, model: str | None = None, scale: float = 1.0,
                     timeout: float = 60.0) -> dict[str, Any]:
        """Load the LoRA adapter GGUF ``path`` (absolute, on the workers' host) into every running worker of
        ``model`` (default: the pool's first) as ``name``, which requests then name as their model or in
        ``lora`` (at ``scale`` unless they give one); workers that start later load it too. Returns once every
        worker has it (``{"model": name, "action": "load", "state": "loaded", "message"}``); a bad name, path or
        scale raises ``BadRequestError`` naming it, an unknown model ``UnknownModelError``. ``unload_model(name)``
        unloads it."""
        return model_action_of(await self._query(LoadAdapter(new_id(), name, path, model, scale), timeout))

    async def pin_model(self, model: str, pinned: bool = True, *, timeout: float = 5.0) -> dict[str, Any]:
        """Pin ``model`` (load it; never evict it or unload it when idle), or unpin it (``pinned=False``)."""
        return await self._model_action("pin" if pinned else "unpin", model, False, timeout)

    async def _model_action(self, action: str, model: str, wait: bool, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        reply = model_action_of(await self._query(ModelAction(new_id(), action, model), timeout))
        while wait and reply["state"] != "loaded" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            models = (await self.status(timeout=max(0.1, deadline - time.monotonic())))["models"]
            row: dict[str, Any] = next((m for m in models if m["name"] == model), {})
            reply["state"] = row.get("state", reply["state"])
            if reply["state"] == "failed":
                raise UnavailableError("unavailable", str(row.get("reason") or f"model {model!r} failed to load"))
        return reply

    async def metrics(self, *, timeout: float = 5.0) -> str:
        """The daemon's Prometheus metrics, in the text exposition format (docs/metrics.md)."""
        return metrics_of(await self._query(MetricsRequest(new_id()), timeout))

    async def _query(self, request: StatusRequest | MetricsRequest | ModelAction | LoadAdapter,
                      timeout: float) -> Message:
        """Send a one-reply request and wait for its reply."""
        q = await self._open(codec.encode(request), request.id, timeout)
        try:
            return await self._next(q, timeout)
        except RequestTimeoutError:
            raise no_answer(self.endpoint, timeout) from None
        finally:
            self._link.waiting.pop(request.id, None)

    async def close(self) -> None:
        """Close the socket; calls waiting on it end with an error. Idempotent; from any thread or loop."""
        self._link.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
