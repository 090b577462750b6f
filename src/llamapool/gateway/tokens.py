"""``POST /tokenize`` and ``POST /detokenize`` as llama-server has them, and vLLM's bodies too:
``/tokenize`` takes llama-server's ``{"content"}`` or vLLM's ``{"prompt"}`` (then answering with vLLM's
``count``, ``max_model_len`` and ``token_strs`` as well), ``/detokenize`` answers with llama-server's
``content`` and vLLM's ``prompt``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.gateway.errors import bad, not_an_object, unsupported
from llamapool.gateway.serving import Call, Serving


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    return model


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise bad(key, f"'{key}' must be a boolean")
    return v


def parse_vllm_tokenize(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/tokenize`` body: ``prompt``, ``add_special_tokens`` (default true), ``return_token_strs``
    (and ``model``); its chat form (``messages``) is refused by name."""
    if "messages" in body:
        raise unsupported("messages", "'messages' (vLLM's chat form of /tokenize) is not supported by llamapool: "
                                      "send 'prompt' (or llama-server's 'content')")
    if not isinstance(body.get("prompt"), str):
        raise bad("prompt", "'prompt' must be a string")
    return {"text": body["prompt"], "model": _model(body), "add_special": _flag(body, "add_special_tokens", True),
            "with_pieces": _flag(body, "return_token_strs", False)}


def parse_tokenize(body: Any) -> dict[str, Any]:
    """llama-server's ``/tokenize`` body: ``content``, ``add_special``, ``parse_special``, ``with_pieces``
    (and ``model``); a bad value names its field."""
    if not isinstance(body, dict):
        raise not_an_object()
    if "content" not in body and ("prompt" in body or "messages" in body):
        return {**parse_vllm_tokenize(body), "vllm": True}
    if not isinstance(body.get("content"), str):
        raise bad("content", "'content' must be a string (or vLLM's 'prompt')")
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
    """``{"tokens": [...]}``; for vLLM's body, also ``count``, ``max_model_len`` and ``token_strs``."""
    kw = parse_tokenize(await s.body(call))
    vllm = kw.pop("vllm", False)
    tokens = await s.client.tokenize(kw.pop("text"), timeout=s.spec.request_timeout, **kw)
    if not vllm:
        return JSONResponse({"tokens": tokens})
    ids = [t["id"] for t in tokens] if kw.get("with_pieces") else tokens
    strs = [t["piece"] if isinstance(t["piece"], str) else bytes(t["piece"]).decode(errors="replace")
            for t in tokens] if kw.get("with_pieces") else None
    info = s.spec.model_info(kw.get("model"))
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": info["ctx_per_slot"] if info else None,
                         "token_strs": strs})


async def detokenize(s: Serving, call: Call) -> Response:
    """``{"content": "...", "prompt": "..."}`` (llama-server's key and vLLM's)."""
    kw = parse_detokenize(await s.body(call))
    text = await s.client.detokenize(kw.pop("tokens"), timeout=s.spec.request_timeout, **kw)
    return JSONResponse({"content": text, "prompt": text})
