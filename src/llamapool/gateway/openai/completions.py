"""``POST /v1/completions``: a prompt as text, texts, token ids, or lists of token ids; with ``suffix``, each
prompt is the prefix of a fill-in-the-middle prompt (gateway/openai/infill.py)."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from llamapool.gateway.errors import bad
from llamapool.gateway.openai import generation, infill
from llamapool.gateway.parsing import Generation, model_name
from llamapool.gateway.serving import Call, Serving
from llamapool.protocol import limits, params
from llamapool.protocol.messages import Prompt


def _logprobs(body: Any) -> Any:
    """Completions' ``logprobs`` is a count (0 to 5) of alternatives: the contract's ``logprobs`` and
    ``top_logprobs``."""
    v = body.get("logprobs") if isinstance(body, dict) else None
    if v is None:
        return body
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 5:
        raise bad("logprobs", f"'logprobs' must be an integer from 0 to 5, got {limits.show(v)}")
    return {**body, "logprobs": True, "top_logprobs": v}


def parse(body: Any) -> Generation:
    body = _logprobs(body)
    sent, stream, include_usage, renames = generation.common(body, params.COMPLETIONS_MAX_TOKENS)
    p = body.get("prompt")
    prompts: list[Prompt]
    if isinstance(p, list) and p and set(map(type, p)) == {int}:  # token ids, the common case: checked in C
        if min(p) < 0:
            raise bad("prompt", "token ids must be >= 0")
        return Generation([list(p)], sent, stream, include_usage, model_name(body), renames=renames)
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
    return Generation(prompts, sent, stream, include_usage, model_name(body), renames=renames)


async def handle(s: Serving, call: Call) -> Response:
    return await generation.serve(s, call, await s.generation(call, lambda body: parse_fim(s, body)), chat=False)


async def parse_fim(s: Serving, body: Any) -> Generation:
    """``parse``, the prompts laid out with the model's FIM tokens around a ``suffix`` when there is one."""
    return await infill.with_suffix(s, body, parse)
