"""The one codec: typed messages <-> msgpack frames, with validation that names the bad field."""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from llamapool import keys
from llamapool.protocol import control, media, params
from llamapool.protocol.messages import (
    MODEL_ACTIONS,
    PROTOCOL_VERSION,
    Abort,
    AdapterDone,
    Cancel,
    ChatMessage,
    Chunk,
    Delta,
    Detokenize,
    DetokenizeReply,
    Done,
    Embed,
    Embedding,
    Error,
    ErrorCode,
    Failed,
    Generate,
    Heartbeat,
    Hello,
    KVPart,
    LoadAdapter,
    Message,
    MetricsReply,
    MetricsRequest,
    ModelAction,
    ModelActionReply,
    Prompt,
    Rerank,
    Result,
    Run,
    SamplingParams,
    Shutdown,
    StatusReply,
    StatusRequest,
    Step,
    Tokenize,
    TokenizeReply,
    TokenLogprob,
    TopLogprob,
    UnloadAdapter,
)

T = TypeVar("T")
MAX_ID_LEN = 128
MAX_PROMPTS = 256
MAX_INPUTS = 2048  # inputs of one embed request (OpenAI's limit)
MAX_TOKEN_ID = 2**31 - 1
MAX_ROLE_LEN = 64
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
# Frames the router takes in at all (ZMQ_MAXMSGSIZE; a larger one makes ZeroMQ drop the connection,
# so the sender would hear nothing): anything up to this gets a ``too_large`` error under its id.
TRANSPORT_MAX_FRAME = 64 * 1024 * 1024


class ProtocolError(Exception):
    """A message that cannot be accepted; becomes an :class:`Error` reply."""

    def __init__(self, code: str, message: str, field: str | None = None, id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.id = id

    def to_error(self) -> Error:
        return Error(id=self.id, code=self.code, message=self.message, field=self.field)


def _invalid(field: str, why: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, f"'{field}' {why}", field)


# ---------------------------------------------------------------- encoding


def _wire(value: Any) -> Any:
    if isinstance(value, SamplingParams):
        return params.to_wire(value)
    return value


def to_dict(msg: Message | control.Command | control.ChildReport) -> dict[str, Any]:
    d: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        d[f.name] = _wire(getattr(msg, f.name))
    if isinstance(msg, Generate):
        prompts = d.pop("prompts")
        if msg.batch:
            d["prompts"] = prompts
        else:
            d["prompt"] = prompts[0]
        del d["batch"]
    if isinstance(msg, Embed):
        d["input"] = d.pop("inputs")
    if isinstance(msg, Rerank) and not msg.max_tokens_per_doc:
        del d["max_tokens_per_doc"]
    if isinstance(msg, (Generate, Embed, Rerank, Tokenize, Detokenize, LoadAdapter)) and msg.model is None:
        del d["model"]
    if isinstance(msg, Tokenize):
        for key in ("render", "messages", "tools", "infill"):
            if not d[key]:
                del d[key]
    if isinstance(msg, Generate):
        for key in ("tenant", "priority"):
            if d[key] is None:
                del d[key]
    if isinstance(msg, Chunk) and msg.prompt_tokens is None:  # only a prompt's first chunk has them
        del d["prompt_tokens"], d["cached_tokens"]
    if isinstance(msg, (Chunk, Result, Error)) and msg.ratelimit is None:
        del d["ratelimit"]
    return d


def encode(msg: Message | control.Command | control.ChildReport) -> bytes:
    """Encode one message as one msgpack frame."""
    return msgpack.packb(to_dict(msg), use_bin_type=True)


def unencodable(value: Any, path: str) -> tuple[str, str] | None:
    """The first part of ``value`` that msgpack cannot carry, as ``(its path, why)``: an integer outside
    -2**63 .. 2**64-1, or text with a lone surrogate (JSON's ``"\\ud800"``); None when it all can."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if -(1 << 63) <= value < 1 << 64:
            return None
        shown = str(value) if value.bit_length() <= 256 else f"an integer of {value.bit_length()} bits"
        if path.startswith(("prompt", "input", "tokens")):
            return path, f"must be a token id, an integer from 0 to {MAX_TOKEN_ID}, got {shown}"
        return path, f"is out of range (integers are -2**63 to 2**64-1), got {shown}"
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as e:
            return path, (f"is not valid Unicode text: a lone surrogate U+{ord(value[e.start]):04X} at character "
                          f"{e.start} (a JSON \\u escape of half a surrogate pair?)")
        return None
    items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple))
             else ())
    for k, v in items:
        found = unencodable(k, path) if isinstance(value, dict) else None
        found = found or unencodable(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if found is not None:
            return found
    return None


def encode_generate(rid: str, prompts: list[Any], batch: bool, stream: bool, timeout: float | None,
                    params: dict[str, Any], model: str | None, tenant: str | None = None,
                    priority: str | None = None) -> bytes:
    """A client's ``generate`` request, with ``params`` as the caller gave them (the router checks them
    and names a bad one), so that a client sends exactly what it was asked to."""
    bias = params.get("logit_bias")
    if isinstance(bias, dict):  # token ids as text: msgpack map keys are text on the wire (as in JSON)
        params = {**params, "logit_bias": {str(k) if type(k) is int else k: b for k, b in bias.items()}}
    d: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": Generate.TYPE, "id": rid, "stream": stream,
                         "params": params}
    if batch:
        d["prompts"] = prompts
    else:
        d["prompt"] = prompts[0]
    if timeout is not None:
        d["timeout"] = timeout
    if model is not None:
        d["model"] = model
    if tenant is not None:
        d["tenant"] = tenant
    if priority is not None:
        d["priority"] = priority
    return msgpack.packb(d, use_bin_type=True)  # type: ignore[no-any-return]


REPORT_MARK = "\x1ellamapool-report "  # starts a child's report line on its output pipe (not a log line)


def report_line(report: control.ChildReport) -> str:
    """A child's report as one line of text (its msgpack frame in base64 after the mark)."""
    return REPORT_MARK + base64.b64encode(encode(report)).decode()


def read_report(raw: bytes) -> control.ChildReport | None:
    """The report in a line of a child's output, or None for an ordinary (log) line or a bad report."""
    at = raw.find(REPORT_MARK.encode())
    if at < 0:
        return None
    try:
        frame = base64.b64decode(raw[at + len(REPORT_MARK):].strip(), validate=True)
        report = decode([frame], REPORT_TYPES)
    except (ValueError, ProtocolError):
        return None
    return report if report.event in control.REPORT_EVENTS else None


# ---------------------------------------------------------------- field readers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _str(d: dict[str, Any], key: str, *, max_len: int = MAX_ID_LEN) -> str:
    if key not in d:
        raise _invalid(key, "is missing")
    v = d[key]
    if not isinstance(v, str):
        raise _invalid(key, f"must be a string, got {type(v).__name__}")
    if not v or len(v) > max_len:
        raise _invalid(key, f"must have 1 to {max_len} characters")
    return v


def _prompt(v: Any, field: str) -> Prompt:
    if isinstance(v, str):
        if not v:
            raise _invalid(field, "must not be empty")
        return v
    if isinstance(v, list):
        if not v:
            raise _invalid(field, "must not be empty")
        if isinstance(v[0], dict):  # a chat: the SDK's and the HTTP API's 'messages'
            return _messages(v, "messages" if field == "prompt" else field)
        if not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
            raise _invalid(field, "must be a list of non-negative integer token ids")
        return v
    raise _invalid(field, f"must be a string, a list of token ids or a list of chat messages, "
                          f"got {type(v).__name__}")


_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})


def _messages(v: list[Any], field: str) -> list[ChatMessage]:
    """A chat: maps with a ``role`` (1 to 64 characters) and a ``content`` string; an assistant message
    may carry ``tool_calls`` instead of content, a ``tool`` message its ``tool_call_id`` and ``name``."""
    out = []
    images = 0
    for i, m in enumerate(v):
        at = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise _invalid(at, f"must be a chat message (a map with 'role' and 'content'), got {type(m).__name__}")
        _check_keys(m, _MESSAGE_KEYS, f"{at}.")
        if not isinstance(m.get("role"), str):
            raise _invalid(f"{at}.role", "is missing" if "role" not in m else "must be a string")
        if not 0 < len(m["role"]) <= MAX_ROLE_LEN:
            raise _invalid(f"{at}.role", f"must have 1 to {MAX_ROLE_LEN} characters")
        msg: ChatMessage = {"role": m["role"], "content": m.get("content")}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
            msg["content"] = msg["content"] or ""
        if isinstance(msg["content"], list):
            msg["content"] = _parts(msg["content"], f"{at}.content")
            images += sum(p["type"] == "image" for p in msg["content"])
            if images > media.MAX_MEDIA:
                raise _invalid(f"{at}.content", f"the chat has more than {media.MAX_MEDIA} images; a request may "
                                                f"have at most {media.MAX_MEDIA}")
        elif not isinstance(msg["content"], str):
            raise _invalid(f"{at}.content", "is missing" if msg["content"] is None
                           else f"must be a string or a list of parts, got {type(msg['content']).__name__}")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str) or len(m[key]) > MAX_ID_LEN:
                    raise _invalid(f"{at}.{key}", f"must be a string of at most {MAX_ID_LEN} characters")
                msg[key] = m[key]
        out.append(msg)
    return out


def _parts(v: list[Any], at: str) -> list[dict[str, Any]]:
    """A content of parts: ``{"type": "text", "text": str}`` and ``{"type": "image", "data": bytes}`` (an
    image file's bytes, its header checked: protocol/media.py), in order."""
    if not v:
        raise _invalid(at, "must not be an empty list of parts")
    out: list[dict[str, Any]] = []
    for j, p in enumerate(v):
        pat = f"{at}[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "image":
            data = p.get("data")
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise _invalid(f"{pat}.data", "must be the image file's bytes (msgpack bin)")
            try:
                media.image_info(bytes(data))
            except media.MediaError as e:
                raise _invalid(f"{pat}.data", str(e)) from None
            out.append({"type": "image", "data": bytes(data)})
        else:
            raise _invalid(pat, "must be a part {'type': 'text', 'text': str} or {'type': 'image', 'data': bytes}")
    return out


def _tool_calls(v: Any, at: str) -> list[dict[str, Any]]:
    """An assistant's earlier tool calls: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
    (``arguments`` a JSON text, as OpenAI sends it, or an object)."""
    if not isinstance(v, list):
        raise _invalid(at, "must be a list of tool calls")
    calls = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _invalid(f"{at}[{j}].function", "must be an object with a 'name' and 'arguments'")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise _invalid(f"{at}[{j}].function.arguments", "must be a JSON text or an object")
        cid = c.get("id", "")
        calls.append({"id": cid if isinstance(cid, str) else "", "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return calls


def _check_keys(d: dict[str, Any], allowed: frozenset[str], prefix: str = "") -> None:
    for k in d:
        if k not in allowed:
            raise _invalid(f"{prefix}{k}", "is not a known field")


def parse_params(raw: Any) -> SamplingParams:
    """Validate a ``params`` map (the contract of protocol/params.py); a bad value names its parameter."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise _invalid("params", "must be a map")
    try:
        return params.parse(raw)
    except params.ParamError as e:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, e.message, e.field) from None


# ---------------------------------------------------------------- decoding


def _generate(d: dict[str, Any]) -> Generate:
    _check_keys(d, frozenset({"v", "type", "id", "prompt", "prompts", "params", "stream", "timeout", "model",
                              "tenant", "priority"}))
    rid = _str(d, "id")
    try:
        if "prompt" in d and "prompts" in d:
            raise _invalid("prompt", "and 'prompts' are both given; give exactly one")
        if "prompt" not in d and "prompts" not in d:
            raise _invalid("prompt", "is missing (give exactly one of 'prompt' or 'prompts')")
        batch = "prompts" in d
        if batch:
            raw = d["prompts"]
            if not isinstance(raw, list) or not 0 < len(raw) <= MAX_PROMPTS:
                raise _invalid("prompts", f"must be a list of 1 to {MAX_PROMPTS} prompts")
            prompts = [_prompt(p, f"prompts[{i}]") for i, p in enumerate(raw)]
        else:
            prompts = [_prompt(d["prompt"], "prompt")]
        stream = d.get("stream", False)
        if not isinstance(stream, bool):
            raise _invalid("stream", "must be a boolean")
        timeout = d.get("timeout")
        if timeout is not None and not (_is_num(timeout) and timeout > 0):
            raise _invalid("timeout", "must be a positive number of seconds")
        params = parse_params(d.get("params"))
        model = None if d.get("model") is None else _str(d, "model")
        tenant = d.get("tenant")
        if tenant is not None and not (isinstance(tenant, str) and keys.NAME.fullmatch(tenant)):
            raise _invalid("tenant", f"must be a tenant's name (1 to 64 of A-Z a-z 0-9 _ . : -), got {tenant!r:.80}")
        priority = d.get("priority")
        if priority is not None and priority not in keys.CLASSES:
            raise _invalid("priority", f"must be one of {', '.join(keys.CLASSES)}, got {priority!r:.80}")
    except ProtocolError as e:
        e.id = rid
        raise
    return Generate(rid, prompts, params, stream, None if timeout is None else float(timeout), batch, model,
                    tenant, priority)


def _timeout_model(d: dict[str, Any]) -> tuple[float | None, str | None]:
    """A request's optional ``timeout`` (seconds, > 0) and ``model``."""
    timeout = d.get("timeout")
    if timeout is not None and not (_is_num(timeout) and timeout > 0):
        raise _invalid("timeout", "must be a positive number of seconds")
    model = None if d.get("model") is None else _str(d, "model")
    return None if timeout is None else float(timeout), model


def _token_ids(v: Any, field: str, empty: bool = False) -> list[int]:
    if not isinstance(v, list) or not (v or empty) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise _invalid(field, "must be a " + ("" if empty else "non-empty ") + "list of non-negative integer token ids")
    return v


def _embed_inputs(v: Any) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, a list of token ids, or a list of strings and token-id lists."""
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        v = [v]
    elif isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not 0 < len(v) <= MAX_INPUTS:
        raise _invalid("input", f"must be a string, a list of token ids, or a list of 1 to {MAX_INPUTS} of them")
    out: list[str | list[int]] = []
    for i, x in enumerate(v):
        if isinstance(x, str):
            if not x:
                raise _invalid(f"input[{i}]", "must not be empty")
            out.append(x)
        else:
            out.append(_token_ids(x, f"input[{i}]"))
    return out


def _with_id(parse: Callable[[dict[str, Any], str], T]) -> Callable[[dict[str, Any]], T]:
    """A request parser whose errors carry the request's id."""
    def run(d: dict[str, Any]) -> T:
        rid = _str(d, "id")
        try:
            return parse(d, rid)
        except ProtocolError as e:
            e.id = rid
            raise

    return run


def _embed(d: dict[str, Any], rid: str) -> Embed:
    _check_keys(d, frozenset({"v", "type", "id", "input", "timeout", "model"}))
    if "input" not in d:
        raise _invalid("input", "is missing")
    inputs = _embed_inputs(d["input"])
    return Embed(rid, inputs, *_timeout_model(d))


def _rerank(d: dict[str, Any], rid: str) -> Rerank:
    _check_keys(d, frozenset({"v", "type", "id", "query", "documents", "max_tokens_per_doc", "timeout", "model"}))
    query = d.get("query")
    if not isinstance(query, str) or not query:
        raise _invalid("query", "must be a non-empty string")
    docs = d.get("documents")
    if not isinstance(docs, list) or not 0 < len(docs) <= MAX_INPUTS:
        raise _invalid("documents", f"must be a list of 1 to {MAX_INPUTS} strings")
    bad = next((i for i, x in enumerate(docs) if not isinstance(x, str)), None)
    if bad is not None:
        raise _invalid(f"documents[{bad}]", "must be a string")
    n = d.get("max_tokens_per_doc", 0)
    if not _is_int(n) or n < 0:
        raise _invalid("max_tokens_per_doc", "must be a positive integer (0 or absent: no limit)")
    return Rerank(rid, query, docs, n, *_timeout_model(d))


def _tokenize(d: dict[str, Any], rid: str) -> Tokenize:
    _check_keys(d, frozenset({"v", "type", "id", "content", "add_special", "parse_special", "with_pieces",
                              "timeout", "model", "render", "messages", "tools", "infill"}))
    if d.get("render") is not None and not isinstance(d["render"], bool):
        raise _invalid("render", "must be a boolean")
    messages = d.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not d.get("render"):
            raise _invalid("messages", "must be a non-empty list of chat messages (with render)")
        messages = _messages(messages, "messages")
    tools = None
    if d.get("tools") is not None:
        try:
            tools = params.check_tools("tools", d["tools"])
        except params.ParamError as e:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, e.message, e.field) from None
    infill = _infill(d["infill"]) if d.get("infill") is not None else None
    content = "" if (messages is not None or infill is not None) and "content" not in d else d.get("content")
    if not isinstance(content, str):
        raise _invalid("content", "is missing" if content is None
                       else f"must be a string, got {type(content).__name__}")
    flags = {}
    for key, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
        flag = d.get(key, default)
        if not isinstance(flag, bool):
            raise _invalid(key, "must be a boolean")
        flags[key] = flag
    timeout, model = _timeout_model(d)
    return Tokenize(rid, content, flags["add_special"], flags["parse_special"], flags["with_pieces"], timeout, model,
                    bool(d.get("render")), messages, tools, infill)


INFILL_KEYS = frozenset({"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict"})


def _mixed(v: Any, field: str) -> str | list[str | int]:
    """A text, or a list of texts and token ids (llama-server's mixed prompt)."""
    if isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(p, str) or (_is_int(p) and 0 <= p <= MAX_TOKEN_ID) for p in v)):
        return v
    raise _invalid(field, "must be a string, or a list of strings and non-negative token ids")


def _infill(v: Any) -> dict[str, Any]:
    """A tokenize's ``infill`` parts (worker/infill.py); a bad one names its field (``infill.input_extra``)."""
    if not isinstance(v, dict):
        raise _invalid("infill", "must be a map")
    _check_keys(v, INFILL_KEYS, "infill.")
    out: dict[str, Any] = {}
    for key in ("input_prefix", "input_suffix"):
        if key in v:
            out[key] = _mixed(v[key], f"infill.{key}")
    extra = v.get("input_extra")
    if (extra is not None and not isinstance(extra, list)) or not all(
            isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f) for f in extra or []):
        raise _invalid("infill.input_extra", "must be a list of [filename, text] pairs of strings")
    if extra is not None:
        out["input_extra"] = extra
    if not isinstance(v.get("prompt", ""), str):
        raise _invalid("infill.prompt", "must be a string")
    out["prompt"] = v.get("prompt", "")
    n = v.get("n_predict", -1)
    if not _is_int(n) or not -1 <= n <= MAX_TOKEN_ID:
        raise _invalid("infill.n_predict", "must be an integer from -1")
    out["n_predict"] = n
    return out


def _detokenize(d: dict[str, Any], rid: str) -> Detokenize:
    _check_keys(d, frozenset({"v", "type", "id", "tokens", "timeout", "model"}))
    if "tokens" not in d:
        raise _invalid("tokens", "is missing")
    return Detokenize(rid, _token_ids(d["tokens"], "tokens", empty=True), *_timeout_model(d))


def _model_action(d: dict[str, Any], rid: str) -> ModelAction:
    _check_keys(d, frozenset({"v", "type", "id", "action", "model"}))
    action, model = d.get("action"), d.get("model")
    if action not in MODEL_ACTIONS:
        raise _invalid("action", f"must be one of {', '.join(MODEL_ACTIONS)}, got {action!r}")
    if not isinstance(model, str) or not model:
        raise _invalid("model", f"must be a model's name, got {model!r}")
    return ModelAction(rid, action, model)


def _load_adapter(d: dict[str, Any], rid: str) -> LoadAdapter:
    """A client's run-time LoRA adapter load: the router checks the name's form, the model and the file."""
    _check_keys(d, frozenset({"v", "type", "id", "name", "path", "model", "scale"}))
    name, path = _str(d, "name", max_len=64), _str(d, "path", max_len=4096)
    try:
        scale = params.check_lora_scale("scale", d.get("scale", 1.0))
    except params.ParamError as e:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, e.message, e.field) from None
    return LoadAdapter(rid, name, path, _timeout_model({"model": d.get("model")})[1], scale)


def _plain(cls: type) -> Callable[[dict[str, Any]], Message]:
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]

    def parse(d: dict[str, Any]) -> Message:
        for k in required:
            if k not in d:
                raise _invalid(k, "is missing")
        return cls(**{k: d[k] for k in names if k in d})  # type: ignore[no-any-return]

    return parse


def _id_only(cls: type) -> Callable[[dict[str, Any]], Message]:
    def parse(d: dict[str, Any]) -> Message:
        _check_keys(d, frozenset({"v", "type", "id"}))
        return cls(_str(d, "id"))  # type: ignore[no-any-return]

    return parse


def _run(d: dict[str, Any]) -> Run:
    req, task, options = d.get("req", ""), d.get("task") or "", d.get("options")
    after = d.get("after", -1)
    # the router checked the parameters (parse_params): a worker reads them back, no second check
    return Run(d["rid"], d["prompt"], params.from_wire(d["params"]), d["stream"], req if isinstance(req, str) else "",
               task if isinstance(task, str) else "", options if isinstance(options, dict) else None,
               after if isinstance(after, int) else -1)


def token_logprobs(raw: list[Any] | None) -> list[TokenLogprob] | None:
    """Logprob entries off the wire (arrays) as :class:`TokenLogprob` records (made with ``tuple.__new__``:
    a fifth of the named tuples' own constructor's time, on every token of a request with logprobs)."""
    if raw is None:
        return None
    new = tuple.__new__
    return [new(TokenLogprob, (token, lp, raw_bytes, [new(TopLogprob, t) for t in top]))
            for token, lp, raw_bytes, top in raw]


def _with_logprobs(cls: type[Chunk] | type[Result]) -> Callable[[dict[str, Any]], Message]:
    """A reply carrying logprob entries: read as :class:`TokenLogprob` records."""
    parse = _plain(cls)

    def run(d: dict[str, Any]) -> Message:
        msg = parse(d)
        if getattr(msg, "logprobs", None) is not None:
            msg.logprobs = token_logprobs(msg.logprobs)  # type: ignore[union-attr]
        return msg

    return run


COMMAND_TYPES: dict[str, Callable[[dict[str, Any]], control.Command]] = {
    cls.TYPE: _plain(cls) for cls in control.COMMANDS  # type: ignore[attr-defined,misc]
}
REPORT_TYPES: dict[str, Callable[[dict[str, Any]], control.ChildReport]] = {
    control.ChildReport.TYPE: _plain(control.ChildReport),  # type: ignore[dict-item]
}
CLIENT_TYPES: dict[str, Callable[[dict[str, Any]], Message]] = {
    Generate.TYPE: _generate,
    Cancel.TYPE: _id_only(Cancel),
    StatusRequest.TYPE: _id_only(StatusRequest),
    MetricsRequest.TYPE: _id_only(MetricsRequest),
    Embed.TYPE: _with_id(_embed),
    Rerank.TYPE: _with_id(_rerank),
    Tokenize.TYPE: _with_id(_tokenize),
    Detokenize.TYPE: _with_id(_detokenize),
    ModelAction.TYPE: _with_id(_model_action),
    LoadAdapter.TYPE: _with_id(_load_adapter),
}
REPLY_TYPES: dict[str, Callable[[dict[str, Any]], Message]] = {
    c.TYPE: _plain(c) for c in (Error, StatusReply, MetricsReply, Embedding, TokenizeReply, DetokenizeReply,
                                ModelActionReply)
}
REPLY_TYPES.update({c.TYPE: _with_logprobs(c) for c in (Chunk, Result)})
WORKER_TYPES: dict[str, Callable[[dict[str, Any]], Message]] = {
    c.TYPE: _plain(c) for c in (Hello, Heartbeat, Shutdown, KVPart, AdapterDone)
}
# The router reads a step's logprob records as the arrays they travel as: it passes them on unread, and
# making them records again would cost it 3 us a token (the client's codec does: REPLY_TYPES)
WORKER_TYPES[Step.TYPE] = lambda d: Step(
    deltas=[Delta(*e) for e in d.get("deltas", ())], done=[Done(*e) for e in d.get("done", ())],
    failed=[Failed(*e) for e in d.get("failed", ())], active=d.get("active", 0))
ROUTER_TYPES: dict[str, Callable[[dict[str, Any]], Message]] = {
    Run.TYPE: _run,
    Abort.TYPE: _plain(Abort),
    Heartbeat.TYPE: _plain(Heartbeat),
    Shutdown.TYPE: _plain(Shutdown),
    KVPart.TYPE: _plain(KVPart),
    LoadAdapter.TYPE: _plain(LoadAdapter),  # the router checked it (a client's): sent on to the workers
    UnloadAdapter.TYPE: _plain(UnloadAdapter),
}


def peek_id(frame: bytes) -> str | None:
    """The ``id`` of an encoded request without decoding the rest (a too-large message still gets
    its error under its id): map keys are read, other values skipped."""
    try:
        up = msgpack.Unpacker(raw=False, max_buffer_size=len(frame) + 1)
        up.feed(frame)
        for _ in range(min(up.read_map_header(), 64)):
            key = up.unpack()
            if key == "id":
                value = up.unpack()
                return value if isinstance(value, str) and len(value) <= MAX_ID_LEN else None
            up.skip()
    except Exception:  # not a map, truncated, ...: no id to answer under
        return None
    return None


def decode(
    frames: list[bytes],
    types: dict[str, Callable[[dict[str, Any]], T]],
    max_frame: int = DEFAULT_MAX_FRAME,
) -> T:
    """Decode a message's frames with the parsers in ``types``; raise :class:`ProtocolError`."""
    if len(frames) != 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"expected 1 frame, got {len(frames)}")
    frame = frames[0]
    if len(frame) > max_frame:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"message is {len(frame)} bytes, the limit is {max_frame} "
            f"(server.max_message_bytes)", id=peek_id(frame)
        )
    try:
        d = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"frame is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"message must be a map, got {type(d).__name__}")
    mid = d.get("id") if isinstance(d.get("id"), str) else None
    v = d.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"field 'v' must be {PROTOCOL_VERSION}, got {v!r}", "v", mid,
        )
    t = d.get("type")
    parse = types.get(t) if isinstance(t, str) else None
    if parse is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"field 'type' must be one of {sorted(types)}, got {t!r}", "type", mid,
        )
    try:
        return parse(d)
    except ProtocolError as e:
        if e.id is None:
            e.id = mid
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"bad {t} message: {e}", None, mid) from None
