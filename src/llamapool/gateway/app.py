"""The gateway's app: the route table over one :class:`llamapool.AsyncClient`, one module per API.

Starlette on uvicorn (uvloop + httptools): a thin ASGI layer whose streaming response hands our
pre-encoded SSE bytes straight to the protocol, and which cancels the handler when the client goes
away, which cancels the request on the worker. Each API's handlers live in their own module
(``openai/chat.py``, ``openai/completions.py``, ``anthropic.py``, ...) over the shared plumbing of
``serving.py``, whose :meth:`~llamapool.gateway.serving.Serving.endpoint` is the one error path.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llamapool.client.errors import LlamapoolError
from llamapool.gateway import anthropic, tokens
from llamapool.gateway.errors import ApiError, openai_error
from llamapool.gateway.openai import chat, completions, embeddings, models, responses
from llamapool.gateway.origins import OriginGuard, OriginPolicy
from llamapool.gateway.serving import Door, Serving
from llamapool.router.metrics import CONTENT_TYPE


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such route) and 405 (a route without that method), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        e = ApiError(404, f"no such endpoint: {where}", code="not_found")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        e = ApiError(405, f"method not allowed: {where} (allowed: {allowed})", code="method_not_allowed")
    else:
        e = ApiError(exc.status_code, exc.detail)
    e.headers = dict(exc.headers or {})
    return openai_error(e)


async def server_error(request: Request, exc: Exception) -> Response:
    """A bug: OpenAI's shape rather than a plain-text 500 (uvicorn still logs the traceback)."""
    return openai_error(ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                                 code="internal_error"))


class Gateway(Serving):
    """The routes; ``client`` is this process's one connection to the router."""

    def app(self) -> Starlette:
        api = self.endpoint
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", api(Door(models.handle_list)), methods=["GET"]),
            Route("/v1/models/{model_id:path}", api(Door(models.handle_one)), methods=["GET"]),
            Route("/v1/completions", api(Door(completions.handle)), methods=["POST"]),
            Route("/v1/chat/completions", api(Door(chat.handle)), methods=["POST"]),
            Route("/v1/responses", api(Door(responses.handle)), methods=["POST"]),
            Route("/v1/messages", api(anthropic.MESSAGES), methods=["POST"]),
            Route("/v1/embeddings", api(Door(embeddings.handle)), methods=["POST"]),
            Route("/tokenize", api(Door(tokens.tokenize)), methods=["POST"]),
            Route("/detokenize", api(Door(tokens.detokenize)), methods=["POST"]),
        ], exception_handlers={HTTPException: http_error, Exception: server_error},
            middleware=[Middleware(OriginGuard, policy=OriginPolicy.make(
                self.spec.host, self.spec.allowed_hosts, self.spec.cors_origins))])

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
            self.authorise(request)
        except ApiError as e:
            return openai_error(e)
        try:
            text = await self.client.metrics(timeout=5.0)
        except LlamapoolError as e:
            return Response(f"# llamapool unavailable: {e.message}\n", status_code=503, media_type="text/plain")
        return Response(text, media_type=CONTENT_TYPE)
