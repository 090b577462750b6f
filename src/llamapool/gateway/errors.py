"""The gateway's one error type and its mapping from llamapool's errors.

A bad request raises :class:`ApiError` naming the parameter, whichever API it came through; each API
gives it its own shape: OpenAI's ``{"error": {...}}``, or Anthropic's ``{"type": "error", "error": {...}}``
for Anthropic's API (every path under ``/v1/messages``), or Cohere's ``{"id", "message"}`` for its rerank
(``/v2/rerank``), whose message names the parameter. An error no endpoint answers (no such route, a
method the route lacks, a bug, a request the origin guard refuses) takes the shape of the path's API
(:func:`error_response`), so an Anthropic client reads each of them as its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from llamapool.client.errors import LlamapoolError
from llamapool.protocol.messages import ErrorCode


class ApiError(Exception):
    """An HTTP error: status, message, and the parameter it names (OpenAI's ``type``/``param``/``code``)."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        self.tokens_delivered: int | None = None  # an error that ends a stream: tokens it had sent

    def body(self) -> dict[str, Any]:
        """OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.tokens_delivered is not None:
            err["tokens_delivered"] = self.tokens_delivered
        return {"error": err}


def bad(param: str, message: str) -> ApiError:
    """A 400 for a bad value of ``param``."""
    return ApiError(400, message, param=param, code="invalid_value")


def unsupported(param: str, message: str) -> ApiError:
    """A 400 for a parameter (or value) the API defines and llamapool cannot honour."""
    return ApiError(400, message, param=param, code="unsupported_parameter")


def not_an_object() -> ApiError:
    return ApiError(400, "the request body must be a JSON object", code="invalid_json")


def openai_error(e: ApiError) -> JSONResponse:
    """The error as an HTTP response in OpenAI's shape (every API but Anthropic's)."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


ANTHROPIC_PATH = "/v1/messages"  # Anthropic's Messages API: this path and every path under it
# HTTP status -> Anthropic's error type (any other: "api_error")
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}


def anthropic_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}


def anthropic_error(e: ApiError) -> JSONResponse:
    """The error as an HTTP response in Anthropic's shape."""
    return JSONResponse(anthropic_body(e), status_code=e.status, headers=e.headers)


def is_anthropic(path: str) -> bool:
    """Whether ``path`` belongs to Anthropic's API (``/v1/messages`` or under it)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


COHERE_PATH = "/v2/rerank"  # Cohere's v2 API: its rerank endpoint


def cohere_body(e: ApiError) -> dict[str, Any]:
    """Cohere's shape: ``{"id", "message"}``, the message saying which parameter (Cohere's errors have no
    field of their own for it), prefixed as Cohere's are ("invalid request: ...")."""
    import uuid

    prefix = "invalid request: " if e.status == 400 else ""
    return {"id": str(uuid.uuid4()), "message": prefix + e.message}


def cohere_error(e: ApiError) -> JSONResponse:
    """The error as an HTTP response in Cohere's shape."""
    return JSONResponse(cohere_body(e), status_code=e.status, headers=e.headers)


def error_body(e: ApiError, path: str) -> dict[str, Any]:
    """The error's body in the shape of the API ``path`` belongs to."""
    if path == COHERE_PATH:
        return cohere_body(e)
    return anthropic_body(e) if is_anthropic(path) else e.body()


def error_response(path: str) -> Callable[[ApiError], JSONResponse]:
    """The error response of the API ``path`` belongs to: Anthropic's, Cohere's or OpenAI's."""
    if path == COHERE_PATH:
        return cohere_error
    return anthropic_error if is_anthropic(path) else openai_error


# llamapool error codes -> (HTTP status, OpenAI error type)
_STATUS = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.MALFORMED: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.DUPLICATE_ID: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    "no_chat_template": (400, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.FORBIDDEN: (403, "permission_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    ErrorCode.TIMEOUT: (504, "timeout"),
    ErrorCode.WORKER_LOST: (502, "server_error"),
    ErrorCode.UNKNOWN_MODEL: (404, "invalid_request_error"),
}
# llamapool's code -> OpenAI's, where they differ
_CODE = {ErrorCode.UNKNOWN_MODEL: "model_not_found", ErrorCode.TOO_LARGE: "request_too_large",
         ErrorCode.RATE_LIMITED: "rate_limit_exceeded"}


_PROMPT_FIELD = re.compile(r"(?:prompts(\[\d+\])|prompt)(.*)", re.DOTALL)


_MESSAGE = re.compile(r"\[(\d+)\](.*)", re.DOTALL)
Messages = str | list[str]  # the field a chat's messages came in, or the field each message came from


def param_name(e: LlamapoolError, chat: bool = False, n_prompts: int = 1,
               messages: Messages = "messages") -> str | None:
    """The HTTP parameter a llamapool error field stands for: ``params.top_p`` -> ``top_p``;
    in a chat, the prompt is ``messages`` (``prompts[0][1].role`` -> ``messages[1].role``), or, where
    ``messages`` lists the field each message came from, that field (``input[3]``, ``instructions``);
    in a completion of several prompts, ``prompt[i]``."""
    if e.field is None or e.field.startswith("params."):
        return e.field[len("params."):] if e.field else None
    m = _PROMPT_FIELD.fullmatch(e.field)
    if m is None:
        return e.field
    if chat and isinstance(messages, list):
        one = _MESSAGE.fullmatch(m.group(2))
        if one is not None and int(one.group(1)) < len(messages):
            return messages[int(one.group(1))] + one.group(2)
        return "input"
    if chat:
        return str(messages) + m.group(2)
    index = m.group(1) or (f"[{e.index}]" if e.index is not None else "")
    return "prompt" + (index if n_prompts > 1 else "") + m.group(2)


def from_llamapool(e: LlamapoolError, chat: bool = False, n_prompts: int = 1,
                   messages: Messages = "messages") -> ApiError:
    """The HTTP error for a llamapool one; mid-stream, the message says how many tokens had been
    delivered (also the error's ``tokens_delivered`` field)."""
    status, kind = _STATUS.get(e.code, (500, "server_error"))
    param = param_name(e, chat, n_prompts, messages)
    headers = None
    if e.code in (ErrorCode.OVERLOADED, ErrorCode.RATE_LIMITED):  # the router says when (a rate limit's reset)
        headers = {"Retry-After": str((e.ratelimit or {}).get("retry_after", 1))}
    message = e.message
    if param and e.field and message.startswith(f"'{e.field}'"):  # the field as this API names it
        message = f"'{param}'" + message[len(e.field) + 2:]
    if e.tokens_delivered is not None and "delivered" not in message:
        message += f" ({e.tokens_delivered} tokens had been delivered)"
    err = ApiError(status, message, type_=kind, param=param, code=_CODE.get(e.code, e.code), headers=headers)
    err.tokens_delivered = e.tokens_delivered
    return err
