"""What every API's request parser shares: the request they all become and the checks of its fields."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from llamapool.gateway.errors import ApiError, bad
from llamapool.protocol import limits, params
from llamapool.protocol.messages import Prompt


@dataclass
class Generation:
    """One generation request as llamapool sees it, whichever API it came through."""

    prompts: list[Prompt]
    params: params.SamplingParams  # the contract's parameters (protocol/params.py), typed once, sent as they are
    stream: bool
    include_usage: bool = False
    model: str | None = None  # the model the body names; None: the pool's first
    id: str = field(default_factory=lambda: os.urandom(12).hex())  # 24 random hex digits (a uuid4 costs 4x)
    created: int = field(default_factory=lambda: int(time.time()))
    # a contract parameter the body gave under another name -> that name (errors name it so)
    renames: dict[str, str] = field(default_factory=dict)

    def renamed(self, e: ApiError) -> ApiError:
        """``e`` naming the body's field where it names a renamed parameter."""
        return renamed(self.renames, e)


def renamed(renames: dict[str, str], e: ApiError) -> ApiError:
    """``e`` naming the body's field where it names a parameter of ``renames`` (ours -> the body's)."""
    for ours, theirs in renames.items():
        if e.param is not None and (e.param == ours or e.param.startswith(ours + ".")):
            e.message = e.message.replace(f"'{e.param}'", f"'{theirs}{e.param[len(ours):]}'")
            e.param = theirs + e.param[len(ours):]
            break
    return e


def json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def model_name(body: dict[str, Any]) -> str | None:
    """The model the body names (the router answers ``unknown_model``, a 404, when the pool lacks it)."""
    named = body.get("model")
    if named is not None and (not isinstance(named, str) or not 0 < len(named) <= 128):
        raise bad("model", f"'model' must be a model name (1 to 128 characters), got {named!r}")
    return named


def limited(body: dict[str, Any], key: str, name: str | None = None) -> Any:
    """``body[key]`` checked against the limit of the generation parameter ``name`` (default: ``key``),
    with the SDK's message (protocol/limits.py); None when absent."""
    v = body.get(key)
    if v is None:
        return None
    why = limits.problem(name or key, v)
    if why is not None:
        raise bad(key, why.replace(f"'{name or key}'", f"'{key}'", 1))
    return v


def checked(name: str, value: Any, public: str | None = None) -> Any:
    """The contract's check of parameter ``name``, its messages naming the API's field ``public``."""
    try:
        return params.check(name, value)
    except params.ParamError as e:
        where, message = e.field, e.message
        if public is not None:
            where, message = public, message.replace(f"'{name}'", f"'{public}'")
        raise bad(where, message) from None


def stream_flag(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("stream", "'stream' must be true or false")
    return bool(stream)
