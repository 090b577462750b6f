"""Fill-in-the-middle: llama-server's ``POST /infill`` (``input_prefix``, ``input_suffix``, ``input_extra`` files,
``prompt``, its sampling fields and ``n_predict``; its ``/completion`` reply and event stream), and OpenAI's
``suffix`` on ``/v1/completions`` (the prompt is the prefix).

The worker lays the tokens out, as llama-server's ``format_prompt_infill`` does, with the FIM tokens of the
model's GGUF (worker/infill.py, one call to the router); the gateway then generates from those token ids as
any completion does. A model without FIM tokens is a 400 naming ``model`` (``suffix`` on /v1/completions).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.client.aio import AsyncStream
from llamapool.client.errors import LlamapoolError
from llamapool.client.types import Completion, StreamChunk
from llamapool.gateway.errors import bad, not_an_object, unsupported
from llamapool.gateway.openai import generation
from llamapool.gateway.parsing import Generation, model_name
from llamapool.gateway.serving import Call, Serving, closing, merge, sse
from llamapool.protocol import limits, params

FIELDS = ("input_prefix", "input_suffix", "input_extra", "prompt")  # what the worker lays out (the rest: sampling)
STOP_TYPES = {"length": "limit", "cancelled": "none"}  # llama-server's stop_type of a finish ("stop": eos or word)


def _mixed(body: dict[str, Any], key: str) -> str | list[str | int]:
    """A text, or llama-server's mixed list of texts and token ids (empty when absent)."""
    v = body.get(key, "")
    if isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= limits.MAX_TOKEN_ID)
            for p in v)):
        return v
    raise bad(key, f"'{key}' must be a string, or a list of strings and token ids, got {limits.show(v)}")


def extra_files(v: Any) -> list[tuple[str, str]]:
    """``input_extra``: the repo's other files, ``[{"filename": string, "text": string}]`` (filename default "tmp")."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad("input_extra", "'input_extra' must be a list of {\"filename\": string, \"text\": string}")
    out = []
    for i, f in enumerate(v):
        if not isinstance(f, dict):
            raise bad(f"input_extra[{i}]", f"'input_extra[{i}]' must be an object {{\"filename\", \"text\"}}")
        unknown = next((k for k in f if k not in ("filename", "text")), None)
        if unknown is not None:
            raise bad(f"input_extra[{i}].{unknown}", f"'input_extra[{i}].{unknown}' is not a field of a file "
                                                     f"(only 'filename' and 'text')")
        for key in ("filename", "text"):
            if (key == "text" or key in f) and not isinstance(f.get(key), str):
                raise bad(f"input_extra[{i}].{key}", f"'input_extra[{i}].{key}' must be a string")
        out.append((f.get("filename", "tmp"), f["text"]))
    return out


def parts(body: dict[str, Any]) -> dict[str, Any]:
    """The worker's parts of an ``/infill`` body (worker/infill.py), each field checked and named."""
    for key in ("input_prefix", "input_suffix"):  # llama-server requires both
        if key not in body:
            raise bad(key, f"'{key}' is required (the code before and after the cursor; it may be \"\")")
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise bad("prompt", f"'prompt' must be a string (text after the prefix), got {limits.show(prompt)}")
    return {"input_prefix": _mixed(body, "input_prefix"), "input_suffix": _mixed(body, "input_suffix"),
            "input_extra": extra_files(body.get("input_extra")), "prompt": prompt}


def sampling(body: dict[str, Any]) -> tuple[params.SamplingParams, bool]:
    """llama-server's sampling fields, ``n_predict`` (or ``max_tokens``; -1 or absent: to the end) and ``stream``."""
    n_predict = body.get("n_predict", body.get("max_tokens"))
    if n_predict is not None and (isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < -1):
        raise bad("n_predict", f"'n_predict' must be an integer, -1 for no limit, got {limits.show(n_predict)}")
    if body.get("n") not in (None, 1):
        raise unsupported("n", "'n' is not supported by /infill (one completion a request)")
    rest = {k: v for k, v in body.items() if k not in (*FIELDS, "n_predict", "max_tokens", "suffix")}
    if n_predict not in (None, -1):
        rest["max_tokens"] = n_predict
    sent, stream, _, _ = generation.common(rest, params.UNTIL_THE_END)
    return sent, stream


async def fim_tokens(s: Serving, model: str | None, infill: dict[str, Any], names: dict[str, str]) -> list[int]:
    """The prompt's tokens, laid out by the model's worker; its errors name the body's fields (``names``:
    the worker's field -> the body's, where they differ: ``model`` -> ``suffix`` on /v1/completions)."""
    try:
        return await s.client.infill(**infill, model=model, timeout=s.spec.request_timeout)
    except LlamapoolError as e:
        if e.field is not None and e.code != "unknown_model":
            ours = e.field[len("infill."):] if e.field.startswith("infill.") else e.field
            theirs = names.get(ours, ours)
            e.message = e.message.replace(f"'{e.field}'", f"'{theirs}'", 1)
            e.field = theirs
        raise


async def parse(s: Serving, body: Any) -> Generation:
    """An ``/infill`` body as a generation from the FIM prompt's token ids."""
    if not isinstance(body, dict):
        raise not_an_object()
    infill = parts(body)
    sent, stream = sampling(body)
    model = model_name(body)
    n_predict = sent.max_tokens if sent.max_tokens != params.UNTIL_THE_END else -1
    tokens = await fim_tokens(s, model, {**infill, "n_predict": n_predict}, {})
    return Generation([tokens], sent, stream, model=model)


def _final(model: str, c: Completion, prompt: str) -> dict[str, Any]:
    """llama-server's final ``/completion`` object (``stop``: true)."""
    reason = "word" if c.stop else STOP_TYPES.get(c.finish_reason, "eos")
    return {"index": 0, "content": c.text, "tokens": [], "id_slot": -1, "stop": True, "model": model,
            "tokens_predicted": c.usage.completion_tokens, "tokens_evaluated": c.usage.prompt_tokens,
            "prompt": prompt, "has_new_line": "\n" in c.text, "truncated": False, "stop_type": reason,
            "stopping_word": c.stop, "tokens_cached": c.usage.cached_tokens}


async def handle(s: Serving, call: Call) -> Response:
    """``POST /infill``: the whole reply, or llama-server's event stream (no ``[DONE]``)."""
    req = await s.generation(call, lambda body: parse(s, body))
    tokens = req.prompts[0]
    assert isinstance(tokens, list)
    if req.stream:
        streams, first = await s.open_streams(call, req)
        return sse(call, _events(s, call, req, streams, first))
    done = (await s.generate(call, req))[0]
    prompt = await s.client.detokenize(tokens, model=req.model, timeout=s.spec.request_timeout)  # type: ignore[arg-type]
    return JSONResponse(_final(s.model(req.model, done), done, prompt))


def _event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _events(s: Serving, call: Call, req: Generation, streams: list[AsyncStream],
                  first: list[Any]) -> AsyncIterator[bytes]:
    """``data: {"content", "stop": false, ...}`` a chunk, then the final object; an error event ends it."""
    evaluated = 0
    async with closing(streams):
        async for _, item in merge(streams, first):
            if isinstance(item, LlamapoolError):
                yield _event(call.api_error(item).body())
                return
            if isinstance(item, StreamChunk):
                evaluated = item.prompt_tokens if item.prompt_tokens is not None else evaluated
                if item.text:
                    yield _event({"index": 0, "content": item.text, "tokens": [], "stop": False, "id_slot": -1,
                                  "tokens_predicted": item.tokens, "tokens_evaluated": evaluated})
                continue
            try:
                prompt = await s.client.detokenize(req.prompts[0], model=req.model,  # type: ignore[arg-type]
                                                   timeout=s.spec.request_timeout)
            except LlamapoolError:
                prompt = ""
            yield _event(_final(s.model(req.model, item), item, prompt))


async def with_suffix(s: Serving, body: Any, parse_completions: Any) -> Generation:
    """A /v1/completions body: with a ``suffix``, each prompt becomes the FIM prompt of (prompt, suffix)."""
    suffix = body.get("suffix") if isinstance(body, dict) else None
    if suffix in (None, ""):
        return parse_completions(body)  # type: ignore[no-any-return]
    if not isinstance(suffix, str):
        raise bad("suffix", f"'suffix' must be a string, got {limits.show(suffix)}")
    req: Generation = parse_completions({k: v for k, v in body.items() if k != "suffix"})
    if req.params.echo:
        raise unsupported("echo", "'echo' cannot be used with 'suffix'")
    n_predict = req.params.max_tokens if req.params.max_tokens is not None else -1
    names = {"model": "suffix", "input_prefix": "prompt", "input_suffix": "suffix"}
    req.prompts = [await fim_tokens(s, req.model, {"input_prefix": p, "input_suffix": suffix, "n_predict": n_predict},
                                    names) for p in req.prompts]
    return req

