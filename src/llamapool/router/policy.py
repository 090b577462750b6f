"""Routing policy: which ready worker takes the next prompt."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol, TypeVar

from llamapool.protocol.media import as_text
from llamapool.protocol.messages import Prompt

TEXT_PREFIXES = (64, 256)  # characters: the short keys; then one a TEXT_BLOCK
TOKEN_PREFIXES = (16, 64)  # token ids: the short keys; then one a TOKEN_BLOCK
TEXT_BLOCK = 1024
TOKEN_BLOCK = 256
MAX_BLOCKS = 512  # block keys a prompt gets (128k tokens): past them its longest key stands for the rest
MAX_REMEMBERED = 65536  # prefix keys remembered per worker (a worker's host KV tier holds many sessions)


class Candidate(Protocol):
    name: str
    prefixes: OrderedDict[int, None]

    @property
    def free(self) -> int: ...

    @property
    def routable(self) -> bool: ...


W = TypeVar("W", bound=Candidate)


def prefix_keys(prompt: Prompt) -> tuple[int, ...]:
    """Hashes of the prompt's leading pieces, shortest first (the router cannot tokenize): a few short ones,
    then a hash chain over whole blocks, so that an agent's returning turn (its previous prompt, the reply
    and more) shares a key with its previous turn as long as most of that turn, not only a common system
    prompt, and finds the worker whose KV (in a slot or its host tier) holds it."""
    if prompt and isinstance(prompt[0], dict):  # chat messages: the text they render from
        # (an image as its hash: protocol/media.py)
        prompt = "".join(f"\x00{m['role']}\x00{as_text(m['content'])}" for m in prompt)  # type: ignore[index]
    seq: str | tuple[int, ...]
    if isinstance(prompt, str):
        seq, short, block = prompt, TEXT_PREFIXES, TEXT_BLOCK
    else:
        seq, short, block = tuple(prompt), TOKEN_PREFIXES, TOKEN_BLOCK  # type: ignore[arg-type]
    keys = [hash(seq[:n]) for n in short if len(seq) >= n]
    chained = 0
    for i in range(min(len(seq) // block, MAX_BLOCKS)):
        chained = hash((chained, seq[i * block:(i + 1) * block]))
        keys.append(chained)
    return tuple(keys)


def pick_worker(workers: Iterable[W], keys: tuple[int, ...] = (), slack: int = 0) -> W | None:
    """The routable worker with the most free slots (ties: lowest name), or None if all are full.

    With prefix ``keys``: a worker that recently ran a prompt with the longest shared prefix is
    preferred while its free slots are within ``slack`` of the least-loaded worker's, since its
    KV cache may still hold that prefix. Workers out of routing are never chosen.
    """
    open_ = [w for w in workers if w.routable and w.free > 0]
    if not open_:
        return None
    best = max(open_, key=lambda w: (w.free, _neg(w.name)))
    for key in reversed(keys):
        holders = [w for w in open_ if key in w.prefixes]
        if holders:
            w = max(holders, key=lambda w: (w.free, _neg(w.name)))
            if w.free >= best.free - slack:
                return w
            break
    return best


def remember(w: Candidate, keys: tuple[int, ...]) -> None:
    for key in keys:
        w.prefixes[key] = None
        w.prefixes.move_to_end(key)
    while len(w.prefixes) > MAX_REMEMBERED:
        w.prefixes.popitem(last=False)


def _neg(name: str) -> tuple[int, ...]:
    """Order names so that max() picks the lowest one."""
    return tuple(-ord(c) for c in name)
