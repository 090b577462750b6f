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
is the step's business (:class:`WidthCosts`): each width's measured step time against the tokens its
drafts are expected to keep, from each sequence's acceptance estimate (:class:`Drafting`), which learns
from the drafts verified and, for free, from the drafts made but not verified (``Drafting.watch``).
No llama.cpp here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llamapool.protocol import limits
from llamapool.worker.engine.ngram import MATCH_MAX, Lookup

MAX_DRAFT = limits.MAX_DRAFT  # draft tokens a sequence proposes at most a step (a request may ask for fewer)
PRIOR = 0.5  # a new sequence's acceptance estimate
DECAY = 0.9  # a step's weight in the acceptance estimate, against the one after it: in spec_sim.py (git history)
# (the H100's step costs) 0.7 lost 5-25 % to three drafts every step at one stream, alpha 0.7 drawn by
# token or in spans, widening on a lucky streak and stopping on an unlucky one; 0.9 is within 2-4 %
SHRINK = 10.0  # the worker's recent acceptance weighs as this many tokens tried in a width's chances
DRIFT = 0.02  # a step without a draft moves the estimate this share of the way back to the prior
# Acceptance by match length (a draft's support: how many tokens before its place match the sequence's
# last ones). Right after an edit of a copied passage the n-gram finds its place again on two or three
# tokens and is often wrong; a long match copies on. So each sequence's estimate is also kept per band of
# match lengths (2-3, 4-7, 8-15, 16-31, 32: ``match_band``), and a draft is cut to its match's length.
MATCH_BANDS = 5
MATCH_PRIOR = (0.5, 0.55, 0.65, 0.75, 0.85)  # the worker's estimate per band before any draft is seen
SHRINK_MATCH = 3.0  # a band's prior (below) weighs as this many tokens tried against the sequence's own
LONG_MATCH = 16  # a match this long is judged by the worker's long matches, not the sequence's record:
# a sequence whose drafts kept failing comes back on a long clean match
MATCH_FACTOR = 2.0  # a draft is at most this times its match length (vLLM's suffix decoding: 1)
DECLINE_BACKOFF = 16  # steps at most between the lookups of a sequence whose drafts are not worth making
REACH = 4  # a draft model's first draft length for a sequence (:attr:`Drafting.reach`: then by its drafts)
MODEL_MAX = 16  # a draft model's draft tokens a step at most: each costs a call of the draft model, and
# more of them a step spread the verify step's cost (measured on an H200, 8B target, a 1B-shape draft
# always right: 1.5 ms a call, a width-16 step 9.9 ms, 13.3 tokens a step, 1.94x llama-server)


@dataclass(eq=False)
class Drafting:
    """One sequence's speculation: its acceptance estimate, the draft of the step in flight, and its counts.

    The estimate is of ``alpha``, the chance that a draft token is kept given the one before it was:
    a step that kept ``a`` of ``d`` drafts saw ``a`` tokens kept and, when ``a < d``, one refused (the
    tokens after the first refusal tell nothing), so ``alpha`` is kept / (kept + refused) over the
    recent steps (sums that halve in ~7 steps, from a prior of ``PRIOR``). Counting every draft token
    after a refusal as refused instead reads 0.27 for 8 drafts at ``alpha`` 0.7."""

    limit: int = MAX_DRAFT  # the most draft tokens a step
    rate: float = PRIOR
    prior: float = PRIOR  # where the estimate starts: the worker's recent acceptance (:class:`Pool`)
    draft: list[int] = field(default_factory=list)
    lookup: Lookup = field(default_factory=Lookup)
    drafted: int = 0
    accepted: int = 0
    kept_w: float = PRIOR  # recent tokens kept, decayed
    tried_w: float = 1.0  # recent tokens kept and refusals, decayed
    refused: int = 0  # refusals (a step's first draft token not kept) since it began
    shadow: list[int] = field(default_factory=list)  # a draft not verified, checked against the tokens after it
    matched: int = 0  # the shadow's tokens generated so far
    misses: int = 0  # lookups in a row that found no draft
    quiet_until: int = 0  # the step before which it looks up no draft (:meth:`missed`, :meth:`declined`)
    match: int = 0  # the support of the last draft made (``match_band``)
    shadow_match: int = 0  # the shadow's
    declines: int = 0  # lookups in a row whose draft was not worth making (:meth:`declined`)
    kept_m: list[float] = field(default_factory=lambda: [0.0] * MATCH_BANDS)  # tokens kept, decayed, a band
    tried_m: list[float] = field(default_factory=lambda: [0.0] * MATCH_BANDS)  # kept and refusals, a band
    reach: int = REACH  # a draft model's next draft length at most (:meth:`verified`)

    def __post_init__(self) -> None:
        if self.prior != PRIOR:
            self.rate, self.kept_w = self.prior, self.prior * self.tried_w

    def chances(self, n: int, pool: float | None = None) -> list[float]:
        """Each of ``n`` draft tokens' chance of being kept (the one before it kept too), from the estimate
        drawn towards ``pool`` (the worker's recent acceptance) as if ``SHRINK`` tokens had been tried at
        it: a few steps' counts are noisy, and the width chosen from them flips (at one stream, alpha 0.8,
        on an H100 a third of the steps went to width 8 on a lucky streak, 10 % slower than three drafts
        every step)."""
        rate = self.rate if pool is None else (self.kept_w + SHRINK * pool) / (self.tried_w + SHRINK)
        return [rate ** (j + 1) for j in range(n)]

    def alpha(self, pool: Pool, match: int | None = None) -> float:
        """The chance that a draft token of a draft supported by ``match`` (default: the last draft's) is
        kept: the sequence's record in the match's band, drawn towards a prior as if ``SHRINK_MATCH``
        tokens had been tried at it. The prior is the sequence's own estimate drawn towards the worker's
        record of the band (``Pool.band``, as :meth:`chances` towards its whole record), and for a long
        match (``LONG_MATCH``) at least that record, whatever the sequence's own: a long clean match brings
        a sequence whose drafts kept failing back."""
        m = self.match if match is None else match
        b = match_band(m)
        prior = (self.kept_w + SHRINK * pool.band(b)) / (self.tried_w + SHRINK)
        if m >= LONG_MATCH:
            prior = max(prior, pool.band(b))
        return (self.kept_m[b] + SHRINK_MATCH * prior) / (self.tried_m[b] + SHRINK_MATCH)

    def chances_of(self, n: int, pool: Pool) -> list[float]:
        """Each of ``n`` draft tokens' chance of being kept (the one before it kept too), for the last draft
        made (:meth:`alpha` at its match)."""
        a = self.alpha(pool)
        return [a ** (j + 1) for j in range(n)]

    def verified(self, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` tokens and kept the first ``accepted``. A draft model's next draft
        (:attr:`reach`) is twice as long after a draft kept whole (up to :attr:`limit`), and one longer
        than the tokens kept after a refusal (llama.cpp's n-gram drafts: capped at what was accepted last
        time; SGLang's steps follow the accepted length): a draft model always right drafts 4, then 8; one
        never right drafts one token, a call of the draft model, until its estimate stops it."""
        if drafted:
            self.reach = min(self.limit, 2 * self.reach) if accepted >= drafted else max(1, accepted + 1)
        self.drafted += drafted
        self.shadow = []
        self.declines = 0
        self.learn(drafted, accepted, self.match)

    def declined(self, step: int, longest: int = DECLINE_BACKOFF) -> None:
        """A draft made at ``step`` was not worth making (its chance under the step's threshold; or the
        step's width was none: ``longest`` ``LOOKUP_BACKOFF``): the sequence backs off, its next lookup
        waiting 2, 4, ... up to ``longest`` steps, and costs nothing meanwhile (no lookup, no indexing);
        the draft is watched (:meth:`watch`), so a text that turns copyable brings it back."""
        self.declines += 1
        self.quiet_until = step + min(1 << self.declines, longest)

    def missed(self, step: int) -> None:
        """A lookup at ``step`` found no draft: the next one waits 1, 2, then ``LOOKUP_BACKOFF`` steps (text
        that repeats nothing costs a lookup a step for nothing: on an H100 at 64 streams, prompt lookup's
        host time was ~0.6-1 ms of a ~5 ms step; a copy that begins is found within a few tokens)."""
        self.misses += 1
        self.quiet_until = step + min(1 << (self.misses - 1), LOOKUP_BACKOFF)

    def watch(self, draft: list[int]) -> None:
        """``draft`` was made but not verified (a step without drafts): the tokens generated after it
        tell, for free, how much of it would have been kept (:meth:`saw`), so an estimate that fell
        learns when the text turns copyable again without a width paid for it."""
        self.shadow, self.matched, self.shadow_match = draft, 0, self.match

    def saw(self, toks: list[int]) -> tuple[int, int] | None:
        """Tokens generated after a watched draft: ``(drafted, kept)`` once they settle it (a token that
        differs, or all of it matched), learnt as a verified draft's; else None."""
        shadow = self.shadow
        for t in toks:
            if not shadow:
                return None
            if t == shadow[self.matched]:
                self.matched += 1
                if self.matched < len(shadow):
                    continue
            settled = (len(shadow), self.matched)
            self.shadow = []
            self.learn(*settled, self.shadow_match)
            if self.matched == len(shadow):  # all of it would have been kept: look again at once
                self.quiet_until, self.declines = 0, 0
            return settled
        return None

    def learn(self, drafted: int, accepted: int, match: int = 0) -> None:
        """``accepted`` of ``drafted`` draft tokens of a draft supported by ``match`` were, or would have
        been, kept."""
        self.accepted += accepted
        self.refused += accepted < drafted
        if drafted:
            self.kept_w = DECAY * self.kept_w + accepted
            self.tried_w = DECAY * self.tried_w + accepted + (accepted < drafted)
            self.rate = self.kept_w / self.tried_w
            b = match_band(match)
            self.kept_m[b] = DECAY * self.kept_m[b] + accepted
            self.tried_m[b] = DECAY * self.tried_m[b] + accepted + (accepted < drafted)

    def idle(self) -> None:
        """A step without a draft: the estimate drifts back towards the sequence's own acceptance since it
        began (text changes course), its prior weighing as two tokens: a sequence whose drafts were never
        kept no longer drifts back to 0.5 and drafts again every ~90 steps (one stream on an H100 lost
        ~10 % to that)."""
        target = (self.accepted + 2 * self.prior) / (self.accepted + self.refused + 2)
        self.kept_w += DRIFT * (target * self.tried_w - self.kept_w)
        self.rate = self.kept_w / self.tried_w


@dataclass
class Pool:
    """The worker's recent acceptance over all its sequences (kept / (kept + refused), sums that halve in
    ~23 verified drafts: when the text changes, new sequences must not keep starting from what drafts
    did before; on an H100, random drafts after kept ones ran at 0.91x of none at 64 streams). A new
    sequence's estimate starts there (:attr:`Drafting.prior`), not at ``PRIOR``. At 64 streams a
    sequence lives ~130 steps; starting at 0.5, three drafts never looked worth starting, and only a
    probe now and then learnt better."""

    kept: float = PRIOR
    tried: float = 1.0
    kept_m: list[float] = field(default_factory=lambda: list(MATCH_PRIOR))  # per match band (``match_band``)
    tried_m: list[float] = field(default_factory=lambda: [1.0] * MATCH_BANDS)

    def verified(self, drafted: int, accepted: int, match: int = 0) -> None:
        if drafted:
            self.kept = POOL_DECAY * self.kept + accepted
            self.tried = POOL_DECAY * self.tried + accepted + (accepted < drafted)
            b = match_band(match)
            self.kept_m[b] = POOL_DECAY * self.kept_m[b] + accepted
            self.tried_m[b] = POOL_DECAY * self.tried_m[b] + accepted + (accepted < drafted)

    def band(self, b: int) -> float:
        """The recent acceptance of drafts whose match is in band ``b`` (``match_band``), at least
        ``POOL_FLOOR`` (as :attr:`rate`)."""
        return max(self.kept_m[b] / self.tried_m[b], POOL_FLOOR)

    @property
    def recent(self) -> float:
        """The recent acceptance."""
        return self.kept / self.tried

    @property
    def rate(self) -> float:
        """A new sequence's prior: the recent acceptance, at least ``POOL_FLOOR`` (text changes: a worker
        whose drafts were never kept still probes now and then)."""
        return max(self.recent, POOL_FLOOR)


POOL_DECAY = 0.97
POOL_FLOOR = 0.3


def match_band(match: int) -> int:
    """The band of a match length: 2-3 (or none) 0, 4-7 1, 8-15 2, 16-31 3, 32 and more 4."""
    return min(max(max(match, 2).bit_length() - 2, 0), MATCH_BANDS - 1)


def spec_mode(setting: str, gpu: bool) -> str:
    """Which requests a worker speculates for (``model.speculative``; a request may still turn it off):
    "all" (``"ngram"``: every request that allows it; on a GPU worker a greedy one without a grammar or
    logprobs is verified in the decode graph, the others are sampled on the host for it), "graph"
    (``"auto"`` on a GPU worker: only those the graph verifies, so no request leaves the graph's sampling
    for it: its logits would be copied to the host a row at a time; on an H100 at 64 streams speculating
    host-sampled JSON requests ran at 0.91x of their speed without it) or "off" (``"off"``,
    and ``"auto"`` on a CPU worker: llama.cpp's CPU kernels compute a row otherwise when a step holds
    several of a sequence's tokens, so greedy text could change at a near-tie). ``"draft:<path>"`` is
    ``"ngram"`` with a draft model's drafts (``draft.py``)."""
    if setting == "ngram" or setting.startswith("draft:"):
        return "all"
    return "graph" if setting == "auto" and gpu else "off"


class Speculating(Protocol):
    """What a proposer sees of a sequence (``engine.sequence.Sequence``)."""

    rid: int
    seq_id: int  # its slot
    history: np.ndarray  # its prompt and output so far, then room
    n_history: int  # tokens in ``history``
    drafting: Drafting | None


class Proposer(Protocol):
    """A source of drafts (one a file: ``ngram.PromptLookup``; benchmarks and tests use :class:`Calls`)."""

    def propose(self, seq: Speculating, k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens to follow ``seq``'s tokens so far (before the launch: host time the GPU
        waits for), and their support: how many of its last tokens the draft's source matched
        (``ngram.MATCH_MAX`` for a source that matches none, a model or an oracle)."""
        ...

    def prepare(self, seq: Speculating) -> None:
        """Work that the sequence's next :meth:`propose` needs, done after the launch while the GPU
        computes (the n-gram index's new tokens)."""
        ...

    def close(self) -> None:
        """Its resources freed (a draft model's context)."""
        ...


class Drafter(Protocol):
    """A source of drafts that costs the step time (a draft model, ``draft.DraftModel``): the drafts of all
    the step's drafting sequences made together, after the step decided their lengths from its price."""

    def draft(self, seqs: Sequence[Speculating], lengths: list[int]) -> list[list[int]]:
        """Each sequence's draft of at most ``lengths[i]`` tokens (before the launch)."""
        ...

    def seconds(self, seqs: Sequence[Speculating], length: int, plain: float, left: Sequence[int] = ()) -> float:
        """The expected seconds of :meth:`draft` for ``seqs`` with drafts of ``length`` tokens (``plain``: the
        model's plain step, for a drafter that has measured nothing yet; ``left``: the tokens each
        sequence's reply has left, over which a one-time cost may be shared)."""
        ...

    def close(self) -> None:
        ...


@dataclass
class Calls:
    """A proposer from a function of ``(rid, tokens so far, k)`` (an oracle: tests/spec_oracle.py)."""

    fn: Callable[[int, np.ndarray, int], list[int]]

    def propose(self, seq: Speculating, k: int) -> tuple[list[int], int]:
        return self.fn(seq.rid, seq.history[: seq.n_history], k), MATCH_MAX

    def prepare(self, seq: Speculating) -> None:
        pass

    def close(self) -> None:
        pass


WIDTHS = (1, 3, MAX_DRAFT)  # a step's draft tokens a sequence: few batch shapes, llama.cpp's graphs kept
MODEL_WIDTHS = (*WIDTHS, MODEL_MAX)  # a draft model's (its drafts as long as its sequences' reach)
MAX_OUTPUTS = 256  # a step's rows with logits at most, drafts' included: llama.cpp keeps n_vocab floats
# and ids a row for its graph samplers' results in pinned host memory, reallocated (and cleared) when a
# step has more rows than any before: 64 rows of 8 tokens at 8B (128,256 tokens) took ~0.5 s once on
# an H100, 0.8 GB (and its verify step cost 3.3x a plain step's, three drafts 2.2x)
STICKY = 0.9  # the last step's width stays unless another one promises this much more: a change costs
# about a step (on an H100 at 64 streams, a new width's first step took 1.3-1.6x a settled one's, and the
# next one captures a CUDA graph)
ENTER = 1.25  # drafting starts when a width promises this much more than none (there and back: two changes;
# one stream of drafts never kept lost 20 % on an H100 where it started on any promise)
SETTLE = 0.8  # a measured step's seconds: the old estimate's weight against the new step's
STALE = 512  # decisions: a width not measured for this long in a band of rows is tried again ...
WORTH_TRYING = 0.9  # ... if its estimate promises at least this share of the best width's speed
MIN_GAIN = 0.05  # a width is a choice when its drafts are expected to add this share of the step's tokens
SETTLING = 2  # steps of a new width not measured: llama.cpp builds its graph, then CUDA captures it
FIRST_STEPS = 3  # settled steps of a width whose least is its estimate before the moving average takes over
HORIZON = 16  # steps in which a change of width must pay for its settling steps there and back (measured)
TRIAL = 4  # steps a trial runs (its first SETTLING are not measured)
OUTLIER = 2.5  # a step this many times a width's estimate is not measured
PROBE_SHARE = 0.01  # while none stays, probes cost at most this share of the step time ...
PROBE_MIN = 16  # ... and come at most once in this many decisions
LOOKUP_BACKOFF = 4  # steps at most between the lookups of a sequence whose lookups find no draft
LEAST_CHANCE = 0.1  # a draft token less likely to be kept than this is not worth making (one stream of 8B
# on an H100: a draft token costs ~9 % of a plain step at widths 3 and 8)
SHADOWS = 8  # a step without drafts watches the drafts of about this many sequences (Drafting.watch): the
# others' prompt lookups are host time between two launches (64 of them cost ~1 ms a step at 8B)


@dataclass
class _Seen:
    """A width's measured decode steps in one band of rows: their seconds and rows (moving averages)."""

    seconds: float
    rows: float
    at: int  # the decision count when last measured
    n: int = 1  # settled steps measured


class WidthCosts:
    """What a decode step costs at each draft width, measured, and the step's width chosen from it.

    A verify step's cost is far from linear in its draft tokens: on an H100 (docs/benchmarks.md) one
    draft token a row at 64 rows cost 1.4x a plain step, three 1.9x, seven 2.9x (matrix-vector kernels
    give way to matrix-matrix ones), and a step whose width differs from the last one's costs 0.4-2 ms
    more (llama.cpp builds its graph again, and the step after it captures a CUDA graph: on an H100 a
    width-8 step measured at its second step looked too slow ever to be chosen again). So each width's
    decode steps (no prompt work) are timed,
    per band of rows (1, 2-3, 4-7, ... rows), as moving averages; a width not measured in the band is
    estimated by the linear cost model (``prior``), and tried for a few steps when that estimate (or a
    stale measurement) comes near the best width's: so the choice follows measured speeds, not a
    fitted line, and a trial costs little. The first ``SETTLING`` steps of a new width are not measured."""

    def __init__(self, probing: bool = True, widths: tuple[int, ...] = WIDTHS) -> None:
        self.widths = widths  # the widths a step may take besides none
        self.widest = max(widths)
        self.seen: dict[tuple[int, int], _Seen] = {}
        self.decisions = 0
        self._tried: dict[tuple[int, int], int] = {}  # (width, band) -> the decision count of its last trial
        self._trial: tuple[int, int] | None = None  # (width, steps left)
        self._probed = -STALE - 1  # the decision count of the last probe (:meth:`_probe`)
        self.change: dict[int, float] = {}  # band -> a settling step's seconds over its width's settled ones
        self.probing = probing  # widths are probed while none stays (tests of the choice alone: off)

    def _probe(self, speeds: dict[int, float], rows: int, cost: Callable[[int], float]) -> int:
        """Width none stays; but now and then a width expected to beat none's speed (short of ``ENTER``)
        runs ``TRIAL`` steps, the one measured least lately first: acceptance is learnt only by drafting, and a width's
        cost only by its steps (at 64 streams the prior's promise never reached ``ENTER``, drafts always
        kept were never drafted; a worker whose recent drafts were refused starts new sequences at
        ``POOL_FLOOR``, below ``ENTER``, and learnt nothing more). How often: a probe's extra seconds
        are at most ``PROBE_SHARE`` of the steps' since the last one (its steps' over none's, and the
        settling steps there and back, measured), and it comes at least once in ``STALE`` decisions, at
        most once in ``PROBE_MIN``. On an H100 at one stream (1B) a probe cost ~4 ms, 3 steps' worth,
        mostly the two width changes; at 64 streams ~20 ms, 4 steps' worth."""
        band = self.band(rows)
        near = [k for k in speeds if k and speeds[k] > speeds[0]]  # a probe is expected to pay too
        if not near:
            return 0
        k = min(near, key=lambda k: ((s.at if (s := self.seen.get((k, band))) else -1), -speeds[k]))
        change = self.change.get(band, cost(0))  # not measured yet: a whole step
        extra = TRIAL * max(cost(k) - cost(0), 0.0) + 2 * SETTLING * change  # there and back
        every = min(STALE, max(PROBE_MIN, int(extra / (PROBE_SHARE * max(cost(0), 1e-9)))))
        if self.decisions - self._probed <= every:
            return 0
        self._probed = self.decisions
        self._trial = (k, TRIAL - 1)
        return k

    @staticmethod
    def band(rows: int) -> int:
        return max(rows, 1).bit_length()

    def observe(self, k: int, rows: int, seconds: float, changed: bool) -> None:
        """A decode step of width ``k`` over ``rows`` rows took ``seconds`` (``changed``: its width is new,
        one of the first ``SETTLING`` steps at it: not measured, but its seconds over the width's settled
        ones are, as what a change costs in the band)."""
        key = (k, self.band(rows))
        s = self.seen.get(key)
        if changed:
            if s is not None and seconds <= OUTLIER * s.seconds:
                excess, was = max(seconds - s.seconds, 0.0), self.change.get(key[1])
                self.change[key[1]] = excess if was is None else SETTLE * was + (1 - SETTLE) * excess
            return
        if s is None:
            self.seen[key] = _Seen(seconds, float(rows), self.decisions)
            return
        if s.n < FIRST_STEPS:  # the least of the first few: a step's time is its cost plus delays
            s.seconds, s.rows, s.at, s.n = min(s.seconds, seconds), float(rows), self.decisions, s.n + 1
            return
        if seconds > OUTLIER * s.seconds:  # the engine waited for work in between, not computing
            return
        s.seconds = SETTLE * s.seconds + (1 - SETTLE) * seconds
        s.rows = SETTLE * s.rows + (1 - SETTLE) * rows
        s.at = self.decisions

    def settled(self, k: int, rows: int) -> bool:
        """Width ``k`` has ``FIRST_STEPS`` settled steps measured in the band of ``rows``: until then its cost
        is estimated as an unmeasured width's (``step_costs``: a lower bound), so it is tried again. On an
        H200 (1B and 8B, one stream) a width 8 whose first settled step was slow was never chosen again,
        drafts always kept: 3.9 tokens a step at width 3 where 7.3 at width 8 in another round."""
        s = self.seen.get((k, self.band(rows)))
        return s is not None and s.n >= FIRST_STEPS

    def seconds(self, k: int, rows: int, per_row: float) -> float | None:
        """A decode step's measured seconds at width ``k`` over ``rows`` rows (None: not measured in their
        band), moved along the cost model's ``per_row`` from the rows it was measured at."""
        s = self.seen.get((k, self.band(rows)))
        return None if s is None else max(s.seconds + per_row * (rows - s.rows), 1e-6)

    def choose(self, chances: dict[int, list[float]], outputs: int, rows: int, most: int, last: int,
               cost: Callable[[int], float]) -> int:
        """The step's draft width ``k``: every decoding sequence and padding slot carries ``k`` tokens after
        its own (drafts cut, or filled with filler tokens), so a step has one shape (llama.cpp computes
        per-sequence KV streams in micro-batches of equally many tokens a sequence: drafts of unequal
        lengths would split the step, each part reading the weights again).

        ``chances[key][j]`` is draft ``j + 1``'s chance of being kept; a width yields the chances of every
        draft's first ``k`` tokens besides the ``outputs`` rows' own tokens, in a step of ``cost(k)``
        seconds (the step's ``rows``: the band its measurements are kept in). The width of most expected
        tokens a second among none and :attr:`widths` (``WIDTHS``; each cut to ``most``) whose drafts are expected to
        add ``MIN_GAIN`` of the step's tokens (drafts unlikely to be kept never tie with none); from none,
        drafting starts where the best width beats none by ``ENTER``; a width stays unless another beats
        it by ``1 / STICKY``, but for none, taken as soon as it is best. While drafting, a width near
        the best whose measurement is missing or stale runs ``TRIAL`` steps; while none stays, one
        expected to beat none does, now and then (:meth:`_probe`). Whatever it returns, a width other
        than none is expected to deliver more tokens a second than none: trials and probes included."""
        self.decisions += 1
        own = max(outputs, 1)
        cut = {min(w, most) for w in self.widths if most >= 1}
        gains = {k: sum(sum(cs[:k]) for cs in chances.values()) for k in cut}
        ks = [0, *sorted(k for k, gain in gains.items() if gain >= MIN_GAIN * own)]
        speeds = {k: (own + gains.get(k, 0.0)) / max(cost(k), 1e-9) for k in ks}
        best = max(speeds, key=lambda k: speeds[k])
        if self._trial is not None:
            k, left = self._trial
            self._trial = (k, left - 1) if left > 1 else None
            if k in speeds and speeds[k] > speeds[0]:
                return k
        if best == 0 or (last == 0 and speeds[best] < ENTER * speeds[0]):  # none; drafting starts where it
            return self._probe(speeds, rows, cost) if self.probing else 0  # pays for its way back
        band = self.band(rows)
        sticky = STICKY
        if last and HORIZON and band in self.change:  # a change must pay for its settling steps in HORIZON
            sticky = min(sticky, 1 - 2 * SETTLING * self.change[band] / (HORIZON * max(cost(last), 1e-9)))
        pick = last if last and last in speeds and speeds[last] >= sticky * speeds[best] \
            and speeds[last] > speeds[0] else best
        for k in ks:  # while drafting, a width near the best whose measurement is missing or stale is tried
            s, tried = self.seen.get((k, band)), self._tried.get((k, band), -STALE - 1)
            fresh = s is not None and self.decisions - s.at <= STALE
            if k and k != pick and not fresh and self.decisions - tried > STALE \
                    and speeds[k] >= WORTH_TRYING * speeds[best] and speeds[k] > speeds[0]:
                self._tried[k, band] = self.decisions
                self._trial = (k, TRIAL - 1)
                return k
        return pick


def threshold(cost: Callable[[int], float], rows: int, outputs: int, floor: float = LEAST_CHANCE,
              longest: int = MAX_DRAFT, widest: int = MAX_DRAFT) -> float:
    """The acceptance estimate a sequence needs for its draft to be made at all: a draft token's chance
    must pay for it at the cheapest width a token (a token's worth: a plain step's seconds over its
    ``outputs``; the step's ``rows`` carry a width each). One a row at 64 rows cost nearly what three did
    on an H100. At least ``floor`` (``LEAST_CHANCE``): while no width but none is measured a wider one costs as much
    as none (``step_costs``' lower bound), and every sequence, however often refused, would make its draft
    and weigh in every step's choice (at 64 streams of drafts never kept, 0.4 ms of host time a step
    before the launch on a 2-core VM, against 0.06 with the floor). A width carries at most ``longest`` draft
    tokens a row (a draft model's drafts are as long as the sequences' reach: ``Drafting.reach``), and
    widths go up to ``widest``."""
    ks = sorted({1, 3, min(MAX_DRAFT, widest), widest})
    least = min((cost(k) - cost(0)) / (min(k, longest) * rows) for k in ks) * outputs / cost(0)
    return max(least, floor)


def step_costs(coef: tuple[float, float, float, float, float] | None, widths: WidthCosts, n_rows: int, rows: int,
               total: int, prompt_s: float) -> Callable[[int], float]:
    """A planned step's seconds at each draft width, plus ``prompt_s`` for its prompt work: a decode step's
    measured seconds at that width (``widths``, over ``total`` rows); a width not measured costs what the
    widest measured one below it does (none's, if only none's is), if the cost model (``coef``:
    ``CostModel.coef``; its ``n_rows`` planned rows, ``per_draft`` a draft token over the step's ``rows``)
    does not say less. That is a lower bound, so an unmeasured width that could pay is tried, and then
    measured: the cost model's line, fitted where width 1 had run only its first steps (a graph built
    and captured), put width 3 at 4x a plain step where it costs 2.2x (1B, 64 rows), so no draft ever
    looked worth it again (on an H100, drafts kept at 0.8 after drafts never kept: 1.00x of off, where
    1.24x before them). Before the model is fitted, a tenth of the step a draft. A width costs at most
    what a wider one does (a measurement too high is never chosen, so never corrected)."""
    if coef is None:
        return lambda k: 1.0 + 0.1 * k
    base, per_row, _, _, per_draft = coef
    decode_s = max(base + per_row * n_rows, 1e-6)
    costs: list[float] = []
    below: float | None = None  # the widest measured width's seconds so far
    widest = widths.widest
    for k in range(widest + 1):
        seen = widths.seconds(k, total, per_row) if widths.settled(k, total) else None
        if seen is None:
            model = decode_s + max(per_draft, 1e-9) * k * rows
            costs.append((model if below is None else min(model, below)) + prompt_s)
        else:
            below = seen
            costs.append(seen + prompt_s)
    for k in range(widest - 1, -1, -1):
        costs[k] = min(costs[k], costs[k + 1])
    return lambda k: costs[min(max(k, 0), widest)]


def choose_width(drafts: dict[int, tuple[Drafting, list[int]]], outputs: int, rows: int, most: int, last: int,
                 cost: Callable[[int], float], widths: WidthCosts, pool: Pool) -> int:
    """The step's draft width (``WidthCosts.choose``) for the ``drafts`` made (by sequence key), each cut to
    it (their chances drawn towards the ``pool``'s recent acceptance); a draft not verified (width
    none) lets its estimate drift as a step without one does (else it could stay low for good)."""
    chances = {key: d.chances_of(len(draft), pool) for key, (d, draft) in drafts.items()}
    k = widths.choose(chances, outputs, rows, most, last, cost)
    ride(drafts, k)
    return k


def ride(drafts: dict[int, tuple[Drafting, list[int]]], k: int) -> None:
    """The ``drafts`` cut to the step's width ``k``; at none each is watched instead (``Drafting.watch``),
    its estimate drifting meanwhile. Once a width is chosen every row pays for it, so the drafts of
    sequences too unlikely to weigh in the choice (:func:`threshold`) ride along (on an H100 at 64
    streams a row left without one carried fillers)."""
    for d, draft in drafts.values():
        if k:
            d.draft = draft[:k]
        else:
            d.draft = []
            if not d.shadow:
                d.watch(draft)
            d.idle()
