"""``POST /v1/chat/completions``: the messages go to the worker, which renders the model's template."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from llamapool.gateway.errors import bad, unsupported
from llamapool.gateway.media import Media
from llamapool.gateway.openai import generation
from llamapool.gateway.parsing import Generation, model_name
from llamapool.gateway.serving import Call, Serving
from llamapool.protocol import params

ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer" is sent as "system"
ROLES_TEXT = "system, developer, user, assistant, tool"


def text_parts(content: Any, at: str, images: Media | None = None) -> str | list[dict[str, Any]]:
    """A list of text parts, joined; with ``images`` (a user message's), ``image_url`` parts too: then the
    parts as the protocol has them (a text part, an image's bytes) when there is an image. A part of
    another type is refused by name."""
    texts, parts = [], []
    for j, part in enumerate(content):
        pat = f"{at}.content[{j}]"
        if not isinstance(part, dict):
            raise bad(pat, f"{pat} must be a content part, {{\"type\": \"text\", \"text\": ...}}")
        kind = part.get("type")
        if kind == "image_url" and images is not None:
            url = part.get("image_url")
            parts.append(images.from_url(url.get("url") if isinstance(url, dict) else url, f"{pat}.image_url"))
            continue
        if kind != "text":
            if isinstance(kind, str) and kind:
                only = "'text' and 'image_url'" if images is not None else "'text'"
                raise unsupported(f"{pat}.type", f"{pat}.type: content parts of type {kind!r:.80} are not "
                                                 f"supported by llamapool here (only {only})")
            raise bad(f"{pat}.type", f"{pat}.type must be 'text', got {kind!r:.80}")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{pat}.text", f"{pat}.text must be a string, got {text!r:.80}")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    if len(parts) > len(texts):
        return parts
    return "".join(texts)


def _content(m: dict[str, Any], at: str, role: str, images: Media) -> str | list[dict[str, Any]]:
    """A message's content: a string, or a list of text parts (joined), a user's with images (parts);
    none (or null) only for an assistant message, as OpenAI has it."""
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
    return text_parts(content, at, images if role == "user" else None)


def parse(body: Any) -> Generation:
    sent, stream, include_usage, renames = generation.common(body, params.UNTIL_THE_END)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    images = Media()
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(at, f"{at} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "function":
            raise unsupported(f"{at}.role", f"{at}: 'function' messages (OpenAI's deprecated form) are not "
                                            f"supported by llamapool: send 'tool' messages")
        if role not in ROLES:
            raise bad(f"{at}.role", f"{at}.role must be one of {ROLES_TEXT}, got {role!r:.80}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content(m, at, role, images)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]  # checked by the codec, which names a bad field
        for key in ("tool_call_id", "name"):
            if role == "tool" and m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return Generation([out], sent, stream, include_usage, model_name(body), renames=renames,  # type: ignore[list-item]
                      media=images if images.fields else None)


async def handle(s: Serving, call: Call) -> Response:
    return await generation.serve(s, call, await s.generation(call, parse), chat=True)
