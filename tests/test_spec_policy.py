"""Speculation's policy (worker/engine/speculator.py, spec.py, ngram.py) as tables: measured step costs and
each request's acceptance (by match length) in, decisions out (how many draft tokens each sequence gets,
the step's width, who backs off). No model, no process: the speculator is driven with sequences whose
drafts a table gives."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from llamapool.protocol.params import SamplingParams
from llamapool.worker.engine.model import EngineConfig
from llamapool.worker.engine.ngram import FOLLOW, MATCH_MAX, Lookup, ngram_match
from llamapool.worker.engine.sequence import Sequence
from llamapool.worker.engine.spec import (
    DECLINE_BACKOFF,
    FIRST_STEPS,
    LONG_MATCH,
    MODEL_MAX,
    POOL_FLOOR,
    SETTLING,
    WIDTHS,
    Drafting,
    WidthCosts,
    match_band,
)
from llamapool.worker.engine.speculator import Speculator
from llamapool.worker.scheduler import CostModel

# decode steps' ms by draft width: an H100's (issue 34's tables)
ONE_1B = {0: 1.45, 1: 1.55, 3: 1.8, 8: 2.3}
ONE_8B = {0: 4.32, 1: 4.79, 3: 5.43, 8: 7.9}
SIXTY_FOUR_8B = {0: 14.5, 1: 21.2, 3: 32.8, 8: 58.0}
# a draft model's widths go to 16: extrapolated from widths 3 and 8 (not measured)
MODEL_8B = {**ONE_8B, 16: 11.8}
MODEL_1B = {**ONE_1B, 16: 3.1}
MODEL_64_8B = {**SIXTY_FOUR_8B, 16: 99.0}
DRAFT = "draft:unused.gguf"


class Table:
    """A proposer whose drafts a table gives: rid -> (draft, match length); its calls recorded."""

    def __init__(self) -> None:
        self.drafts: dict[int, tuple[list[int], int]] = {}
        self.proposed: list[int] = []
        self.prepared: list[int] = []

    def propose(self, seq: Any, k: int) -> tuple[list[int], int]:
        self.proposed.append(seq.rid)
        draft, match = self.drafts.get(seq.rid, ([], 0))
        return draft[:k], match

    def prepare(self, seq: Any) -> None:
        self.prepared.append(seq.rid)


def measured(ms: dict[int, float], rows: int, widths: tuple[int, ...] = WIDTHS) -> WidthCosts:
    w = WidthCosts(probing=False, widths=widths)
    for k, v in ms.items():
        w.observe(k, rows, v / 1e3, changed=True)
        for _ in range(FIRST_STEPS):
            w.observe(k, rows, v / 1e3, changed=False)
    return w


def speculator(ms: dict[int, float], rows: int, setting: str = "ngram") -> tuple[Speculator, Table]:
    """A speculator whose steps were measured at ``ms`` over ``rows`` rows (a draft token's cost in the fitted
    model: dearer than any measured width, so the measurements decide)."""
    cfg = EngineConfig("unused.gguf", slots=rows, ctx_per_slot=4096, max_batch_tokens=8192, n_ubatch=8192,
                       speculative=setting)
    sp = Speculator("all", cfg, SimpleNamespace(gpu=False, verifies=lambda p: True), CostModel())  # type: ignore[arg-type]
    sp.widths = measured(ms, rows, sp.widths.widths)
    sp.cost.coef = (ms[0] / 1e3, 0.0, 0.0, 0.0, 1.0)
    table = Table()
    sp.proposer = table
    return sp, table


def sequence(rid: int, n: int = 40) -> Sequence:
    """A decoding sequence of ``n`` tokens that speculates."""
    return Sequence(rid=rid, seq_id=rid, tokens=np.arange(4, dtype=np.int32), stream=False,
                    params=SamplingParams(max_tokens=1000, temperature=0.0), sampling=SimpleNamespace(matcher=None),
                    text=None, n_past=n, history=np.zeros(n + 64, np.int32), n_history=n,  # type: ignore[arg-type]
                    drafting=Drafting())


def record(sp: Speculator, d: Drafting, kind: str) -> None:
    """Ten verified drafts of the sequence (and so of the worker): 'failing' ones (3 drafted at match 2, none
    kept), 'copying' ones (8 at a long match, all kept); 'new': none."""
    for _ in range(10 if kind != "new" else 0):
        d.match = 2 if kind == "failing" else MATCH_MAX
        kept = 0 if kind == "failing" else 8
        d.verified(3 if kind == "failing" else 8, kept)
        sp.pool.verified(3 if kind == "failing" else 8, kept, d.match)


def decide(ms: dict[int, float], rows: int, kind: str, match: int) -> tuple[int, int, bool]:
    """``rows`` sequences with ``kind``'s record, each finding an 8-token draft at ``match``: the step's width,
    a sequence's draft length, and whether it backs off."""
    sp, table = speculator(ms, rows)
    seqs = {i: sequence(i) for i in range(rows)}
    for s in seqs.values():
        assert s.drafting is not None
        record(sp, s.drafting, kind)
        table.drafts[s.rid] = (list(range(100, 108)), match)
    k = sp.propose(dict.fromkeys(seqs, 1), seqs, 100)
    d = seqs[0].drafting
    assert d is not None
    return k, len(seqs[0].draft), d.quiet_until > 100


# (step costs, rows, the sequences' record, their drafts' match length) -> (width, draft tokens, backs off: a
# draft declined, or worth making where no width pays, waits for its next lookup)
POLICY = [
    # one stream of 1B: a new request's draft pays at once, cut to twice its match
    (ONE_1B, 1, "new", 2, (3, 3, False)),  # 4 tokens supported (2 x 2): width 3 (1.47x a plain step's speed)
    (ONE_1B, 1, "new", 32, (8, 8, False)),  # a long match: the worker's long matches' prior (0.85)
    (ONE_1B, 1, "copying", 3, (8, 6, False)),  # its own record: 6 supported, width 8 over 3
    # drafts that kept failing: declined at short matches (it backs off), a long clean match brings it back
    (ONE_1B, 1, "failing", 2, (0, 0, True)),
    (ONE_1B, 1, "failing", 5, (1, 1, False)),  # 4-7 unseen: 0.34, width 1 pays 1.25x (just ENTER)
    (ONE_1B, 1, "failing", LONG_MATCH, (8, 8, False)),
    # one stream of 8B: a draft token costs less of a step, the same decisions but one
    (ONE_8B, 1, "new", 2, (3, 3, False)),
    (ONE_8B, 1, "failing", 2, (0, 0, True)),
    (ONE_8B, 1, "failing", 5, (0, 0, True)),  # 0.34 pays for a draft token but width 1 is 1.12x: none
    (ONE_8B, 1, "failing", LONG_MATCH, (3, 3, False)),
    (ONE_8B, 1, "copying", 5, (8, 8, False)),
    # 64 streams of 8B: three drafts a row cost 2.3x a plain step; only likely drafts pay
    (SIXTY_FOUR_8B, 64, "new", 2, (0, 0, True)),  # alpha 0.5: 1.03x at width 1, short of ENTER
    (SIXTY_FOUR_8B, 64, "new", MATCH_MAX, (3, 3, False)),
    (SIXTY_FOUR_8B, 64, "failing", 5, (0, 0, True)),  # 0.34 under the 0.42 a draft token costs here
    (SIXTY_FOUR_8B, 64, "failing", LONG_MATCH, (0, 0, True)),  # 0.75: 1.21x at width 3, short of ENTER
    (SIXTY_FOUR_8B, 64, "copying", 2, (3, 3, False)),
    (SIXTY_FOUR_8B, 64, "copying", MATCH_MAX, (3, 3, False)),  # width 8: 2.9 tokens a ms against 3's 2.0
]


@pytest.mark.parametrize(("ms", "rows", "kind", "match", "want"), POLICY)
def test_the_policy_decides_from_costs_and_acceptance(ms: dict[int, float], rows: int, kind: str, match: int,
                                                      want: tuple[int, int, bool]) -> None:
    assert decide(ms, rows, kind, match) == want


def test_acceptance_is_kept_by_match_length() -> None:
    """Drafts refused at short matches (an edited passage: the n-gram finding its place again) and kept at
    long ones: the sequence's estimate at a short match falls, at a long one it rises; the worker's bands
    too (a new sequence's prior there)."""
    sp, _ = speculator(ONE_1B, 1)
    d = Drafting()
    for _ in range(20):
        d.match = 2
        d.verified(4, 0)
        sp.pool.verified(4, 0, 2)
        d.match = 20
        d.verified(8, 8)
        sp.pool.verified(8, 8, 20)
    assert d.alpha(sp.pool, 2) < 0.25 < 0.9 < d.alpha(sp.pool, 20)  # (its record overall: 0.9)
    # the worker's (a new sequence's prior; at least POOL_FLOOR: a worker whose drafts failed still tries)
    assert sp.pool.band(match_band(2)) == POOL_FLOOR < 0.9 < sp.pool.band(match_band(20))
    assert Drafting().alpha(sp.pool, 2) < 0.35 < 0.9 < Drafting().alpha(sp.pool, 20)
    assert [match_band(m) for m in (0, 2, 3, 4, 7, 8, 15, 16, 31, 32, 99)] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_draft_is_cut_to_what_its_match_supports() -> None:
    """A draft is at most twice its match length (vLLM's suffix decoding caps a draft by its match): a
    match of 2 drafts 4, one of 4 or more the request's limit."""
    for match, want in ((1, 2), (2, 4), (3, 6), (4, 8), (MATCH_MAX, 8)):
        sp, table = speculator(ONE_8B, 1)
        s = sequence(0)
        assert s.drafting is not None
        for _ in range(10):
            s.drafting.match = match
            s.drafting.verified(8, 8)  # kept: the width is the widest
        table.drafts[0] = (list(range(100, 108)), match)
        made = sp._drafts([s], 1)
        assert len(made[0][1]) == want, match


def test_a_step_with_drafts_is_expected_to_beat_the_same_step_without() -> None:
    """Whatever the costs and chances (random tables, probes and trials on, widths remembered between
    decisions), a width other than none is chosen only where its drafts' expected tokens a second, by the
    costs and chances it was given, exceed none's."""
    rng = random.Random(5)
    for _ in range(40):
        rows = rng.choice([1, 2, 8, 64])
        base = rng.uniform(1, 20)
        ms = {0: base, **{k: base * (1 + rng.uniform(0.02, 0.5) * k) for k in WIDTHS}}
        w = WidthCosts(probing=True)
        last = 0
        for _ in range(300):
            alpha = rng.choice([0.0, 0.05, 0.2, 0.5, 0.7, 0.9, 1.0])
            chances = {i: [alpha ** (j + 1) for j in range(rng.randint(1, 8))] for i in range(rows)}

            def cost(k: int, w: WidthCosts = w, rows: int = rows, ms: dict[int, float] = ms) -> float:
                return (w.seconds(k, rows, 0.0) or ms[max(x for x in ms if x <= k)]) / 1e3

            k = w.choose(chances, rows, rows, 8, last, cost)
            if k:
                tokens = rows + sum(sum(c[:k]) for c in chances.values())
                assert tokens / cost(k) > rows / cost(0), (k, ms, alpha)
            settled = 0 if k != last else SETTLING
            w.observe(k, rows, ms[max(x for x in ms if x <= k)] / 1e3, changed=settled < SETTLING)
            last = k


def drive(sp: Speculator, seqs: dict[int, Sequence], steps: range, truth: dict[int, list[int]] | None = None
          ) -> list[int]:
    """Decode steps as the engine runs them (propose, launch, the rows taken: a draft kept where ``truth``
    says, else refused at once; after the launch); the widths."""
    widths = []
    for step in steps:
        k = sp.propose(dict.fromkeys(seqs, 1), seqs, step)
        sp.launching(False)
        for s in seqs.values():
            draft = s.draft
            right = (truth or {}).get(s.rid, [])
            kept = next((i for i, (a, b) in enumerate(zip(draft, right, strict=False)) if a != b),
                        min(len(draft), len(right)))
            toks = [*draft[:kept], 7]
            sp.verified(s, draft, toks, toks)
            for t in toks:
                s.generated_token(t)
        sp.after_launch(seqs, step + 1)
        widths.append(k)
    return widths


def test_a_width_whose_first_settled_step_was_slow_is_tried_again() -> None:
    """A width's first settled step may still be slow (a graph captured late): its cost is estimated as an
    unmeasured width's until ``FIRST_STEPS`` settled steps are measured, and then it is their least. On an
    H200 one such step kept width 8 out of a copy whose drafts were all kept (3.9 tokens a step at width 3
    where 7.3 at width 8)."""
    sp, table = speculator({0: 1.3, 3: 1.77}, 1)
    slow = 6.0  # ms: width 8's first settled step; its steps take 2.2
    sp.widths.observe(8, 1, slow / 1e3, changed=False)
    s = sequence(0)
    assert s.drafting is not None
    record(sp, s.drafting, "copying")
    table.drafts[0] = (list(range(100, 108)), MATCH_MAX)
    cost = sp.width_cost(1, 1, 0)
    assert cost(8) <= cost(3) < slow / 1e3  # estimated as unmeasured: no dearer than width 3
    picks = []
    for step in range(12):
        k = sp.propose({0: 1}, {0: s}, step)
        picks.append(k)
        if k:
            sp.observe(k, 1, {3: 1.77, 8: 2.2}[k] / 1e3, settling=False)
        sp.verified(s, s.draft, [*s.draft, 7], [*s.draft, 7])
    assert picks[-1] == 8 and sp.widths.settled(8, 1)
    assert sp.widths.seconds(8, 1, 0.0) == pytest.approx(2.2e-3)  # the least of its first steps


def test_a_request_whose_drafts_keep_failing_backs_off_and_costs_nothing() -> None:
    """Drafts at short matches that are never kept: the request's lookups come after 2, 4, 8, then every
    ``DECLINE_BACKOFF`` steps, and between them it costs nothing (no lookup, no indexing). A long clean
    match at its next lookup brings it back."""
    sp, table = speculator(ONE_1B, 1)
    s = sequence(0)
    seqs = {0: s}
    table.drafts[0] = ([5, 6, 7], 2)
    drive(sp, seqs, range(200))
    assert s.drafting is not None and s.drafting.declines > 3
    assert len(table.proposed) <= 200 / DECLINE_BACKOFF + 8, len(table.proposed)
    assert len(table.prepared) <= len(table.proposed) + 1  # indexed only for the lookups due
    # a long clean match: drafted at its next lookup, and drafting on while kept
    table.drafts[0] = ([5, 6, 7, 8, 9, 10, 11, 12], LONG_MATCH)
    widths = drive(sp, seqs, range(200, 200 + DECLINE_BACKOFF + 8), {0: [5, 6, 7, 8, 9, 10, 11, 12]})
    assert widths[-1] > 0 and s.drafting.declines == 0, widths


def test_a_failing_requests_lookups_are_spaced_out() -> None:
    """The steps at which a request whose drafts are declined looks up: 2, 4, 8, 16 steps apart, then
    every ``DECLINE_BACKOFF``."""
    sp, table = speculator(ONE_1B, 1)
    s = sequence(0)
    assert s.drafting is not None
    record(sp, s.drafting, "failing")
    table.drafts[0] = ([5, 6, 7], 2)
    at = []
    for step in range(100):
        before = len(table.proposed)
        drive(sp, {0: s}, range(step, step + 1))
        if len(table.proposed) > before:
            at.append(step)
    assert np.diff(at).tolist()[:6] == [2, 4, 8, 16, 16, 16], at


def test_a_width_bridges_a_short_gap_and_drops_after_what_a_change_costs() -> None:
    """A copy with an edit now and then finds no draft for a step or two: the width stays (fillers), as long
    as those steps' extra seconds stay under a change of width there and back (measured: a settling
    step's seconds over a settled one's; a ski rental), then none. After drafts that were refused it
    drops at once."""
    sp, table = speculator(ONE_1B, 1)
    sp.widths.observe(3, 1, (ONE_1B[3] + 1.0) / 1e3, changed=True)  # a change costs 1 ms a settling step
    s = sequence(0)
    seqs = {0: s}
    table.drafts[0] = ([5, 6, 7, 8, 9, 10], 3)
    assert drive(sp, seqs, range(3), {0: [5, 6, 7, 8, 9, 10]})[-1] == 8
    table.drafts[0] = ([], 0)  # nothing found for a while
    gap = drive(sp, seqs, range(3, 40))
    extra = ONE_1B[8] - ONE_1B[0]  # ms a step at width 8 over none
    bridged = int(2 * SETTLING * 1.0 // extra)
    assert gap[:bridged] == [8] * bridged and set(gap[bridged + 1:]) == {0}, gap
    # after a refused draft (the request's estimate under BRIDGE_RATE): none at once
    sp, table = speculator(ONE_1B, 1)
    s = sequence(0)
    table.drafts[0] = ([5, 6, 7], 2)
    first = drive(sp, {0: s}, range(1))
    table.drafts[0] = ([], 0)
    assert first == [3] and drive(sp, {0: s}, range(1, 4)) == [0, 0, 0]


def test_a_step_with_nothing_drafted_costs_no_step_costs() -> None:
    """With nothing to draft (every lookup finds nothing), a step computes no width costs: speculation's
    host time before the launch is the lookups due, each a dict read."""
    sp, table = speculator(ONE_1B, 4)
    costed = []
    width_cost = sp.width_cost
    sp.width_cost = lambda *a: costed.append(a) or width_cost(*a)  # type: ignore[method-assign]
    seqs = {i: sequence(i) for i in range(4)}
    assert drive(sp, seqs, range(50)) == [0] * 50
    assert not costed and 0 < len(table.proposed) < 4 * 50 / 3


# ---------------------------------------------------------------- the n-gram index against a scan

def check_index(toks: np.ndarray, rng: np.random.Generator) -> None:
    """At every length of ``toks`` (tokens coming one and several at a time) the index's draft and match
    are the scan's."""
    look = Lookup()
    size = int(rng.integers(1, 30))
    while size <= len(toks):
        k = int(rng.integers(1, 9))
        draft = look.draft(toks, size, k)
        assert (draft, look.match if draft else 0) == ngram_match(toks[:size], k), size
        size += int(rng.integers(1, 4))


def test_the_index_proposes_what_a_scan_proposes_on_random_streams() -> None:
    rng = np.random.default_rng(11)
    for trial in range(60):
        check_index(rng.integers(0, 2 + trial % 7, size=300).astype(np.int32), rng)


def test_the_index_proposes_what_a_scan_proposes_on_real_token_streams(gemma_vocab: Any) -> None:
    """Real text (the held tasks' inputs and a copy of them with edits), Gemma 3's tokens."""
    from .spec_tasks import TASKS

    rng = np.random.default_rng(3)
    for _, _, prompt in TASKS:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        words = text.split(" ")
        edited = " ".join(w if rng.random() > 0.1 else "edit" for w in words)
        check_index(np.asarray(gemma_vocab(text + "\n" + edited), np.int32), rng)


def test_a_copy_is_followed_past_an_edited_token() -> None:
    """After a token that differs from the passage copied (an edit), the last n-gram is new for two more
    tokens: the lookup follows the copy on from where its last draft came (``Lookup.follow``), for at most
    ``FOLLOW`` tokens."""
    passage = list(range(100, 140))
    edited = passage.copy()
    edited[20] = 5  # the prompt's passage has an edit; the reply writes the true passage
    toks = np.array([1, 2, *edited, 3, *passage[:20]], np.int32)
    look = Lookup()
    size = len(toks)
    assert look.draft(toks, size, 4) == [5, 121, 122, 123]  # the edit, then the passage
    toks = np.array([*toks, 120], np.int32)  # the true token, not the edit
    assert look.draft(toks, size + 1, 4) == []  # (119, 120) is not in the prompt
    assert look.follow(size + 1, 4) == [121, 122, 123, 124]
    assert look.follow(size + FOLLOW + 1, 4) == []


@pytest.fixture(scope="module")
def gemma_vocab() -> Any:
    """Gemma 3 270M's tokenizer (models/; the lead fetches it)."""
    import llama_cpp as L

    path = Path(__file__).resolve().parent.parent / "models" / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    vocab = L.llama_model_get_vocab(model)

    def tokenize(text: str) -> list[int]:
        data = text.encode()
        buf = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, False)
        return list(buf[:n])

    yield tokenize
    L.llama_model_free(model)


# ---------------------------------------------------------------- a draft model: its calls priced

class Priced:
    """A drafter (a draft model) whose calls cost ``call_ms`` each, one to catch up and one a draft position
    after the first: its price (``seconds``) and the calls its drafts made (``calls``), by step."""

    def __init__(self, call_ms: float) -> None:
        self.call_s = call_ms / 1e3
        self.calls = 0
        self.lengths: list[list[int]] = []

    def seconds(self, seqs: list[Any], length: int, plain: float, left: Any = ()) -> float:
        return length * self.call_s if seqs and length > 0 else 0.0

    def draft(self, seqs: list[Any], lengths: list[int]) -> list[list[int]]:
        self.calls += max(lengths)
        self.lengths.append(list(lengths))
        return [list(range(100, 100 + n)) for n in lengths]

    def close(self) -> None:
        pass


def model_record(sp: Speculator, d: Drafting, kind: str) -> None:
    """Ten verified drafts of a draft model's: 'copying' (8 drafted, all kept), 'failing' (1 drafted, refused),
    'new': none."""
    for _ in range(10 if kind != "new" else 0):
        drafted, kept = (8, 8) if kind == "copying" else (1, 0)
        d.match = MATCH_MAX
        d.verified(drafted, kept)
        sp.pool.verified(drafted, kept, MATCH_MAX)


def decide_priced(ms: dict[int, float], rows: int, call_ms: float, kind: str) -> tuple[int, int, bool, int]:
    """``rows`` sequences with ``kind``'s record and a draft model whose calls cost ``call_ms``: the step's
    width, a sequence's draft length, whether it backs off, and the draft model's calls."""
    sp, _ = speculator(ms, rows, DRAFT)
    drafter = Priced(call_ms)
    sp.drafter = drafter
    seqs = {i: sequence(i) for i in range(rows)}
    for s in seqs.values():
        assert s.drafting is not None
        s.drafting.limit = sp.widest  # a draft model's: MODEL_MAX (a request asking for no fewer)
        model_record(sp, s.drafting, kind)
    k = sp.propose(dict.fromkeys(seqs, 1), seqs, 100)
    d = seqs[0].drafting
    assert d is not None
    return k, len(seqs[0].draft), d.quiet_until > 100, drafter.calls


# (step costs, rows, a draft model call's ms, the sequences' record) -> (width, draft tokens, backs off, calls):
# a draft is made only where its tokens pay for the step's width AND the draft model's calls
PRICED = [
    # one stream of 8B with a 1B-shape draft (1.4 ms a call on an H200): drafts kept pay at width 16 (34 ms
    # for 17 tokens, 8: 19 ms for 9, against 4.3 ms for one); a new request (0.85, a reach of 4) at width 3
    # (9.6 ms for 3.2 tokens; its 4 tokens at width 8: 13.5 ms for 3.7)
    (MODEL_8B, 1, 1.4, "copying", (16, 16, False, 16)),
    (MODEL_8B, 1, 1.4, "new", (3, 3, False, 3)),
    # the same draft never right: no call (its estimate does not pay for a call), it backs off
    (MODEL_8B, 1, 1.4, "failing", (0, 0, True, 0)),
    (MODEL_8B, 1, 0.05, "failing", (0, 0, True, 0)),  # nearly free calls: its tokens are still not kept
    # a draft as dear as the model: always right, still not worth its calls (width 8: 40 ms for 8 tokens)
    (MODEL_8B, 1, 4.3, "copying", (0, 0, True, 0)),
    (MODEL_8B, 1, 2.0, "copying", (16, 16, False, 16)),  # dearer calls: 44 ms for 17 tokens, 8: 24 ms for 9
    # one stream of 1B with a small draft (0.3 ms a call)
    (MODEL_1B, 1, 0.3, "copying", (16, 16, False, 16)),
    (MODEL_1B, 1, 0.3, "new", (3, 3, False, 3)),
    (MODEL_1B, 1, 1.4, "new", (0, 0, True, 0)),  # a draft as dear as the model: 0.77x of none at width 3
    # 64 streams of 8B: a call drafts every row (2 ms a call); 64 rows of 1 + 3 are MAX_OUTPUTS
    (MODEL_64_8B, 64, 2.0, "copying", (3, 3, False, 3)),
    (MODEL_64_8B, 64, 2.0, "new", (0, 0, True, 0)),  # width 3: 1.18x of none, short of ENTER
]


@pytest.mark.parametrize(("ms", "rows", "call_ms", "kind", "want"), PRICED)
def test_a_draft_models_calls_are_priced_in_the_choice(ms: dict[int, float], rows: int, call_ms: float, kind: str,
                                                       want: tuple[int, int, bool, int]) -> None:
    assert decide_priced(ms, rows, call_ms, kind) == want


def test_a_draft_models_reach_grows_while_kept_and_shrinks_on_a_refusal() -> None:
    """A draft model's next draft length (``Drafting.reach``): twice as long after a draft kept whole (at most
    the sequence's limit: ``MODEL_MAX``, or what the request asks for), one more than the tokens kept after
    a refusal."""
    d = Drafting(limit=MODEL_MAX)
    steps = [(4, 4), (8, 8), (16, 16), (16, 3), (4, 0), (1, 1), (2, 2), (3, 3), (4, 1)]  # (drafted, kept)
    reach = []
    for drafted, kept in steps:
        assert drafted <= d.reach
        d.verified(drafted, kept)
        reach.append(d.reach)
    assert reach == [8, 16, 16, 4, 1, 2, 4, 8, 2]
    d = Drafting(limit=5)  # a request's ``speculative: 5``
    for _ in range(4):
        d.verified(d.reach, d.reach)
    assert d.reach == 5


def test_a_step_with_a_draft_models_drafts_is_expected_to_beat_the_same_step_without() -> None:
    """Random step costs, draft-model call prices and records: whenever the speculator drafts, the step's
    expected tokens over its seconds, the draft model's calls included, exceed the step's without drafts."""
    rng = random.Random(11)
    drafted = 0
    for _ in range(300):
        rows = rng.choice([1, 2, 8, 64])
        base = rng.uniform(1, 20)
        ms = {0: base, **{k: base * (1 + rng.uniform(0.02, 0.5) * k) for k in WIDTHS}}
        sp, _ = speculator(ms, rows, DRAFT)
        drafter = Priced(base * rng.choice([0.02, 0.1, 0.3, 0.6, 1.0]))
        sp.drafter = drafter
        seqs = {i: sequence(i) for i in range(rows)}
        for s in seqs.values():
            assert s.drafting is not None
            s.drafting.limit = sp.widest
            for _ in range(rng.randint(0, 12)):
                n = rng.randint(1, s.drafting.reach)
                kept = n if rng.random() < rng.choice([0.0, 0.5, 0.9, 1.0]) else rng.randint(0, n - 1)
                s.drafting.match = MATCH_MAX
                s.drafting.verified(n, kept)
                sp.pool.verified(n, kept, MATCH_MAX)
            s.drafting.match = MATCH_MAX
        chances = {i: s.drafting.chances_of(s.drafting.reach, sp.pool) for i, s in seqs.items()}  # type: ignore[union-attr]
        cost = sp.width_cost(rows, rows, 0)
        k = sp.propose(dict.fromkeys(seqs, 1), seqs, 100)
        if k:
            drafted += 1
            length = max(len(s.draft) for s in seqs.values())
            tokens = rows + sum(sum(c[: len(seqs[i].draft)]) for i, c in chances.items())
            assert tokens / (cost(k) + length * drafter.call_s) > rows / cost(0), (k, ms, drafter.call_s)
    assert drafted > 30  # the draws drafted often enough to tell


def test_a_draft_model_that_is_never_right_stops_calling_it() -> None:
    """A draft model whose drafts are all refused: after a few drafts its sequence backs off, and from then
    on the draft model is not called at all (no draft, no catching up), at whatever call price."""
    for call_ms in (0.05, 1.4):
        sp, _ = speculator(MODEL_8B, 1, DRAFT)
        drafter = Priced(call_ms)
        sp.drafter = drafter
        seqs = {0: sequence(0)}
        drive(sp, seqs, range(40))
        first = drafter.calls
        drive(sp, seqs, range(40, 400))
        assert 0 < first <= 12 and drafter.calls == first, (call_ms, first, drafter.calls, drafter.lengths)
        # and a draft model always right drafts on, at the widest width (its reach: 4, 8, then 16)
        sp, _ = speculator(MODEL_8B, 1, DRAFT)
        sp.drafter = drafter = Priced(call_ms)
        seqs = {0: sequence(0)}
        seqs[0].drafting.limit = sp.widest  # type: ignore[union-attr]
        widths = drive(sp, seqs, range(20), {0: list(range(100, 116))})
        assert widths[-5:] == [16] * 5 and drafter.lengths[-1] == [16], (widths, drafter.lengths)
