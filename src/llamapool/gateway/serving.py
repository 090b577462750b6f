"""The request plumbing every API's handlers share: authentication, the body, the router calls, the
event stream, and the one error path (:meth:`Serving.endpoint`), each API giving only its error shape.

A handler is ``async def handle(s: Serving, call: Call) -> Response``; it raises :class:`ApiError` for
a bad request, and the router's errors (:class:`LlamapoolError`) pass through to the endpoint, which
names the HTTP field they stand for from what the handler recorded in ``call``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from llamapool import keys as keysfile
from llamapool.client.aio import AsyncClient, AsyncStream
from llamapool.client.calls import generate_frame, new_id
from llamapool.client.errors import LlamapoolError
from llamapool.client.types import Completion, StreamChunk
from llamapool.gateway import GatewaySpec
from llamapool.gateway.errors import ApiError, Messages, bad, from_llamapool, is_anthropic, openai_error
from llamapool.gateway.openai.store import Owner, ResponseStore
from llamapool.gateway.parsing import Generation, json_body, priority_class, ratelimit_headers, renamed
from llamapool.log import Logger

T = TypeVar("T")

LIMIT_KEY = "server.max_message_bytes"
# A JSON body encodes to no more bytes of msgpack (its strings, numbers and lists are no longer
# there), plus an envelope of a few hundred bytes (id, parameters, timeout): only a body this close
# to the limit needs its encoded size checked.
ENCODING_SLACK = 64 * 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client went away before its answer (or its first token) was ready."""


@dataclass
class Call:
    """One HTTP request being served, and what the error path needs to name a router error's field:
    whether the prompt is a chat's (and the field its messages came in) and how many prompts there are."""

    request: Request
    chat: bool = False
    n_prompts: int = 1
    messages: Messages = "messages"
    # a contract parameter the body gave under another name: its name there (``response_format.json_schema``
    # -> ``text.format``)
    renames: dict[str, str] = field(default_factory=dict)
    # the disconnect watch of the streams open_streams opened: their event stream's response takes it over
    watch: Watch | None = None
    tenant: str | None = None  # who asks: the API key's tenant, or the trusted header's (None: the default)
    owner: Owner = field(default_factory=Owner)  # whose stored responses it may see (gateway/openai/store.py)
    ratelimit: dict[str, Any] | None = None  # the tenant's rate-limit state the router sent (the headers)

    def api_error(self, e: LlamapoolError) -> ApiError:
        return renamed(self.renames, from_llamapool(e, self.chat, self.n_prompts, self.messages))


Handler = Callable[["Serving", Call], Awaitable[Response]]


@dataclass(frozen=True)
class Door:
    """One endpoint: its handler and its API's error shape."""

    handle: Handler
    error_response: Callable[[ApiError], Response] = openai_error


def load_keys(path: str) -> keysfile.KeysFile:
    """The keys file (llamapool/keys.py): each key's tenant; a bad line raises naming it."""
    return keysfile.load(path)


def too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, f"{what}, over the limit of {limit} bytes ({LIMIT_KEY})", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) from its Content-Length before any of it is read (so a client that
    sent ``Expect: 100-continue`` gets no ``100 Continue``), or as soon as a chunked body passes ``limit``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large(f"the request body is {int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"the request body is more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


class Serving:
    """What handlers use: ``client`` is this process's one connection to the router."""

    def __init__(self, spec: GatewaySpec, client: AsyncClient):
        self.spec, self.client = spec, client
        self.keys = load_keys(spec.api_keys_file).keys if spec.api_keys_file else {}
        self.log = Logger(spec.name, prefix=f"llamapool gateway {spec.name}")
        self.responses = ResponseStore(spec.responses_store, spec.responses_ttl, spec.responses_max_bytes) \
            if spec.responses_store else None  # [http] responses_store

    def endpoint(self, door: Door) -> Callable[[Request], Awaitable[Response]]:
        """The Starlette endpoint of ``door``: the API key checked, and every error in the API's shape."""
        async def serve(request: Request) -> Response:
            call = Call(request)
            response: Response | None = None
            try:
                call.tenant = self.authorise(request, call)
                response = await door.handle(self, call)
                response.headers.update(ratelimit_headers(call.ratelimit, request.url.path))
                return response
            except (ClientGone, ClientDisconnect):
                return Response(status_code=499)  # nobody reads it; the request was cancelled on the daemon
            except ApiError as e:
                return door.error_response(e)
            except LlamapoolError as e:  # before the reply's first byte (a stream's too): nothing delivered
                e.tokens_delivered = None
                err = call.api_error(e)
                err.headers.update(ratelimit_headers(e.ratelimit, request.url.path))
                return door.error_response(err)
            except TypeError as e:  # a parameter the SDK refuses
                return door.error_response(ApiError(400, str(e)))
            finally:
                if call.watch is not None and not (isinstance(response, EventStream) and response.watch is call.watch):
                    call.watch.stop()  # no event stream takes it over
        return serve

    def authorise(self, request: Request, call: Call | None = None) -> str | None:
        """The request's tenant: the trusted header's name (``http.tenant_header``), else its API key's
        (None: no keys, no header: the default tenant); a missing or wrong key is a 401. ``call.owner``
        becomes the key and the header's name."""
        tenant, matched = None, b""
        if self.keys:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not given:  # Anthropic's clients send theirs as x-api-key
                given = request.headers.get("x-api-key", "").strip().encode()
            for key, name in self.keys.items():  # constant time for each key, and every key is compared
                if hmac.compare_digest(given, key):
                    tenant, matched = name, key
            if tenant is None:
                raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' "
                                    "(or 'x-api-key: KEY')", code="invalid_api_key")
        header = self.spec.tenant_header
        named = request.headers.get(header) if header else None
        if named is not None:
            if not keysfile.NAME.fullmatch(named):
                raise ApiError(400, f"header {header!r} must name a tenant (1 to 64 of A-Z a-z 0-9 _ . : -), got "
                                    f"{named!r:.80}", param=header, code="invalid_value")
            tenant = named
        if call is not None:
            call.owner = Owner(matched, named or "")
        return tenant

    async def body(self, call: Call) -> Any:
        """The request's JSON body."""
        return json_body(await read_body(call.request, self.spec.max_message_bytes))

    async def generation(self, call: Call, parse: Callable[[Any], Generation | Awaitable[Generation]]) -> Generation:
        """The body parsed by ``parse`` (which may await: a stored conversation); one near the size limit
        is refused (413) when its message to the router would pass it."""
        raw = await read_body(call.request, self.spec.max_message_bytes)
        body = json_body(raw)
        parsed = parse(body)
        req = await parsed if inspect.isawaitable(parsed) else parsed
        if req.media is not None:
            await self.media(req)
        req.priority, asked = priority_class(body, is_anthropic(call.request.url.path))
        call.n_prompts, call.renames = len(req.prompts), req.renames
        if asked not in (None, "priority"):  # the router's 'priority' errors name the field the body used
            call.renames = {**req.renames, "priority": asked}
        if len(raw) > self.spec.max_message_bytes - ENCODING_SLACK:
            self.check_encoded(req)
        return req

    async def media(self, req: Generation) -> None:
        """A request with images: refused (400 naming the first) for a model that takes none; its http(s)
        images fetched where ``[http] fetch_media`` allows (gateway/fetch.py), else refused."""
        assert req.media is not None
        if self.spec.takes_images(req.model) is False:
            at = req.media.fields[0]
            raise bad(at, f"'{at}' is an image, and the model {req.model or self.spec.model!r} takes none (its "
                          f"config sets no mmproj: docs/models.md#images)")
        if req.media.fetches:
            from llamapool.gateway.fetch import fetch_all

            await fetch_all(req.media.fetches, self.spec.fetch_media)

    def check_encoded(self, req: Generation) -> None:
        """A 413 when ``req``'s message to the router would pass ``server.max_message_bytes``."""
        t, limit = self.spec.request_timeout, self.spec.max_message_bytes
        if req.stream:  # a stream per prompt
            size = max(len(generate_frame(new_id(), [p], False, True, t, req.params, req.model)) for p in req.prompts)
        else:
            size = len(generate_frame(new_id(), req.prompts, True, False, t, req.params, req.model))
        if size > limit:
            raise too_large(f"the request encodes to a {size}-byte message to the router", limit)

    async def generate(self, call: Call, req: Generation) -> list[Completion]:
        """Every prompt's completions (``n`` each), unless the client goes away first."""
        done = cast(list[Completion], await unless_gone(call.request, self.client.generate_many(
            req.prompts, timeout=self.spec.request_timeout, model=req.model, sampling=req.params, tenant=call.tenant,
            priority=req.priority)))
        call.ratelimit = next((c.ratelimit for c in reversed(done) if c.ratelimit is not None), None)
        return done

    async def open_streams(self, call: Call, req: Generation) -> tuple[list[AsyncStream], list[Any]]:
        """A stream per prompt and each one's first item: an error before the first token is raised
        here, so it can still become the HTTP status. The requests are sent in this loop round (no task
        between the HTTP request and the router); the client's disconnect is watched from here to the
        end of the event stream (:func:`sse`, which takes ``call.watch`` over)."""
        streams = [self.client.stream(p, timeout=self.spec.request_timeout, model=req.model, sampling=req.params,
                                      tenant=call.tenant, priority=req.priority) for p in req.prompts]
        call.watch = watch = Watch(call.request)
        try:
            firsts = await _start(streams)
            call.ratelimit = next((f.ratelimit for f in reversed(firsts) if getattr(f, "ratelimit", None)), None)
            return streams, firsts
        except asyncio.CancelledError:
            if watch.gone():
                raise ClientGone from None
            raise

    def model(self, named: str | None, done: Completion | None = None) -> str:
        """The model that served (or will serve) a request."""
        return (done.model if done is not None else None) or named or self.spec.model


class Watch:
    """Cancels the task serving a request when its client disconnects (one task, awaiting the
    disconnect), so that whatever it awaits (the router's reply, the next token, a send held back by
    a slow client) ends at once, and its ``finally`` cancels the request on the daemon; ``gone()``
    says whether a ``CancelledError`` was this (and takes it back), ``stop()`` ends the watch."""

    def __init__(self, request: Request):
        self.task = asyncio.current_task()
        self.left = self.stopped = False
        self.watcher = asyncio.create_task(self._watch(request.receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":  # the body has been read: nothing else comes
            pass
        if not self.stopped and self.task is not None:
            self.left = True
            self.task.cancel()

    def gone(self) -> bool:
        """Whether the client went away (its cancel is taken back: the task goes on, to clean up)."""
        if self.left and self.task is not None and self.task.cancelling():
            self.task.uncancel()
        return self.left

    def stop(self) -> None:
        self.stopped = True
        self.watcher.cancel()


class EventStream(Response):
    """An event stream (``text/event-stream``), in the task that opened its streams and under its
    disconnect watch: Starlette's StreamingResponse would start a task group and a task of its own
    to watch for the disconnect, and write the headers a few loop rounds after the first token; this
    writes them and the first event in the round the handler returns. A client that goes away
    cancels the events (their ``finally`` cancels the requests on the daemon); a slow one holds them
    back in ``send`` (gateway/connections.py)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], watch: Watch | None):
        self.events, self.watch = events, watch
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch if self.watch is not None else Watch(Request(scope, receive))
        events = self.events
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            watch.stop()  # before the watch sees the response complete, which receive() reports as a disconnect
        except asyncio.CancelledError:
            if not watch.gone():
                raise
        finally:
            watch.stop()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:  # left early: its finally cancels the requests still running
                await aclose()


def sse(call: Call, events: AsyncIterator[bytes]) -> EventStream:
    """The event stream of the streams ``open_streams`` opened for ``call``."""
    return EventStream(events, call.watch)


@contextlib.asynccontextmanager
async def closing(streams: list[AsyncStream]) -> AsyncIterator[None]:
    """Closes the streams on the way out: the disconnect watch (:class:`Watch`) cancels an event
    generator when the client goes away, and the shield lets the cancel reach the router all the same."""
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            for s in streams:
                await s.aclose()


async def unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work`` (in this task: its request is sent in this loop round) unless the client
    disconnects first; then cancel it, which cancels the request on the daemon: a queued prompt
    leaves the queue, a running one stops within a step."""
    watch = Watch(request)
    try:
        return await work
    except asyncio.CancelledError:
        if watch.gone():
            raise ClientGone from None
        raise
    finally:
        watch.stop()


async def _start(streams: list[AsyncStream]) -> list[Any]:
    """Each stream's first item (a chunk, or ``None`` when it ended without one)."""
    firsts: list[Any] = []
    try:
        for s in streams:
            try:
                firsts.append(await s.__anext__())
            except StopAsyncIteration:
                firsts.append(None)
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return firsts


async def merge(streams: list[AsyncStream], first: list[Any], n: int = 1) -> AsyncIterator[tuple[int, Any]]:
    """Interleave the streams' items as ``(index, StreamChunk | Completion | LlamapoolError)``: stream ``i``
    (prompt ``i``) has ``n`` choices, indexed ``i * n + j`` (a chunk's ``index`` is its choice ``j``)."""
    if len(streams) == 1:  # the common case, without tasks
        s = streams[0]
        if first[0] is not None:
            yield first[0].index, first[0]
        try:
            async for chunk in s:
                yield chunk.index, chunk
        except LlamapoolError as e:
            yield 0, e
            return
        for c in s.completions:
            yield c.index, c
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: AsyncStream) -> None:
        try:
            if first[i] is not None:
                queue.put_nowait((i * n + first[i].index, first[i]))
            async for chunk in s:
                queue.put_nowait((i * n + chunk.index, chunk))
            for c in s.completions:
                queue.put_nowait((i * n + c.index, c))
        except LlamapoolError as e:
            queue.put_nowait((i * n, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams) * n:
            i, item = await queue.get()
            if not isinstance(item, StreamChunk):
                ended += 1
            yield i, item
            if isinstance(item, LlamapoolError):
                return
    finally:
        for t in tasks:
            t.cancel()
