"""Prompt lookup, a :class:`~llamapool.worker.engine.spec.Proposer`: a sequence's draft is what followed
the latest earlier occurrence of its last few tokens in its own prompt and output (n-gram matching).

One proposer a file (as vLLM's ``v1/spec_decode``); the policy that decides how many of a draft's tokens
a step verifies is ``speculator.py``'s. No llama.cpp here.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

NGRAM_MAX = 3  # the longest suffix looked up in the sequence's tokens
NGRAM_MIN = 2  # the shortest (single tokens match too often to be worth a row)
FOLLOW = 10  # tokens after a draft was found within which a lookup that finds none follows its copy on
MATCH_MAX = 32  # a match is followed back this many tokens at most (its length: what supports a draft)


def ngram_draft(hist: np.ndarray, k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``hist``'s last ``n`` tokens,
    the longest ``n`` from ``n_max`` down to ``n_min`` that occurs (prompt lookup: a scan, the reference
    that :class:`Lookup` must agree with)."""
    size = len(hist)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = hist[size - n:]
        at = np.flatnonzero(hist[: size - n] == tail[0])  # starts whose continuation is in hist
        for j in range(1, n):
            at = at[hist[at + j] == tail[j]]
        if at.size:
            start = int(at[-1]) + n
            return [int(t) for t in hist[start : start + k]]
    return []


def ngram_match(hist: np.ndarray, k: int) -> tuple[list[int], int]:
    """:func:`ngram_draft`'s draft and the length of its match: how many tokens before the draft's place
    equal ``hist``'s last ones (the n-gram found, followed back up to ``MATCH_MAX``; 0 without a draft)."""
    size = len(hist)
    for n in range(min(NGRAM_MAX, size - 1), NGRAM_MIN - 1, -1):
        tail = hist[size - n:]
        at = np.flatnonzero(hist[: size - n] == tail[0])
        for j in range(1, n):
            at = at[hist[at + j] == tail[j]]
        if at.size:
            start = int(at[-1]) + n
            m = n
            while m < MATCH_MAX and start - 1 - m >= 0 and hist[start - 1 - m] == hist[size - 1 - m]:
                m += 1
            return [int(t) for t in hist[start : start + k]], m
    return [], 0


class Lookup:
    """Prompt lookup (:func:`ngram_draft`) kept up to date a token at a time: where each n-gram of the
    sequence's tokens (``NGRAM_MIN`` to ``NGRAM_MAX`` long) last ended with a token after it, so a draft
    is a dict lookup. Scanning every sequence's tokens each step cost ~1 ms a step at 64 streams,
    host time between two decodes (H100, 1B: prompt lookup at 0.78x of off with nothing to draft)."""

    def __init__(self) -> None:
        self.grams: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest end
        self.toks: list[int] = []  # the sequence's tokens seen so far
        self.done = 0  # positions whose n-grams ending there are in ``grams``
        self.match = 0  # the last draft's match length (:func:`ngram_match`)
        self.source = -1  # where the last draft found came from (:meth:`follow`) ...
        self.at = 0  # ... and the sequence's length then

    def draft(self, hist: np.ndarray, size: int, k: int) -> list[int]:
        """:func:`ngram_draft`'s draft: up to ``k`` tokens that followed the latest earlier occurrence of
        the last ``n`` of ``hist[:size]``, the longest ``n`` that occurs (``hist``: this sequence's
        tokens so far, the ones of an earlier call among them)."""
        self.index(hist, size)
        toks, grams = self.toks, self.grams
        for n in range(min(NGRAM_MAX, size - 1), NGRAM_MIN - 1, -1):
            start = grams.get(tuple(toks[size - n : size]))
            if start is not None:
                m = n  # followed back: the draft's support (a long match copies a passage)
                while m < MATCH_MAX and start - 1 - m >= 0 and toks[start - 1 - m] == toks[size - 1 - m]:
                    m += 1
                self.match, self.source, self.at = m, start, size
                return toks[start : min(start + k, size)]
        self.match = 0
        return []

    def follow(self, size: int, k: int) -> list[int]:
        """Where the n-gram finds nothing shortly after a draft was found (``FOLLOW`` tokens): the copy
        that draft came from, followed on as if the tokens since had replaced as many there (an edited
        passage: after a token that differs, the last n-gram is new for two more tokens, and a copy with
        an edit every ten tokens lost those steps' drafts)."""
        if self.source < 0 or size - self.at > FOLLOW:
            return []
        p = self.source + size - self.at
        return self.toks[p : min(p + k, size)] if p < size else []

    def index(self, hist: np.ndarray, size: int) -> None:
        """Index ``hist[:size]`` (this sequence's tokens so far) ahead of the next :meth:`draft`, which then
        indexes at most the tokens that came since."""
        toks = self.toks
        if len(toks) < size:
            toks += hist[len(toks) : size].tolist()
        if self.done < size - 1:
            self._index(size - 1)

    def _index(self, end: int) -> None:
        """Index the n-grams that end at ``done`` to ``end - 1`` (each has a token after it)."""
        toks, grams, done = self.toks, self.grams, self.done
        if end - done > 8:  # a prompt: each length's n-grams in one zip
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                first = max(done, n - 1)  # the first end to index
                grams.update(zip(zip(*(toks[first - n + 1 + j : end - n + 1 + j] for j in range(n)), strict=True),
                                 range(first + 1, end + 1), strict=True))
        else:  # a step's tokens
            for e in range(done, end):
                for n in range(NGRAM_MIN, min(NGRAM_MAX, e + 1) + 1):
                    grams[tuple(toks[e - n + 1 : e + 1])] = e + 1
        self.done = end


class _Drafting(Protocol):
    lookup: Lookup


class Looking(Protocol):
    """What prompt lookup reads of a sequence (spec.Speculating's part; declared here, where it is used,
    so that spec.py, which makes the lookups, and this file do not import each other)."""

    history: np.ndarray
    n_history: int

    @property
    def drafting(self) -> _Drafting | None: ...


class PromptLookup:
    """The n-gram proposer: each sequence's :class:`Lookup` (kept in its ``Drafting``), indexed after the
    launch (:meth:`prepare`) so that the lookup before the next one is a dict read; a draft's support is
    its match length (1 for a copy followed past an edit: :meth:`Lookup.follow`)."""

    def propose(self, seq: Looking, k: int) -> tuple[list[int], int]:
        assert seq.drafting is not None
        look = seq.drafting.lookup
        draft = look.draft(seq.history, seq.n_history, k)
        if draft:
            return draft, look.match
        return look.follow(seq.n_history, k), 1  # a guess: supported by no match

    def prepare(self, seq: Looking) -> None:
        assert seq.drafting is not None
        seq.drafting.lookup.index(seq.history, seq.n_history)

    def close(self) -> None:
        pass
