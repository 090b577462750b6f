"""``GET /v1/models`` and ``GET /v1/models/{id}``: the pool's models, as the router has them now; and
``POST /models/load``, ``/models/unload``, ``/models/pin``, ``/models/unpin`` (llama-server's router
mode's names, behind the API keys): an operator's command for one model; ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's): a LoRA adapter loaded or unloaded at run time."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, PlainTextResponse, Response

from llamapool.client.errors import LlamapoolError
from llamapool.gateway.errors import ApiError, from_llamapool
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


VLLM_LORA_PARAMS = {"name": "lora_name", "path": "lora_path"}  # the daemon's parameter -> vLLM's field


async def handle_load_lora(s: Serving, call: Call) -> Response:
    """vLLM's ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``; llamapool's ``model``, the base,
    default the pool's first, and ``scale``): the adapter loaded into every worker of its model; vLLM's plain
    text answer."""
    body = await s.body(call)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object with lora_name and lora_path")
    unknown = sorted(set(body) - {"lora_name", "lora_path", "model", "scale", "load_inplace"})
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} (load_lora_adapter takes lora_name, lora_path, model "
                       f"and scale)", param=unknown[0])
    for key in ("lora_name", "lora_path"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise ApiError(400, f"'{key}' must be a non-empty string, got {body.get(key)!r}", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be the name of one of the pool's models, got {model!r}", param="model")
    try:
        await s.client.load_adapter(body["lora_name"], body["lora_path"], model=model, scale=body.get("scale", 1.0))
    except LlamapoolError as e:
        raise _vllm_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def handle_unload_lora(s: Serving, call: Call) -> Response:
    """vLLM's ``POST /v1/unload_lora_adapter`` (``lora_name``): no new request takes it, and its workers free it
    once the requests using it have finished."""
    body = await s.body(call)
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"'lora_name' must be the name of a LoRA adapter loaded at run time, got {name!r}",
                       param="lora_name")
    if name in {m["id"] for m in await listed(s) if "parent" not in m}:
        raise ApiError(400, f"'lora_name': {name!r} is a model, not a LoRA adapter", param="lora_name")
    try:
        await s.client.unload_model(name)
    except LlamapoolError as e:
        raise _vllm_error(e, "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _vllm_error(e: LlamapoolError, model_param: str = "model") -> ApiError:
    """The daemon's error, its parameter as vLLM's endpoint names it."""
    err = from_llamapool(e)
    param = model_param if e.field == "model" else VLLM_LORA_PARAMS.get(e.field or "", err.param)
    if param and e.field and err.message.startswith(f"'{e.field}'"):
        err.message = f"'{param}'" + err.message[len(e.field) + 2:]
    err.param = param
    return err
