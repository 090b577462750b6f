"""The gateway's routes: OpenAI's API as a Starlette app over one :class:`llamapool.AsyncClient`.

Starlette on uvicorn (uvloop + httptools): a thin ASGI layer whose streaming response hands our
pre-encoded SSE bytes straight to the protocol, and which cancels the handler when the client goes
away, which cancels the request on the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llamapool.client.aio import AsyncClient, AsyncStream
from llamapool.client.calls import generate_frame, new_id
from llamapool.client.errors import LlamapoolError
from llamapool.client.types import Completion, StreamChunk
from llamapool.gateway import GatewaySpec
from llamapool.gateway import anthropic as anth
from llamapool.gateway import openai as oai
from llamapool.router.metrics import CONTENT_TYPE


def load_keys(path: str) -> list[bytes]:
    """API keys, one per line; blank lines and ``#`` comments are skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line.encode())
    return keys


T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client went away before its answer (or its first token) was ready."""


def error_response(e: oai.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def anthropic_error(e: oai.ApiError) -> JSONResponse:
    """The error in Anthropic's shape (``/v1/messages``)."""
    return JSONResponse(anth.error_body(e), status_code=e.status, headers=e.headers)


def json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise oai.ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


LIMIT_KEY = "server.max_message_bytes"
# A JSON body encodes to no more bytes of msgpack (its strings, numbers and lists are no longer
# there), plus an envelope of a few hundred bytes (id, parameters, timeout): only a body this close
# to the limit needs its encoded size checked.
ENCODING_SLACK = 64 * 1024


def too_large(what: str, limit: int) -> oai.ApiError:
    return oai.ApiError(413, f"{what}, over the limit of {limit} bytes ({LIMIT_KEY})", code="request_too_large")


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


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such route) and 405 (a route without that method), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        e = oai.ApiError(404, f"no such endpoint: {where}", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        e = oai.ApiError(405, f"method not allowed: {where} (allowed: {allowed})", code="method_not_allowed")
    else:
        e = oai.ApiError(exc.status_code, exc.detail)
    e.headers = dict(exc.headers or {})
    return error_response(e)


async def server_error(request: Request, exc: Exception) -> Response:
    """A bug: OpenAI's shape rather than a plain-text 500 (uvicorn still logs the traceback)."""
    return error_response(oai.ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                                       code="internal_error"))


class Gateway:
    """Request handlers; ``client`` is this process's one connection to the router."""

    def __init__(self, spec: GatewaySpec, client: AsyncClient):
        self.spec, self.client = spec, client
        self.keys = load_keys(spec.api_keys_file) if spec.api_keys_file else []

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ], exception_handlers={HTTPException: http_error, Exception: server_error})

    def _authorised(self, request: Request) -> None:
        if not self.keys:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        if not given:  # Anthropic's clients send theirs as x-api-key
            given = request.headers.get("x-api-key", "").strip().encode()
        ok = False
        for key in self.keys:  # constant time for each key, and every key is compared
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise oai.ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' "
                                    "(or 'x-api-key: KEY')", code="invalid_api_key")

    async def health(self, request: Request) -> Response:
        try:
            st = await self.client.status(timeout=2.0)
        except LlamapoolError as e:
            return JSONResponse({"status": "unavailable", "error": e.message}, status_code=503)
        ready = sum(1 for w in st["workers"] if w.get("state") == "ready")
        body = {"status": "ok" if ready else "unavailable", "workers_ready": ready,
                "queued": st["queued"], "running": st["running"]}
        return JSONResponse(body, status_code=200 if ready and not st["draining"] else 503)

    async def metrics(self, request: Request) -> Response:
        """Prometheus metrics, rendered by the router (one owner per figure; see docs/metrics.md).
        Behind the API keys when there are some (Prometheus: ``authorization: {credentials: KEY}``)."""
        try:
            self._authorised(request)
        except oai.ApiError as e:
            return error_response(e)
        try:
            text = await self.client.metrics(timeout=5.0)
        except LlamapoolError as e:
            return Response(f"# llamapool unavailable: {e.message}\n", status_code=503, media_type="text/plain")
        return Response(text, media_type=CONTENT_TYPE)

    async def _models(self) -> list[dict[str, Any]]:
        """The pool's models in OpenAI's shape, each with its worker ids ("workers": not OpenAI's,
        clients ignore it)."""
        try:  # the router's list is the current one (a reload may have changed it)
            models = (await self.client.status(timeout=2.0)).get("models") or []
        except LlamapoolError:
            models = []
        return [{"id": m["name"], "object": "model", "created": 0, "owned_by": "llamapool", "workers": m["workers"]}
                for m in models or [{"name": self.spec.model, "workers": []}]]

    async def models(self, request: Request) -> Response:
        try:
            self._authorised(request)
        except oai.ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": await self._models()})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: one model, or a 404 ``model_not_found``."""
        try:
            self._authorised(request)
        except oai.ApiError as e:
            return error_response(e)
        name = request.path_params["model_id"]
        models = await self._models()
        for m in models:
            if m["id"] == name:
                return JSONResponse(m)
        known = ", ".join(m["id"] for m in models)
        return error_response(oai.ApiError(404, f"The model {name!r} does not exist (the pool's models: {known})",
                                           param="model", code="model_not_found"))

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        n_prompts = 1
        try:
            self._authorised(request)
            raw = await read_body(request, self.spec.max_message_bytes)
            req = (oai.parse_chat if chat else oai.parse_completion)(json_body(raw))
            n_prompts = len(req.prompts)
            if len(raw) > self.spec.max_message_bytes - ENCODING_SLACK:
                self._check_encoded(req)
            if req.stream:
                streams = [self.client.stream(p, timeout=self.spec.request_timeout, model=req.model, **req.params)
                           for p in req.prompts]
                first = await _unless_gone(request, _start(streams))  # errors before the first token are HTTP errors
                return StreamingResponse(self._sse(req, chat, streams, first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            done = cast(list[Completion], await _unless_gone(request, self.client.generate_many(
                req.prompts, timeout=self.spec.request_timeout, model=req.model, **req.params)))
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody reads it; the request was cancelled on the daemon
        except oai.ApiError as e:
            return error_response(e)
        except LlamapoolError as e:
            return error_response(oai.from_llamapool(e, chat, n_prompts))
        except TypeError as e:  # a parameter the SDK refuses
            return error_response(oai.ApiError(400, str(e)))
        pt, ct, cached = oai.totals(done, req.params.get("n", 1))
        model = done[0].model or req.model or self.spec.model
        if chat:
            return JSONResponse(oai.chat_body(req, model, done, pt, ct, cached))
        return JSONResponse(oai.completion_body(req, model, done, pt, ct, cached))

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings`` for an embedding model of the pool (``embedding = true``)."""
        try:
            self._authorised(request)
            raw = await read_body(request, self.spec.max_message_bytes)
            req = oai.parse_embeddings(json_body(raw))
            vecs = await _unless_gone(request, self.client.embed(req.inputs, timeout=self.spec.request_timeout,
                                                                 model=req.model))
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        except oai.ApiError as e:
            return error_response(e)
        except LlamapoolError as e:
            return error_response(oai.from_llamapool(e))
        except TypeError as e:  # inputs the SDK refuses
            return error_response(oai.bad("input", str(e)))
        model = vecs.model or req.model or self.spec.model
        return JSONResponse(oai.embeddings_body(req, model, vecs, vecs.raw, vecs.prompt_tokens))

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` as llama-server has it: ``{"tokens": [...]}``."""
        return await self._tokens(request, detokenize=False)

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` as llama-server has it: ``{"content": "..."}``."""
        return await self._tokens(request, detokenize=True)

    async def _tokens(self, request: Request, detokenize: bool) -> Response:
        try:
            self._authorised(request)
            body = json_body(await read_body(request, self.spec.max_message_bytes))
            t = self.spec.request_timeout
            if detokenize:
                kw = oai.parse_detokenize(body)
                out: dict[str, Any] = {"content": await self.client.detokenize(kw.pop("tokens"), timeout=t, **kw)}
            else:
                kw = oai.parse_tokenize(body)
                out = {"tokens": await self.client.tokenize(kw.pop("text"), timeout=t, **kw)}
        except oai.ApiError as e:
            return error_response(e)
        except LlamapoolError as e:
            return error_response(oai.from_llamapool(e))
        return JSONResponse(out)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (gateway/anthropic.py translates it), errors in its shape."""
        try:
            self._authorised(request)
            raw = await read_body(request, self.spec.max_message_bytes)
            req = anth.parse_messages(json_body(raw))
            if len(raw) > self.spec.max_message_bytes - ENCODING_SLACK:
                self._check_encoded(req)
            if req.stream:
                stream = self.client.stream(req.prompts[0], timeout=self.spec.request_timeout, model=req.model,
                                            **req.params)
                first = await _unless_gone(request, _start([stream]))  # errors before the first token: HTTP errors
                return StreamingResponse(self._message_events(req, stream, first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            done = cast(list[Completion], await _unless_gone(request, self.client.generate_many(
                req.prompts, timeout=self.spec.request_timeout, model=req.model, **req.params)))
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        except oai.ApiError as e:
            return anthropic_error(e)
        except LlamapoolError as e:
            return anthropic_error(oai.from_llamapool(e, chat=True))
        except TypeError as e:  # a parameter the SDK refuses
            return anthropic_error(oai.ApiError(400, str(e)))
        c = done[0]
        return JSONResponse(anth.message_body(req, c.model or req.model or self.spec.model, c))

    async def _message_events(self, req: oai.Request, stream: AsyncStream, first: list[Any]) -> AsyncIterator[bytes]:
        """Anthropic's event stream; leaving it (the client went away) cancels the request."""
        w = anth.EventWriter(req, req.model or self.spec.model)
        try:
            yield w.start()
            async for _, item in _merge([stream], first):
                if isinstance(item, LlamapoolError):  # mid-stream: an error event ends the stream
                    yield w.error(oai.from_llamapool(item, chat=True))
                    break
                if isinstance(item, StreamChunk):
                    if item.text:
                        yield w.text(item.text)
                    continue
                yield w.end(item)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    def _check_encoded(self, req: oai.Request) -> None:
        """A body near the limit: refuse it here (413) if its message to the router would pass
        ``max_message_bytes``, rather than send what the router refuses."""
        t, limit = self.spec.request_timeout, self.spec.max_message_bytes
        if req.stream:  # a stream per prompt
            size = max(len(generate_frame(new_id(), [p], False, True, t, req.params, req.model)) for p in req.prompts)
        else:
            size = len(generate_frame(new_id(), req.prompts, True, False, t, req.params, req.model))
        if size > limit:
            raise too_large(f"the request encodes to a {size}-byte message to the router", limit)

    async def _sse(self, req: oai.Request, chat: bool, streams: list[AsyncStream],
                   first: list[Any]) -> AsyncIterator[bytes]:
        """The event stream; leaving it (the client went away) cancels every request still running."""
        w = oai.ChunkWriter(req, req.model or self.spec.model, chat)
        pt = ct = cached = 0
        try:
            n = req.params.get("n", 1)
            if chat:
                for j in range(n):
                    yield w.first(j)
            async for index, item in _merge(streams, first, n):
                if isinstance(item, LlamapoolError):  # mid-stream: an error event ends the stream
                    yield w.error(oai.from_llamapool(item, chat, len(req.prompts)))
                    break
                if isinstance(item, StreamChunk):
                    if item.text or item.logprobs:
                        yield w.text(index, item.text, item.logprobs)
                    continue
                if index % n == 0:  # a prompt counts once for its n choices
                    pt += item.usage.prompt_tokens
                    cached += item.usage.cached_tokens
                ct += item.usage.completion_tokens
                if item.tool_calls:
                    yield w.tool_calls(index, item)
                yield w.end(index, item.finish_reason)
            else:
                if req.include_usage:
                    yield w.usage(pt, ct, cached)
            yield w.DONE
        finally:
            # Starlette cancels this generator when the client goes away; the shield lets the
            # cancel reach the router all the same
            with anyio.CancelScope(shield=True):
                for s in streams:
                    await s.aclose()


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it, which cancels the request
    on the daemon: a queued prompt leaves the queue, a running one stops within a step. (Once the
    event stream has started, Starlette watches for the disconnect itself.)"""
    task = asyncio.create_task(work)
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let it send the cancel
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _start(streams: list[AsyncStream]) -> list[Any]:
    """Each stream's first item (a chunk, or ``None`` when it ended without one): an error here
    is raised, so it can still become the HTTP status."""
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


async def _merge(streams: list[AsyncStream], first: list[Any], n: int = 1) -> AsyncIterator[tuple[int, Any]]:
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
