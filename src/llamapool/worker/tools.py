"""Tool calls: how each chat-template family writes them, the grammar that enforces them, the parser.

A family is recognised from the chat template's source (as llama.cpp's ``common/chat.cpp`` does):

============  ==============================================================  ===================
family        a call as the model writes it                                   templates
============  ==============================================================  ===================
``hermes``    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``  Hermes, Qwen 2.5/3
``llama3``    ``{"name": ..., "parameters": {...}}``                            Llama 3.1-3.3
``mistral``   ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``          Mistral, Mixtral
``generic``   as ``hermes``, taught by a system message                        any other (Gemma 3)
============  ==============================================================  ===================

A template that takes no ``tools`` (the ``generic`` family) gets them as a system message that shows
the call format, and earlier calls and results are written into the turns as text. Mistral's
templates take only call ids of 9 letters and digits: any other id (OpenAI's ``call_...``) is given
to the template as 9 hex digits of its hash, the same in the call and in its result.

``tool_choice`` ``required`` and a named function constrain the whole reply to calls; ``auto`` leaves
prose free and constrains from the moment the model writes the call's opening (a lazy trigger), so
the arguments always parse and follow the function's ``parameters`` schema.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from llamapool.worker.schemas import COMPACT, bounded

FAMILIES = ("hermes", "llama3", "mistral", "generic")
NAME_OPEN = '{"name": "'


@dataclass(frozen=True)
class ToolFormat:
    """One family's call syntax: ``block_open`` + calls joined by ``sep`` + ``block_close``, each call
    ``call_open`` + ``{"name": NAME, "ARGS_KEY": {...}}`` + ``call_close``."""

    family: str
    call_open: str = "<tool_call>\n"
    call_close: str = "\n</tool_call>"
    sep: str = "\n"
    args_key: str = "arguments"
    block_open: str = ""
    block_close: str = ""
    native: bool = True  # the template renders ``tools`` itself
    special: dict[str, int] = field(default_factory=dict)  # marker text -> its control token in the vocab
    call_id_len: int = 0  # the template takes only call ids of this many letters and digits (Mistral: 9)

    @property
    def trigger(self) -> str:
        """The text that opens a reply's calls (``auto`` constrains from here on)."""
        return self.block_open + self.call_open + NAME_OPEN

    def grammar(self, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool,
                answer: dict[str, Any] | None = None) -> str:
        """An llguidance Lark grammar: calls of the given tools (only the named one for a named choice),
        after free text for ``auto``; with an ``answer`` schema (a ``response_format``), ``auto`` is a
        call or an answer that follows the schema, and no free text. Arguments follow their function's
        ``parameters`` bounded as :func:`~llamapool.worker.schemas.bounded` does, in compact JSON."""
        fns = [t["function"] for t in tools]
        if isinstance(choice, dict):
            fns = [f for f in fns if f["name"] == choice["function"]["name"]]
        close = self._lit("}" + self.call_close)
        rules = [f'fn_{i}: {self._lit(json.dumps(f["name"])[1:] + ", " + json.dumps(self.args_key) + ": ")} '
                 f'%json {json.dumps(compact(bounded(f.get("parameters") or {"type": "object"})))} {close}'
                 for i, f in enumerate(fns)]
        names = " | ".join(f"fn_{i}" for i in range(len(fns)))
        again = self._lit(self.sep + self.call_open + NAME_OPEN)
        more = f" ({again} call)*" if parallel else ""
        end = f" {self._lit(self.block_close)}" if self.block_close else ""
        head = ["%llguidance {}"]
        if choice == "auto" and answer is not None:
            head += [f"start: answer | {self._lit(self.trigger)} call{more}{end}",
                     f"answer: %json {json.dumps(compact(answer))}"]
        elif choice == "auto":
            head += ["start: TEXT | opening call" + more + end, "opening[lazy]: TEXT " + self._lit(self.trigger),
                     "TEXT: /(.|\\n)*/"]
        else:
            head += [f"start: {self._lit(self.trigger)} call{more}{end}"]
        return "\n".join([*head, f"call: {names}", *rules]) + "\n"

    def _lit(self, text: str) -> str:
        """Lark for literal text, a marker that is a control token written as that token."""
        for marker, tok in self.special.items():
            if marker in text:
                a, _, b = text.partition(marker)
                return " ".join(p for p in (self._lit(a) if a else "", f"<[{tok}]>", self._lit(b) if b else "") if p)
        return json.dumps(text)

    def parse(self, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        """``(content, calls)`` of a reply: each call ``{"id", "name", "arguments"}`` (arguments as JSON
        text), content the text before the first call. No call found: ``(text, [])``.

        Whatever JSON the model wrote is taken without raising: an object whose ``name`` is not one of
        the tools' (an object, a list, a number), arguments that are not an object, a truncated or
        too deeply nested value are not calls."""
        names = {t["function"]["name"] for t in tools}
        calls: list[dict[str, Any]] = []
        first = -1
        for at, obj in _json_objects(text):
            call = _as_call(obj, names)
            if call is not None:
                first = at if first < 0 else first
                calls.append(call)
        if not calls:
            return text, []
        content = text[:first]
        for marker in (self.block_open, self.call_open, "<tool_call>", "[TOOL_CALLS]", "["):
            marker = marker.strip()
            if marker and content.rstrip().endswith(marker):
                content = content.rstrip()[: -len(marker)]
        return content.strip(), calls

    # ------------------------------------------------------------ prompts for templates without tools

    def messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """Messages as this family's template takes them: for a template that renders tools itself,
        earlier calls' arguments as objects; for the generic family, tools as a system message and
        calls and results as text."""
        if self.native:
            return [_with_call_ids(_with_object_arguments(m), self.call_id_len) for m in messages]
        out: list[dict[str, Any]] = []
        if tools:
            out.append({"role": "system", "content": self._tool_prompt(tools)})
        for m in messages:
            if m["role"] == "tool":
                text = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
                if out and out[-1]["role"] == "user" and out[-1]["content"].endswith("</tool_response>"):
                    out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text})
            elif m.get("tool_calls"):
                calls = self.sep.join(self.call_open + json.dumps(
                    {"name": c["function"]["name"], self.args_key: _arguments(c["function"]["arguments"])})
                    + self.call_close for c in m["tool_calls"])
                out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
            elif m["role"] == "system" and out and out[0]["role"] == "system" and len(out) == 1:
                out[0] = {"role": "system", "content": m["content"] + "\n\n" + out[0]["content"]}
            else:
                out.append({"role": m["role"], "content": m.get("content") or ""})
        return out

    def _tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        return ("You can call these tools (functions):\n<tools>\n" + listing + "\n</tools>\n"
                "To call a tool, answer with a JSON object in <tool_call></tool_call> tags:\n"
                "<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<its arguments>}}\n</tool_call>")


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance's option for compact JSON (no runs of whitespace to wander in)."""
    return {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}


def _json_objects(text: str) -> Iterator[tuple[int, Any]]:
    """Each JSON value in ``text`` that starts with ``{`` and decodes, with where it starts; what does not
    decode (truncated, invalid, nested deeper than Python's recursion limit) is skipped."""
    decoder = json.JSONDecoder()
    at = text.find("{")
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            at = text.find("{", at + 1)
            continue
        yield at, obj
        at = text.find("{", end)


def _as_call(o: Any, names: set[str]) -> dict[str, Any] | None:
    """The call ``o`` is (``{"name": one of names, "arguments" or "parameters": {...}}``), else None."""
    if not isinstance(o, dict):
        return None
    name = o.get("name")
    args = o.get("arguments", o.get("parameters"))
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    try:
        arguments = json.dumps(args)
    except (ValueError, RecursionError):  # nested too deep to write again
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": arguments}


def _arguments(args: Any) -> Any:
    """Arguments as an object (OpenAI sends them as JSON text; templates index them); text that does not
    decode (invalid, or nested deeper than Python's recursion limit) is an empty object."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except (ValueError, RecursionError):
            return {}
    return args


def _with_object_arguments(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _call_id(cid: Any, n: int) -> Any:
    """A call id as a template that takes only ``n`` letters and digits wants it: one that fits is kept,
    any other becomes ``n`` hex digits of its hash (the same for a call and its result)."""
    if not n or (isinstance(cid, str) and len(cid) == n and cid.isascii() and cid.isalnum()):
        return cid
    return hashlib.sha256(str(cid).encode()).hexdigest()[:n]


def _with_call_ids(m: dict[str, Any], n: int) -> dict[str, Any]:
    """The message with its call ids (``tool_calls[].id``, ``tool_call_id``) as the template takes them."""
    if not n:
        return m
    if m.get("tool_calls"):
        m = {**m, "tool_calls": [{**c, "id": _call_id(c.get("id", ""), n)} for c in m["tool_calls"]]}
    if m["role"] == "tool" and "tool_call_id" in m:
        m = {**m, "tool_call_id": _call_id(m["tool_call_id"], n)}
    return m


def detect(source: str, special: Callable[[str], int | None]) -> ToolFormat:
    """The family of a chat template (its Jinja source); ``special(text)`` is the control token that
    ``text`` is in the model's vocabulary, if any."""
    def markers(*texts: str) -> dict[str, int]:
        return {t: tok for t in texts if (tok := special(t)) is not None}

    if "[TOOL_CALLS]" in source:
        return ToolFormat("mistral", call_open="", call_close="", sep=", ", block_open="[TOOL_CALLS][",
                          block_close="]", special=markers("[TOOL_CALLS]"), call_id_len=9)
    if "<tool_call>" in source:
        return ToolFormat("hermes", special=markers("<tool_call>", "</tool_call>"))
    if "<|python_tag|>" in source or ("tools" in source and "<|start_header_id|>" in source):
        return ToolFormat("llama3", call_open="", call_close="", sep="\n", args_key="parameters")
    return ToolFormat("generic", native="tools" in source and "tool_calls" in source)
