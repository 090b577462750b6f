"""Cross-site protection for the gateway: an ASGI middleware in front of every route.

A web page the user opens can send requests to a gateway on localhost: "simple" requests (a
``POST`` with ``Content-Type: text/plain``, a form) go out without a CORS preflight, and DNS
rebinding lets the page read the replies. So, in this order:

1. **Host allow-list** (when the gateway listens on a loopback address, or ``[http] allowed_hosts``
   is set): the ``Host`` header must name localhost (``localhost``, ``*.localhost``, a loopback
   address), the listen address, or an allowed host. A rebinding page's requests carry its own
   name: 403.
2. **Origin check**: a request with an ``Origin`` header (browsers send one) is refused (403)
   unless ``[http] cors_origins`` lists that origin (or ``"*"``). Programs (curl, SDKs) send none.
3. **CORS**, only for ``cors_origins``: a preflight ``OPTIONS`` is answered (204) and the replies
   carry ``Access-Control-Allow-Origin``. Without ``cors_origins``, no CORS header is ever sent.
4. **JSON only**: a request with a body (``POST``) must be ``Content-Type: application/json`` (or
   ``*/*+json``; no ``Content-Type`` at all is taken as JSON): 415 otherwise.

Refusals are JSON in OpenAI's shape (Anthropic's on ``/v1/messages``).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from llamapool.gateway.errors import ApiError, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE = "600"  # seconds a browser may cache a preflight's answer
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def host_name(value: str) -> str:
    """The name in a ``Host`` header (or an origin's authority), without port, brackets or final dot,
    lower-cased: ``"[::1]:8000"`` -> ``"::1"``, ``"LocalHost.:80"`` -> ``"localhost"``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    name, colon, port = value.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address or a Host name) is this machine only."""
    host = host_name(host) if host.startswith("[") else host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_key(value: str) -> str:
    """An origin as compared: ``scheme://host[:port]``, lower-case, without a final ``/``."""
    return value.strip().lower().rstrip("/")


@dataclass(frozen=True)
class OriginPolicy:
    """Which Hosts and Origins the gateway answers; built from ``[http]`` (see :func:`OriginPolicy.make`)."""

    check_host: bool
    hosts: frozenset[str]  # exact names (lower-case, no port)
    host_suffixes: tuple[str, ...]  # "*.example.com" -> ".example.com"
    cors: frozenset[str]  # origin_key()s, or {"*"}

    @classmethod
    def make(cls, listen_host: str, allowed_hosts: list[str], cors_origins: list[str]) -> OriginPolicy:
        """The Host check applies when the gateway listens on loopback or ``allowed_hosts`` is given
        (``["*"]``: never); localhost names and the listen address are always allowed."""
        wildcard = "*" in allowed_hosts
        check = not wildcard and (is_loopback(listen_host) or bool(allowed_hosts))
        names = {host_name(h) for h in allowed_hosts if not h.startswith("*.")}
        names.add(host_name(f"[{listen_host}]" if ":" in listen_host else listen_host))
        suffixes = tuple(h[1:].lower().rstrip(".") for h in allowed_hosts if h.startswith("*."))
        return cls(check, frozenset(names), suffixes, frozenset(origin_key(o) for o in cors_origins))

    def host_allowed(self, host: str | None) -> bool:
        if not self.check_host or host is None:  # HTTP/1.0 without Host: not a browser
            return True
        name = host_name(host)
        return name in self.hosts or is_loopback(name) or any(name.endswith(s) for s in self.host_suffixes)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors or origin_key(origin) in self.cors


def is_json(content_type: str | None) -> bool:
    """``application/json`` (any parameters), ``application/*+json``; no Content-Type counts as JSON."""
    if content_type is None:
        return True
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return str(v.decode("latin-1"))
    return None


async def refuse(scope: Scope, send: Send, status: int, message: str, code: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A JSON error in the shape of the path's API: OpenAI's, Anthropic's under ``/v1/messages``."""
    raw = json.dumps(error_body(ApiError(status, message, code=code), scope.get("path", ""))).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": raw})


class OriginGuard:
    """The ASGI middleware (see the module's docstring)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        p, method = self.policy, scope["method"]
        host = _header(scope, b"host")
        if not p.host_allowed(host):
            await refuse(scope, send, 403, f"Host {host!r} is not allowed: this gateway listens on a loopback "
                         "address and answers to localhost names only (a web page may be trying DNS rebinding); "
                         "add the name to [http] allowed_hosts to allow it", "host_not_allowed")
            return
        origin = _header(scope, b"origin")
        if origin is not None and not p.origin_allowed(origin):
            await refuse(scope, send, 403, f"Origin {origin!r} is not allowed: requests from web pages are refused "
                         "unless [http] cors_origins lists their origin", "origin_not_allowed")
            return
        if origin is not None and method == "OPTIONS" and _header(scope, b"access-control-request-method"):
            await self._preflight(scope, send, origin)
            return
        if method in BODY_METHODS and not is_json(ctype := _header(scope, b"content-type")):
            await refuse(scope, send, 415, f"Content-Type {ctype!r} is not supported: send the body as JSON "
                         "with 'Content-Type: application/json'", "unsupported_media_type")
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        allow = self._allow_headers(origin)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *allow]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _allow_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        value = b"*" if "*" in self.policy.cors else origin.encode("latin-1")
        return [(b"access-control-allow-origin", value), (b"vary", b"Origin")]

    async def _preflight(self, scope: Scope, send: Send, origin: str) -> None:
        """A CORS preflight from an allowed origin: any of our methods, the headers it asks for."""
        asked = _header(scope, b"access-control-request-headers")
        headers = [*self._allow_headers(origin), (b"access-control-allow-methods", CORS_METHODS.encode()),
                   (b"access-control-max-age", CORS_MAX_AGE.encode()), (b"content-length", b"0")]
        if asked:
            headers.append((b"access-control-allow-headers", asked.encode("latin-1")))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
