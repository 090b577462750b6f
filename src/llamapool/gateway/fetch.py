"""http(s) image URLs, fetched by the gateway only where ``[http] fetch_media`` allows it (off by default).

Bounds (docs/configuration.md): ``fetch_media_hosts`` (host names allowed; none listed: any), the bytes an
image may have (``fetch_media_max_bytes``: a longer body is cut and refused) and the seconds a fetch may take
(``fetch_media_timeout``, all of it). The host's addresses are resolved first and the connection goes to a
checked one: a private, loopback, link-local or otherwise non-global address is refused unless
``fetch_media_private`` (a URL must not reach into the gateway's network). Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

from llamapool.gateway.errors import bad
from llamapool.gateway.media import checked


class FetchError(ValueError):
    """Why an image URL was not fetched."""


def _address(host: str, port: int, private: bool) -> str:
    """A resolved address of ``host`` to connect to; FetchError when none is allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise FetchError(f"its host {host!r} does not resolve ({e.strerror or e})") from None
    for info in infos:
        ip = str(info[4][0])
        if private or ipaddress.ip_address(ip.split("%")[0]).is_global:
            return ip
    raise FetchError(f"its host {host!r} is a private address (set [http] fetch_media_private = true to allow)")


def _get(url: str, cfg: dict[str, Any]) -> bytes:
    """The URL's body (blocking: run in a thread)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    hosts = [h.lower() for h in cfg["hosts"]]
    if hosts and host.lower() not in hosts:
        raise FetchError(f"its host {host!r} is not in [http] fetch_media_hosts")
    https = parts.scheme.lower() == "https"
    port = parts.port or (443 if https else 80)
    deadline = time.monotonic() + float(cfg["timeout"])
    ip = _address(host, port, bool(cfg["private"]))
    sock = socket.create_connection((ip, port), timeout=float(cfg["timeout"]))
    if https:
        sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    conn = http.client.HTTPConnection(host, port, timeout=float(cfg["timeout"]))
    conn.sock = sock
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Host": parts.netloc.rsplit("@", 1)[-1], "User-Agent": "llamapool", "Accept": "image/*"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise FetchError(f"answered HTTP {resp.status} (redirects are not followed)")
        limit = int(cfg["max_bytes"])
        body = bytearray()
        while len(body) <= limit:
            if time.monotonic() > deadline:
                raise FetchError(f"took over {cfg['timeout']} s ([http] fetch_media_timeout)")
            piece = resp.read(min(65536, limit + 1 - len(body)))
            if not piece:
                break
            body += piece
        if len(body) > limit:
            raise FetchError(f"is over {limit} bytes ([http] fetch_media_max_bytes)")
        return bytes(body)
    except (OSError, http.client.HTTPException) as e:
        raise FetchError(f"could not be fetched ({e})") from None
    finally:
        conn.close()


async def fetch_all(fetches: list[tuple[dict[str, Any], str, str]], cfg: dict[str, Any]) -> None:
    """Each ``(part, url, field)``'s image fetched into ``part["data"]`` and checked; a 400 naming the field
    of the first that fails (or of the first at all where ``fetch_media`` is off)."""
    if not cfg.get("enabled"):
        at = fetches[0][2]
        raise bad(at, f"'{at}' is an http(s) image URL; this server fetches none ([http] fetch_media = false): "
                      f"send the image as a data: URL (data:image/png;base64,...)")
    results = await asyncio.gather(*[asyncio.wait_for(asyncio.to_thread(_get, url, cfg), float(cfg["timeout"]) + 1)
                                     for _, url, _ in fetches], return_exceptions=True)
    for (part, url, at), got in zip(fetches, results, strict=True):
        if isinstance(got, asyncio.TimeoutError | TimeoutError):
            raise bad(at, f"'{at}': the image at {url[:80]!r} took over {cfg['timeout']} s "
                          f"([http] fetch_media_timeout)")
        if isinstance(got, BaseException):
            raise bad(at, f"'{at}': the image at {url[:80]!r} {got}")
        checked(got, at)
        part["data"] = got
