"""Routing policy: which ready worker takes the next prompt."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Candidate(Protocol):
    name: str

    @property
    def free(self) -> int: ...

    @property
    def routable(self) -> bool: ...


W = TypeVar("W", bound="Candidate")


def pick_worker(workers: Iterable[W]) -> W | None:
    """The routable worker with the most free slots; ties go to the lowest name. None if all full."""
    best: W | None = None
    for w in workers:
        if not w.routable or w.free <= 0:
            continue
        if best is None or w.free > best.free or (w.free == best.free and w.name < best.name):
            best = w
    return best
