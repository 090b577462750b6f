"""``POST /v1/completions/render`` (vLLM's): a completions request's prompts as the token ids a generation of each
would put in the KV cache (BOS as the model wants), one vLLM ``GenerateRequest`` a prompt, nothing generated.
llm-d's precise prefix-cache scorer tokenizes with it (docs/kubernetes.md)."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from llamapool.gateway.openai import completions, shapes
from llamapool.gateway.serving import Call, Serving


async def handle(s: Serving, call: Call) -> Response:
    req = await s.generation(call, lambda body: completions.parse_fim(s, body))  # as /v1/completions checks it
    model = req.model or s.spec.model
    out = []
    for prompt in req.prompts:
        tokens = list(prompt) if isinstance(prompt, list) else \
            await s.client.render(prompt, model=req.model, timeout=s.spec.request_timeout)  # type: ignore[arg-type]
        out.append(shapes.generate_request(req, tokens, "cmpl", model))  # type: ignore[arg-type]
    return JSONResponse(out)
