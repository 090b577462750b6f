"""The bodies and stream chunks of chat and completions: pure functions of the completions."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from llamapool import __version__
from llamapool.client.types import Completion
from llamapool.gateway.errors import ApiError
from llamapool.gateway.parsing import Generation
from llamapool.protocol.messages import TokenLogprob, TopLogprob

# OpenAI's system_fingerprint names the backend configuration that served a reply: here, llamapool's version
SYSTEM_FINGERPRINT = f"fp_llamapool_{__version__}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish(reason: str) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """Chat's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if entries is None:
        return None

    def one(e: TokenLogprob | TopLogprob) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": e.bytes}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob maps)
    and ``text_offset`` (each token's offset in the text, from ``offset``)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def tool_calls(c: Completion) -> list[dict[str, Any]]:
    return [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in c.tool_calls]


def totals(done: list[Completion], n: int) -> tuple[int, int, int]:
    """``usage``'s prompt, completion and cached tokens: a prompt counted once for its ``n`` choices."""
    firsts = done[::n]
    return (sum(c.usage.prompt_tokens for c in firsts), sum(c.usage.completion_tokens for c in done),
            sum(c.usage.cached_tokens for c in firsts))


def completion_body(req: Generation, model: str, done: list[Completion], pt: int, ct: int,
                    cached: int = 0) -> dict[str, Any]:
    choices = [{"text": c.text, "index": i, "logprobs": completion_logprobs(c.logprobs),
                "finish_reason": finish(c.finish_reason)} for i, c in enumerate(done)]
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, "usage": usage(pt, ct, cached)}


def chat_body(req: Generation, model: str, done: list[Completion], pt: int, ct: int,
              cached: int = 0) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(done):
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        if c.tool_calls:
            message["content"] = c.text or None
            message["tool_calls"] = tool_calls(c)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(c.logprobs),
                        "finish_reason": finish(c.finish_reason)})
    return {"id": f"chatcmpl-{req.id}", "object": "chat.completion", "created": req.created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, "usage": usage(pt, ct, cached)}


class ChunkWriter:
    """Server-sent events of one streamed request, each ``data: {...}\\n\\n``, built from templates so a
    token costs one ``json.dumps`` of its text."""

    def __init__(self, req: Generation, model: str, chat: bool):
        self.chat = chat
        self._offsets: dict[int, int] = {}  # a completion's text offset so far, per choice
        obj = "chat.completion.chunk" if chat else "text_completion"
        ident = f"chatcmpl-{req.id}" if chat else f"cmpl-{req.id}"
        self._head = (f'data: {{"id":"{ident}","object":"{obj}","created":{req.created},'
                      f'"model":{json.dumps(model)},"system_fingerprint":"{SYSTEM_FINGERPRINT}","choices":[')

    def first(self, index: int) -> bytes:
        """Chat streams open with the assistant role."""
        return (self._head + f'{{"index":{index},"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()

    def text(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.chat:
            lp = "null" if logprobs is None else json.dumps(chat_logprobs(logprobs))
            choice = (f'{{"index":{index},"delta":{{"content":{json.dumps(text)}}},"logprobs":{lp},'
                      '"finish_reason":null}')
        else:
            lp = "null"
            if logprobs is not None:
                lp = json.dumps(completion_logprobs(logprobs, self._offsets.get(index, 0)))
                self._offsets[index] = self._offsets.get(index, 0) + sum(len(e.token) for e in logprobs)
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


def generate_request(req: Generation, tokens: list[int], prefix: str, model: str) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` (what its ``/render`` endpoints answer): the prompt's token ids as a
    generation puts them in KV, with the request's sampling parameters (issue 53)."""
    p = dataclasses.asdict(req.params)
    sampling = {k: v for k, v in p.items() if v is not None and k not in ("tools", "tool_choice", "logit_bias")}
    return {"request_id": f"{prefix}-{req.id}", "token_ids": tokens, "sampling_params": sampling, "model": model,
            "stream": req.stream, "stream_options": {"include_usage": True} if req.include_usage else None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": None, "features": None, "token_offsets": None}
