"""What chat and completions share: their sampling parameters, and their serving (one answer, or an
event stream of chunks) once each has parsed its prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.client.aio import AsyncStream
from llamapool.client.errors import LlamapoolError
from llamapool.client.types import StreamChunk
from llamapool.gateway.errors import ApiError, bad, unsupported
from llamapool.gateway.openai import shapes
from llamapool.gateway.parsing import Generation, limited, renamed, stream_flag
from llamapool.gateway.serving import Call, Serving, closing, merge, sse
from llamapool.protocol import limits, params

UNSUPPORTED = {  # parameter -> the values that are fine (their defaults)
    "best_of": (None, 1), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}
# The contract's parameters that HTTP bodies carry under their own names (protocol/params.py checks
# them); max_tokens and seed have HTTP forms of their own (below).
SAME_NAME = tuple(n for n in params.PARAM_NAMES if n not in ("max_tokens", "seed"))


def seed(body: dict[str, Any]) -> int | None:
    """OpenAI's seed is any 64-bit integer: llama.cpp takes its low 32 bits."""
    v = body.get("seed")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not -(1 << 63) <= v < 1 << 64:
        raise bad("seed", f"'seed' must be a 64-bit integer, got {limits.show(v)}")
    return v & 0xFFFFFFFF


def cross_checked(sent: dict[str, Any]) -> params.SamplingParams:
    """The typed parameters from values each already checked, after the checks across them (one
    constraint; a tool choice in tools): built once, here, and sent as they are."""
    try:
        return params.build(sent)
    except params.ParamError as e:
        raise bad(e.field, e.message) from None


def sampling(body: dict[str, Any], default_max_tokens: int) -> params.SamplingParams:
    """The contract's parameters from a chat or completions body."""
    for key, fine in UNSUPPORTED.items():
        if key in body and body[key] not in fine:
            raise unsupported(key, f"'{key}' is not supported by llamapool (got {body[key]!r})")
    max_tokens = limited(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = limited(body, "max_tokens")
    sent: dict[str, Any] = {"max_tokens": max_tokens or default_max_tokens}
    for key in SAME_NAME:
        v = body.get(key)
        if v is None or (key == "stop" and v == []):
            continue
        try:
            sent[key] = params.check(key, v)
        except params.ParamError as e:
            raise bad(e.field, e.message) from None
    s = seed(body)
    if s is not None:
        sent["seed"] = s
    return cross_checked(sent)


def include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    v = opts.get("include_usage", False)
    if not isinstance(v, bool) and v is not None:
        raise bad("stream_options.include_usage", "'stream_options.include_usage' must be true or false")
    return bool(v)


# llama-server's {"type": "json_object", "schema": {...}}: OpenAI's json_schema under another name
JSON_OBJECT_SCHEMA = {"response_format.json_schema.schema": "response_format.schema"}


def json_object_schema(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The body with llama-server's ``json_object`` + ``schema`` as the ``json_schema`` it means, and the
    renames that make errors name ``response_format.schema``."""
    rf = body.get("response_format")
    if not isinstance(rf, dict) or rf.get("type") != "json_object" or rf.get("schema") is None:
        return body, {}
    return {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "json_object", "schema": rf["schema"]}}}, JSON_OBJECT_SCHEMA


def common(body: Any, default_max_tokens: int) -> tuple[params.SamplingParams, bool, bool, dict[str, str]]:
    """A chat or completions body's parameters, ``stream``, ``stream_options.include_usage``, and the
    renames of parameters the body gave under other names."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body, renames = json_object_schema(body)
    try:
        sent = sampling(body, default_max_tokens)
    except ApiError as e:
        raise renamed(renames, e) from None
    return sent, stream_flag(body), include_usage(body), renames


async def serve(s: Serving, call: Call, req: Generation, chat: bool) -> Response:
    """A parsed chat or completions request, answered whole or streamed."""
    call.chat = chat
    if req.stream:
        streams, first = await s.open_streams(call, req)
        return sse(call, _events(s, call, req, chat, streams, first))
    done = await s.generate(call, req)
    pt, ct, cached = shapes.totals(done, req.params.n)
    model = s.model(req.model, done[0])
    body = (shapes.chat_body if chat else shapes.completion_body)(req, model, done, pt, ct, cached)
    return JSONResponse(body)


async def _events(s: Serving, call: Call, req: Generation, chat: bool, streams: list[AsyncStream],
                  first: list[Any]) -> AsyncIterator[bytes]:
    """The event stream; leaving it (the client went away) cancels every request still running."""
    w = shapes.ChunkWriter(req, s.model(req.model), chat)
    pt = ct = cached = 0
    async with closing(streams):
        n = req.params.n
        if chat:
            for j in range(n):
                yield w.first(j)
        async for index, item in merge(streams, first, n):
            if isinstance(item, LlamapoolError):  # mid-stream: an error event ends the stream
                yield w.error(call.api_error(item))
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
