"""The host KV tier's handover: a draining worker sends its newest entries in parts (``KVPart``, through the
router) to a sibling of its model, whose I/O thread joins them and checks them before its engine keeps them.

Pure Python (no llama.cpp): the I/O thread joins and checks (``zlib.crc32`` lets go of the GIL, so the
engine thread decodes meanwhile); the engine thread only files a checked entry (``HostTier.take_in``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from llamapool.protocol.messages import KVPart

PART_BYTES = 8 << 20  # a part's share of an entry's state (the router and the receiver take frames to 64 MiB)
HANDOVER_SECONDS = 3.0  # a drain spends at most this long handing entries over (within drain_timeout)
MAX_PENDING = 64  # entries a receiver joins at once (parts of more are dropped: a sender that never finishes)
STALE_SECONDS = 10.0  # an entry whose next part has not come for this long is dropped (its sender died)


@dataclass(frozen=True)
class Received:
    """A whole entry a sibling handed over, its checksum checked (``intact``)."""

    tokens: np.ndarray  # int32
    blob: np.ndarray  # uint8
    identity: bytes
    intact: bool


def parts(entries: Iterable[tuple[np.ndarray, np.ndarray, bytes]], seconds: float = HANDOVER_SECONDS
          ) -> Iterator[KVPart]:
    """Each (tokens, state, identity) entry as parts, the first carrying the tokens and checks; no new entry
    is begun once ``seconds`` have passed."""
    end = time.monotonic() + seconds
    for key, (tokens, blob, identity) in enumerate(entries):
        if time.monotonic() > end:
            return
        data = memoryview(blob.data).cast("B")
        n = max(1, -(-len(data) // PART_BYTES))
        crc = zlib.crc32(data)
        for i in range(n):
            piece = bytes(data[i * PART_BYTES:(i + 1) * PART_BYTES])
            if i == 0:
                yield KVPart(key, 0, n, piece, np.asarray(tokens, dtype=np.int32).tobytes(), identity, crc)
            else:
                yield KVPart(key, i, n, piece)


@dataclass
class _Pending:
    first: KVPart
    seen: float  # time.monotonic() of its last part
    pieces: list[bytes] = field(default_factory=list)


class Assembler:
    """Joins the parts of entries by (source, key), in order; a part out of order drops its entry, and so
    does a sender that stops midway (killed in its handover): :meth:`expire` lets its parts go."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.dropped = 0

    def add(self, part: KVPart, now: float | None = None) -> Received | None:
        """The whole entry once its last part came (None before, or for a part that fits no entry)."""
        now = time.monotonic() if now is None else now
        at = (part.source, part.key)
        if part.part == 0:
            if len(self.pending) >= MAX_PENDING:
                self.expire(now)
            if len(self.pending) >= MAX_PENDING:
                self.dropped += 1
                return None
            self.pending[at] = _Pending(part, now, [part.data])
        else:
            p = self.pending.get(at)
            if p is None or len(p.pieces) != part.part:
                self.pending.pop(at, None)
                self.dropped += 1
                return None
            p.pieces.append(part.data)
            p.seen = now
        p = self.pending[at]
        if len(p.pieces) < p.first.parts:
            return None
        del self.pending[at]
        blob = np.frombuffer(b"".join(p.pieces), dtype=np.uint8)  # read-only: llama.cpp only reads it
        tokens = np.frombuffer(p.first.tokens, dtype=np.int32).copy()
        return Received(tokens, blob, p.first.identity, zlib.crc32(blob.data) == p.first.crc)

    def expire(self, now: float) -> int:
        """Drop the entries whose last part came ``STALE_SECONDS`` ago or more; how many were dropped."""
        stale = [at for at, p in self.pending.items() if now - p.seen >= STALE_SECONDS]
        for at in stale:
            del self.pending[at]
        self.dropped += len(stale)
        return len(stale)


__all__ = ["HANDOVER_SECONDS", "PART_BYTES", "STALE_SECONDS", "Assembler", "Received", "parts"]
