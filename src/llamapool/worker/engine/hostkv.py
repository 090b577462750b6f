"""The host-RAM KV tier: a sequence's KV copied out of its slot before the slot is overwritten, and copied
back when a prompt that starts with the same tokens returns (an agent's next turn, a shared system prompt).

An entry is one sequence's state as llama.cpp serializes it (``llama_state_seq_get_data_ext``: its cells'
positions and every layer's K and V rows), with the tokens whose KV it holds. Entries are found by a hash
chain over fixed-size token blocks (``BLOCK``; a block's hash covers every token before it, seeded with the
model's identity), so a prompt that shares only the first blocks of an entry still finds it; the match is
then checked token by token. Restoring copies the whole entry into a free slot and trims it to the shared
prefix. The store is bounded in bytes and drops its least recently used entries first; an entry whose
tokens a newer one extends (the same session one turn later) is dropped when the newer one is saved.

Only the engine thread calls into :class:`HostTier` (the llama calls); :class:`HostStore` is plain Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.protocol.messages import KVPart
from llamapool.worker import handover
from llamapool.worker.engine.kvevents import BlockTracker
from llamapool.worker.engine.pinned import HostBuffers
from llamapool.worker.handover import Received

BLOCK = 16  # tokens a block (the hash chain's step; llm-d's default block size)
# Saving costs a copy out of the KV cache on the engine thread (8B: ~128 KiB a token). Where the tier finds
# nothing (prompts that never come back: a RAG load of random documents) saves cost steps for nothing, so
# after WARMUP saves with fewer than one hit in RARE, only one save in SAMPLE is made (the tier keeps probing).
WARMUP, RARE, SAMPLE = 32, 16, 16
DECAY = 0.98  # the saves' and hits' weights halve in ~35 events
_FLAGS = 0  # LLAMA_STATE_SEQ_FLAGS_NONE: the whole sequence, in host memory


def block_hashes(tokens: np.ndarray, seed: bytes, block: int = BLOCK) -> list[int]:
    """The chained 64-bit hashes of the full blocks of ``tokens``: hash ``i`` stands for ``tokens[: (i+1)*block]``
    (never 0; seeded with ``seed``, so two models never share a hash for different KV)."""
    data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    out, prev, step = [], seed, 4 * block
    for i in range(len(tokens) // block):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big") or 1)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(eq=False)
class Entry:
    """One saved sequence: the tokens its KV holds, llama.cpp's serialized state of them, their block hashes."""

    tokens: np.ndarray  # int32
    blob: np.ndarray  # uint8
    hashes: list[int]
    identity: bytes  # the model file and build it was computed by (and its adapter set's tag)
    held: int = 0  # bytes it takes of the bound (a page-locked slab: pinned.py); 0: its state's own
    tag: bytes = b""  # the LoRA adapter set it was computed under (worker/engine/adapters.py): b"", the base

    @property
    def nbytes(self) -> int:
        return self.held or int(self.blob.nbytes)


@dataclass
class TierStats:
    """The tier's counters (cumulative, but ``bytes`` and ``entries``: what it holds now)."""

    bytes: int = 0
    entries: int = 0
    capacity: int = 0
    hits: int = 0  # prompts that found a longer prefix here than in VRAM, and restored it
    misses: int = 0  # prompts of at least a block that found nothing here
    skipped: int = 0  # prompts that found an entry but recomputing was cheaper
    restores: int = 0
    restored_tokens: int = 0
    bytes_restored: int = 0
    restore_seconds: float = 0.0
    saves: int = 0
    unsaved: int = 0  # slots' KV not saved: the tier lately found nothing for prompts (sampled saves)
    bytes_saved: int = 0
    save_seconds: float = 0.0
    save_wait_seconds: float = 0.0  # of save_seconds: waiting for the GPU's queued work (llama_synchronize)
    save_alloc_seconds: float = 0.0  # of save_seconds: sizing the state and finding its host memory
    saves_pageable: int = 0  # saves into pageable memory on a GPU worker (no page-locked slab fit: slower)
    evictions: int = 0  # entries dropped for room (LRU) or superseded by a longer one
    failed: int = 0  # entries llama.cpp would not restore, or mismatched ones: dropped, the prompt recomputed
    handed_out: int = 0  # entries sent to a sibling worker (drain)
    handed_in: int = 0  # entries received from one
    refused: int = 0  # received entries dropped (another model or build, a bad checksum, no room)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class HostStore:
    """Entries by id, least recently used first, a block hash -> ids index, and the byte bound."""

    capacity: int
    identity: bytes
    on_drop: Callable[[np.ndarray], None] = lambda blob: None  # an entry's state is no longer used
    stats: TierStats = field(default_factory=TierStats)
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    index: dict[int, dict[int, None]] = field(default_factory=dict)
    kept: int = -1  # an entry about to be restored: never dropped to make room (HostTier.hold)
    _next: int = 0
    events: BlockTracker | None = None  # kv-events: the entries' blocks, CPU medium (worker/engine/kvevents.py)

    def __post_init__(self) -> None:
        self.stats.capacity = self.capacity

    def find(self, tokens: np.ndarray, hashes: list[int]) -> tuple[int, int]:
        """(entry id, tokens of ``tokens`` it holds) for the entry sharing the most blocks with the prompt; (-1, 0)."""
        for k in range(len(hashes) - 1, -1, -1):
            ids = self.index.get(hashes[k])
            if ids:
                best, n = -1, 0
                for eid in ids:
                    m = common_prefix(self.entries[eid].tokens, tokens)
                    if m > n:
                        best, n = eid, m
                if best >= 0:
                    return best, n
        return -1, 0

    def covers(self, tokens: np.ndarray, hashes: list[int]) -> bool:
        """Whether an entry already holds all of ``tokens`` (it is touched as just used)."""
        eid, n = self.find(tokens, hashes)
        if eid >= 0 and n == len(tokens):
            self.entries.move_to_end(eid)
            return True
        return False

    def add(self, entry: Entry) -> bool:
        """Keep ``entry``, dropping the entries it extends and then the least recently used until it fits."""
        if entry.nbytes > self.capacity or not entry.hashes:
            return False
        self.make_room(entry.tokens, entry.hashes, entry.nbytes)
        if self.stats.bytes + entry.nbytes > self.capacity:  # the kept entry leaves no room
            return False
        eid, self._next = self._next, self._next + 1
        self.entries[eid] = entry
        for h in entry.hashes:
            self.index.setdefault(h, {})[eid] = None
        self.stats.bytes += entry.nbytes
        self.stats.entries = len(self.entries)
        if self.events is not None:  # kv-events
            self.events.stored(eid, entry.tokens, entry.tag)
        return True

    def make_room(self, tokens: np.ndarray, hashes: list[int], nbytes: int) -> None:
        """Drop the entries that ``tokens`` extend, then the least recently used until ``nbytes`` more fit."""
        for eid in list(self.index.get(hashes[0], ())) if hashes else ():
            old = self.entries[eid]
            if eid != self.kept and len(old.tokens) <= len(tokens) \
                    and common_prefix(old.tokens, tokens) == len(old.tokens):
                self.drop(eid)
                self.stats.evictions += 1
        while self.stats.bytes + nbytes > self.capacity:
            victim = next((eid for eid in self.entries if eid != self.kept), None)
            if victim is None:
                break
            self.drop(victim)
            self.stats.evictions += 1

    def drop(self, eid: int) -> None:
        entry = self.entries.pop(eid)
        self.on_drop(entry.blob)
        for h in entry.hashes:
            ids = self.index.get(h)
            if ids is not None:
                ids.pop(eid, None)
                if not ids:
                    del self.index[h]
        self.stats.bytes -= entry.nbytes
        self.stats.entries = len(self.entries)
        if self.events is not None:  # kv-events
            self.events.dropped(eid)

    def newest(self, limit: int) -> list[Entry]:
        """Up to ``limit`` bytes of entries, most recently used first (what a drain hands over)."""
        out, total = [], 0
        for entry in reversed(self.entries.values()):
            if total + entry.nbytes > limit:
                continue
            out.append(entry)
            total += entry.nbytes
        return out


class HostTier:
    """The store, and the llama calls that fill it from a slot and restore a slot from it."""

    def __init__(self, ctx: Any, capacity: int, identity: bytes, prefill_s: Callable[[int], float | None],
                 gpu: bool = False, max_tokens: int = 0, seq_id: int = 0):
        self.ctx = ctx
        # page-locked slabs on a GPU (pinned.py), each a slot's largest state (``seq_id``: an empty slot to probe)
        per, fixed = state_size(ctx, seq_id) if gpu and max_tokens else (0, 0)
        self.buffers = HostBuffers(gpu, capacity, per * max_tokens + fixed if per else 0)
        self.store = HostStore(capacity, identity, self.buffers.give)
        self.identity = identity
        self.prefill_s = prefill_s  # the fitted seconds of computing n prompt tokens (None: not fitted yet)
        self.s_per_byte: float | None = None  # restore cost, measured
        self.recent_saves = self.recent_hits = 0.0  # decayed counts (WARMUP, RARE, SAMPLE)
        self._sampled = 0

    @property
    def stats(self) -> TierStats:
        return self.store.stats

    def hashes(self, tokens: np.ndarray, tag: bytes = b"") -> list[int]:
        """The block hashes of ``tokens`` as KV computed under the LoRA adapter set ``tag`` (b"": the base
        model's; worker/engine/adapters.py): KV of another set never shares a hash."""
        return block_hashes(tokens, self.identity + tag)

    def save(self, seq_id: int, tokens: np.ndarray, tag: bytes = b"") -> None:
        """Copy slot ``seq_id``'s KV of ``tokens`` (its cells beyond them already removed, computed under the
        adapter set ``tag``) into the store."""
        hashes = self.hashes(tokens, tag)
        if not hashes or self.store.covers(tokens, hashes) or not self._worth_saving():
            return
        t0 = time.perf_counter()
        L.llama_synchronize(self.ctx)
        t1 = time.perf_counter()
        size = state_bytes(self.ctx, seq_id)
        if size <= 0 or size > self.store.capacity:
            return
        self.store.make_room(tokens, hashes, self.buffers.bound(size))  # first: a dropped entry's slab is reused
        blob = self.buffers.get(size)
        t2 = time.perf_counter()
        wrote = L.llama_state_seq_get_data_ext(self.ctx, _ptr(blob), size, seq_id, _FLAGS)
        if wrote != size:
            self.buffers.give(blob)
            return
        self.stats.save_wait_seconds += t1 - t0
        self.stats.save_alloc_seconds += t2 - t1
        self.stats.saves_pageable += self.buffers.pinned and not self.buffers.held_pinned(blob)
        entry = Entry(np.array(tokens, dtype=np.int32), blob, hashes, self.identity + tag, self.buffers.held(blob),
                      tag)
        if not self.store.add(entry):
            self.buffers.give(blob)
        else:
            self.recent_saves = DECAY * self.recent_saves + 1
            self.recent_hits *= DECAY
            self.stats.saves += 1
            self.stats.bytes_saved += size
            self.stats.save_seconds += time.perf_counter() - t0

    def _worth_saving(self) -> bool:
        """False for all but one save in SAMPLE once the tier has lately found less than one prompt in RARE."""
        if self.stats.saves < WARMUP or self.recent_hits * RARE >= self.recent_saves:
            return True
        self._sampled = (self._sampled + 1) % SAMPLE
        if self._sampled:
            self.stats.unsaved += 1
        return not self._sampled

    def lookup(self, tokens: np.ndarray, limit: int, vram: int, tag: bytes = b"") -> tuple[int, int]:
        """(entry id, tokens to reuse) when restoring beats both the VRAM prefix ``vram`` and recomputing;
        (-1, 0) otherwise. At most ``limit`` tokens are reused, of KV computed under the adapter set ``tag``."""
        hashes = self.hashes(tokens[:limit], tag)
        if not hashes:
            return -1, 0
        eid, n = self.store.find(tokens[:limit], hashes)
        n = min(n, limit)
        if eid < 0 or n <= vram:
            self.stats.misses += eid < 0
            return -1, 0
        entry = self.store.entries[eid]
        recompute = self.prefill_s(n - vram)
        if recompute is not None and self.s_per_byte is not None and self.s_per_byte * entry.blob.nbytes >= recompute:
            self.stats.skipped += 1
            return -1, 0
        return eid, n

    def drop_tags(self, tags: set[bytes]) -> None:
        """Drop the entries computed under the adapter sets ``tags`` (an adapter of theirs was freed)."""
        for eid in [e for e, entry in self.store.entries.items() if entry.tag in tags and e != self.store.kept]:
            self.store.drop(eid)

    def hold(self, eid: int) -> None:
        """Keep entry ``eid`` (-1: none) from being dropped while a slot is emptied for its restore (emptying
        it saves that slot's KV, which may need room)."""
        self.store.kept = eid

    def restore(self, eid: int, seq_id: int, n: int, tag: bytes = b"") -> bool:
        """Copy entry ``eid`` into the empty slot ``seq_id`` and keep its first ``n`` tokens; False (the slot
        left empty, the entry dropped) when llama.cpp refuses it or it is not this model's."""
        entry = self.store.entries.get(eid)
        if entry is None:  # dropped meanwhile (not expected: ``hold`` keeps it)
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), seq_id, -1, -1)
            return False
        size = int(entry.blob.nbytes)
        t0 = time.perf_counter()
        ok = entry.identity == self.identity + tag and \
            L.llama_state_seq_set_data_ext(self.ctx, _ptr(entry.blob), size, seq_id, _FLAGS) == size
        if not ok:
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), seq_id, -1, -1)
            self.store.drop(eid)
            self.stats.failed += 1
            return False
        L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), seq_id, n, -1)
        seconds = time.perf_counter() - t0
        per = seconds / max(1, entry.blob.nbytes)
        self.s_per_byte = per if self.s_per_byte is None else 0.8 * self.s_per_byte + 0.2 * per
        self.store.entries.move_to_end(eid)
        self.recent_hits += 1
        s = self.stats
        s.hits += 1
        s.restores += 1
        s.restored_tokens += n
        s.bytes_restored += entry.blob.nbytes
        s.restore_seconds += seconds
        return True

    def take_in(self, got: Received) -> bool:
        """An entry a draining sibling handed over: kept when it is this model's and build's and intact."""
        hashes = block_hashes(got.tokens, got.identity)  # its identity carries its adapter set's tag
        mine = got.identity[: len(self.identity)] == self.identity
        if not mine or not got.intact or self.store.covers(got.tokens, hashes) \
                or not self.store.add(Entry(got.tokens, got.blob, hashes, got.identity,
                                            tag=got.identity[len(self.identity):])):
            self.stats.refused += 1
            return False
        self.stats.handed_in += 1
        return True

    def close(self) -> None:
        """Let go of the page-locked memory (the engine is closing)."""
        self.store.entries.clear()
        self.buffers.close()

    def hand_out(self) -> Iterator[KVPart]:
        """The newest entries, as parts for a sibling (a drain; ``handover.parts`` bounds its time)."""
        for part in handover.parts((e.tokens, e.blob, e.identity) for e in self.store.newest(self.store.capacity)):
            self.stats.handed_out += part.part == part.parts - 1
            yield part


def state_bytes(ctx: Any, seq_id: int) -> int:
    """The bytes of sequence ``seq_id``'s serialized state (its cells' positions and KV)."""
    return int(L.llama_state_seq_get_size_ext(ctx, seq_id, _FLAGS))


def state_size(ctx: Any, seq_id: int, n: int = 32) -> tuple[int, int]:
    """(bytes a token, bytes besides) of a sequence's serialized state: ``n`` tokens decoded into the empty
    sequence ``seq_id``, its state measured with all and with half of them, and removed again (at start,
    before the worker serves). (0, 0) when the decode fails."""
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(n, 0, 1)
    try:
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 0, i, 1, i == n - 1
            batch.seq_id[i][0] = seq_id
        batch.n_tokens = n
        if L.llama_decode(ctx, batch) != 0:
            return 0, 0
        L.llama_synchronize(ctx)
        full = state_bytes(ctx, seq_id)
        L.llama_memory_seq_rm(mem, seq_id, n // 2, -1)
        half = state_bytes(ctx, seq_id)
        L.llama_memory_seq_rm(mem, seq_id, -1, -1)
        per = (full - half) // (n - n // 2)
        return per, max(0, half - per * (n // 2))
    finally:
        L.llama_batch_free(batch)


def _ptr(blob: np.ndarray) -> Any:
    return blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def model_identity(model_path: str, *facts: object) -> bytes:
    """What an entry is tied to: the model file (path, size, mtime), llama.cpp's build, and the facts that
    shape its KV (device kind, flash attention). Entries of another identity are never restored."""
    st = os.stat(model_path)
    build = getattr(L, "__version__", "")
    info = L.llama_print_system_info()
    text = repr((os.path.realpath(model_path), st.st_size, st.st_mtime_ns, build, info, facts))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


__all__ = ["BLOCK", "Entry", "HostStore", "HostTier", "TierStats", "block_hashes", "model_identity"]
