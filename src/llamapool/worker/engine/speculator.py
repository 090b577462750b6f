"""Speculation's one owner: which sequences draft, what they draft, how many draft tokens a step carries,
and what is learnt from the drafts verified (the pieces: ``spec.py``; the drafts' sources, one a file:
``ngram.py``, prompt lookup, free, a :class:`~spec.Proposer`; ``draft.py``, a draft model, a
:class:`~spec.Drafter` whose calls the step prices before it drafts: :meth:`Speculator._propose_priced`).

The engine's step calls it at four points: :meth:`Speculator.propose` at plan time (the step's drafts and
its width, before the batch is filled), :meth:`Speculator.launching` and :meth:`Speculator.observe` when a
batch is launched (its width, and the seconds of the batch before it), :meth:`Speculator.verified` when a
sequence's rows are taken (the draft's tokens kept), and :meth:`Speculator.after_launch` while the GPU
computes (work the next step's drafts need that the batch in flight does not wait for). No llama.cpp here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from llamapool.protocol.params import SamplingParams
from llamapool.worker.engine.model import EngineConfig
from llamapool.worker.engine.ngram import MATCH_MAX, PromptLookup
from llamapool.worker.engine.sequence import Sequence
from llamapool.worker.engine.spec import (
    LEAST_CHANCE,
    LOOKUP_BACKOFF,
    MATCH_FACTOR,
    MAX_DRAFT,
    MAX_OUTPUTS,
    MODEL_MAX,
    MODEL_WIDTHS,
    SETTLING,
    WIDTHS,
    Drafter,
    Drafting,
    Pool,
    Proposer,
    WidthCosts,
    choose_width,
    ride,
    step_costs,
    threshold,
)
from llamapool.worker.sampling import Sampling, SeqSampling
from llamapool.worker.scheduler import CostModel

BRIDGE_RATE = 0.5  # a step without drafts keeps the last width (_bridge) while a sequence's estimate is this high


def rows_per_seq(mode: str, setting: str = "") -> int:
    """Output rows a sequence may have in a step: its own and, if the worker speculates, a draft's (a draft
    model's, ``setting`` "draft:<path>", up to ``MODEL_MAX``)."""
    return 1 if mode == "off" else 1 + widest(setting)


def widest(setting: str) -> int:
    """The most draft tokens a step under the ``speculative`` setting: a draft model's ``MODEL_MAX``, else
    ``MAX_DRAFT``."""
    return MODEL_MAX if setting.startswith("draft:") else MAX_DRAFT


def may_draft(p: SamplingParams) -> bool:
    """The request allows speculation: not turned off, and no tool calls (a call's opening is marked
    as its token is sampled, before the step's earlier tokens are pushed)."""
    return p.speculative is not False and p.speculative != 0 and not p.tools


class Speculator:
    """The worker's speculation (``mode``: ``spec.spec_mode``): its proposer, the widths' measured costs, the
    worker's recent acceptance, and the counts of draft tokens verified and kept."""

    def __init__(self, mode: str, cfg: EngineConfig, sampling: Sampling, cost: CostModel):
        self.mode = mode
        self.cfg = cfg
        self.sampling = sampling
        self.cost = cost  # the engine's step-cost model (fitted from its steps' times)
        self.proposer: Proposer = PromptLookup()
        self.drafter: Drafter | None = None  # a draft model (its drafts priced and made together), else the proposer
        self.widest = widest(cfg.speculative)  # draft tokens a step at most
        self.widths = WidthCosts(widths=MODEL_WIDTHS if self.widest > MAX_DRAFT else WIDTHS)  # steps' seconds a width
        self.pool = Pool()  # the recent acceptance of all sequences' drafts (a new sequence's prior)
        self.least_chance = LEAST_CHANCE  # a draft token's chance of being kept worth making it (spec.threshold)
        self.width = 0  # the draft width of the batch being built (spec.WidthCosts.choose)
        self.drafted_tokens = 0  # draft tokens verified
        self.accepted_tokens = 0  # draft tokens kept
        self._launched_width = 0  # the draft width of the batch launched last
        self._launched_prompt = False  # the batch launched last had prompt work
        self._settled = 0  # decode batches launched since the draft width changed or a prompt step
        self._unverified: list[Sequence] = []  # the step's speculating sequences with no draft (after_launch)
        self._gap = 0.0  # extra seconds of the steps that kept the width without a draft (_bridge)
        self._aside = 0.0  # seconds the drafter took since the last launch (:meth:`aside`)

    # ------------------------------------------------------------ a sequence starts

    def on_host(self, p: SamplingParams) -> bool:
        """The request's rows are sampled on the host so that it speculates (mode "all", a request the
        decode graph cannot verify)."""
        return self.mode == "all" and may_draft(p) and not self.sampling.verifies(p)

    def start(self, s: SeqSampling) -> Drafting | None:
        """A new sequence's speculation (None: it does not speculate): the worker's mode and the request's;
        for a row the decode graph samples only where it samples all of them (``Sampling.verifies``; in
        mode "graph" only those), and never with logprobs on a pipelined worker (its logprob rows are
        copied one a sequence: ``output.Deferred``)."""
        p = s.params
        verified = s.in_graph and self.sampling.verifies(p)
        if self.mode == "off" or not may_draft(p) or (s.in_graph and not verified) \
                or (self.mode == "graph" and not verified) or (p.logprobs and self.sampling.gpu):
            return None
        return Drafting(limit=self.widest if p.speculative is True else int(p.speculative), prior=self.pool.rate)

    # ------------------------------------------------------------ plan time

    def propose(self, chunk: dict[int, int], active: dict[int, Sequence], steps: int) -> int:
        """Drafts for the step's decoding sequences that speculate (each sequence's ``drafting.draft``) and
        the step's draft width (returned: every decoding row carries as many tokens after its own).

        Per sequence: a sequence looks up a draft when its lookup is due (one that found nothing, or
        whose drafts were not worth making, backs off: ``Drafting.missed``, ``Drafting.declined``; while
        it backs off it costs nothing); the draft is cut to its match's length (``MATCH_FACTOR``) and
        weighs in the step's choice when its first token's chance of being kept (``Drafting.alpha``, by
        its match length) pays for a draft token at the cheapest width (``spec.threshold``, from the
        measured step costs); else it is declined, and watched for free. Per step: the width of most
        expected tokens a second, none included (``WidthCosts.choose``: each width's measured seconds,
        each draft token's chance), so a step carries drafts only when they are expected to deliver more
        tokens a second than the same step without. A step with prompt work drafts nothing: llama.cpp
        splits it into one micro-batch a prompt after a first one of every sequence's width, and on an
        H100 (1B, 64 streams, prompts arriving) such steps with drafts of 3 cost 2.5x the time a prompt
        of those without."""
        decoding: list[Sequence] = []
        outputs = prefilling = 0
        for sid in chunk:
            seq = active.get(sid)
            if seq is None:
                continue
            if seq.prefilling:
                prefilling += 1
                continue
            outputs += 1
            if seq.drafting is not None:
                decoding.append(seq)
        if self.drafter is not None:
            return self._propose_priced(chunk, decoding, outputs, prefilling, steps)
        riding = self.width > 0 and not prefilling and bool(decoding)  # the rows are paid for: all look up
        due = decoding if riding else [seq for seq in decoding if seq.drafting.quiet_until <= steps]  # type: ignore[union-attr]
        made = self._drafts(due, steps) if due and not prefilling else {}
        if not made and not riding:  # nothing drafted (or prompt work): speculation costs the step no more
            self.width, self._gap = 0, 0.0
            self._unverified = decoding
            return 0
        rows = max(1, max(chunk) - min(chunk) + 1)  # decoding rows and padding slots (batch.fill)
        cost = self.width_cost(len(chunk), rows, 0)
        least = threshold(cost, rows, outputs, self.least_chance)  # a draft's first token must pay for itself
        weigh = {sid: x for sid, x in made.items() if x[0].alpha(self.pool) >= least}
        k = 0
        if weigh:
            self._gap = 0.0
            most = min(MAX_DRAFT, (self.cfg.max_batch_tokens - sum(chunk.values())) // rows,
                       min(self.cfg.n_ubatch, MAX_OUTPUTS) // rows - 1)  # one micro-batch, MAX_OUTPUTS rows
            k = choose_width(weigh, outputs, rows, most, self.width, cost, self.widths, self.pool)
        elif riding and any(seq.drafting.rate >= BRIDGE_RATE for seq in decoding):  # type: ignore[union-attr]
            k = self._bridge(cost, rows)
        declined = {sid: x for sid, x in made.items() if sid not in weigh}
        if k:  # the declined drafts ride along: the step's rows carry k tokens whatever they are
            ride(declined, k)
        else:
            for d, _ in declined.values():
                d.declined(steps)
            for d, _ in weigh.values():  # drafts worth making that no width pays for: looked up less often
                d.declined(steps, LOOKUP_BACKOFF)  # (64 streams' lookups and choice: ~1 ms a step on an H200)
            ride(declined, 0)  # watched, for free
        self.width = k
        self._unverified = [seq for seq in decoding if not seq.draft and seq.seq_id not in made]
        return k

    def _propose_priced(self, chunk: dict[int, int], decoding: list[Sequence], outputs: int, prefilling: int,
                        steps: int) -> int:
        """:meth:`propose` with a drafter (a draft model), whose drafts cost the step their calls: the step
        decides first, from each sequence's acceptance and draft length (``Drafting.reach``) and the
        drafter's price (``Drafter.seconds``, measured per call by its tokens) added to each width's
        measured cost, which sequences draft and how many tokens (the width of most expected tokens a
        second, none included: a step with drafts is expected to deliver more tokens a second than
        without, the drafter's time counted); then only those are drafted, together. A sequence whose
        draft is not worth its price backs off (2, 4, ... 16 steps) and costs nothing meanwhile: no call
        of the drafter, not even to catch up on its tokens (done when it drafts again, in the one call)."""
        drafter = self.drafter
        assert drafter is not None
        last, self.width, self._gap = self.width, 0, 0.0
        self._unverified = decoding
        due = [seq for seq in decoding if seq.drafting.quiet_until <= steps]  # type: ignore[union-attr]
        if not due or prefilling:
            return 0
        ctx = self.cfg.ctx_per_slot - 2
        plans: dict[int, tuple[Sequence, int]] = {}
        for seq in due:
            d = seq.drafting
            assert d is not None
            d.match = MATCH_MAX  # a model's draft: judged as a long match's (a high prior, its own record first)
            n = min(d.reach, d.limit, seq.params.max_tokens - seq.generated - 1, ctx - seq.n_past)
            if n >= 1:
                plans[seq.seq_id] = (seq, n)
        if not plans:
            return 0
        rows = max(1, max(chunk) - min(chunk) + 1)
        cost = self.width_cost(len(chunk), rows, 0)
        plain = cost(0)

        def priced(drafting: list[tuple[Sequence, int]]) -> Callable[[int], float]:
            seqs, longest = [seq for seq, _ in drafting], max(n for _, n in drafting)
            left = [seq.params.max_tokens - seq.generated for seq in seqs]
            calls: dict[int, float] = {0: 0.0}  # draft tokens -> the drafter's seconds (asked once a step)

            def at(k: int) -> float:
                n = min(max(k, 0), longest)
                if n not in calls:
                    calls[n] = drafter.seconds(seqs, n, plain, left)
                return cost(k) + calls[n]
            return at

        longest = max(n for _, n in plans.values())
        least = threshold(priced(list(plans.values())), rows, outputs, self.least_chance, longest, self.widest)
        weigh = {sid: x for sid, x in plans.items() if x[0].drafting.alpha(self.pool) >= least}  # type: ignore[union-attr]
        for sid, (seq, _) in plans.items():
            if sid not in weigh:
                seq.drafting.declined(steps)  # type: ignore[union-attr]
        if not weigh:
            return 0
        most = min(self.widest, (self.cfg.max_batch_tokens - sum(chunk.values())) // rows,
                   min(self.cfg.n_ubatch, MAX_OUTPUTS) // rows - 1)
        chances = {sid: seq.drafting.chances_of(n, self.pool) for sid, (seq, n) in weigh.items()}  # type: ignore[union-attr]
        k = self.widths.choose(chances, outputs, rows, most, last, priced(list(weigh.values()))) if most >= 1 else 0
        if not k:
            for seq, _ in weigh.values():
                seq.drafting.declined(steps, LOOKUP_BACKOFF)  # type: ignore[union-attr]
            return 0
        seqs = [seq for seq, _ in weigh.values()]
        t0 = time.perf_counter()
        drafts = drafter.draft(seqs, [min(k, n) for _, n in weigh.values()])
        self._aside += time.perf_counter() - t0
        for seq, draft in zip(seqs, drafts, strict=True):
            matcher = seq.sampling.matcher
            if draft and matcher is not None:  # cut where its grammar refuses a token
                draft = draft[: matcher.validate_tokens(draft)]
            seq.drafting.draft = draft  # type: ignore[union-attr]
        self.width = k
        self._unverified = [seq for seq in decoding if not seq.draft]
        return k

    def aside(self) -> float:
        """The drafter's seconds since the last call (before the launch about to be made): host and device
        time between two launches that is not the batch's, left out of its measured seconds."""
        s, self._aside = self._aside, 0.0
        return s

    def _bridge(self, cost: Callable[[int], float], rows: int) -> int:
        """No draft this step, but the last step drafted: its width stays (the rows carry fillers) until the
        steps' extra seconds reach what a change of width there and back costs (``WidthCosts.change``,
        measured: llama.cpp builds its graph again, CUDA captures it), then none (a ski rental: at most
        twice what either choice alone would have cost). A copy with an edit every ten tokens finds its
        place again within a step or two. Only while a sequence's recent drafts were mostly kept
        (``BRIDGE_RATE``): after a draft refused where there was nothing to copy, none at once."""
        k = self.width
        extra = max(cost(k) - cost(0), 0.0)
        change = self.widths.change.get(self.widths.band(rows), cost(0))
        if self._gap + extra > 2 * SETTLING * change:
            self._gap = 0.0
            return 0
        self._gap += extra
        return k

    def width_cost(self, n_rows: int, rows: int, prefilling: int) -> Callable[[int], float]:
        """The planned decode step's seconds at each draft width (``spec.step_costs``; a step with prompt
        work carries no drafts, so none is added for it): ``n_rows`` planned rows, ``rows`` decoding ones."""
        return step_costs(self.cost.coef, self.widths, n_rows, rows, rows + prefilling, 0.0)

    def _drafts(self, seqs: list[Sequence], steps: int) -> dict[int, tuple[Drafting, list[int]]]:
        """The sequences' drafts (by sequence id), each as long as its request, its match and its grammar
        allow (a sequence whose lookup found nothing backs off: ``Drafting.missed``)."""
        drafts: dict[int, tuple[Drafting, list[int]]] = {}
        ctx = self.cfg.ctx_per_slot - 2
        for seq in seqs:
            d = seq.drafting
            assert d is not None
            d.draft = []
            draft, d.match = self.proposer.propose(seq, MAX_DRAFT)
            if not draft:
                d.missed(steps)
                continue
            d.misses = 0
            draft = draft[: min(d.limit, seq.params.max_tokens - seq.generated - 1, ctx - seq.n_past,
                                max(1, int(MATCH_FACTOR * d.match)))]
            matcher = seq.sampling.matcher
            if draft and matcher is not None:  # cut where its grammar refuses a token
                draft = draft[: matcher.validate_tokens(draft)]
            if draft:
                drafts[seq.seq_id] = (d, draft)
        return drafts

    # ------------------------------------------------------------ launch

    def launching(self, prompt: bool) -> tuple[int, bool]:
        """A batch is launched (``prompt``: it has prompt work): its draft width, and whether it is one of
        the first ``SETTLING`` steps of a width (llama.cpp builds the graph again, then CUDA captures it:
        its time is not the width's)."""
        new = self.width != self._launched_width or self._launched_prompt  # a decode graph built again
        self._settled = 0 if new else self._settled + 1
        self._launched_width, self._launched_prompt = self.width, prompt
        return self.width, self._settled < SETTLING

    def observe(self, k: int, rows: int, seconds: float, settling: bool) -> None:
        """A decode step (no prompt work) of width ``k`` over ``rows`` rows took ``seconds``."""
        self.widths.observe(k, rows, seconds, settling)

    def after_launch(self, active: dict[int, Sequence], steps: int) -> None:
        """Speculation's work that the batch in flight does not wait for, done while it computes: the
        estimates of the sequences with no draft in the batch drift (``Drafting.idle``; not those that back
        off after declined drafts), and the proposer
        prepares for the sequences that the next step looks up (prompt lookup indexes their tokens so
        far; a sequence that backs off is left alone), so that the next step's proposals, made before its
        launch, are dict reads. All of it before the launch cost 0.25-0.28 ms a step at 64 streams with
        nothing to draft (a 2-core VM, a model of negligible compute), 0.13 ms with this after it: the
        GPU waits for what comes before a launch."""
        seqs, self._unverified = self._unverified, []
        for seq in seqs:
            d = seq.drafting
            if d is not None and not d.declines and active.get(seq.seq_id) is seq:  # backing off: untouched
                d.idle()
        if self.drafter is not None:  # nothing to prepare: a draft model catches up when it drafts
            return
        riding = self.width > 0  # those that the next step looks up: all while drafts ride, else those due
        for seq in _speculating(active.values()):
            d = seq.drafting
            assert d is not None
            if riding or d.quiet_until <= steps:
                self.proposer.prepare(seq)

    def close(self) -> None:
        self.proposer.close()
        if self.drafter is not None:
            self.drafter.close()

    # ------------------------------------------------------------ update

    def verified(self, seq: Sequence, draft: list[int], toks: list[int], taken: list[int]) -> None:
        """The sequence's rows of the step gave ``toks`` (``taken``: those taken, none once it ended) for
        its ``draft`` (empty: none verified; a draft watched meanwhile learns from the tokens taken)."""
        d = seq.drafting
        if d is None:
            return
        d.draft = []
        if d.shadow and not draft and toks:
            settled = d.saw(taken)
            if settled is not None:  # a watched draft: what it would have kept is the worker's news too
                self.pool.verified(*settled, d.shadow_match)
        if draft:
            kept = next((i for i, (t, x) in enumerate(zip(toks, draft, strict=False)) if t != x),
                        min(len(toks), len(draft)))
            d.verified(len(draft), kept)
            self.pool.verified(len(draft), kept, d.match)
            self.drafted_tokens += len(draft)
            self.accepted_tokens += kept


def _speculating(seqs: Iterable[Sequence]) -> Iterable[Sequence]:
    return (seq for seq in seqs if seq.drafting is not None)
