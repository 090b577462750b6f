"""``POST /tokenize`` and ``POST /detokenize`` as llama-server has them."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.gateway.errors import bad, not_an_object
from llamapool.gateway.serving import Call, Serving


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    return model


def parse_tokenize(body: Any) -> dict[str, Any]:
    """llama-server's ``/tokenize`` body: ``content``, ``add_special``, ``parse_special``, ``with_pieces``
    (and ``model``); a bad value names its field."""
    if not isinstance(body, dict):
        raise not_an_object()
    if not isinstance(body.get("content"), str):
        raise bad("content", "'content' must be a string")
    out: dict[str, Any] = {"text": body["content"], "model": _model(body)}
    for key in ("add_special", "parse_special", "with_pieces"):
        if key in body:
            if not isinstance(body[key], bool):
                raise bad(key, f"'{key}' must be a boolean")
            out[key] = body[key]
    return out


def parse_detokenize(body: Any) -> dict[str, Any]:
    """llama-server's ``/detokenize`` body: ``tokens`` (and ``model``)."""
    if not isinstance(body, dict):
        raise not_an_object()
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "'tokens' must be a list of token ids")
    return {"tokens": tokens, "model": _model(body)}


async def tokenize(s: Serving, call: Call) -> Response:
    """``{"tokens": [...]}``."""
    kw = parse_tokenize(await s.body(call))
    return JSONResponse({"tokens": await s.client.tokenize(kw.pop("text"), timeout=s.spec.request_timeout, **kw)})


async def detokenize(s: Serving, call: Call) -> Response:
    """``{"content": "..."}``."""
    kw = parse_detokenize(await s.body(call))
    return JSONResponse({"content": await s.client.detokenize(kw.pop("tokens"), timeout=s.spec.request_timeout,
                                                              **kw)})
