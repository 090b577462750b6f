"""``POST /v1/embeddings`` for an embedding model of the pool (``embedding = true``)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.gateway.errors import bad, not_an_object, unsupported
from llamapool.gateway.serving import Call, Serving, unless_gone


@dataclass
class EmbeddingsRequest:
    """The inputs (the daemon checks each and names a bad one), the model and the format."""

    inputs: Any
    model: str | None
    base64: bool


def parse(body: Any) -> EmbeddingsRequest:
    """OpenAI's embeddings body: ``input`` (a string, token ids, or a list of them), ``model``,
    ``encoding_format`` ("float" or "base64"); ``dimensions`` is refused (a model's vectors have its own
    size); ``user`` and fields nobody defines are ignored."""
    if not isinstance(body, dict):
        raise not_an_object()
    if body.get("dimensions") is not None:
        raise unsupported("dimensions", "'dimensions' is not supported: the vectors have the model's own size "
                                        "(no shortening)")
    if "input" not in body:
        raise bad("input", "'input' is required")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"'encoding_format' must be \"float\" or \"base64\", got {fmt!r}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    return EmbeddingsRequest(body["input"], model, fmt == "base64")


def body(req: EmbeddingsRequest, model: str, vectors: list[list[float]], raw: list[bytes],
         prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response: base64 is the float32 little-endian bytes, as OpenAI encodes them."""
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(raw[i]).decode() if req.base64 else vectors[i]}
            for i in range(len(raw))]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def default_model(s: Serving) -> str | None:
    """The model of a request that names none: the pool's first embedding model (not its first model, a
    generation model in most pools); a pool without one is a 400 naming ``model``."""
    if not s.spec.models:  # a spec without the pool's models: the router's default
        return None
    name = s.spec.embedding_model()
    if name is None:
        known = ", ".join(m["name"] for m in s.spec.models)
        raise bad("model", f"the pool has no embedding model (its models: {known}); embeddings need a model "
                           f"with embedding = true in its [[models]] table")
    return name


async def handle(s: Serving, call: Call) -> Response:
    req = parse(await s.body(call))
    if req.model is None:
        req.model = default_model(s)
    try:
        vecs = await unless_gone(call.request, s.client.embed(req.inputs, timeout=s.spec.request_timeout,
                                                              model=req.model))
    except TypeError as e:  # inputs the SDK refuses
        raise bad("input", str(e)) from None
    return JSONResponse(body(req, vecs.model or req.model or s.spec.model, vecs, vecs.raw, vecs.prompt_tokens))
