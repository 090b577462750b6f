"""What the worker's threads need of an engine: the llama.cpp engine and the echo engine both are one.

The engine thread calls ``submit``, ``abort`` and ``step``; the I/O thread reads the load and the
counters for its heartbeats. Nothing else of an engine is used outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Protocol

from llamapool.protocol.messages import KVPart, Run, Step
from llamapool.worker.handover import Received


class Engine(Protocol):
    @property
    def desc(self) -> str:
        """What is loaded (llama.cpp's model description)."""
        ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def active(self) -> Sized:
        """The running sequences."""
        ...

    @property
    def waiting(self) -> Sized:
        """The runs waiting for a slot."""
        ...

    @property
    def decode_s(self) -> float:
        """Cumulative seconds inside llama_decode."""
        ...

    @property
    def step_s(self) -> float:
        """Cumulative seconds of whole steps."""
        ...

    @property
    def reused_tokens(self) -> int:
        """Cumulative prompt tokens served from the prefix cache."""
        ...

    @property
    def busy(self) -> bool: ...

    @property
    def stalled(self) -> bool:
        """Busy, but a step can do nothing yet (the worker's loop waits a little rather than spin)."""
        ...

    def submit(self, run: Run, out: Step) -> None: ...

    def abort(self, rid: int, out: Step) -> None: ...

    def step(self, flush: Callable[[Step], None] | None = None) -> Step: ...

    def kv_cells(self) -> tuple[int, int]:
        """KV cells holding tokens, and in all ((0, 0) when the engine has no KV cache)."""
        ...

    def speculation(self) -> list[int]:
        """Cumulative draft tokens verified and accepted, tokens sampled, and (sequence, step) pairs sampled
        ([] without speculative decoding)."""
        ...

    def kv_host(self) -> dict[str, float]:
        """The host KV tier's counters ({} without one: worker/engine/hostkv.py TierStats)."""
        ...

    def hand_out(self) -> Iterator[KVPart]:
        """Once drained: the host KV tier's newest entries as parts for a sibling (none without a tier)."""
        ...

    def take_in(self, got: Received) -> None:
        """An entry a draining sibling handed over, into the host KV tier (ignored without one)."""
        ...

    def scheduling(self) -> tuple[str, int, list[float]]:
        """The step target (``model.target_step``), the last step's token budget, and the fitted step
        cost in seconds (base, per row, per prompt token, per step with prompt work; [] until fitted)."""
        ...

    def close(self) -> None: ...
