"""The KV cache's slots: which llama sequence ids are free, and the prompt prefixes their KV still holds."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.worker.engine.sequence import Sequence


class KVSlots:
    """Free sequence ids, the prefix cache (free id -> prompt tokens its KV still holds) and its counters."""

    def __init__(self, mem: Any, slots: int, prefix_cache: bool, computed: int = 1):
        self.mem = mem
        self.prefix_cache = prefix_cache
        self.computed = computed  # a prompt's last tokens always computed, never reused (at least its last)
        self.free_ids: deque[int] = deque(range(slots))
        self.cached: dict[int, np.ndarray] = {}  # free seq id -> prompt tokens its KV still holds
        self.reused_tokens = 0  # prompt tokens started sequences had from the cache
        self.copied_streams = 0  # prefix shares that copied a KV stream buffer

    def take(self, want: np.ndarray, running: Iterable[Sequence], reuse: bool = True) -> tuple[int, int]:
        """A free sequence id for the prompt ``want`` and how many of its leading tokens are already in KV.

        The KV of every running sequence's computed prompt, and of recently finished sequences
        kept in free slots, is searched for the longest common prefix. A prefix kept in a free
        slot is used in place; one held by a running sequence (in another KV stream) is shared
        by copying that stream into the new slot's (``llama_memory_seq_cp`` copies the whole
        stream buffer at the next decode, on the device) and trimming the copy to the prefix.
        At least the last prompt token is always computed, for its logits; in deterministic mode the last
        two (``computed``): a prompt's tokens are then always computed at least two at a time, as without a
        prefix cache (docs/http.md#determinism).
        """
        src, best = -1, 0
        if self.prefix_cache and reuse:
            in_kv = list(self.cached.items())
            in_kv += [(s.seq_id, s.tokens[: s.n_past]) for s in running if s.n_past]
            for sid, have in in_kv:
                n = min(len(have), len(want) - self.computed)
                if n <= best:
                    continue
                diff = np.flatnonzero(have[:n] != want[:n])
                common = int(diff[0]) if diff.size else n
                if common > best:
                    src, best = sid, common
        if best and src in self.free_ids:
            seq_id = src
            self.free_ids.remove(seq_id)
        else:
            # the free slot whose cached prefix is least worth keeping, lowest id first
            seq_id = min(self.free_ids, key=lambda i: (len(self.cached.get(i, ())), i))
            self.free_ids.remove(seq_id)
            L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
            if best:
                L.llama_memory_seq_cp(self.mem, src, seq_id, -1, -1)
                self.copied_streams += 1
        if best:
            L.llama_memory_seq_rm(self.mem, seq_id, best, -1)
        self.cached.pop(seq_id, None)
        return seq_id, best

    def undo(self, seq_id: int) -> None:
        """Give back a slot just taken, its KV cleared (the sequence could not start)."""
        self.free_ids.appendleft(seq_id)
        self.cached.pop(seq_id, None)
        L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot, keeping its prompt's KV for a later request (with the prefix cache)."""
        if self.prefix_cache and seq.n_past:
            self.cached[seq.seq_id] = seq.tokens[: seq.n_past]
        else:
            L.llama_memory_seq_rm(self.mem, seq.seq_id, -1, -1)
        self.free_ids.append(seq.seq_id)

    def cells(self, running: Iterable[Sequence]) -> int:
        """KV cells in use: running sequences' computed tokens and kept prefixes."""
        return sum(s.n_past for s in running) + sum(len(t) for t in list(self.cached.values()))
