"""The KV cache's slots: which llama sequence ids are free, and the token prefixes their KV still holds.

With the host tier (``hostkv.py``), a free slot's KV is copied to host RAM before another sequence
overwrites it, and a prompt whose prefix is longer there than in any slot has it copied back."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.worker.engine.hostkv import BLOCK, HostTier
from llamapool.worker.engine.kvevents import BlockTracker
from llamapool.worker.engine.sequence import Sequence


class KVSlots:
    """Free sequence ids, the prefix cache (free id -> tokens its KV still holds), the host tier, counters.

    ``keep_output``: a finished sequence's generated tokens stay in its cached prefix too (an agent's
    next turn starts with the reply); off in deterministic mode on the CPU, where a token decoded one row
    at a time may differ in its last bits from the same token computed as a prompt."""

    def __init__(self, mem: Any, slots: int, prefix_cache: bool, computed: int = 1,
                 host: HostTier | None = None, keep_output: bool = True, events: BlockTracker | None = None):
        self.mem = mem
        self.prefix_cache = prefix_cache
        self.computed = computed  # a prompt's last tokens always computed, never reused (at least its last)
        self.host = host if prefix_cache else None
        self.keep_output = keep_output
        self.free_ids: deque[int] = deque(range(slots))
        self.cached: dict[int, np.ndarray] = {}  # free seq id -> tokens its KV still holds
        # seq id -> the tag of the LoRA adapter set its KV was computed under (worker/engine/adapters.py; absent:
        # the base model's, b""): a prefix is reused, here and in the host tier, under the same tag only
        self.tags: dict[int, bytes] = {}
        self.reused_tokens = 0  # prompt tokens started sequences had from the cache
        self.copied_streams = 0  # prefix shares that copied a KV stream buffer
        self.events = events  # kv-events: what the slots hold, in blocks (worker/engine/kvevents.py); None: off

    def take(self, want: np.ndarray, running: Iterable[Sequence], reuse: bool = True,
             tag: bytes = b"") -> tuple[int, int]:
        """A free sequence id for the prompt ``want`` and how many of its leading tokens are already in KV.

        The KV of every running sequence's computed prompt, and of recently finished sequences
        kept in free slots, is searched for the longest common prefix. A prefix kept in a free
        slot is used in place; one held by a running sequence (in another KV stream) is shared
        by copying that stream into the new slot's (``llama_memory_seq_cp`` copies the whole
        stream buffer at the next decode, on the device) and trimming the copy to the prefix.
        A longer prefix in the host tier is copied back into the least valuable free slot instead,
        when that is cheaper than computing what it adds (``HostTier.lookup``).
        At least the last prompt token is always computed, for its logits; in deterministic mode the last
        two (``computed``): a prompt's tokens are then always computed at least two at a time, as without a
        prefix cache (docs/http.md#determinism). ``tag``: the adapter set the prompt runs under; only KV of
        the same tag is reused.
        """
        src, best = self._in_vram(want, running, tag) if self.prefix_cache and reuse else (-1, 0)
        if self.host is not None and reuse and len(want) - self.computed >= BLOCK:
            eid, n = self.host.lookup(want, len(want) - self.computed, best, tag)
            if eid >= 0:
                self.host.hold(eid)  # saving the emptied slot's KV must not drop the entry it will take
                try:
                    seq_id = self._evict(self._least_worth())
                finally:
                    self.host.hold(-1)
                if self.host.restore(eid, seq_id, n, tag):
                    self._tag(seq_id, tag)
                    self._held(seq_id, want[:n])  # kv-events
                    return seq_id, n
                self.free_ids.appendleft(seq_id)  # emptied: the VRAM's prefixes are looked for again
                src, best = self._in_vram(want, running, tag) if self.prefix_cache else (-1, 0)
        if best and src in self.free_ids and not self._keep_apart(src, best):
            seq_id = src
            self.free_ids.remove(seq_id)
            if self.host is not None and len(self.cached[seq_id]) - best >= BLOCK:
                self._save(seq_id)  # the part beyond the shared prefix is another session's
        else:
            seq_id = self._evict(self._least_worth(besides=src))
            if best:
                L.llama_memory_seq_cp(self.mem, src, seq_id, -1, -1)
                self.copied_streams += 1
        if best:
            L.llama_memory_seq_rm(self.mem, seq_id, best, -1)
        self.cached.pop(seq_id, None)
        self._tag(seq_id, tag)
        self._held(seq_id, want[:best])  # kv-events
        return seq_id, best

    def _tag(self, seq_id: int, tag: bytes) -> None:
        if tag:
            self.tags[seq_id] = tag
        else:
            self.tags.pop(seq_id, None)

    def _in_vram(self, want: np.ndarray, running: Iterable[Sequence], tag: bytes = b"") -> tuple[int, int]:
        """(slot, tokens) of the longest prefix of ``want`` held in a slot of ``tag``, running or free ((-1, 0):
        none)."""
        src, best = -1, 0
        in_kv = list(self.cached.items())
        in_kv += [(s.seq_id, s.tokens[: s.n_past]) for s in running if s.n_past]
        for sid, have in in_kv:
            if self.tags.get(sid, b"") != tag:
                continue
            n = min(len(have), len(want) - self.computed)
            if n <= best:
                continue
            diff = np.flatnonzero(have[:n] != want[:n])
            common = int(diff[0]) if diff.size else n
            if common > best:
                src, best = sid, common
        return src, best

    def _keep_apart(self, src: int, best: int) -> bool:
        """Whether free slot ``src``, whose KV shares ``best`` tokens with a new prompt, holds another session's
        context beyond them (a block or more) while a free slot holding less exists: the shared prefix is then
        copied there, and ``src`` keeps its session's KV for its return."""
        rest = len(self.cached[src]) - best
        return rest >= BLOCK and any(len(self.cached.get(i, ())) < rest for i in self.free_ids if i != src)

    def _least_worth(self, besides: int = -1) -> int:
        """The free slot whose cached prefix is least worth keeping, lowest id first (not ``besides``)."""
        return min((i for i in self.free_ids if i != besides), key=lambda i: (len(self.cached.get(i, ())), i))

    def _evict(self, seq_id: int) -> int:
        """Take free slot ``seq_id`` emptied, its cached prefix saved to the host tier first."""
        self.free_ids.remove(seq_id)
        self._save(seq_id)
        L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self.cached.pop(seq_id, None)
        return seq_id

    def _save(self, seq_id: int) -> None:
        keep = self.cached.get(seq_id)
        if self.host is not None and keep is not None and len(keep) >= BLOCK:
            L.llama_memory_seq_rm(self.mem, seq_id, len(keep), -1)  # a padding token or a reply's last cells
            self.host.save(seq_id, keep, self.tags.get(seq_id, b""))

    def save_all(self) -> None:
        """Every free slot's cached prefix into the host tier (a drain, before the tier is handed over)."""
        for seq_id in list(self.cached):
            self._save(seq_id)

    def drop_tags(self, tags: set[bytes]) -> None:
        """Forget the KV computed under the adapter sets ``tags`` (an adapter of theirs was freed): the free
        slots' kept prefixes and the host tier's entries."""
        for seq_id in [s for s in self.free_ids if self.tags.get(s, b"") in tags]:
            if seq_id in self.cached:
                L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
                del self.cached[seq_id]
                self._held(seq_id, None)  # kv-events
            del self.tags[seq_id]
        if self.host is not None:
            self.host.drop_tags(tags)

    def undo(self, seq_id: int) -> None:
        """Give back a slot just taken, its KV cleared (the sequence could not start)."""
        self.free_ids.appendleft(seq_id)
        self.cached.pop(seq_id, None)
        L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self._held(seq_id, None)  # kv-events

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot, keeping its KV for a later request (with the prefix cache): its prompt's
        and, with ``keep_output``, its reply's computed tokens."""
        if self.prefix_cache and seq.n_past:
            held = seq.history[: min(seq.n_past, seq.n_history)] if self.keep_output else seq.tokens[: seq.n_past]
            self.cached[seq.seq_id] = held if len(held) else seq.tokens[: seq.n_past]
        else:
            L.llama_memory_seq_rm(self.mem, seq.seq_id, -1, -1)
        self._held(seq.seq_id, self.cached.get(seq.seq_id))  # kv-events
        self.free_ids.append(seq.seq_id)

    # ---- kv-events (issue 53): what the slots hold, for worker/engine/kvevents.py; nothing when it is off

    def _held(self, seq_id: int, tokens: np.ndarray | None) -> None:
        """Slot ``seq_id`` now holds ``tokens`` (None: nothing)."""
        if self.events is not None:
            if tokens is None:
                self.events.clear(seq_id)
            else:
                self.events.hold(seq_id, tokens, tag=self.tags.get(seq_id, b""))

    def grown(self, running: Iterable[Sequence]) -> None:
        """Once a step: the running sequences whose computed tokens completed a block since the last
        announcement have it announced (their prompt's and reply's tokens up to ``n_past``; a verified draft's
        tokens count once kept, in ``history``)."""
        ev = self.events
        if ev is None:
            return
        for s in running:
            n = min(s.n_past, s.n_history)
            if n // ev.block > ev.held(s.seq_id):
                ev.hold(s.seq_id, s.history[:n], extends=True, tag=self.tags.get(s.seq_id, b""))

    def cells(self, running: Iterable[Sequence]) -> int:
        """KV cells in use: running sequences' computed tokens and kept prefixes."""
        return sum(s.n_past for s in running) + sum(len(t) for t in list(self.cached.values()))
