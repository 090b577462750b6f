"""KV handover parts that found no sibling: a model's only worker drained (a rolling reload of one worker,
an on-demand model evicted and loaded again). The router keeps them, bounded in bytes and time, with the
prefix keys it remembered of that worker, for the next worker of the model that says hello."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from llamapool.protocol.messages import KVPart

PARKED_BYTES = 8 << 30  # all models' parked parts together
PARKED_SECONDS = 900.0  # parts older than this are dropped (a replacement loads within workers.start_timeout)


@dataclass
class _Model:
    parts: list[KVPart] = field(default_factory=list)
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    since: float = 0.0


class Parked:
    """Parts by model, whole entries only (an entry that does not fit is dropped from its first part on)."""

    def __init__(self, limit: int = PARKED_BYTES, seconds: float = PARKED_SECONDS):
        self.limit, self.seconds = limit, seconds
        self.models: dict[str, _Model] = {}
        self.bytes = 0
        self.dropped = 0  # entries dropped for want of room
        self._skipping: set[tuple[str, int]] = set()  # (source, key) of entries being dropped

    def park(self, model: str, part: KVPart, prefixes: OrderedDict[int, None]) -> None:
        self._expire()
        at = (part.source, part.key)
        if part.part == 0:
            self._skipping.discard(at)
            if self.bytes + part.parts * len(part.data) > self.limit:
                self._skipping.add(at)
                self.dropped += 1
        if at in self._skipping:
            return
        m = self.models.setdefault(model, _Model(since=time.monotonic()))
        m.parts.append(part)
        m.prefixes.update(prefixes)
        self.bytes += len(part.data)

    def take(self, model: str) -> tuple[list[KVPart], OrderedDict[int, None]]:
        """A model's parked parts (in order) and prefix keys, taken out."""
        self._expire()
        m = self.models.pop(model, None)
        if m is None:
            return [], OrderedDict()
        self.bytes -= sum(len(p.data) for p in m.parts)
        return m.parts, m.prefixes

    def _expire(self) -> None:
        now = time.monotonic()
        for name in [n for n, m in self.models.items() if now - m.since > self.seconds]:
            self.take(name)


__all__ = ["Parked"]
