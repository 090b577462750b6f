"""Images in HTTP requests, whichever API they come through: a data: URL or base64 (decoded and checked
from its header here: protocol/media.py), or an http(s) URL (fetched only where ``[http] fetch_media``
allows: gateway/fetch.py). Each image becomes a protocol content part ``{"type": "image", "data": bytes}``;
a bad one is a 400 naming its part (``messages[1].content[0].image_url``)."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any

from llamapool.gateway.errors import bad, unsupported
from llamapool.protocol import media

_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.I)


@dataclass
class Media:
    """A request's images, as its parser finds them: the field naming each (in order), and the parts whose
    bytes an http(s) URL gives (fetched before the request goes on: ``Serving.generation``)."""

    fields: list[str] = field(default_factory=list)
    fetches: list[tuple[dict[str, Any], str, str]] = field(default_factory=list)  # (part, url, field)

    def _count(self, at: str) -> None:
        self.fields.append(at)
        if len(self.fields) > media.MAX_MEDIA:
            raise bad(at, f"'{at}': a request may have at most {media.MAX_MEDIA} images")

    def from_url(self, url: Any, at: str) -> dict[str, Any]:
        """The part of an image URL: a data: URL decoded and checked, an http(s) one to fetch."""
        self._count(at)
        if not isinstance(url, str) or not url:
            raise bad(at, f"'{at}' must be an image URL: data:image/png;base64,... (or http(s) where allowed)")
        if url[:5].lower() == "data:":
            return {"type": "image", "data": _data_url(url, at)}
        if url[:7].lower() == "http://" or url[:8].lower() == "https://":
            part: dict[str, Any] = {"type": "image", "data": b""}
            self.fetches.append((part, url, at))
            return part
        raise bad(at, f"'{at}' must be a data: URL (data:image/png;base64,...) or an http(s) URL, got {url[:40]!r}")

    def from_base64(self, data: Any, at: str, media_type: Any = None) -> dict[str, Any]:
        """The part of a base64 image (Anthropic's ``source.data``), ``media_type`` checked against it."""
        self._count(at)
        if not isinstance(data, str) or not data:
            raise bad(at, f"'{at}' must be the image's bytes in base64")
        raw = _base64(data, at)
        info = checked(raw, at)
        if isinstance(media_type, str) and media_type.lower() not in (f"image/{info.format}",) \
                and not (info.format == "jpeg" and media_type.lower() == "image/jpg"):
            raise bad(at, f"'{at}' is a {info.format.upper()} image, but its media_type says {media_type!r:.40}")
        return {"type": "image", "data": raw}


def checked(raw: bytes, at: str) -> media.ImageInfo:
    """The image's header read (protocol/media.py); a 400 naming ``at`` when it is no image llamapool takes."""
    try:
        return media.image_info(raw)
    except media.MediaError as e:
        raise (unsupported if "format" in str(e) else bad)(at, f"'{at}' {e}") from None


def _base64(text: str, at: str) -> bytes:
    if len(text) > (media.MAX_IMAGE_BYTES * 4) // 3 + 8:
        raise bad(at, f"'{at}' is over {media.MAX_IMAGE_BYTES} bytes of image")
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad(at, f"'{at}' is not valid base64") from None


def _data_url(url: str, at: str) -> bytes:
    m = _DATA_URL.match(url)
    if m is None:
        raise bad(at, f"'{at}' is not a valid data: URL (data:image/png;base64,...)")
    kind, opts = m.group(1).lower(), m.group(2).lower()
    if "base64" not in opts.split(";"):
        raise bad(at, f"'{at}' must be a base64 data: URL (data:{kind or 'image/png'};base64,...)")
    if kind and not kind.startswith("image/"):
        raise bad(at, f"'{at}' is a data: URL of {kind!r:.40}, not an image")
    raw = _base64(url[m.end():], at)
    checked(raw, at)
    return raw
