"""asyncio client: the same calls as :class:`llamapool.Client`, as coroutines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio

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

    ``model``, ``server_public_key`` and ``client_key``: as for :class:`llamapool.Client`.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT,
                 server_public_key: KeySource | None = None, client_key: KeySource | None = None,
                 model: str | None = None):
        self.endpoint = endpoint or default_frontend()
        self.timeout = timeout
        self.model = model
        keys = curve_keys(self.endpoint, server_public_key, client_key)
        self._zctx = zmq.asyncio.Context()
        self._sock = self._zctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self._sock.curve_serverkey, self._sock.curve_publickey, self._sock.curve_secretkey = keys
        self._sock.connect(self.endpoint)
        self._waiting: dict[str, asyncio.Queue[Message]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        while True:
            msg = decode_reply(await self._sock.recv_multipart())
            q = self._waiting.get(getattr(msg, "id", None) or "")
            if q is not None:
                q.put_nowait(msg)

    async def _open(self, frame: bytes, rid: str, timeout: float | None = None) -> asyncio.Queue[Message]:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        q: asyncio.Queue[Message] = asyncio.Queue()
        self._waiting[rid] = q
        self._sock.sndtimeo = send_timeout_ms(timeout)
        try:
            await self._sock.send(frame)
        except zmq.Again:
            self._waiting.pop(rid, None)
            raise not_connected(self.endpoint) from None
        return q

    def _budget(self, timeout: float | None) -> tuple[float | None, float | None]:
        t = check_timeout(self.timeout if timeout is None else timeout)
        check_endpoint(self.endpoint)
        return t, (None if t is None else t + 1.0)

    async def _next(self, q: asyncio.Queue[Message], wait: float | None) -> Message:
        try:
            return await asyncio.wait_for(q.get(), wait)
        except TimeoutError:
            raise RequestTimeoutError("timeout", "no reply from llamapool before the deadline") from None

    async def _run(self, prompts: list[Prompt], batch: bool, timeout: float | None,
                   params: dict[str, Any], model: str | None) -> Pending:
        rid = new_id()
        t, wait = self._budget(timeout)
        frame = generate_frame(rid, prompts, batch, False, t, params, self.model if model is None else model)
        q = await self._open(frame, rid, t)
        pending = Pending(len(prompts))
        loop = asyncio.get_running_loop()
        end = None if wait is None else loop.time() + wait
        try:
            while not pending.done:
                pending.feed(await self._next(q, None if end is None else end - loop.time()))
        except BaseException:
            await self._cancel(rid)
            raise
        finally:
            self._waiting.pop(rid, None)
        return pending

    async def _cancel(self, rid: str) -> None:
        self._waiting.pop(rid, None)
        with contextlib.suppress(zmq.Again):  # not connected: nothing to cancel there
            await self._sock.send(codec.encode(Cancel(rid)))

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
                       **params: Any) -> Completion:
        return (await self._run([prompt], False, timeout, params, model)).completions()[0]

    async def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None,
                            return_exceptions: bool = False, model: str | None = None, **params: Any
                            ) -> list[Completion] | list[Completion | LlamapoolError]:
        pending = await self._run(list(prompts), True, timeout, params, model)
        if return_exceptions:
            return [r for r in pending.results if r is not None]
        return pending.completions()

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                   model: str | None = None, **params: Any) -> Completion:
        """The model's reply to a chat (see :meth:`llamapool.Client.chat`)."""
        return await self.generate(chat_prompt(messages), timeout=timeout, model=model, **params)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                    model: str | None = None, **params: Any) -> AsyncStream:
        """:meth:`chat`, streamed: ``async for chunk in client.chat_stream(...)``."""
        return self.stream(chat_prompt(messages), timeout=timeout, model=model, **params)

    def stream(self, prompt: Prompt, *, timeout: float | None = None, model: str | None = None,
               **params: Any) -> AsyncStream:
        """Async iterator of chunks (``completion`` is set at the end); leaving it early cancels the request.

        The request is sent when the iteration starts.
        """
        done: list[Completion] = []
        return AsyncStream(self._stream(prompt, timeout, params, done, self.model if model is None else model),
                           done)

    async def _stream(self, prompt: Prompt, timeout: float | None, params: dict[str, Any],
                      done: list[Completion], model: str | None) -> AsyncGenerator[StreamChunk, None]:
        rid = new_id()
        t, wait = self._budget(timeout)
        q = await self._open(generate_frame(rid, [prompt], False, True, t, params, model), rid, t)
        pending = Pending(1)
        loop = asyncio.get_running_loop()
        end = None if wait is None else loop.time() + wait
        finished = False
        try:
            while not pending.done:
                chunk = pending.feed(await self._next(q, None if end is None else end - loop.time()))
                if chunk is not None:
                    yield chunk
            finished = True
            done.append(pending.completions()[0])  # or raise the final error
        finally:
            if not finished:
                await self._cancel(rid)
            self._waiting.pop(rid, None)

    async def status(self, *, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's view (see ``Client.status``)."""
        return status_of(await self._query(StatusRequest(new_id()), timeout))

    async def metrics(self, *, timeout: float = 5.0) -> str:
        """The daemon's Prometheus metrics, in the text exposition format (docs/metrics.md)."""
        return metrics_of(await self._query(MetricsRequest(new_id()), timeout))

    async def _query(self, request: StatusRequest | MetricsRequest, timeout: float) -> Message:
        """Send a one-reply request and wait for its reply."""
        q = await self._open(codec.encode(request), request.id, timeout)
        try:
            return await asyncio.wait_for(q.get(), timeout)
        except TimeoutError:
            raise no_answer(self.endpoint, timeout) from None
        finally:
            self._waiting.pop(request.id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._zctx.destroy(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
