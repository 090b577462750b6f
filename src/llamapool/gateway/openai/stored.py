"""Stored responses over HTTP: what ``POST /v1/responses`` keeps (``store``, default true) and reads back
(``previous_response_id``), and ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
``DELETE /v1/responses/{id}`` in OpenAI's shapes, over the daemon's store (gateway/openai/store.py).

A response is visible to the owner that made it alone (its API key, and the trusted header's tenant):
an unknown id and another owner's are the same 404 (400 ``previous_response_not_found`` for
``previous_response_id``, as OpenAI answers it), which says nothing of what is stored. A response the
store cannot keep (full, unwritable) is served all the same, with ``"store": false``: the failure is
logged and counted (``llamapool_responses_store_failures_total``, by the router: the gateway reports it
to its supervisor).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool import lifeline
from llamapool.gateway.errors import ApiError, bad, unsupported
from llamapool.gateway.openai.store import ResponseStore, Stored, StoreError
from llamapool.gateway.serving import Call, Serving

ID_LIMIT = 128  # characters of a response id
LOG_EVERY = 10.0  # seconds between two log lines of store failures (every failure is counted)
STORE_OFF = "the response store is off ([http] responses_store = false): send the whole conversation in 'input'"
ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def store_flag(body: dict[str, Any]) -> bool:
    """``store``: true unless the body says false."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad("store", "'store' must be true or false")
    return store is not False


def previous_id(body: dict[str, Any]) -> str | None:
    """``previous_response_id`` (None: not given)."""
    rid = body.get("previous_response_id")
    if rid is None or rid == "":
        return None
    if not isinstance(rid, str) or len(rid) > ID_LIMIT:
        raise bad("previous_response_id", f"'previous_response_id' must be the id of a stored response (a string of "
                                          f"at most {ID_LIMIT} characters), got {rid!r:.80}")
    return rid


def _unavailable(e: StoreError) -> ApiError:
    return ApiError(503, f"the response store is unavailable: {e.message}", type_="server_error",
                    code="store_unavailable")


def _store(s: Serving) -> ResponseStore:
    """The store; a 404 when there is none (``responses_store = false``: nothing was ever stored)."""
    if s.responses is None:
        raise ApiError(404, f"no response is stored: {STORE_OFF}", param="response_id", code="not_found")
    return s.responses


async def chain(s: Serving, call: Call, rid: str) -> list[dict[str, Any]]:
    """The items of the stored conversation ``rid`` ends (its chain's inputs and outputs, oldest first)."""
    if s.responses is None:
        raise unsupported("previous_response_id", f"'previous_response_id' needs a stored response: {STORE_OFF}")
    try:
        got = await s.responses.run(s.responses.chain, call.owner, rid)
    except StoreError as e:
        raise _unavailable(e) from None
    if got is None:
        raise ApiError(400, f"Previous response with id {rid!r:.90} not found.", param="previous_response_id",
                       code="previous_response_not_found")
    if got.missing is not None:
        raise ApiError(400, f"Previous response with id {rid!r:.90} continues {got.missing!r}, which is no longer "
                            f"stored (expired or evicted: http.responses_ttl, http.responses_max_mb): its "
                            f"conversation cannot be rebuilt", param="previous_response_id",
                       code="previous_response_not_found")
    return got.items


def input_items(given: Any, rid: str) -> list[dict[str, Any]]:
    """The request's ``input`` as stored items, each with an id (``msg_…``, ``fc_…``; its own when it
    had one) and a message's content as parts, as ``GET /v1/responses/{id}/input_items`` lists them."""
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given)
    out = []
    for i, given_item in enumerate(items):
        item: dict[str, Any] = {"type": "message", **given_item}
        kind = item["type"]
        if kind == "message" and isinstance(item.get("content"), str):
            part = {"type": "output_text", "text": item["content"], "annotations": []} \
                if item.get("role") == "assistant" else {"type": "input_text", "text": item["content"]}
            item["content"] = [part]
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = f"{ITEM_PREFIX.get(kind, 'item')}_{rid[5:]}_{i}"
        item.setdefault("status", "completed")
        out.append(item)
    return out


async def keep(s: Serving, call: Call, row: Stored) -> bool:
    """Store ``row``; False when the store could not (logged and counted, never an error)."""
    if s.responses is None:
        return False
    try:
        await s.responses.run(s.responses.put, call.owner, row)
        return True
    except StoreError as e:
        lifeline.report("store_failed", detail=e.reason)  # the supervisor has the router count it
        store = s.responses
        store.failures += 1
        now = time.monotonic()
        if now - store.logged_at >= LOG_EVERY:
            more = f" ({store.failures - 1} more since the last report)" if store.failures > 1 else ""
            s.log.warning(f"response {row.id} served but not stored ({e.reason}): {e.message}{more}")
            store.logged_at, store.failures = now, 0
        return False


def _rid(call: Call) -> str:
    return str(call.request.path_params["response_id"])


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id {rid!r:.90} not found.", param="response_id", code="not_found")


async def _get(s: Serving, call: Call) -> Stored:
    store, rid = _store(s), _rid(call)
    try:
        got = await store.run(store.get, call.owner, rid)
    except StoreError as e:
        raise _unavailable(e) from None
    if got is None:
        raise _not_found(rid)
    return got


async def handle_one(s: Serving, call: Call) -> Response:
    """``GET`` or ``DELETE /v1/responses/{id}``."""
    return await (handle_delete(s, call) if call.request.method == "DELETE" else handle_get(s, call))


async def handle_get(s: Serving, call: Call) -> Response:
    """``GET /v1/responses/{id}``: the response as it was served."""
    if call.request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
        raise unsupported("stream", "'stream': a stored response is retrieved whole (llamapool runs no "
                                    "background responses to stream from)")
    return JSONResponse((await _get(s, call)).body)


def _limit(call: Call) -> int:
    text = call.request.query_params.get("limit", "20")
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise bad("limit", f"'limit' must be an integer from 1 to 100, got {text!r:.40}")
    return int(text)


async def handle_input_items(s: Serving, call: Call) -> Response:
    """``GET /v1/responses/{id}/input_items``: its input items, a page of them (``limit``, default 20;
    ``order``, default ``desc``; ``after`` an item id, ``before`` too) in OpenAI's list shape."""
    q = call.request.query_params
    limit, order = _limit(call), q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("order", f"'order' must be asc or desc, got {order!r:.40}")
    items = (await _get(s, call)).input
    if order == "desc":
        items = items[::-1]
    for key in ("after", "before"):
        mark = q.get(key)
        if mark is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == mark), None)
            if at is None:
                raise bad(key, f"'{key}' must be the id of one of the response's input items, got {mark!r:.80}")
            items = items[at + 1:] if key == "after" else items[:at]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def handle_delete(s: Serving, call: Call) -> Response:
    """``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``."""
    store, rid = _store(s), _rid(call)
    try:
        gone = await store.run(store.delete, call.owner, rid)
    except StoreError as e:
        raise _unavailable(e) from None
    if not gone:
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})
