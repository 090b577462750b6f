"""Images in requests: what a chat message's image part may hold, checked from the file's header alone.

An image travels as its file's bytes (msgpack bin; the HTTP API's base64 decoded by the gateway), in a
chat message's content part ``{"type": "image", "data": <bytes>}``. Before anything decodes it, its
header says its format and size: PNG, JPEG, GIF and BMP are what the worker's decoder (libmtmd's
stb_image) reads; another format is refused by name, and an image of more than ``MAX_IMAGE_PIXELS``
pixels is refused unread (a decompression bomb: a small file of a huge image).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAX_MEDIA = 16  # images in one request
MAX_IMAGE_PIXELS = 4096 * 4096  # an image's width x height at most (checked from its header)
MAX_IMAGE_BYTES = 16 << 20  # an image file's bytes at most
FORMATS = ("png", "jpeg", "gif", "bmp")  # what the worker decodes
MEDIA_MARKER = "<__media__>"  # where an image is in a rendered prompt (libmtmd's mtmd_default_marker())


class MediaError(ValueError):
    """A bad image: the message says what is wrong (the caller names the part)."""


@dataclass(frozen=True)
class ImageInfo:
    format: str
    width: int
    height: int


def _png(b: bytes) -> tuple[int, int] | None:
    if len(b) < 24 or b[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", b[16:24])


def _gif(b: bytes) -> tuple[int, int] | None:
    return struct.unpack("<HH", b[6:10]) if len(b) >= 10 else None


def _bmp(b: bytes) -> tuple[int, int] | None:
    if len(b) < 26:
        return None
    size = struct.unpack("<I", b[14:18])[0]
    if size == 12:  # OS/2 BITMAPCOREHEADER
        w, h = struct.unpack("<HH", b[18:22])
        return w, h
    w, h = struct.unpack("<ii", b[18:26])
    return abs(w), abs(h)


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg(b: bytes) -> tuple[int, int] | None:
    """The frame header's size: the segments walked from the start (markers and their lengths) to the
    first SOF; None when the file ends before one."""
    i = 2
    while i + 4 <= len(b):
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        (n,) = struct.unpack(">H", b[i + 2 : i + 4])
        if marker in _SOF:
            if i + 9 > len(b):
                return None
            h, w = struct.unpack(">HH", b[i + 5 : i + 9])
            return w, h
        if n < 2:
            return None
        i += 2 + n
    return None


def image_info(data: bytes) -> ImageInfo:
    """The image's format and size from its header; :class:`MediaError` when it is not an image of a
    format the worker decodes, is empty or too large, or has too many pixels."""
    if not data:
        raise MediaError("is empty (no image bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"is {len(data)} bytes; an image may have at most {MAX_IMAGE_BYTES}")
    size: tuple[int, int] | None
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        fmt, size = "png", _png(data)
    elif data.startswith(b"\xff\xd8\xff"):
        fmt, size = "jpeg", _jpeg(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        fmt, size = "gif", _gif(data)
    elif data.startswith(b"BM"):
        fmt, size = "bmp", _bmp(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise MediaError(f"is a WebP image, a format llamapool does not decode (it takes {', '.join(FORMATS)})")
    elif data[4:12] in (b"ftypavif", b"ftypheic", b"ftypheix", b"ftypmif1"):
        raise MediaError(f"is an AVIF/HEIF image, a format llamapool does not decode "
                         f"(it takes {', '.join(FORMATS)})")
    else:
        raise MediaError(f"is not an image (its bytes are none of {', '.join(FORMATS)})")
    if size is None:
        raise MediaError(f"is not a valid {fmt.upper()} image (its header is cut short or broken)")
    w, h = size
    if w < 1 or h < 1:
        raise MediaError(f"is a {fmt.upper()} image of {w}x{h} pixels: it has none")
    if w * h > MAX_IMAGE_PIXELS:
        raise MediaError(f"is a {fmt.upper()} image of {w}x{h} = {w * h} pixels; an image may have at most "
                         f"{MAX_IMAGE_PIXELS} (refused before decoding)")
    return ImageInfo(fmt, w, h)


def media_hash(data: bytes) -> str:
    """An image's identity: the sha256 of its file's bytes (the same file, the same image)."""
    return hashlib.sha256(data).hexdigest()


def as_text(content: object) -> str:
    """A content (a string, or parts) as one string where each image stands as its hash: the router's
    prefix keys (router/policy.py) and size estimates read a chat this way (never the image's bytes)."""
    if not isinstance(content, list):
        return str(content or "")
    return "".join(p.get("text", "") if p.get("type") == "text" else f"\x00image:{media_hash(p.get('data', b''))}\x00"
                   for p in content if isinstance(p, dict))
