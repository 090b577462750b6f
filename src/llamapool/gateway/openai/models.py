"""``GET /v1/models`` and ``GET /v1/models/{id}``: the pool's models, as the router has them now; and
``POST /models/load``, ``/models/unload``, ``/models/pin``, ``/models/unpin`` (llama-server's router
mode's names, behind the API keys): an operator's command for one model."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from llamapool.client.errors import LlamapoolError
from llamapool.gateway.errors import ApiError
from llamapool.gateway.serving import Call, Serving
from llamapool.protocol.messages import MODEL_ACTIONS


async def listed(s: Serving) -> list[dict[str, Any]]:
    """The pool's models in OpenAI's shape, each with its worker ids ("workers": not OpenAI's,
    clients ignore it), each followed by its LoRA adapters ("parent": the model)."""
    try:  # the router's list is the current one (a reload may have changed it)
        models = (await s.client.status(timeout=2.0)).get("models") or []
    except LlamapoolError:
        models = []
    out = []
    for m in models or [{"name": s.spec.model, "workers": []}]:
        out.append({"id": m["name"], "object": "model", "created": 0, "owned_by": "llamapool",
                    "workers": m["workers"],
                    "input_modalities": ["text", "image"] if s.spec.takes_images(m["name"]) else ["text"],
                    **{k: m[k] for k in ("state", "load", "pinned", "devices", "reason") if k in m}})
        # its LoRA adapters, each a model name (vLLM lists them so, its base as "parent")
        out += [{"id": a["name"], "object": "model", "created": 0, "owned_by": "llamapool", "parent": m["name"],
                 "lora_scale": a["scale"], "workers": m["workers"], "input_modalities": out[-1]["input_modalities"]}
                for a in m.get("lora", ())]
    return out


async def handle_list(s: Serving, call: Call) -> Response:
    return JSONResponse({"object": "list", "data": await listed(s)})


async def handle_one(s: Serving, call: Call) -> Response:
    """One model, or a 404 ``model_not_found``."""
    name = call.request.path_params["model_id"]
    models = await listed(s)
    for m in models:
        if m["id"] == name:
            return JSONResponse(m)
    known = ", ".join(m["id"] for m in models)
    raise ApiError(404, f"The model {name!r} does not exist (the pool's models: {known})", param="model",
                   code="model_not_found")


async def handle_action(s: Serving, call: Call) -> Response:
    """``POST /models/{load,unload,pin,unpin}`` with ``{"model": NAME}``: the model's state after it."""
    action = call.request.path_params["action"]
    if action not in MODEL_ACTIONS:
        raise ApiError(404, f"no such endpoint: POST /models/{action} (the model commands: "
                       f"{', '.join(MODEL_ACTIONS)})", code="not_found")
    body = await s.body(call)
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"'model' must be the name of one of the pool's models, got {model!r}", param="model")
    if action == "load":
        reply = await s.client.load_model(model)
    elif action == "unload":
        reply = await s.client.unload_model(model)
    else:
        reply = await s.client.pin_model(model, action == "pin")
    return JSONResponse({"success": True, **reply})
