"""What every API's request parser shares: the request they all become and the checks of its fields."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from llamapool.gateway.errors import ApiError, bad
from llamapool.gateway.media import Media
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
    priority: str | None = None  # its class (keys.CLASSES) from service_tier or priority; None: default
    media: Media | None = None  # its images (gateway/media.py): their fields, URLs to fetch; None: none

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


SERVICE_TIERS = {"auto": None, "default": None, "flex": "flex", "priority": "priority"}  # OpenAI's -> class
ANTHROPIC_TIERS = {"auto": None, "standard_only": None}  # Anthropic's service_tier: both the default class
PRIORITY_RANGE = (-100, 100)  # vLLM's integer priority: lower runs first; < 0 "priority", > 0 "flex"


def priority_class(body: Any, anthropic: bool = False) -> tuple[str | None, str | None]:
    """The priority class a body asks for (None: the default) and the field that asked: OpenAI's
    ``service_tier`` (Anthropic's on ``/v1/messages``), else vLLM's integer ``priority``."""
    if not isinstance(body, dict):
        return None, None
    tier = body.get("service_tier")
    if tier is not None:
        tiers = ANTHROPIC_TIERS if anthropic else SERVICE_TIERS
        if not isinstance(tier, str) or tier not in tiers:
            raise bad("service_tier", f"'service_tier' must be one of {', '.join(tiers)}, got {tier!r:.80}")
        return tiers[tier], "service_tier"
    p = body.get("priority")
    if p is None:
        return None, None
    lo, hi = PRIORITY_RANGE
    if isinstance(p, bool) or not isinstance(p, int) or not lo <= p <= hi:
        raise bad("priority", f"'priority' must be an integer from {lo} to {hi} (lower runs first: < 0 is the "
                              f"priority class, 0 the default, > 0 flex), got {p!r:.80}")
    return ("priority" if p < 0 else "flex" if p > 0 else None), "priority"


def _duration(seconds: float) -> str:
    """OpenAI's form of a reset time: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    return f"{int(seconds // 60)}m{round(seconds % 60, 3):g}s"


def ratelimit_headers(limits: dict[str, Any] | None, path: str) -> dict[str, str]:
    """The rate-limit headers of a reply from the tenant's state the router sent: OpenAI's
    ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, or on Anthropic's API (``/v1/messages``)
    ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` (the reset an RFC 3339 time)."""
    if not limits:
        return {}
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    out: dict[str, str] = {}
    for what in ("requests", "tokens"):
        if f"limit_{what}" not in limits:
            continue
        reset = float(limits[f"reset_{what}"])
        if anthropic:
            at = (datetime.now(UTC) + timedelta(seconds=reset)).replace(microsecond=0)
            out[f"anthropic-ratelimit-{what}-limit"] = str(limits[f"limit_{what}"])
            out[f"anthropic-ratelimit-{what}-remaining"] = str(limits[f"remaining_{what}"])
            out[f"anthropic-ratelimit-{what}-reset"] = at.isoformat().replace("+00:00", "Z")
        else:
            out[f"x-ratelimit-limit-{what}"] = str(limits[f"limit_{what}"])
            out[f"x-ratelimit-remaining-{what}"] = str(limits[f"remaining_{what}"])
            out[f"x-ratelimit-reset-{what}"] = _duration(reset)
    return out
