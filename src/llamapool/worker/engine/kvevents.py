"""A worker's KV-cache events (issue 53): which full token blocks its KV holds, as llm-d's precise prefix-cache
scorer reads them (protocol/kvevents.py has the wire form; supervisor/kvevents.py publishes them).

Two media, as vLLM names them: ``GPU``, the slots' KV (a running sequence's computed tokens, a free slot's
cached prefix), and ``CPU``, the host-RAM tier's entries (worker/engine/hostkv.py). A holder (a slot, an
entry) holds a chain of full blocks of ``block`` tokens; a block's hash stands for every token up to its end,
seeded with the model's identity, so blocks are content-addressed: the same prefix held by two slots is one
block, announced once (a count of holders per medium and hash), and removed when its last holder lets it go.
A block's parent is held wherever it is (a holder holds a prefix), so parents are announced before their
children and outlive them. KV computed under a LoRA adapter set (its tag, worker/engine/adapters.py) is other
content: its chain is seeded with the tag too, and its blocks carry the set's name (``lora_name``).

Only the engine thread calls :class:`BlockTracker` (the hooks in kvcache.py and hostkv.py, and
``KVSlots.grown`` once a step); it only appends to ``events``, which the engine loop sends after each step.
"""

from __future__ import annotations

import hashlib

import numpy as np

from llamapool.protocol.kvevents import CPU, GPU, Cleared, Event, Removed, Stored

BLOCK = 16  # tokens a block: llm-d's default blockSizeTokens (its EPP's tokenProcessorConfig.blockSize)


def chain(prev: int | None, seed: bytes, tokens: np.ndarray, block: int) -> list[int]:
    """The hashes of the full blocks of ``tokens``, continuing the chain after ``prev`` (None: from the seed).
    Non-zero 64-bit integers (llm-d reads 0 as "no parent")."""
    data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    out, last, step = [], seed if prev is None else prev.to_bytes(8, "big"), 4 * block
    for i in range(len(tokens) // block):
        h = int.from_bytes(hashlib.blake2b(last + data[i * step:(i + 1) * step], digest_size=8).digest(), "big") or 1
        out.append(h)
        last = h.to_bytes(8, "big")
    return out


class BlockTracker:
    """What a worker's KV holds, in blocks, and the events that changes to it make (``events``; it starts
    with ``AllBlocksCleared``: a new worker holds nothing)."""

    def __init__(self, seed: bytes, block: int = BLOCK):
        self.seed, self.block = seed, block
        self.count: dict[tuple[str, int], int] = {}  # (medium, hash) -> holders
        self.hashes: dict[tuple[str, int], list[int]] = {}  # holder (medium, slot or entry id) -> its chain
        self.tokens: dict[tuple[str, int], np.ndarray] = {}  # holder -> the tokens of its full blocks
        self.tags: dict[tuple[str, int], bytes] = {}  # holder -> its adapter set's tag (absent: the base model's)
        self.names: dict[bytes, str] = {}  # an adapter set's tag -> its name (the engine says, kv-events)
        self.events: list[Event] = [Cleared()]

    def held(self, slot: int) -> int:
        """Full blocks announced for ``slot``."""
        return len(self.hashes.get((GPU, slot), ()))

    def hold(self, slot: int, tokens: np.ndarray, extends: bool = False, tag: bytes = b"") -> None:
        """Slot ``slot``'s KV now holds ``tokens`` (and nothing after them that a prompt could reuse), computed
        under the adapter set ``tag``. ``extends``: they extend what it held (a running sequence grew), which
        is then not compared."""
        self._set((GPU, slot), tokens, extends, tag)

    def clear(self, slot: int) -> None:
        self._set((GPU, slot), tokens=None)

    def stored(self, entry: int, tokens: np.ndarray, tag: bytes = b"") -> None:
        """The host tier now holds entry ``entry`` of ``tokens`` (KV of the adapter set ``tag``)."""
        self._set((CPU, entry), tokens, tag=tag)

    def dropped(self, entry: int) -> None:
        self._set((CPU, entry), tokens=None)

    def clear_all(self) -> None:
        """Every holder lets go (the engine closes: its KV is freed)."""
        for holder in list(self.hashes):
            self._set(holder, tokens=None)

    def take(self) -> list[Event]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[Event]:
        """What a new subscriber needs to hold the same view: ``AllBlocksCleared``, then every held block once
        (after events were lost on the way to the publisher)."""
        fresh = BlockTracker(self.seed, self.block)
        fresh.names = self.names
        for holder, toks in self.tokens.items():
            fresh._set(holder, toks, tag=self.tags.get(holder, b""))
        return fresh.events

    def _set(self, holder: tuple[str, int], tokens: np.ndarray | None, extends: bool = False,
             tag: bytes = b"") -> None:
        medium, b = holder[0], self.block
        old = self.hashes.get(holder, [])
        if self.tags.get(holder, b"") != tag:  # KV of another adapter set: nothing of the old chain is kept
            self._release(medium, old)
            self.hashes.pop(holder, None)
            self.tokens.pop(holder, None)
            old = []
        if tag and tokens is not None:
            self.tags[holder] = tag
        else:
            self.tags.pop(holder, None)
        n = 0 if tokens is None else len(tokens) // b
        if extends or tokens is None:
            keep = min(len(old), n)
        else:
            have = self.tokens.get(holder)
            keep = min(len(old), n)
            if keep and have is not None:
                diff = np.flatnonzero(have[: keep * b] != tokens[: keep * b])
                keep = int(diff[0]) // b if diff.size else keep
        self._release(medium, old[keep:])
        new = old[:keep] + chain(old[keep - 1] if keep else None, self.seed + tag, tokens[keep * b: n * b], b) \
            if tokens is not None and n > keep else old[:keep]
        if new:
            self.hashes[holder] = new
            assert tokens is not None
            self.tokens[holder] = np.array(tokens[: n * b], dtype=np.int32)
        else:
            self.hashes.pop(holder, None)
            self.tokens.pop(holder, None)
        if len(new) > keep:
            assert tokens is not None
            self._acquire(medium, new, keep, tokens, self.names.get(tag) if tag else None)

    def _acquire(self, medium: str, chain_: list[int], start: int, tokens: np.ndarray,
                 lora: str | None = None) -> None:
        """Count the holder in for blocks ``start..`` of its chain; the ones no holder had are announced, in
        runs of consecutive blocks (each run's parent is the block before it)."""
        b, run = self.block, -1
        for i in range(start, len(chain_) + 1):
            fresh = i < len(chain_) and self.count.get((medium, chain_[i]), 0) == 0
            if i < len(chain_):
                self.count[(medium, chain_[i])] = self.count.get((medium, chain_[i]), 0) + 1
            if fresh and run < 0:
                run = i
            elif not fresh and run >= 0:
                self.events.append(Stored(tuple(chain_[run:i]), chain_[run - 1] if run else None,
                                          tuple(int(t) for t in tokens[run * b: i * b]), b, medium, lora))
                run = -1

    def _release(self, medium: str, hashes: list[int]) -> None:
        """Count the holder out of ``hashes``; the ones no holder has any more are removed (children first)."""
        gone = []
        for h in reversed(hashes):
            left = self.count.get((medium, h), 0) - 1
            if left > 0:
                self.count[(medium, h)] = left
            else:
                self.count.pop((medium, h), None)
                gone.append(h)
        if gone:
            self.events.append(Removed(tuple(gone), medium))


__all__ = ["BLOCK", "BlockTracker", "chain"]
