"""``POST /v1/rerank`` (and ``/rerank``: Jina's and llama-server's shape) and ``POST /v2/rerank``
(Cohere's v2) for a reranker of the pool (``task = "rerank"``).

Both take ``model``, ``query``, ``documents`` (texts; Jina's ``{"text": ...}`` objects too), ``top_n``
and ``max_tokens_per_doc``; the results are the documents' ``index`` and ``relevance_score`` sorted by
score, highest first. Jina's adds each ``document`` (``return_documents``, true by default as Jina's)
and ``usage``; Cohere's is ``{"id", "results", "meta": {"api_version", "billed_units"}}`` and truncates a
document to 4,096 tokens unless ``max_tokens_per_doc`` says otherwise, as Cohere's does. The daemon's
worker scores the pairs of every request it holds in one decode (worker/embedder.py).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.gateway.errors import COHERE_PATH, bad, cohere_error, not_an_object, unsupported
from llamapool.gateway.serving import Call, Door, Serving, unless_gone

COHERE_MAX_TOKENS_PER_DOC = 4096  # Cohere's default max_tokens_per_doc
SEARCH_UNIT_DOCUMENTS = 100  # Cohere bills a search unit per query of up to 100 documents


@dataclass
class RerankRequest:
    query: str
    documents: list[Any]  # as given (a text or a {"text": ...} object), returned with return_documents
    texts: list[str]
    model: str | None
    top_n: int | None
    return_documents: bool
    max_tokens_per_doc: int


def _int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise bad(key, f"'{key}' must be an integer >= 1, got {v!r}")
    return v


def _texts(docs: Any) -> list[str]:
    if not isinstance(docs, list) or not docs:
        raise bad("documents", "'documents' must be a non-empty list of strings")
    out = []
    for i, d in enumerate(docs):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise bad(f"documents[{i}]", f"'documents[{i}]' must be a string (or an object with a \"text\" string)")
        out.append(text)
    return out


def parse(body: Any, cohere: bool) -> RerankRequest:
    """A rerank body of either API; a bad one is a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise not_an_object()
    query = body.get("query")
    if query is None:
        raise bad("query", "'query' is required")
    if not isinstance(query, str) or not query.strip():
        raise bad("query", "'query' must be a non-empty string")
    if "documents" not in body and "texts" in body:
        raise unsupported("texts", "'texts' (the TEI form llama-server also takes) is not supported: send the "
                                   "texts as 'documents'")
    if "documents" not in body:
        raise bad("documents", "'documents' is required")
    texts = _texts(body["documents"])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    ret = body.get("return_documents", not cohere)
    if not isinstance(ret, bool):
        raise bad("return_documents", "'return_documents' must be true or false")
    top_n = _int(body, "top_n")
    limit = _int(body, "max_tokens_per_doc") or (COHERE_MAX_TOKENS_PER_DOC if cohere else 0)
    return RerankRequest(query, body["documents"], texts, model, top_n, ret, limit)


def default_model(s: Serving) -> str | None:
    """The model of a request that names none: the pool's first reranker; a pool without one is a 400."""
    if not s.spec.models:
        return None
    name = s.spec.rerank_model()
    if name is None:
        known = ", ".join(m["name"] for m in s.spec.models)
        raise bad("model", f"the pool has no reranker (its models: {known}); rerank needs a model with "
                           f"task = \"rerank\" in its [[models]] table")
    return name


async def _ranked(s: Serving, call: Call, cohere: bool) -> tuple[RerankRequest, Any]:
    req = parse(await s.body(call), cohere)
    if req.model is None:
        req.model = default_model(s)
    ranked = await unless_gone(call.request, s.client.rerank(
        req.query, req.texts, top_n=req.top_n, max_tokens_per_doc=req.max_tokens_per_doc,
        timeout=s.spec.request_timeout, model=req.model))
    return req, ranked


def _document(doc: Any) -> Any:
    return doc if isinstance(doc, dict) else {"text": doc}


async def handle(s: Serving, call: Call) -> Response:
    """Jina's (and llama-server's) ``/v1/rerank``."""
    req, ranked = await _ranked(s, call, cohere=False)
    results = []
    for r in ranked:
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if req.return_documents:
            item["document"] = _document(req.documents[r.index])
        results.append(item)
    return JSONResponse({"model": ranked.model or req.model or s.spec.model, "object": "list", "results": results,
                         "usage": {"prompt_tokens": ranked.prompt_tokens, "total_tokens": ranked.prompt_tokens}})


async def handle_cohere(s: Serving, call: Call) -> Response:
    """Cohere's ``/v2/rerank``."""
    req, ranked = await _ranked(s, call, cohere=True)
    results = []
    for r in ranked:
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if req.return_documents:
            item["document"] = _document(req.documents[r.index])
        results.append(item)
    units = math.ceil(len(req.texts) / SEARCH_UNIT_DOCUMENTS)
    return JSONResponse({"id": str(uuid.uuid4()), "results": results,
                         "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": units},
                                  "tokens": {"input_tokens": ranked.prompt_tokens, "output_tokens": 0}}})


JINA = Door(handle)
COHERE = Door(handle_cohere, cohere_error)
ROUTES = [("/rerank", JINA), ("/reranking", JINA)]  # llama-server's paths, under /v1 and without it
PATH_COHERE = COHERE_PATH
