"""The one parameter contract: every generation parameter is declared here once.

A parameter is a field of :class:`SamplingParams` with its default and, in its metadata, the check
that reads a value as a caller gave it (over the wire, from the SDK's keywords or from an HTTP body)
into the value kept, and a one-line description. The SDK's keywords (``PARAM_NAMES``), the codec's
validation (:func:`parse`), the HTTP mapping (``gateway/openai/generation.py`` reads the same names with
the same checks) and docs/protocol.md's table all follow from these declarations.

A bad value raises :class:`ParamError` naming the parameter (``response_format.json_schema.schema``),
with the same message wherever it arrives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llamapool.protocol import limits

MAX_GRAMMAR_CHARS = 1 << 20  # a grammar, regex or serialised schema
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("none", "auto", "required")
# Each door's max_tokens when a request gives none (docs/http.md, docs/sdk.md), declared here alone:
DEFAULT_MAX_TOKENS = 128  # the SDK, the CLI and the wire protocol: SamplingParams' default
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's /v1/completions (OpenAI's default)
UNTIL_THE_END = 1 << 20  # OpenAI's chat completions and responses: until the end of turn (or of the context)
MESSAGES_MAX_TOKENS: int | None = None  # Anthropic's /v1/messages: none, max_tokens is required (as Anthropic has it)


class ParamError(ValueError):
    """A bad parameter value: ``field`` is the parameter's public name (with a path into it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


Check = Callable[[str, Any], Any]  # (name, value as given) -> value kept; raises ParamError


def number(name: str, v: Any) -> Any:
    why = limits.problem(name, v)
    if why is not None:
        raise ParamError(name, why)
    return v if limits.PARAMS[name].integer else float(v)


def boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ParamError(name, f"'{name}' must be true or false, got {limits.show(v)}")
    return v


def stop_strings(name: str, v: Any) -> tuple[str, ...]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)) or len(stops) > limits.MAX_STOP:
        raise ParamError(name, f"'{name}' must be a string or a list of at most {limits.MAX_STOP} strings")
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= limits.MAX_STOP_LEN:
            raise ParamError(name, f"'{name}' entries must be strings of 1 to {limits.MAX_STOP_LEN} characters")
    return tuple(stops)


def check_logit_bias(name: str, v: Any) -> dict[str, float]:
    """OpenAI's: token id -> bias from -100 to 100 added to the token's logit; the ids are integers or
    their decimal text (JSON has only string keys), kept as text (msgpack's map keys are text on the wire)."""
    if not isinstance(v, dict) or len(v) > limits.MAX_LOGIT_BIAS:
        raise ParamError(name, f"'{name}' must be a map of token ids to biases (at most {limits.MAX_LOGIT_BIAS} "
                               f"entries), got {limits.show(v)[:80]}")
    out: dict[str, float] = {}
    for k, b in v.items():
        tok = k if isinstance(k, int) and not isinstance(k, bool) else None
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10:
            tok = int(k)
        if tok is None or not 0 <= tok <= limits.MAX_TOKEN_ID:
            raise ParamError(name, f"'{name}' keys must be token ids (integers from 0, or their decimal text), "
                                   f"got {limits.show(k)[:80]}")
        lim = limits.PARAMS[name]
        if not limits.is_number(b, False) or not lim.ok(b):
            raise ParamError(name, f"'{name}' values must be numbers from {limits.show(lim.lo)} to "
                                   f"{limits.show(lim.hi)}, got {limits.show(b)[:80]} for token {tok}")
        out[str(tok)] = float(b)
    return out


def check_speculative(name: str, v: Any) -> bool | int:
    """``true`` (the model's setting), ``false`` (off), or the most draft tokens a step, 0 (off) to
    ``limits.MAX_DRAFT``."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and 0 <= v <= limits.MAX_DRAFT:
        return v
    raise ParamError(name, f"'{name}' must be true, false or the most draft tokens a step (an integer from 0 to "
                           f"{limits.MAX_DRAFT}), got {limits.show(v)[:80]}")


def check_lora(name: str, v: Any) -> tuple[dict[str, Any], ...]:
    """llama-server's ``[{"id": N, "scale": S}]``, or an adapter by ``name``: at most ``limits.MAX_LORA`` entries,
    ids from 0, scales finite and at most ``limits.MAX_LORA_SCALE`` either way (no scale: the adapter's
    configured one). :func:`resolve_lora` checks the ids and names against the model's adapters."""
    if not isinstance(v, (list, tuple)) or len(v) > limits.MAX_LORA:
        raise ParamError(name, f"'{name}' must be a list of at most {limits.MAX_LORA} adapters "
                               f"({{\"id\": N, \"scale\": S}} or {{\"name\": ..., \"scale\": S}})")
    out = []
    for i, e in enumerate(v):
        at = f"{name}[{i}]"
        if not isinstance(e, dict) or ("id" in e) == ("name" in e) or set(e) - {"id", "name", "scale"}:
            raise ParamError(at, f"'{at}' must be {{\"id\": N, \"scale\": S}} or {{\"name\": ..., \"scale\": S}} "
                                 f"(one of id and name), got {limits.show(e)[:80]}")
        kept: dict[str, Any] = {}
        if "id" in e:
            if not isinstance(e["id"], int) or isinstance(e["id"], bool) or not 0 <= e["id"] <= limits.MAX_TOKEN_ID:
                raise ParamError(f"{at}.id", f"'{at}.id' must be an adapter's index (an integer from 0), "
                                             f"got {limits.show(e['id'])[:80]}")
            kept["id"] = e["id"]
        else:
            if not isinstance(e["name"], str) or not 0 < len(e["name"]) <= 64:
                raise ParamError(f"{at}.name", f"'{at}.name' must be an adapter's name, "
                                               f"got {limits.show(e['name'])[:80]}")
            kept["name"] = e["name"]
        if e.get("scale") is not None:
            kept["scale"] = check_lora_scale(f"{at}.scale", e["scale"])
        out.append(kept)
    return tuple(out)


def check_lora_scale(name: str, s: Any) -> float:
    """A LoRA adapter's scale (a request's ``lora[i].scale``, a run-time load's ``scale``): a finite number, at
    most ``limits.MAX_LORA_SCALE`` either way."""
    if not limits.is_number(s, False) or not math.isfinite(s) or abs(s) > limits.MAX_LORA_SCALE:
        raise ParamError(name, f"'{name}' must be a number from -{limits.MAX_LORA_SCALE:g} to "
                               f"{limits.MAX_LORA_SCALE:g}, got {limits.show(s)[:80]}")
    return float(s)


def resolve_lora(lora: tuple[dict[str, Any], ...], names: list[str], scales: list[float]) -> dict[int, float]:
    """A request's checked ``lora`` entries against a model's adapters (``names``, their ``scales``; an id is a
    place in that list) as {place: scale}: a later entry for the same adapter overrides an earlier one, an entry
    without a scale takes the adapter's own. A :class:`ParamError` names the entry that is wrong. The router
    resolves a request's entries against its table, a worker against what it loaded: the one rule for both."""
    if lora and not names:
        raise ParamError("lora", "'lora': this model has no LoRA adapters (a model's [[models.lora]] tables "
                                 "declare them, `llamapool load NAME --lora PATH` loads one)")
    listed = ", ".join(f"{i}: {n!r}" for i, n in enumerate(names))
    chosen: dict[int, float] = {}
    for i, entry in enumerate(lora):
        if "id" in entry:
            idx = entry["id"]
            if not 0 <= idx < len(names):
                raise ParamError(f"lora[{i}].id", f"'lora[{i}].id' is {idx}; this model's adapters are "
                                                  f"0 to {len(names) - 1} ({listed})")
        else:
            if entry["name"] not in names:
                raise ParamError(f"lora[{i}].name", f"'lora[{i}].name': no adapter {entry['name']!r} in this "
                                                    f"model (its adapters: {listed})")
            idx = names.index(entry["name"])
        scale = entry.get("scale")
        chosen[idx] = scales[idx] if scale is None else float(scale)
    return chosen


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ParamError(name, f"'{name}' must be a non-empty string, got {limits.show(v)[:80]}")
    if len(v) > MAX_GRAMMAR_CHARS:
        raise ParamError(name, f"'{name}' has {len(v)} characters; the limit is {MAX_GRAMMAR_CHARS}")
    return v


def _object(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ParamError(name, f"'{name}' must be an object (a JSON schema), got {type(v).__name__}")
    _within(name, v)
    return v


def _within(name: str, v: Any) -> None:
    """A schema (or tool list) of at most ``MAX_GRAMMAR_CHARS`` characters as JSON: its grammar's size."""
    try:
        size = len(json.dumps(v, separators=(",", ":")))
    except (TypeError, ValueError) as e:
        raise ParamError(name, f"'{name}' is not JSON: {e}") from None
    if size > MAX_GRAMMAR_CHARS:
        raise ParamError(name, f"'{name}' has {size} characters as JSON; the limit is {MAX_GRAMMAR_CHARS}")


def check_response_format(name: str, v: Any) -> dict[str, Any]:
    """OpenAI's: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``."""
    if not isinstance(v, dict):
        raise ParamError(name, f"'{name}' must be an object with a 'type', got {type(v).__name__}")
    kind = v.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ParamError(f"{name}.type", f"'{name}.type' must be one of {', '.join(RESPONSE_FORMATS)}, "
                                         f"got {limits.show(kind)[:80]}")
    if kind != "json_schema":
        return {"type": kind}
    js = v.get("json_schema")
    at = f"{name}.json_schema"
    if not isinstance(js, dict):
        raise ParamError(at, f"'{at}' must be an object with 'name' and 'schema'")
    if "name" in js and (not isinstance(js["name"], str) or not TOOL_NAME.fullmatch(js["name"])):
        raise ParamError(f"{at}.name", f"'{at}.name' must be 1 to 64 letters, digits, '_', '-' or '.'")
    schema = js.get("schema", {"type": "object"})  # OpenAI's schema is optional: any JSON object
    _object(f"{at}.schema", schema)
    if "strict" in js and js["strict"] is not None:
        boolean(f"{at}.strict", js["strict"])
    return {"type": kind, "json_schema": {"name": js.get("name", "response"), "schema": schema,
                                          "strict": bool(js.get("strict"))}}


def check_tools(name: str, v: Any) -> list[dict[str, Any]]:
    """OpenAI's: ``[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]``."""
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise ParamError(name, f"'{name}' must be a list of at most {MAX_TOOLS} tools")
    out, seen = [], set()
    for i, t in enumerate(v):
        at = f"{name}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ParamError(f"{at}.type", f"'{at}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ParamError(f"{at}.function", f"'{at}.function' must be an object with a 'name'")
        fname = fn.get("name")
        if not isinstance(fname, str) or not TOOL_NAME.fullmatch(fname):
            raise ParamError(f"{at}.function.name", f"'{at}.function.name' must be 1 to 64 letters, digits, "
                                                     f"'_', '-' or '.', got {limits.show(fname)[:80]}")
        if fname in seen:
            raise ParamError(f"{at}.function.name", f"'{at}.function.name': {fname!r} is defined twice")
        seen.add(fname)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise ParamError(f"{at}.function.description", f"'{at}.function.description' must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _object(f"{at}.function.parameters", params)
        out.append({"type": "function", "function": {"name": fname, "description": desc, "parameters": params}})
    _within(name, out)
    return out


def check_tool_choice(name: str, v: Any) -> str | dict[str, Any]:
    """``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise ParamError(name, f"'{name}' must be one of {', '.join(TOOL_CHOICES)} or "
                                   f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {v[:80]!r}")
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    fname = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(fname, str):
        raise ParamError(name, f"'{name}' must be a string or {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": ...}}}}")
    return {"type": "function", "function": {"name": fname}}


def _meta(check: Check, doc: str) -> dict[str, Any]:
    return {"check": check, "doc": doc}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation parameters: the contract (each field's metadata holds its check and doc)."""

    max_tokens: int = field(default=DEFAULT_MAX_TOKENS, metadata=_meta(
        number, "tokens to generate at most (each door's default: docs/http.md, docs/sdk.md)"))
    temperature: float = field(default=0.8, metadata=_meta(number, "0 to 2; 0 is greedy"))
    top_k: int = field(default=40, metadata=_meta(number, "sample among the k likeliest tokens; 0: off"))
    top_p: float = field(default=0.95, metadata=_meta(
        number, "nucleus sampling: the fewest tokens with this much probability"))
    min_p: float = field(default=0.05, metadata=_meta(
        number, "drop tokens below min_p times the likeliest one's probability"))
    repeat_penalty: float = field(default=1.0, metadata=_meta(
        number, "llama.cpp's repetition penalty over the last 64 tokens; 1: off"))
    presence_penalty: float = field(default=0.0, metadata=_meta(
        number, "-2 to 2: subtracted from the logit of every token already generated (OpenAI's)"))
    frequency_penalty: float = field(default=0.0, metadata=_meta(
        number, "-2 to 2: subtracted from a token's logit once per time it was generated (OpenAI's)"))
    logit_bias: dict[str, float] | None = field(default=None, metadata=_meta(
        check_logit_bias, "token id -> -100 to 100, added to the token's logit (-100 bans it, 100 forces it)"))
    seed: int | None = field(default=None, metadata=_meta(number, "a seed for reproducible sampling (0 to 2^32-1)"))
    stop: tuple[str, ...] = field(default=(), metadata=_meta(
        stop_strings, "up to 16 strings that end the text (not included)"))
    ignore_eos: bool = field(default=False, metadata=_meta(boolean, "keep generating past the end-of-generation token"))
    response_format: dict[str, Any] | None = field(default=None, metadata=_meta(
        check_response_format, 'OpenAI\'s: {"type": "json_object"} or {"type": "json_schema", "json_schema": ...}'))
    json_schema: dict[str, Any] | None = field(default=None, metadata=_meta(
        _object, "a JSON schema the output follows (llama-server's field)"))
    grammar: str | None = field(default=None, metadata=_meta(
        _text, "a GBNF (llama.cpp's) or Lark (llguidance's) grammar the output follows"))
    regex: str | None = field(default=None, metadata=_meta(_text, "a regular expression the whole output matches"))
    tools: list[dict[str, Any]] | None = field(default=None, metadata=_meta(
        check_tools, "OpenAI's function tools (chat prompts only)"))
    tool_choice: str | dict[str, Any] | None = field(default=None, metadata=_meta(
        check_tool_choice, 'none | auto (the default with tools) | required | {"type": "function", ...}'))
    parallel_tool_calls: bool = field(default=True, metadata=_meta(boolean, "whether a reply may call several tools"))
    logprobs: bool = field(default=False, metadata=_meta(
        boolean, "each generated token's log-probability under the model (the raw distribution: docs/sdk.md)"))
    top_logprobs: int = field(default=0, metadata=_meta(
        number, "with logprobs: the likeliest tokens at each position and theirs, 0 to 20"))
    echo: bool = field(default=False, metadata=_meta(
        boolean, "the reply starts with the prompt's text (with logprobs, its tokens' too: the first has none)"))
    n: int = field(default=1, metadata=_meta(
        number, "choices per prompt: the prompt is computed once and its KV copied (seed + i each, if seeded)"))
    speculative: bool | int = field(default=True, metadata=_meta(
        check_speculative, "speculative decoding (drafts from the prompt and output, verified in the batch; "
                           "the text is the same): true (the model's setting), false, or the most draft "
                           "tokens a step (0 to 8)"))
    lora: tuple[dict[str, Any], ...] = field(default=(), metadata=_meta(
        check_lora, 'LoRA adapters of the model to apply, llama-server\'s [{"id": N, "scale": S}] (or "name"; '
                    'no scale: the configured one; docs/http.md#lora)'))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change the logits before the sampler picks (sampled on the host)."""
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output (a format, a grammar, or tool calls)."""
        rf = self.response_format
        return bool((rf and rf["type"] != "text") or self.json_schema is not None or self.grammar is not None
                    or self.regex is not None or (self.tools and self.tool_choice != "none"))


FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
PARAM_NAMES = tuple(FIELDS)
CONSTRAINTS = ("response_format", "json_schema", "grammar", "regex")


def check(name: str, value: Any) -> Any:
    """One parameter's value as kept; :class:`ParamError` names it."""
    return FIELDS[name].metadata["check"](name, value)


def parse(raw: dict[str, Any], *, known_names: str = "") -> SamplingParams:
    """Validate a map of parameters (absent or None: the default) into :class:`SamplingParams`."""
    kw: dict[str, Any] = {}
    for k, v in raw.items():
        f = FIELDS.get(k)
        if f is None:
            raise ParamError(k, f"'{k}' is not a generation parameter (known: {known_names or ', '.join(FIELDS)})")
        if v is None:
            if f.default is not None and k != "stop":
                raise ParamError(k, f"'{k}' must not be null")
            continue
        kw[k] = check(k, v)
    return build(kw)


def build(kw: dict[str, Any]) -> SamplingParams:
    """:class:`SamplingParams` from values each already read by :func:`check` (an HTTP door checks each
    under its own field's name), after the checks across parameters."""
    if "top_logprobs" in kw and kw.get("logprobs") is not True:  # given, even 0 (OpenAI's and vLLM's rule)
        raise ParamError("top_logprobs", "'top_logprobs' is only allowed when 'logprobs' is true")
    p = SamplingParams(**kw)
    consistent(p)
    return p


def consistent(p: SamplingParams) -> None:
    """Checks across parameters: one constraint at a time (tools go with a response format: a reply is a
    call or an answer in the format); a tool choice names a given tool."""
    given = [k for k in CONSTRAINTS if getattr(p, k) is not None
             and not (k == "response_format" and p.response_format == {"type": "text"})]
    if p.tools and p.tool_choice != "none" and not set(given) & {"response_format", "json_schema"}:
        given.append("tools")
    if len(given) > 1:
        raise ParamError(given[1], f"'{given[0]}' and '{given[1]}' both constrain the output; give one of them")
    if p.tool_choice is not None and not p.tools:
        raise ParamError("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
    if isinstance(p.tool_choice, dict):
        want = p.tool_choice["function"]["name"]
        names = [t["function"]["name"] for t in p.tools or ()]
        if want not in names:
            raise ParamError("tool_choice", f"'tool_choice' names the function {want!r}, which is not in 'tools' "
                                            f"(given: {', '.join(names)})")


def choice(p: SamplingParams, j: int) -> SamplingParams:
    """The parameters of choice ``j`` of ``n``: its own seed (``seed + j``) when one is given."""
    if j == 0 or p.seed is None:
        return p
    return dataclasses.replace(p, seed=(p.seed + j) & limits.MAX_SEED)


def to_wire(p: SamplingParams) -> dict[str, Any]:
    """The parameters that differ from their defaults, as the wire (and :func:`parse`) takes them."""
    out = {}
    for name, f in FIELDS.items():
        v = getattr(p, name)
        if v != f.default:
            out[name] = list(v) if isinstance(v, tuple) else v
    return out


def from_wire(raw: dict[str, Any]) -> SamplingParams:
    """The parameters of a ``run`` as :func:`to_wire` wrote them from parameters already checked (the
    router checked the request's): read back as they are, with no second check."""
    if "stop" in raw:
        raw = {**raw, "stop": tuple(raw["stop"])}
    if "lora" in raw:
        raw = {**raw, "lora": tuple(raw["lora"])}
    return SamplingParams(**raw)
