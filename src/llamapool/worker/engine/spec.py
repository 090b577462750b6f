"""Speculative decoding: draft tokens proposed for a sequence and verified in the shared batch.

A speculating sequence puts its last token and ``k`` draft tokens into the step's batch, every one with
logits. Its rows are then sampled in order, exactly as if they were steps of their own: the token of
row ``i`` is picked from row ``i``'s logits with the sequence's own sampler chain (penalties, bias,
grammar mask, seeded draw), and while it equals draft ``i + 1`` the next row's is taken too. The first
disagreement (or the last row) ends it; the positions of the drafts not kept leave the KV cache
(``llama_memory_seq_rm``). Every row's logits depend only on the tokens before it, so:

- greedy output is token-for-token the output without speculation;
- sampled output keeps its distribution: a draft ``d`` is accepted exactly when the token sampled
  from ``p`` is ``d`` (probability ``p(d)``), and when it is not, the token sampled is distributed as
  ``p`` without ``d``, renormalised: speculative sampling's accept/resample rule for a draft that puts
  all its probability on ``d``. One draw is made per output token, as without speculation, so a seeded
  request gives the same text either way.

Drafts come from the sequence itself (prompt lookup): the longest recent n-gram match of its last
tokens in its prompt and output proposes the tokens that followed it. How many a sequence may draft
adapts to its acceptance (:class:`Drafting`), and how many a step carries is the step's business
(:func:`afford`): a draft token costs what a batch row costs, and pays its expected acceptance.
No llama.cpp here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llamapool.protocol import limits

MAX_DRAFT = limits.MAX_DRAFT  # draft tokens a sequence proposes at most a step (a request may ask for fewer)
NGRAM_MAX = 3  # the longest suffix looked up in the sequence's tokens
NGRAM_MIN = 2  # the shortest (single tokens match too often to be worth a row)
PRIOR = 0.5  # a new sequence's acceptance estimate
EMA = 0.3  # how much one step's acceptance moves the estimate
WORTH = 0.1  # a draft position is proposed while its chance of acceptance is at least this


@dataclass(eq=False)
class Drafting:
    """One sequence's speculation: its acceptance estimate (per draft token, an exponential average),
    the draft of the step in flight, and its counts."""

    limit: int = MAX_DRAFT  # the most draft tokens a step
    rate: float = PRIOR
    draft: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def depth(self) -> int:
        """Draft tokens worth proposing: while ``rate ** j`` (draft ``j`` accepted) stays above ``WORTH``."""
        if self.rate >= 0.99:
            return self.limit
        if self.rate <= WORTH:
            return 1
        return max(1, min(self.limit, int(math.log(WORTH) / math.log(self.rate))))

    def verified(self, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` tokens and kept the first ``accepted``. The estimate counts a
        token drafted after the first rejection as a rejection, not knowing better."""
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.rate += EMA * (accepted / drafted - self.rate)

    def idle(self) -> None:
        """A step without a draft: the estimate drifts back towards the prior (text changes course)."""
        self.rate += 0.02 * (PRIOR - self.rate)


def ngram_draft(hist: np.ndarray, k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``hist``'s last ``n`` tokens,
    the longest ``n`` from ``n_max`` down to ``n_min`` that occurs (prompt lookup)."""
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


class Proposer(Protocol):
    """Another source of drafts than prompt lookup (:func:`ngram_draft`, the engine's own when it has none):
    benchmarks in-process only (scripts/spec_oracle.py), no setting names one."""

    def __call__(self, rid: int, hist: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``hist`` (request ``rid``'s prompt and output so far)."""
        ...


WIDTHS = (1, 3, MAX_DRAFT)  # a step's draft tokens a sequence: few batch shapes, llama.cpp's graphs kept
STICKY = 0.97  # the last step's width stays unless another one promises this much more


def width(chances: dict[int, list[float]], step_s: float, draft_s: float, outputs: int, rows: int, most: int,
          last: int = 0) -> int:
    """The step's draft width ``k``: every decoding sequence, and every padding slot between them (``rows`` in
    all), carries ``k`` tokens after its own, its draft cut or filled up to ``k`` with filler tokens that are
    computed and dropped. llama.cpp computes a batch of per-sequence KV streams in micro-batches of equally
    many tokens a sequence, so drafts of unequal lengths would split the step into one micro-batch per
    length, each reading the weights again.

    ``chances[key][j]`` is draft ``j + 1``'s chance of being accepted; a width ``k`` costs ``rows * k``
    tokens of ``draft_s`` each and yields the chances of every draft's first ``k`` tokens. The width of
    most expected tokens a second among ``WIDTHS`` (each cut to the longest draft and to ``most``) or
    none; ``last`` stays unless another beats it by ``1 / STICKY`` (a new shape: llama.cpp's graph built
    again)."""
    seconds = max(step_s, 1e-9)

    def speed(k: int) -> float:
        gain = sum(sum(cs[:k]) for cs in chances.values())
        return (max(outputs, 1) + gain) / (seconds + k * rows * draft_s)

    longest = max((len(cs) for cs in chances.values()), default=0)
    speeds = {k: speed(k) for k in (0, *(min(w, longest, most) for w in WIDTHS)) if k >= 0}
    best = max(speeds, key=lambda k: speeds[k])
    if last in speeds and speeds[last] >= STICKY * speeds[best]:
        return last
    return best
