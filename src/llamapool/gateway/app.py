"""The gateway's app: the route table over one :class:`llamapool.AsyncClient`, one module per API.

Starlette on uvicorn (uvloop + httptools): a thin ASGI layer; an event stream is our own response
(``serving.EventStream``), which hands the pre-encoded SSE bytes straight to the protocol in the
handler's task, and a client that goes away cancels that task, which cancels the request on the
worker. Each API's handlers live in their own module (``openai/chat.py``, ``openai/completions.py``,
``anthropic.py``, ...) over the shared plumbing of ``serving.py``, whose
:meth:`~llamapool.gateway.serving.Serving.endpoint` is the one error path.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llamapool.client.aio import AsyncClient
from llamapool.gateway import GatewaySpec, anthropic, tokenizer_info, tokens
from llamapool.gateway.errors import ANTHROPIC_PATH, ApiError, error_response, openai_error
from llamapool.gateway.openai import (
    chat,
    chat_render,
    completions,
    completions_render,
    embeddings,
    infill,
    models,
    rerank,
    responses,
    stored,
)
from llamapool.gateway.origins import OriginGuard, OriginPolicy
from llamapool.gateway.pod import PodView
from llamapool.gateway.serving import Door, Serving


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 (no such route) and 405 (a route without that method), in the shape of the
    path's API (Anthropic's under ``/v1/messages``, OpenAI's elsewhere)."""
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
    return error_response(request.url.path)(e)


async def server_error(request: Request, exc: Exception) -> Response:
    """A bug: a 500 in the shape of the path's API rather than plain text (uvicorn still logs the traceback)."""
    return error_response(request.url.path)(ApiError(500, f"internal error: {type(exc).__name__}",
                                                     type_="server_error", code="internal_error"))


class Gateway(Serving):
    """The routes; ``client`` is this process's one connection to the router."""

    def __init__(self, spec: GatewaySpec, client: AsyncClient):
        super().__init__(spec, client)
        self.pod = PodView(spec, client, self._guard)  # /health, /ready, /metrics (gateway/pod.py)

    def app(self) -> Starlette:
        api = self.endpoint
        openai_routes = [  # served at /v1/... and, as llama-server and vLLM do, without the /v1
            ("/models", Door(models.handle_list), "GET"), ("/models/{model_id:path}", Door(models.handle_one), "GET"),
            ("/completions", Door(completions.handle), "POST"), ("/chat/completions", Door(chat.handle), "POST"),
            ("/completions/render", Door(completions_render.handle), "POST"),  # vLLM's (issue 53)
            ("/chat/completions/render", Door(chat_render.handle), "POST"),
            ("/responses", Door(responses.handle), "POST"), ("/embeddings", Door(embeddings.handle), "POST"),
            ("/load_lora_adapter", Door(models.handle_load_lora), "POST"),  # vLLM's run-time LoRA adapters
            ("/unload_lora_adapter", Door(models.handle_unload_lora), "POST"),
            ("/responses/{response_id:str}", Door(stored.handle_one), "GET DELETE"),
            ("/responses/{response_id:str}/input_items", Door(stored.handle_input_items), "GET"),
            *((path, door, "POST") for path, door in rerank.ROUTES),  # Jina's and llama-server's rerank
        ]
        return Starlette(routes=[
            *self.pod.routes(),
            Route("/models/{action:str}", api(Door(models.handle_action)), methods=["POST"]),  # llama-server's
            *(Route(prefix + path, api(door), methods=methods.split())
              for prefix in ("/v1", "") for path, door, methods in openai_routes),
            Route(rerank.PATH_COHERE, api(rerank.COHERE), methods=["POST"]),  # Cohere's v2 rerank
            Route(ANTHROPIC_PATH, api(anthropic.MESSAGES), methods=["POST"]),
            Route(ANTHROPIC_PATH + "/count_tokens", api(anthropic.COUNT_TOKENS), methods=["POST"]),
            Route("/infill", api(Door(infill.handle)), methods=["POST"]),  # llama-server's
            Route("/tokenize", api(Door(tokens.tokenize)), methods=["POST"]),
            Route("/detokenize", api(Door(tokens.detokenize)), methods=["POST"]),
            Route("/tokenizer_info", api(Door(tokenizer_info.handle)), methods=["GET"]),
        ], exception_handlers={HTTPException: http_error, Exception: server_error},
            middleware=[Middleware(OriginGuard, policy=OriginPolicy.make(
                self.spec.host, self.spec.allowed_hosts, self.spec.cors_origins))])

    def _guard(self, request: Request) -> Response | None:
        """``/metrics`` is behind the API keys when there are some (Prometheus: ``authorization:
        {credentials: KEY}``): the error response, or None."""
        try:
            self.authorise(request)
        except ApiError as e:
            return openai_error(e)
        return None
