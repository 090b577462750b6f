"""Anthropic's Messages API (``POST /v1/messages``): request bodies -> llamapool requests, results ->
messages and stream events, and its handler. A bad request raises :class:`ApiError` naming the field,
and :func:`~llamapool.gateway.errors.anthropic_error` gives it Anthropic's shape.

The translation: ``system`` becomes the first (system) message; a user message's ``tool_result``
blocks become ``tool`` messages (in order, before the user's text), an assistant's ``tool_use`` blocks
its ``tool_calls``; Anthropic's tools (``name``, ``description``, ``input_schema``) become the contract's
function tools and ``tool_choice`` auto / any / tool / none becomes auto / required / the named function
/ none, so the worker's template, constraint and parser do the rest as for OpenAI's API.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.client.aio import AsyncStream
from llamapool.client.errors import LlamapoolError
from llamapool.client.types import Completion, StreamChunk
from llamapool.gateway.errors import ApiError, anthropic_body, anthropic_error, bad, not_an_object, unsupported
from llamapool.gateway.media import Media
from llamapool.gateway.parsing import Generation, checked, model_name, stream_flag
from llamapool.gateway.serving import Call, Door, Serving, closing, merge, sse
from llamapool.protocol import limits, params

# tool fields as the contract names them -> as Anthropic's request does
_TOOL_FIELDS = ((".function.parameters", ".input_schema"), (".function.description", ".description"),
                (".function.name", ".name"), (".function", ""), (".type", ""))
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _texts(content: Any, at: str, kinds: tuple[str, ...] = ("text",)) -> list[dict[str, Any]]:
    """A content string or list of blocks, as blocks; a block of another type is a 400 naming it."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(at, f"'{at}' must be a string or a list of content blocks, got {limits.show(content)[:80]}")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in kinds:
            raise unsupported(f"{at}[{j}].type", f"'{at}[{j}].type': content blocks of type {kind!r:.80} are "
                                                 f"not supported by llamapool here (only {', '.join(kinds)})")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad(f"{at}[{j}].text", f"'{at}[{j}].text' must be a string")
    return content


def _joined(blocks: list[dict[str, Any]]) -> str:
    return "".join(b["text"] for b in blocks if b.get("type") == "text")


def _image(block: dict[str, Any], at: str, images: Media) -> dict[str, Any]:
    """An ``image`` block as the protocol's image part: its ``source`` base64 or a URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        return images.from_base64(source.get("data"), f"{at}.source.data", source.get("media_type"))
    if kind == "url":
        assert isinstance(source, dict)
        return images.from_url(source.get("url"), f"{at}.source.url")
    raise bad(f"{at}.source", f"'{at}.source' must be {{'type': 'base64', 'media_type', 'data'}} or "
                              f"{{'type': 'url', 'url'}}, got {limits.show(source)[:80]}")


def _user(content: Any, at: str, calls: set[str], images: Media) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages, then its text (and images, as parts) as a user
    message. A result must answer one of ``calls``, the ids of the assistant turn's tool_use blocks just
    before it (Anthropic's API refuses any other ``tool_use_id``)."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for j, block in enumerate(_texts(content, at, ("text", "tool_result", "image", "document"))):
        if block["type"] == "text":
            texts.append(block)
            continue
        if block["type"] == "image":
            texts.append(_image(block, f"{at}[{j}]", images))
            continue
        if block["type"] != "tool_result":
            raise unsupported(f"{at}[{j}].type", f"'{at}[{j}].type': {block['type']} blocks are not supported "
                                                 f"by llamapool (text models only)")
        use_id = block.get("tool_use_id")
        if not isinstance(use_id, str) or not use_id:
            raise bad(f"{at}[{j}].tool_use_id", f"'{at}[{j}].tool_use_id' must be the id of a tool_use block")
        if use_id not in calls:
            raise bad(f"{at}[{j}].tool_use_id", f"'{at}[{j}].tool_use_id' is {use_id!r:.80}: no tool_use block of "
                                                "the assistant turn before it has that id")
        result = block.get("content", "")
        text = _joined(_texts(result, f"{at}[{j}].content")) if result else ""
        if block.get("is_error") is True:
            text = f"Error: {text}"
        out.append({"role": "tool", "tool_call_id": use_id, "content": text})
    if texts or not out:
        with_images = any(b["type"] == "image" for b in texts)
        out.append({"role": "user", "content": [{"type": "text", "text": b["text"]} if b["type"] == "text" else b
                                                for b in texts] if with_images else _joined(texts)})
    return out


def _assistant(content: Any, at: str) -> dict[str, Any]:
    """An assistant turn: its text, and its ``tool_use`` blocks as ``tool_calls``."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    blocks = _texts(content, at, ("text", "tool_use", "thinking", "redacted_thinking"))
    msg["content"] = _joined(blocks)
    calls = []
    for j, block in enumerate(blocks):
        if block["type"] != "tool_use":
            continue  # thinking blocks of another model are not shown to this one
        name, args = block.get("name"), block.get("input", {})
        if not isinstance(name, str) or not isinstance(args, dict):
            raise bad(f"{at}[{j}]", f"'{at}[{j}]' must be a tool_use block with a 'name' and an 'input' object")
        calls.append({"id": str(block.get("id", "")), "type": "function",
                      "function": {"name": name, "arguments": args}})
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict[str, Any], images: Media) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _joined(_texts(system, "system"))})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad(f"{at}.role", f"'{at}.role' must be 'user' or 'assistant', got {role!r:.80}")
        if "content" not in m:
            raise bad(f"{at}.content", f"'{at}.content' is required")
        if role == "user":
            before = out[-1] if out and out[-1]["role"] == "assistant" else {}
            out.extend(_user(m["content"], f"{at}.content", {c["id"] for c in before.get("tool_calls", ())},
                             images))
        else:
            out.append(_assistant(m["content"], f"{at}.content"))
    return out



def _tools(body: dict[str, Any], sent: dict[str, Any]) -> None:
    """``tools`` and ``tool_choice`` as the contract's (OpenAI-shaped) ones, into ``sent``."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "'tools' must be a list of tools")
        fns = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else None
                raise unsupported(f"tools[{i}].type", f"'tools[{i}]': tools of type {kind!r:.80} are not "
                                                      f"supported by llamapool (only client tools with 'name' "
                                                      f"and 'input_schema')")
            if "input_schema" not in t:  # Anthropic's API requires it (and refuses the request without it)
                raise bad(f"tools[{i}].input_schema", f"'tools[{i}].input_schema' is required: the JSON schema of "
                                                      "the tool's input")
            fn = {"name": t.get("name"), "description": t.get("description", ""), "parameters": t["input_schema"]}
            fns.append({"type": "function", "function": fn})
        try:
            sent["tools"] = params.check("tools", fns) if fns else None
        except params.ParamError as e:
            field = e.field
            for ours, theirs in _TOOL_FIELDS:
                field = field.replace(ours, theirs)
            raise bad(field, e.message.replace(e.field, field)) from None
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none") and not sent.get("tools"):
        return  # nothing to choose from: as without tools
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "'tool_choice.name' must name one of 'tools'")
        sent["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _CHOICES:
        sent["tool_choice"] = _CHOICES[kind]
    else:
        raise bad("tool_choice.type", f"'tool_choice.type' must be one of auto, any, tool, none, got {kind!r:.80}")
    if choice.get("disable_parallel_tool_use") is not None:
        sent["parallel_tool_calls"] = not checked("parallel_tool_calls", choice["disable_parallel_tool_use"],
                                                 "tool_choice.disable_parallel_tool_use")


# top-level fields: those honoured, and those accepted that mean nothing here (no debug line for them)
HONOURED = frozenset(("model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k", "stop_sequences",
                      "stream", "tools", "tool_choice", "output_config", "output_format", "thinking", "lora"))
ACCEPTED = frozenset(("metadata", "cache_control", "service_tier", "container", "inference_geo", "speed",
                      "diagnostics", "user_profile_id", "workspace_id", "context_management", "mcp_servers"))


def unknown_fields(body: Any) -> list[str]:
    """The body's top-level fields Anthropic's API did not define when this was written: ignored (the
    API's clients are forward-compatible), with a debug line."""
    return sorted(k for k in body if k not in HONOURED and k not in ACCEPTED) if isinstance(body, dict) else []


def _format(body: dict[str, Any], sent: dict[str, Any]) -> None:
    """``output_config.format`` (or the beta's top-level ``output_format``), ``{"type": "json_schema",
    "schema": {...}}``: constrained as OpenAI's ``response_format``; ``output_config.effort`` is ignored."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad("output_config", "'output_config' must be an object")
    where, fmt = "output_config.format", (config or {}).get("format")
    if fmt is None and body.get("output_format") is not None:
        where, fmt = "output_format", body["output_format"]
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise bad(f"{where}.type", f"'{where}.type' must be 'json_schema' (with a 'schema'), got {got!r:.80}")
    if "schema" not in fmt:
        raise bad(f"{where}.schema", f"'{where}.schema' is required (a JSON schema)")
    rf = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    try:
        sent["response_format"] = params.check("response_format", rf)
    except params.ParamError as e:
        at = e.field.replace("response_format.json_schema", where)
        raise bad(at, e.message.replace(e.field, at)) from None


def _thinking(body: dict[str, Any]) -> None:
    """Accepted (``enabled``, ``adaptive``, ``disabled``, ...): the reply has thinking blocks only where
    the model's template writes them, which none of llamapool's templates do."""
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str)):
        raise bad("thinking.type", "'thinking' must be an object with a 'type' (enabled, adaptive, disabled)")
    if body.get("mcp_servers"):
        raise unsupported("mcp_servers", "'mcp_servers' is not supported by llamapool (client tools only)")


def parse_messages(body: Any, count_only: bool = False) -> Generation:
    """``POST /v1/messages``: Anthropic's request as the chat request the worker takes (``count_only``:
    ``/v1/messages/count_tokens``'s body, without ``max_tokens``)."""
    if not isinstance(body, dict):
        raise not_an_object()
    max_tokens = body.get("max_tokens", params.MESSAGES_MAX_TOKENS)
    if max_tokens is None and not count_only:
        raise bad("max_tokens", "'max_tokens' is required")
    sent: dict[str, Any] = {"max_tokens": 1 if count_only else checked("max_tokens", max_tokens)}
    for key in ("temperature", "top_p", "top_k", "lora"):  # lora: llama-server's adapters field, as on chat
        if body.get(key) is not None and not count_only:
            sent[key] = checked(key, body[key])
    if body.get("stop_sequences") and not count_only:
        sent["stop"] = checked("stop", body["stop_sequences"], "stop_sequences")
    _thinking(body)
    _tools(body, sent)
    _format(body, sent)
    if count_only:  # the prompt renders the same without a constraint (the tools stay: they are in it)
        sent = {k: v for k, v in sent.items() if k not in ("response_format", "tool_choice", "parallel_tool_calls")}
        sent.update(temperature=0.0, **({"tool_choice": "none"} if sent.get("tools") else {}))
    sent = {k: v for k, v in sent.items() if v is not None}
    try:
        typed = params.build(sent)  # the checks across parameters (a tool choice names one of the tools)
    except params.ParamError as e:
        field = e.field.replace("parallel_tool_calls", "tool_choice").replace("response_format", "output_config")
        raise bad(field, e.message.replace("'response_format'", "'output_config'")) from None
    stream = stream_flag(body) and not count_only
    images = Media()
    messages = _messages(body, images)
    return Generation([messages], typed, stream, False, model_name(body),  # type: ignore[list-item]
                      renames={"response_format.json_schema": "output_config.format",
                               "response_format": "output_config"}, media=images if images.fields else None)


# ---------------------------------------------------------------- responses


def stop_reason(c: Completion) -> str:
    """``tool_use``, ``max_tokens``, ``stop_sequence`` (one of ``stop_sequences``) or ``end_turn``."""
    if c.tool_calls:
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop else "end_turn"


def usage(c: Completion) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the cache apart from the others."""
    cached = c.usage.cached_tokens
    return {"input_tokens": c.usage.prompt_tokens - cached, "output_tokens": c.usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content(c: Completion) -> list[dict[str, Any]]:
    """The reply's blocks: its text (when it has some, or nothing else), then its tool calls."""
    blocks: list[dict[str, Any]] = []
    text = c.text
    calls = []
    for t in c.tool_calls:
        args = _input(t.arguments)
        if args is None:  # not a JSON object: shown as text rather than lost
            text += t.arguments
        else:
            calls.append({"type": "tool_use", "id": t.id, "name": t.name, "input": args})
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    return blocks + calls


def message_body(req: Generation, model: str, c: Completion) -> dict[str, Any]:
    return {"id": f"msg_{req.id}", "type": "message", "role": "assistant", "model": model, "content": content(c),
            "stop_reason": stop_reason(c), "stop_sequence": c.stop or None, "usage": usage(c)}


def event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


class EventWriter:
    """The server-sent events of one streamed message: ``message_start``, a text block (opened at the
    first text), a ``tool_use`` block per call (its input as one ``input_json_delta``), ``message_delta``
    (stop reason and usage) and ``message_stop``."""

    def __init__(self, req: Generation, model: str):
        self.req, self.model = req, model
        self.index = 0  # the open or next block
        self.text_open = False

    def start(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        """``message_start``, its usage counting the prompt as the final one does."""
        usage = {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached_tokens}
        message: dict[str, Any] = {
            "id": f"msg_{self.req.id}", "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}
        return event("message_start", {"message": message}) + event("ping", {})

    def text(self, text: str) -> bytes:
        head = b""
        if not self.text_open:
            self.text_open = True
            head = event("content_block_start", {"index": self.index, "content_block": {"type": "text", "text": ""}})
        return head + event("content_block_delta", {"index": self.index,
                                                    "delta": {"type": "text_delta", "text": text}})

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        self.index += 1
        return event("content_block_stop", {"index": self.index - 1})

    def end(self, c: Completion) -> bytes:
        """The rest: the text block closed, the tool calls, the stop reason and usage."""
        blocks = content(c)
        out = []
        if blocks[0]["type"] == "text":  # a reply without text still has its (empty) text block
            rest = blocks[0]["text"][len(c.text) if self.text_open else 0:]  # arguments that were not JSON
            if rest or not self.text_open:
                out.append(self.text(rest))
        out.append(self._close_text())
        for b in blocks:
            if b["type"] != "tool_use":
                continue
            out.append(event("content_block_start", {"index": self.index, "content_block": {**b, "input": {}}}))
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(b["input"])}}))
            out.append(event("content_block_stop", {"index": self.index}))
            self.index += 1
        out.append(event("message_delta", {"delta": {"stop_reason": stop_reason(c), "stop_sequence": c.stop or None},
                                           "usage": usage(c)}))
        out.append(event("message_stop", {}))
        return b"".join(out)

    @staticmethod
    def error(e: ApiError) -> bytes:
        return event("error", {"error": anthropic_body(e)["error"]})


# ---------------------------------------------------------------- the handler


def _ignore_unknown(s: Serving, call: Call, body: Any) -> Any:
    unknown = unknown_fields(body)
    if unknown:
        s.log.debug("ignored fields", path=call.request.url.path, fields=",".join(unknown)[:200])
    return body


async def handle(s: Serving, call: Call) -> Response:
    """``POST /v1/messages``, answered whole or as Anthropic's event stream."""
    call.chat = True
    req = await s.generation(call, lambda body: parse_messages(_ignore_unknown(s, call, body)))
    if req.stream:
        streams, first = await s.open_streams(call, req)
        return sse(call, _events(s, call, req, streams[0], first))
    c = (await s.generate(call, req))[0]
    return JSONResponse(message_body(req, s.model(req.model, c), c))


async def count_tokens(s: Serving, call: Call) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt's tokens as the model's
    template renders it (with the tools and format): counted by computing the prompt (one step, the
    prompt then in the prefix cache for the request that follows)."""
    call.chat = True
    req = await s.generation(call, lambda body: parse_messages(_ignore_unknown(s, call, body), count_only=True))
    c = (await s.generate(call, req))[0]
    return JSONResponse({"input_tokens": c.usage.prompt_tokens})


def _prompt_usage(stream: AsyncStream, first: list[Any]) -> tuple[int, int]:
    """The prompt's tokens and cached tokens: from the first chunk, or the reply if there was none."""
    item = first[0]
    if isinstance(item, StreamChunk) and item.prompt_tokens is not None:
        return item.prompt_tokens, item.cached_tokens or 0
    if item is None and stream.completions:
        u = stream.completions[0].usage
        return u.prompt_tokens, u.cached_tokens
    return 0, 0


async def _events(s: Serving, call: Call, req: Generation, stream: AsyncStream,
                  first: list[Any]) -> AsyncIterator[bytes]:
    """Anthropic's event stream; leaving it (the client went away) cancels the request."""
    w = EventWriter(req, s.model(req.model))
    async with closing([stream]):
        yield w.start(*_prompt_usage(stream, first))
        async for _, item in merge([stream], first):
            if isinstance(item, LlamapoolError):  # mid-stream: an error event ends the stream
                yield w.error(call.api_error(item))
                break
            if isinstance(item, StreamChunk):
                if item.text:
                    yield w.text(item.text)
                continue
            yield w.end(item)


MESSAGES = Door(handle, anthropic_error)
COUNT_TOKENS = Door(count_tokens, anthropic_error)
