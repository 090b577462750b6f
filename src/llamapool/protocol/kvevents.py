"""KV-cache events on the wire: what llm-d's precise prefix-cache scorer reads (docs/kubernetes.md).

The form is vLLM's ``vllm/distributed/kv_events.py`` as its structs encoded with msgspec ``array_like=True``
(vLLM v0.18 to the last release before vllm-project/vllm#42892, which made the events maps): positional
msgpack arrays, each event tagged by its first element. llm-d's ``pkg/kvevents`` reads this form (both
``llm-d-kv-cache``, which reads arrays only, and ``llm-d-router``, which reads arrays or maps).

- a batch: ``[ts, [event, ...], data_parallel_rank]``
- ``["BlockStored", block_hashes, parent_block_hash | nil, token_ids, block_size, lora_id, medium, lora_name]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

A published message is three frames: ``[topic, seq (8 bytes, big-endian), payload]``; a replay answer
frame is the same three frames, and a replay ends with ``[topic, -1 (8 bytes), b""]``.

The daemon's workers send the same payload to their supervisor's publisher (worker/engine/kvevents.py,
supervisor/kvevents.py), which merges the workers of a pod into the pod's one stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
GPU, CPU = "GPU", "CPU"  # vLLM's medium names: the slots' KV, the host-RAM tier's
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame: no more batches


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks newly held: ``hashes[i]`` stands for ``tokens[i*block:(i+1)*block]`` after ``parent``."""

    hashes: tuple[int, ...]
    parent: int | None
    tokens: tuple[int, ...]
    block: int
    medium: str
    lora_name: str | None = None  # the LoRA adapter set the KV was computed under (None: the base model)

    def encode(self) -> list[Any]:
        return [STORED, list(self.hashes), self.parent, list(self.tokens), self.block, None, self.medium,
                self.lora_name]


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str

    def encode(self) -> list[Any]:
        return [REMOVED, list(self.hashes), self.medium]


@dataclass(frozen=True, slots=True)
class Cleared:
    def encode(self) -> list[Any]:
        return [CLEARED]


Event = Stored | Removed | Cleared


def encode_batch(events: list[Event], ts: float | None = None, rank: int = 0) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [e.encode() for e in events], rank])


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """A batch's time and events (ValueError when it is not one: the publisher drops it)."""
    try:
        raw = msgpack.unpackb(payload)
        ts, items = raw[0], raw[1]
        return float(ts), [_event(e) for e in items]
    except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData) as e:
        raise ValueError(f"not a KV event batch: {e}") from None


def _event(e: list[Any]) -> Event:
    if e[0] == STORED:
        return Stored(tuple(int(h) for h in e[1]), None if e[2] is None else int(e[2]),
                      tuple(int(t) for t in e[3]), int(e[4]), str(e[6]),
                      None if len(e) < 8 or e[7] is None else str(e[7]))
    if e[0] == REMOVED:
        return Removed(tuple(int(h) for h in e[1]), str(e[2]))
    if e[0] == CLEARED:
        return Cleared()
    raise ValueError(f"unknown event {e[0]!r}")


__all__ = ["CLEARED", "CPU", "END_SEQ", "GPU", "REMOVED", "STORED", "Cleared", "Event", "Removed", "Stored",
           "decode_batch", "encode_batch"]
