"""``POST /v1/chat/completions/render`` (vLLM's): a chat request's messages (and tools) as the token ids a
generation would put in the KV cache, the model's chat template and BOS included, as one vLLM
``GenerateRequest``; nothing generated. llm-d's precise prefix-cache scorer tokenizes with it
(docs/kubernetes.md)."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from llamapool.gateway.openai import chat, shapes
from llamapool.gateway.serving import Call, Serving


async def handle(s: Serving, call: Call) -> Response:
    req = await s.generation(call, chat.parse)  # checked as /v1/chat/completions checks it
    tokens = await s.client.render(req.prompts[0], tools=req.params.tools, model=req.model,  # type: ignore[arg-type]
                                   timeout=s.spec.request_timeout)
    return JSONResponse(shapes.generate_request(req, tokens, "chatcmpl", req.model or s.spec.model))
