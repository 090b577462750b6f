"""``POST /v1/responses``: OpenAI's Responses API.

The request becomes a chat: ``instructions`` the first (system) message, then the stored conversation
``previous_response_id`` ends (its chain's input and output items, oldest first: gateway/openai/stored.py;
the earlier responses' ``instructions`` are not carried over, as OpenAI documents), then ``input``, a
string (one user message) or items (messages, ``function_call`` items as the assistant's calls,
``function_call_output`` items as tool messages). A chained request is so the very chat of sending the
whole history at once: the same tokens, whose prefix the worker finds warm. Function ``tools``,
``tool_choice``, ``text.format`` (``json_schema``, ``json_object``), ``max_output_tokens``,
``temperature``, ``top_p`` become the contract's parameters. With ``store`` (default true) the response
and its input items are stored (gateway/openai/store.py); what needs state llamapool does not keep
(``conversation``, ``background``, a stored ``prompt``, an ``item_reference``) is a 400 naming the field.
The reply is a ``message`` item (its text) and a ``function_call`` item per call; streamed, the events
come in the order OpenAI documents.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.client.aio import AsyncStream
from llamapool.client.errors import LlamapoolError
from llamapool.client.types import Completion, StreamChunk
from llamapool.gateway.errors import ApiError, bad, not_an_object, unsupported
from llamapool.gateway.media import Media
from llamapool.gateway.openai import stored
from llamapool.gateway.openai.generation import cross_checked
from llamapool.gateway.openai.store import Stored
from llamapool.gateway.parsing import Generation, checked, limited, model_name, stream_flag
from llamapool.gateway.serving import Call, Serving, closing, merge, sse
from llamapool.protocol import limits
from llamapool.protocol.messages import TokenLogprob, TopLogprob
from llamapool.protocol.params import UNTIL_THE_END, SamplingParams

NO_STATE = ("llamapool keeps no conversations, stored prompts or background responses: chain turns with "
            "'previous_response_id', or send the whole conversation in 'input'")
# fields that need state llamapool does not keep: refused when given (anything but null/false)
STATEFUL = ("conversation", "background", "prompt")
CHAINED = "previous_response_id"  # the field the stored conversation's messages came from (errors name it)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass
class ResponsesRequest:
    """The chat request, and what the response echoes of the body."""

    gen: Generation
    fields: list[str]  # the body field each chat message came from (errors name it)
    echo: dict[str, Any] = field(default_factory=dict)
    store: bool = False  # the response is to be stored
    input: list[dict[str, Any]] = field(default_factory=list)  # its input items as stored


def _refuse_state(body: dict[str, Any]) -> None:
    for key in STATEFUL:
        if body.get(key) not in (None, False, ""):
            raise unsupported(key, f"'{key}' is not supported: {NO_STATE}")


def _text(content: Any, at: str, kinds: tuple[str, ...], images: Media | None = None) -> str | list[dict[str, Any]]:
    """A message's content: a string, or a list of text parts (joined); with ``images`` (a user message's),
    ``input_image`` parts too (then the protocol's parts). Another part is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(at, f"'{at}' must be a string or a list of content parts, got {limits.show(content)[:80]}")
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images is not None:
            if part.get("file_id") is not None and part.get("image_url") is None:
                raise unsupported(f"{at}[{j}].file_id", f"'{at}[{j}].file_id': llamapool has no files API; send "
                                                        f"the image as image_url (a data: URL)")
            parts.append(images.from_url(part.get("image_url"), f"{at}[{j}].image_url"))
            continue
        if kind not in kinds:
            if isinstance(kind, str) and kind:
                raise unsupported(f"{at}[{j}].type", f"'{at}[{j}].type': content parts of type {kind!r:.80} are "
                                                     f"not supported by llamapool here (only {', '.join(kinds)})")
            raise bad(f"{at}[{j}].type", f"'{at}[{j}].type' must be one of {', '.join(kinds)}")
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}[{j}].text", f"'{at}[{j}].text' must be a string")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    return parts if len(parts) > len(texts) else "".join(texts)


def _message(item: dict[str, Any], at: str, images: Media | None = None) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad(f"{at}.role", f"'{at}.role' must be one of user, system, developer, assistant, got {role!r:.80}")
    if "content" not in item:
        raise bad(f"{at}.content", f"'{at}.content' is required")
    kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    if role == "assistant" and isinstance(item["content"], list):  # a refusal's text is in 'refusal'
        item = {**item, "content": [{**p, "text": p.get("refusal", "")} if isinstance(p, dict) and
                                    p.get("type") == "refusal" else p for p in item["content"]]}
    text = _text(item["content"], f"{at}.content", kinds, images if role == "user" else None)
    return {"role": "system" if role == "developer" else role, "content": text}


def _call(item: dict[str, Any], at: str) -> dict[str, Any]:
    """A ``function_call`` item: one of the assistant's calls."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad(f"{at}.{key}", f"'{at}.{key}' must be a string")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def _output(item: dict[str, Any], at: str) -> dict[str, Any]:
    """A ``function_call_output`` item: a tool message."""
    if not isinstance(item.get("call_id"), str):
        raise bad(f"{at}.call_id", f"'{at}.call_id' must be the call_id of a function_call")
    out = item.get("output")
    text = _text(out, f"{at}.output", ("input_text", "output_text")) if out is not None else ""
    return {"role": "tool", "tool_call_id": item["call_id"], "content": text}


def _items(items: list[Any], messages: list[dict[str, Any]], fields: list[str], named: str = "",
           images: Media | None = None) -> None:
    """``input`` items as chat messages; consecutive ``function_call`` items are one assistant turn.
    ``named``: the field the items came from (a stored conversation's), else each is ``input[i]``."""
    for i, item in enumerate(items):
        at = named or f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(at, f"'{at}' must be an input item (a message, function_call or function_call_output)")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, at, images))
        elif kind == "function_call":
            call = _call(item, at)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and fields[-1].startswith(("input[", CHAINED)):
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_output(item, at))
        elif kind == "reasoning":
            continue  # another model's reasoning is not shown to this one
        elif kind == "item_reference":
            raise unsupported(f"{at}.type", f"'{at}': item references need stored items: {NO_STATE}")
        else:
            raise unsupported(f"{at}.type", f"'{at}.type': input items of type {kind!r:.80} are not supported "
                                            f"by llamapool (only message, function_call, function_call_output)")
        fields.append(at)


def _messages(body: dict[str, Any], history: list[dict[str, Any]],
              images: Media | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat: ``instructions``, the stored conversation's items (``history``), ``input``."""
    messages: list[dict[str, Any]] = []
    fields: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
        fields.append("instructions")
    _items(history, messages, fields, CHAINED, images)
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        fields.append("input")
    elif isinstance(given, list) and given:
        _items(given, messages, fields, images=images)
    else:
        raise bad("input", "'input' must be a string or a non-empty list of input items")
    if not messages or all(m["role"] == "system" for m in messages):
        raise bad("input", "'input' must hold at least one message or function call output")
    return messages, fields


def _tools(body: dict[str, Any], sent: dict[str, Any]) -> None:
    """Function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) and
    ``tool_choice`` as the contract's; hosted tools are refused by name."""
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools", "'tools' must be a list of tools")
        fns = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise unsupported(f"tools[{i}].type", f"'tools[{i}].type': tools of type {kind!r:.80} are not "
                                                      f"supported by llamapool (only function tools)")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            fns.append({"type": "function", "function": fn})
        try:
            sent["tools"] = checked("tools", fns)
        except ApiError as e:  # tools[0].function.name -> tools[0].name
            at = (e.param or "tools").replace(".function", "")
            raise bad(at, e.message.replace(e.param or "tools", at)) from None
    if body.get("parallel_tool_calls") is not None:
        sent["parallel_tool_calls"] = checked("parallel_tool_calls", body["parallel_tool_calls"])
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported("tool_choice", f"'tool_choice' of type {choice.get('type')!r:.80} is not supported "
                                             f"by llamapool (none, auto, required or a function)")
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "'tool_choice.name' must name one of 'tools'")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    sent["tool_choice"] = checked("tool_choice", choice)


def _format(body: dict[str, Any], sent: dict[str, Any]) -> None:
    """``text.format``: ``text`` (free), ``json_object``, or ``json_schema`` (``name``, ``schema``,
    ``strict``) as the contract's ``response_format``."""
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise bad("text", "'text' must be an object ({\"format\": {...}})")
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise bad("text.format", "'text.format' must be an object with a 'type'")
    kind = fmt.get("type")
    if kind == "json_schema":
        rf: dict[str, Any] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}}
        if "schema" not in fmt:
            raise bad("text.format.schema", "'text.format.schema' is required (a JSON schema)")
    else:
        rf = {"type": kind}
    try:
        sent["response_format"] = checked("response_format", rf)
    except ApiError as e:
        at = (e.param or "response_format").replace("response_format.json_schema", "text.format")
        at = at.replace("response_format", "text.format")
        raise bad(at, e.message.replace(e.param or "response_format", at)) from None


def _sampling(body: dict[str, Any]) -> SamplingParams:
    sent: dict[str, Any] = {"max_tokens": limited(body, "max_output_tokens", "max_tokens") or UNTIL_THE_END}
    for key in ("temperature", "top_p", "lora"):  # lora: llama-server's adapters field, as on chat
        if body.get(key) is not None:
            sent[key] = checked(key, body[key])
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad("include", "'include' must be a list")
    if LOGPROBS_INCLUDE in include or body.get("top_logprobs"):
        sent["logprobs"] = True
        if body.get("top_logprobs") is not None:
            sent["top_logprobs"] = checked("top_logprobs", body["top_logprobs"])
    _tools(body, sent)
    _format(body, sent)
    return cross_checked(sent)


def parse(body: Any, history: list[dict[str, Any]] | None = None, store: bool = False) -> ResponsesRequest:
    """The request; ``history``: the items of the stored conversation it continues; ``store``: whether
    it is to be stored (the body's ``store``, with a store to keep it in)."""
    if not isinstance(body, dict):
        raise not_an_object()
    _refuse_state(body)
    sent = _sampling(body)
    images = Media()
    messages, fields = _messages(body, history or [], images)
    gen = Generation([messages], sent, stream_flag(body), False, model_name(body),  # type: ignore[list-item]
                     renames={"response_format.json_schema": "text.format", "response_format": "text.format",
                              "max_tokens": "max_output_tokens"}, media=images if images.fields else None)
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "top_logprobs": body.get("top_logprobs"),
            "user": body.get("user"), "service_tier": "default", "truncation": "disabled",
            "store": store, "previous_response_id": stored.previous_id(body)}
    return ResponsesRequest(gen, fields, echo, store, stored.input_items(body["input"], f"resp_{gen.id}"))


# ---------------------------------------------------------------- the response


def usage(c: Completion) -> dict[str, Any]:
    """``input_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    u = c.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def logprobs(entries: list[TokenLogprob] | None, with_bytes: bool = True) -> list[dict[str, Any]]:
    """Per token ``{token, logprob, bytes, top_logprobs}`` (a stream's deltas carry theirs without bytes)."""
    def one(e: TokenLogprob | TopLogprob) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, **({"bytes": e.bytes} if with_bytes else {})}

    return [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries or ()]


def status(c: Completion) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


class Ids:
    """The ids of one response and its items."""

    def __init__(self, req: Generation):
        self.response, self.message = f"resp_{req.id}", f"msg_{req.id}"

    def call(self, i: int) -> str:
        return f"fc_{self.response[5:]}_{i}"


def text_part(text: str, lp: list[TokenLogprob] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs(lp)}


def message_item(ids: Ids, text: str, lp: list[TokenLogprob] | None, state: str) -> dict[str, Any]:
    content = [text_part(text, lp)] if state != "in_progress" else []
    return {"id": ids.message, "type": "message", "role": "assistant", "status": state, "content": content}


def call_items(ids: Ids, c: Completion, state: str = "completed") -> list[dict[str, Any]]:
    return [{"id": ids.call(i), "type": "function_call", "call_id": t.id, "name": t.name,
             "arguments": t.arguments if state == "completed" else "", "status": state}
            for i, t in enumerate(c.tool_calls)]


def output(ids: Ids, c: Completion, lp: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """The reply's items: its text as a message (unless it is only calls), then a function_call per call."""
    items = [message_item(ids, c.text, lp, status(c))] if c.text or not c.tool_calls else []
    return items + call_items(ids, c)


def response_body(req: ResponsesRequest, ids: Ids, model: str, c: Completion | None,
                  items: list[dict[str, Any]]) -> dict[str, Any]:
    """The response object; ``c`` None: still in progress."""
    state = "in_progress" if c is None else status(c)
    return {"id": ids.response, "object": "response", "created_at": req.gen.created,
            "completed_at": None if c is None else int(time.time()), "status": state, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if state == "incomplete" else None,
            "model": model, "output": items, "usage": None if c is None else usage(c),
            "background": False, "reasoning": None, **req.echo}


def event(kind: str, seq: int, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n".encode()


class EventWriter:
    """The events of one streamed response, in the order OpenAI documents: ``response.created``,
    ``response.in_progress``; the message item (``output_item.added``, ``content_part.added``,
    ``output_text.delta`` ..., ``output_text.done``, ``content_part.done``, ``output_item.done``),
    opened at the first text; per call ``output_item.added``, ``function_call_arguments.delta`` and
    ``.done``, ``output_item.done``; then ``response.completed`` (``response.incomplete`` when cut by
    ``max_output_tokens``)."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model, self.ids = req, model, Ids(req.gen)
        self.seq = 0
        self.text = ""
        self.lp: list[TokenLogprob] | None = [] if req.gen.params.logprobs else None
        self.open = False  # the message item is open
        self.index = 0  # the output index of the open or next item

    def _event(self, kind: str, **data: Any) -> bytes:
        out = event(kind, self.seq, data)
        self.seq += 1
        return out

    def start(self) -> bytes:
        body = response_body(self.req, self.ids, self.model, None, [])
        return self._event("response.created", response=body) + self._event("response.in_progress", response=body)

    def _open(self) -> bytes:
        """The message item and its text part, added."""
        self.open = True
        return (self._event("response.output_item.added", output_index=self.index,
                            item=message_item(self.ids, "", None, "in_progress"))
                + self._event("response.content_part.added", item_id=self.ids.message,
                              output_index=self.index, content_index=0, part=text_part("", None)))

    def delta(self, text: str, lp: list[TokenLogprob] | None) -> bytes:
        head = b"" if self.open else self._open()
        self.text += text
        if self.lp is not None and lp:
            self.lp.extend(lp)
        return head + self._event("response.output_text.delta", item_id=self.ids.message, output_index=self.index,
                                  content_index=0, delta=text, logprobs=logprobs(lp, with_bytes=False))

    def _close_message(self, c: Completion) -> bytes:
        at = {"item_id": self.ids.message, "output_index": self.index, "content_index": 0}
        part = text_part(self.text, self.lp)
        out = (self._event("response.output_text.done", **at, text=self.text,
                           logprobs=logprobs(self.lp, with_bytes=False))
               + self._event("response.content_part.done", **at, part=part)
               + self._event("response.output_item.done", output_index=self.index,
                             item=message_item(self.ids, self.text, self.lp, status(c))))
        self.open = False
        self.index += 1
        return out

    def end(self, c: Completion) -> tuple[bytes, dict[str, Any]]:
        """The message item closed (an empty one for a reply without text or calls) and the calls; and
        the response, which :meth:`finish` sends (once it is stored)."""
        out = []
        if not self.open and not c.tool_calls:
            out.append(self._open())
        if self.open:
            out.append(self._close_message(c))
        for added, done in zip(call_items(self.ids, c, "in_progress"), call_items(self.ids, c), strict=True):
            at = {"item_id": done["id"], "output_index": self.index}
            out += [self._event("response.output_item.added", output_index=self.index, item=added),
                    self._event("response.function_call_arguments.delta", **at, delta=done["arguments"]),
                    self._event("response.function_call_arguments.done", **at, name=done["name"],
                                arguments=done["arguments"]),
                    self._event("response.output_item.done", output_index=self.index, item=done)]
            self.index += 1
        items = output(self.ids, dataclasses.replace(c, text=self.text), self.lp)  # the text as streamed
        return b"".join(out), response_body(self.req, self.ids, self.model, c, items)

    def finish(self, c: Completion, body: dict[str, Any]) -> bytes:
        """``response.completed`` (``response.incomplete``) with the whole response."""
        kind = "response.completed" if status(c) == "completed" else "response.incomplete"
        return self._event(kind, response=body)

    def error(self, e: ApiError) -> bytes:
        """An error that ends the stream (OpenAI's ``error`` event)."""
        return self._event("error", code=e.code, message=e.message, param=e.param)


# ---------------------------------------------------------------- the handler


async def handle(s: Serving, call: Call) -> Response:
    """``POST /v1/responses``, answered whole or as the Responses event stream."""
    parsed: list[ResponsesRequest] = []

    async def parse_one(body: Any) -> Generation:
        history, keep = None, False
        if isinstance(body, dict):
            keep = stored.store_flag(body) and s.responses is not None
            rid = stored.previous_id(body)
            history = await stored.chain(s, call, rid) if rid is not None else None
        parsed.append(parse(body, history, keep))
        if history:  # the body is small, its conversation need not be
            s.check_encoded(parsed[0].gen)
        return parsed[0].gen

    gen = await s.generation(call, parse_one)
    req = parsed[0]
    call.chat, call.messages = True, req.fields
    if gen.stream:
        streams, first = await s.open_streams(call, gen)
        return sse(call, _events(s, call, req, streams[0], first))
    c = (await s.generate(call, gen))[0]
    ids = Ids(gen)
    body = response_body(req, ids, s.model(gen.model, c), c, output(ids, c, c.logprobs))
    await _keep(s, call, req, body)
    return JSONResponse(body)


async def _keep(s: Serving, call: Call, req: ResponsesRequest, body: dict[str, Any]) -> None:
    """Store the response (with ``store``); one the store could not keep says ``"store": false``."""
    if req.store and not await stored.keep(s, call, Stored(body["id"], body, req.input,
                                                           body["previous_response_id"])):
        body["store"] = False


async def _events(s: Serving, call: Call, req: ResponsesRequest, stream: AsyncStream,
                  first: list[Any]) -> AsyncIterator[bytes]:
    """The event stream; leaving it (the client went away) cancels the request. The response is stored
    before its last event, so a client that chains it at once finds it."""
    w = EventWriter(req, s.model(req.gen.model))
    async with closing([stream]):
        yield w.start()
        async for _, item in merge([stream], first):
            if isinstance(item, LlamapoolError):  # mid-stream: an error event ends the stream
                yield w.error(call.api_error(item))
                break
            if isinstance(item, StreamChunk):
                if item.text or item.logprobs:
                    yield w.delta(item.text, item.logprobs)
                continue
            events, body = w.end(item)
            yield events
            await _keep(s, call, req, body)
            yield w.finish(item, body)
