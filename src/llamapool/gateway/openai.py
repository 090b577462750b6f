"""OpenAI's API shapes: request bodies -> llamapool requests, results -> responses and stream chunks.

Pure functions, no I/O. A bad request raises :class:`ApiError` naming the parameter; parameters
OpenAI defines that llamapool cannot honour (``n`` > 1, ``logprobs``, ``tools``, ...) are refused,
never silently ignored; fields nobody defines are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llamapool.client.errors import LlamapoolError
from llamapool.client.types import Completion
from llamapool.protocol import limits, params
from llamapool.protocol.messages import ErrorCode, Prompt


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        self.tokens_delivered: int | None = None  # an error that ends a stream: tokens it had sent

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.tokens_delivered is not None:
            err["tokens_delivered"] = self.tokens_delivered
        return {"error": err}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# llamapool error codes -> (HTTP status, OpenAI error type)
_STATUS = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.MALFORMED: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.DUPLICATE_ID: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    "no_chat_template": (400, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    ErrorCode.TIMEOUT: (504, "timeout"),
    ErrorCode.WORKER_LOST: (502, "server_error"),
    ErrorCode.UNKNOWN_MODEL: (404, "invalid_request_error"),
}
# llamapool's code -> OpenAI's, where they differ
_CODE = {ErrorCode.UNKNOWN_MODEL: "model_not_found", ErrorCode.TOO_LARGE: "request_too_large"}


_PROMPT_FIELD = re.compile(r"(?:prompts(\[\d+\])|prompt)(.*)", re.DOTALL)


def param_name(e: LlamapoolError, chat: bool = False, n_prompts: int = 1) -> str | None:
    """The OpenAI parameter a llamapool error field stands for: ``params.top_p`` -> ``top_p``;
    in a chat, the prompt is ``messages`` (``prompts[0][1].role`` -> ``messages[1].role``); in a
    completion of several prompts, ``prompt[i]``."""
    if e.field is None or e.field.startswith("params."):
        return e.field[len("params."):] if e.field else None
    m = _PROMPT_FIELD.fullmatch(e.field)
    if m is None:
        return e.field
    if chat:
        return "messages" + m.group(2)
    index = m.group(1) or (f"[{e.index}]" if e.index is not None else "")
    return "prompt" + (index if n_prompts > 1 else "") + m.group(2)


def from_llamapool(e: LlamapoolError, chat: bool = False, n_prompts: int = 1) -> ApiError:
    """OpenAI's error for a llamapool one; mid-stream, the message says how many tokens had been
    delivered (also the error's ``tokens_delivered`` field)."""
    status, kind = _STATUS.get(e.code, (500, "server_error"))
    param = param_name(e, chat, n_prompts)
    headers = {"Retry-After": "1"} if e.code == ErrorCode.OVERLOADED else None
    message = e.message
    if e.tokens_delivered is not None and "delivered" not in message:
        message += f" ({e.tokens_delivered} tokens had been delivered)"
    err = ApiError(status, message, type_=kind, param=param, code=_CODE.get(e.code, e.code), headers=headers)
    err.tokens_delivered = e.tokens_delivered
    return err


@dataclass
class Request:
    """One OpenAI request as llamapool sees it."""

    prompts: list[Prompt]
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    model: str | None = None  # the model the body names; None: the pool's first
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


_UNSUPPORTED = {  # parameter -> the values that are fine (their defaults)
    "best_of": (None, 1), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}
# The contract's parameters that HTTP bodies carry under their own names (protocol/params.py checks
# them); max_tokens and seed have HTTP forms of their own (below).
_SAME_NAME = tuple(n for n in params.PARAM_NAMES if n not in ("max_tokens", "seed"))


def _param(body: dict[str, Any], key: str, name: str | None = None) -> Any:
    """``body[key]`` checked against the limit of the generation parameter ``name`` (default: ``key``),
    with the SDK's message (protocol/limits.py); None when absent."""
    v = body.get(key)
    if v is None:
        return None
    why = limits.problem(name or key, v)
    if why is not None:
        raise bad(key, why.replace(f"'{name or key}'", f"'{key}'", 1))
    return v


def _model(body: dict[str, Any]) -> str | None:
    """The model the body names (the router answers ``unknown_model``, a 404, when the pool lacks it)."""
    named = body.get("model")
    if named is not None and (not isinstance(named, str) or not 0 < len(named) <= 128):
        raise bad("model", f"'model' must be a model name (1 to 128 characters), got {named!r}")
    return named


def _completion_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """Completions' ``logprobs`` is a count (0 to 5) of alternatives: the contract's ``logprobs`` and
    ``top_logprobs``."""
    v = body.get("logprobs")
    if v is None:
        return body
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 5:
        raise bad("logprobs", f"'logprobs' must be an integer from 0 to 5, got {limits.show(v)}")
    return {**body, "logprobs": True, "top_logprobs": v}


def _common(body: Any, default_max_tokens: int, chat: bool) -> tuple[dict[str, Any], bool, bool]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not chat:
        body = _completion_logprobs(body)
    for key, fine in _UNSUPPORTED.items():
        if key in body and body[key] not in fine:
            raise ApiError(400, f"'{key}' is not supported by llamapool (got {body[key]!r})",
                           param=key, code="unsupported_parameter")
    max_tokens = _param(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = _param(body, "max_tokens")
    sent: dict[str, Any] = {"max_tokens": max_tokens or default_max_tokens}
    for key in _SAME_NAME:
        v = body.get(key)
        if v is None or (key == "stop" and v == []):
            continue
        try:
            params.check(key, v)
        except params.ParamError as e:
            raise bad(e.field, e.message) from None
        sent[key] = v
    seed = body.get("seed")
    if seed is not None:  # OpenAI's seed is any 64-bit integer: llama.cpp takes its low 32 bits
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
            raise bad("seed", f"'seed' must be a 64-bit integer, got {limits.show(seed)}")
        sent["seed"] = seed & 0xFFFFFFFF
    try:
        params.parse(sent)  # the checks across parameters (one constraint; a tool choice in tools)
    except params.ParamError as e:
        raise bad(e.field, e.message) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("stream", "'stream' must be true or false")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "'stream_options' must be an object")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool) and include_usage is not None:
            raise bad("stream_options.include_usage", "'stream_options.include_usage' must be true or false")
    return sent, bool(stream), bool(include_usage)


def parse_completion(body: Any) -> Request:
    """``POST /v1/completions``: a prompt as text, texts, token ids, or lists of token ids."""
    sent, stream, include_usage = _common(body, 16, chat=False)
    p = body.get("prompt")
    prompts: list[Prompt]
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        prompts = [list(x) for x in p]
    else:
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids, "
                            "or a list of lists of token ids (none of them empty)")
    if any(isinstance(x, list) and any(isinstance(t, int) and t < 0 for t in x) for x in prompts):
        raise bad("prompt", "token ids must be >= 0")
    return Request(prompts, sent, stream, include_usage, _model(body))


ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer" is sent as "system"
ROLES_TEXT = "system, developer, user, assistant, tool"


def _content(m: dict[str, Any], at: str, role: str) -> str:
    """A message's content: a string, or a list of text parts (joined); none (or null) only for an
    assistant message, as OpenAI has it."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" or (role == "tool" and "tool_call_id" in m):
            return ""
        raise bad(f"{at}.content", f"{at}.content is required in a {role} message "
                                   f"(a string or a list of text parts)")
    if not isinstance(content, list) or not content:
        raise bad(f"{at}.content", f"{at}.content must be a string or a non-empty list of text parts, "
                                   f"got {content!r:.80}")
    texts = []
    for j, part in enumerate(content):
        pat = f"{at}.content[{j}]"
        if not isinstance(part, dict):
            raise bad(pat, f"{pat} must be a content part, {{\"type\": \"text\", \"text\": ...}}")
        kind = part.get("type")
        if kind != "text":
            if isinstance(kind, str) and kind:
                raise ApiError(400, f"{pat}.type: content parts of type {kind!r:.80} are not supported by "
                                    f"llamapool (only 'text')", param=f"{pat}.type", code="unsupported_parameter")
            raise bad(f"{pat}.type", f"{pat}.type must be 'text', got {kind!r:.80}")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{pat}.text", f"{pat}.text must be a string, got {text!r:.80}")
        texts.append(text)
    return "".join(texts)


def parse_chat(body: Any) -> Request:
    """``POST /v1/chat/completions``: the messages go to the worker, which renders the model's template."""
    sent, stream, include_usage = _common(body, 1 << 20, chat=True)  # until end of turn or the context
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(at, f"{at} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "function":
            raise ApiError(400, f"{at}: 'function' messages (OpenAI's deprecated form) are not supported by "
                                f"llamapool: send 'tool' messages", param=f"{at}.role", code="unsupported_parameter")
        if role not in ROLES:
            raise bad(f"{at}.role", f"{at}.role must be one of {ROLES_TEXT}, got {role!r:.80}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m, at, role)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]  # checked by the codec, which names a bad field
        for key in ("tool_call_id", "name"):
            if role == "tool" and m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return Request([out], sent, stream, include_usage, _model(body))  # type: ignore[list-item]


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish(reason: str) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


def chat_logprobs(entries: list[Any] | None) -> dict[str, Any] | None:
    """Chat's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if entries is None:
        return None

    def one(e: list[Any]) -> dict[str, Any]:
        return {"token": e[0], "logprob": e[1], "bytes": e[2]}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e[3]]} for e in entries], "refusal": None}


def completion_logprobs(entries: list[Any] | None, offset: int = 0) -> dict[str, Any] | None:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob maps)
    and ``text_offset`` (each token's offset in the text, from ``offset``)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e[0])
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [None if e[1] is None else {t[0]: t[1] for t in e[3]} for e in entries],
            "text_offset": offsets}


def tool_calls(c: Completion) -> list[dict[str, Any]]:
    return [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in c.tool_calls]


def completion_body(req: Request, model: str, done: list[Completion], pt: int, ct: int,
                    cached: int = 0) -> dict[str, Any]:
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": model,
            "choices": [{"text": c.text, "index": i, "logprobs": completion_logprobs(c.logprobs),
                         "finish_reason": finish(c.finish_reason)} for i, c in enumerate(done)],
            "usage": usage(pt, ct, cached)}


def chat_body(req: Request, model: str, done: list[Completion], pt: int, ct: int, cached: int = 0) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(done):
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        if c.tool_calls:
            message["content"] = c.text or None
            message["tool_calls"] = tool_calls(c)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(c.logprobs),
                        "finish_reason": finish(c.finish_reason)})
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created, "model": model,
            "choices": choices, "usage": usage(pt, ct, cached)}


def totals(done: list[Completion], n: int) -> tuple[int, int, int]:
    """``usage``'s prompt, completion and cached tokens: a prompt counted once for its ``n`` choices."""
    firsts = done[::n]
    return (sum(c.usage.prompt_tokens for c in firsts), sum(c.usage.completion_tokens for c in done),
            sum(c.usage.cached_tokens for c in firsts))


class ChunkWriter:
    """Server-sent events of one streamed request, each ``data: {...}\\n\\n``, built from templates so a
    token costs one ``json.dumps`` of its text."""

    def __init__(self, req: Request, model: str, chat: bool):
        self.chat = chat
        self._offsets: dict[int, int] = {}  # a completion's text offset so far, per choice
        obj = "chat.completion.chunk" if chat else "text_completion"
        ident = f"chatcmpl-{req.id}" if chat else f"cmpl-{req.id}"
        self._head = (f'data: {{"id":"{ident}","object":"{obj}","created":{req.created},'
                      f'"model":{json.dumps(model)},"choices":[')

    def first(self, index: int) -> bytes:
        """Chat streams open with the assistant role."""
        return (self._head + f'{{"index":{index},"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()

    def text(self, index: int, text: str, logprobs: list[Any] | None = None) -> bytes:
        if self.chat:
            lp = "null" if logprobs is None else json.dumps(chat_logprobs(logprobs))
            choice = (f'{{"index":{index},"delta":{{"content":{json.dumps(text)}}},"logprobs":{lp},'
                      '"finish_reason":null}')
        else:
            lp = "null"
            if logprobs is not None:
                lp = json.dumps(completion_logprobs(logprobs, self._offsets.get(index, 0)))
                self._offsets[index] = self._offsets.get(index, 0) + sum(len(e[0]) for e in logprobs)
            choice = f'{{"text":{json.dumps(text)},"index":{index},"logprobs":{lp},"finish_reason":null}}'
        return (self._head + choice + "]}\n\n").encode()

    def tool_calls(self, index: int, c: Completion) -> bytes:
        """A reply's calls as OpenAI streams them: per call its id and name, then its arguments."""
        events = []
        for i, call in enumerate(tool_calls(c)):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            args = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
            for part in (head, args):
                delta = json.dumps({"tool_calls": [part]})
                events.append(self._head + f'{{"index":{index},"delta":{delta},"logprobs":null,'
                              f'"finish_reason":null}}]}}\n\n')
        return "".join(events).encode()

    def end(self, index: int, reason: str) -> bytes:
        r = json.dumps(finish(reason))
        if self.chat:
            choice = f'{{"index":{index},"delta":{{}},"logprobs":null,"finish_reason":{r}}}'
        else:
            choice = f'{{"text":"","index":{index},"logprobs":null,"finish_reason":{r}}}'
        return (self._head + choice + "]}\n\n").encode()

    def usage(self, pt: int, ct: int, cached: int = 0) -> bytes:
        return (self._head + f'],"usage":{json.dumps(usage(pt, ct, cached))}}}\n\n').encode()

    @staticmethod
    def error(e: ApiError) -> bytes:
        return f"data: {json.dumps(e.body())}\n\n".encode()

    DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------- embeddings, tokenize, detokenize


@dataclass
class EmbeddingsRequest:
    """``POST /v1/embeddings``: the inputs (the daemon checks each and names a bad one) and the format."""

    inputs: Any
    model: str | None
    base64: bool


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    """OpenAI's embeddings body: ``input`` (a string, token ids, or a list of them), ``model``,
    ``encoding_format`` ("float" or "base64"); ``dimensions`` is refused (a model's vectors have its own
    size); ``user`` and fields nobody defines are ignored."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if body.get("dimensions") is not None:
        raise ApiError(400, "'dimensions' is not supported: the vectors have the model's own size (no "
                            "shortening)", param="dimensions", code="unsupported_parameter")
    if "input" not in body:
        raise bad("input", "'input' is required")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be \"float\" or \"base64\", got {fmt!r}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    return EmbeddingsRequest(body["input"], model, fmt == "base64")


def embeddings_body(req: EmbeddingsRequest, model: str, vectors: list[list[float]], raw: list[bytes],
                    prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response: base64 is the float32 little-endian bytes, as OpenAI encodes them."""
    import base64

    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(raw[i]).decode() if req.base64 else vectors[i]}
            for i in range(len(raw))]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def parse_tokenize(body: Any) -> dict[str, Any]:
    """llama-server's ``/tokenize`` body: ``content``, ``add_special``, ``parse_special``, ``with_pieces``
    (and ``model``); a bad value names its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if not isinstance(body.get("content"), str):
        raise bad("content", "'content' must be a string")
    out: dict[str, Any] = {"text": body["content"], "model": _model_field(body)}
    for key in ("add_special", "parse_special", "with_pieces"):
        if key in body:
            if not isinstance(body[key], bool):
                raise bad(key, f"'{key}' must be a boolean")
            out[key] = body[key]
    return out


def parse_detokenize(body: Any) -> dict[str, Any]:
    """llama-server's ``/detokenize`` body: ``tokens`` (and ``model``)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "'tokens' must be a list of token ids")
    return {"tokens": tokens, "model": _model_field(body)}


def _model_field(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    return model
