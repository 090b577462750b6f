"""Speculative decoding (worker/engine/spec.py): drafts from the sequence's own tokens, verified in the
shared batch, change no greedy text and keep the sampled distribution.

llama.cpp's CPU kernels compute a sequence's row otherwise when the step holds several of its tokens
(tinyBLAS for two or more query rows, a dot product for one: logits up to ~2 apart on Gemma 3 270M),
so where the model's two likeliest tokens are that close, greedy text may differ at that token. The
identity checks therefore compare token by token up to the first such near-tie of the reference, and
require that to be most of the text.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.protocol.params import ParamError, parse
from llamapool.worker.engine import Engine, EngineConfig
from llamapool.worker.engine.ngram import Lookup, PromptLookup, ngram_draft
from llamapool.worker.engine.spec import (
    FIRST_STEPS,
    HORIZON,
    LOOKUP_BACKOFF,
    OUTLIER,
    POOL_FLOOR,
    PRIOR,
    PROBE_MIN,
    PROBE_SHARE,
    SETTLE,
    SETTLING,
    STALE,
    STICKY,
    TRIAL,
    Calls,
    Drafting,
    Pool,
    WidthCosts,
    spec_mode,
)
from llamapool.worker.engine.speculator import Speculator

from .spec_tasks import CODE, DOCS, INVOICE

MAX_DRAFT_FOR_TESTS = 8  # draft tokens a step the oracle test asks for
NEAR_TIE = 2.5  # nats between the two likeliest tokens under which the kernels' rounding may decide


# ---------------------------------------------------------------- the parts, no model

def test_ngram_draft_proposes_what_followed_the_latest_match() -> None:
    hist = np.array([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2], np.int32)
    assert ngram_draft(hist, 3) == [4, 7, 1]  # "1 2" last seen at 5: what followed it
    assert ngram_draft(np.array([1, 2, 3, 4, 1, 2, 3], np.int32), 2) == [4, 1]  # the 3-gram wins
    assert ngram_draft(np.array([1, 2, 3, 4], np.int32), 4) == []  # no repeat, no draft
    assert ngram_draft(np.array([7, 7, 7], np.int32), 4) == [7]


def test_drafts_never_kept_bring_the_estimate_down() -> None:
    d = Drafting(rate=0.5)
    for _ in range(30):
        d.verified(4, 0)
    assert d.rate < 0.05 and d.chances(3)[0] == d.rate


def test_the_acceptance_estimate_is_the_chance_a_draft_token_is_kept() -> None:
    """At alpha 0.7 a step of 8 drafts keeps ~2.2 of them (accepted / drafted ~0.27): the estimate
    counts the tokens kept and one refusal a step, so it reads alpha, whatever the draft length."""
    rng = np.random.default_rng(3)
    for k in (3, 8):
        d, seen = Drafting(), []
        for _ in range(400):
            kept = 0
            while kept < k and rng.random() < 0.7:
                kept += 1
            d.verified(k, kept)
            seen.append(d.rate)
        assert np.mean(seen[50:]) == pytest.approx(0.7, abs=0.06), k


def draft_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step drafts what the proposer finds, its longest draft setting the width (the widths' costs
    and choice bypassed: the choice is tested on its own)."""
    monkeypatch.setattr(Speculator, "width_cost", lambda self, n_rows, rows, prefilling: (lambda k: 1.0))
    monkeypatch.setattr(WidthCosts, "choose", lambda self, chances, outputs, rows, most, last, cost:
                        min(max((len(c) for c in chances.values()), default=0), most))


def measured(seconds: dict[int, float], rows: int, probing: bool = False) -> WidthCosts:
    """Width costs that have seen each width's decode steps take ``seconds`` over ``rows`` rows (``probing``
    off: a choice alone; :func:`test_while_none_stays_a_width_is_probed_now_and_then`)."""
    w = WidthCosts(probing)
    for k, s in seconds.items():
        w.observe(k, rows, s, changed=True)  # a new shape (a graph built again): not measured
        for _ in range(FIRST_STEPS):
            w.observe(k, rows, s, changed=False)
    return w


def linear(step_s: float, draft_s: float, rows: int):  # type: ignore[no-untyped-def]
    return lambda k: step_s + k * rows * draft_s


# an H100's verify steps (issue 34's table, ms): 8B q8_0, one sequence and 64 (n tokens a sequence = k + 1)
ONE = {0: 4.32, 1: 4.79, 3: 5.43, 8: 7.9}
SIXTY_FOUR = {0: 14.5, 1: 21.2, 3: 32.8, 8: 58.0}


def choose(w: WidthCosts, chances: dict[int, list[float]], outputs: int, rows: int, most: int = 8, last: int = 0,
           cost=None) -> int:  # type: ignore[no-untyped-def]
    return w.choose(chances, outputs, rows, most, last, cost or (lambda k: w.seconds(k, rows, 0.0) or 1.0))


def test_without_drafts_the_estimate_drifts_to_the_sequences_own_acceptance() -> None:
    """Text changes course, so steps without a draft move the estimate back; but towards what the
    sequence's drafts have done so far, not the prior: drafts never kept stay unlikely."""
    never, mostly = Drafting(), Drafting()
    for _ in range(10):
        never.verified(3, 0)
        mostly.verified(4, 4)
        mostly.verified(4, 1)  # alpha ~0.8: 5 kept, 1 refused a pair of steps
    for _ in range(400):
        never.idle()
        mostly.idle()
    assert never.rate == pytest.approx(1 / 12, abs=0.01)
    assert mostly.rate == pytest.approx(51 / 62, abs=0.01)


def test_a_new_sequence_starts_at_the_workers_recent_acceptance() -> None:
    """At 64 streams a sequence lives ~130 steps: starting at 0.5, three drafts never looked worth
    starting. It starts at what the worker's drafts have lately done (at least POOL_FLOOR)."""
    pool = Pool()
    assert Drafting(prior=pool.rate).rate == PRIOR
    for _ in range(300):
        pool.verified(3, 3)
        pool.verified(3, 1)
    d = Drafting(prior=pool.rate)
    assert d.rate == pytest.approx(4 / 5, abs=0.02)
    for _ in range(300):
        pool.verified(3, 0)
    assert Drafting(prior=pool.rate).rate == POOL_FLOOR


def test_a_step_takes_the_measured_draft_width_that_pays() -> None:
    likely = [0.9 ** (j + 1) for j in range(8)]
    one = measured(ONE, 1)
    assert choose(one, {0: likely}, 1, 1) == 8  # one stream, a likely draft: the widest
    assert choose(one, {0: [0.05, 0.0025]}, 1, 1) == 0  # an unlikely one pays nothing (one at 0.2 would)
    # drafting starts where it beats none by ENTER (there and back: two new graphs) ...
    assert choose(one, {0: [0.2, 0.04]}, 1, 1, last=1) == 1
    assert choose(one, {0: [0.2, 0.04]}, 1, 1) == 0  # 8 % faster: not worth starting
    assert choose(one, {0: [0.3, 0.09, 0.027]}, 1, 1) == 0  # width 3 at 1.12x: neither
    assert choose(one, {0: [0.45, 0.2, 0.09]}, 1, 1) == 3  # 1.38x
    # ... and stops as soon as none is best
    dear = measured({**ONE, 1: 5.0}, 1)
    assert choose(dear, {0: [0.15, 0.03, 0.005]}, 1, 1, last=3) == 0  # width 3 at 0.94x of none
    assert choose(one, {0: likely}, 1, 1, most=4) == 4  # cut to ``most`` (its step estimated as width 8's)
    assert choose(one, {0: likely}, 1, 1, most=0) == 0
    assert choose(one, {}, 1, 1) == 0
    alpha = [0.8, 0.64, 0.512]
    sixty_four = measured(SIXTY_FOUR, 64)
    # 64 streams at alpha 0.8: three drafts (2.95 tokens for 2.26x the step), not one (1.8 for 1.46x)
    assert choose(sixty_four, {i: alpha for i in range(64)}, 64, 64) == 3
    # ... and drafts never kept: none
    assert choose(sixty_four, {i: [0.05, 0.0025, 0.0001] for i in range(64)}, 64, 64) == 0
    # drafts that add less than MIN_GAIN of the step's tokens are no choice, whatever the costs say
    assert choose(measured({0: 4.32, 1: 4.32}, 1), {0: [0.04]}, 1, 1, last=1) == 0
    # the last width stays while it is nearly as good (a new width: llama.cpp builds its graph again)
    near = {0: [0.78 ** (j + 1) for j in range(8)]}  # width 8: 0.975x width 3's expected speed
    assert choose(one, near, 1, 1) == 3
    assert choose(one, near, 1, 1, last=8) == 8
    assert choose(one, {0: [0.7 ** (j + 1) for j in range(8)]}, 1, 1, last=8) == 3  # 0.87x: it changes


def serve(w: WidthCosts, chances: dict[int, list[float]], rows: int, true_ms: dict[int, float],
          prior, steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    """``steps`` decode steps as the engine runs them: each chooses a width, then takes its true time."""
    picks: list[int] = []
    settled = 0
    for _ in range(steps):
        k = w.choose(chances, rows, rows, 8, picks[-1] if picks else 0,
                     lambda k: w.seconds(k, rows, 0.0) or prior(k))
        settled = settled + 1 if picks and k == picks[-1] else 0
        w.observe(k, rows, true_ms[k], changed=settled < SETTLING)
        picks.append(k)
    return picks


def test_measured_costs_overrule_the_linear_estimate() -> None:
    """The linear cost model (a draft token's fitted cost) says drafting at 64 rows and alpha 0.8 is not
    worth starting (one draft a row at 1.08x of none, short of ENTER; three at 0.99x); measured, one
    draft a row gives 1.23x: probed, measured, kept (three, 1.31x, are not worth a change of width)."""
    alpha = {i: [0.8, 0.64, 0.512] for i in range(64)}
    prior = linear(14.5, 0.15, 64)  # expected tokens a ms: width 0 4.41, 1 4.78, 3 4.36, 8 2.07
    w = measured({0: 14.5}, 64, probing=True)
    picks = serve(w, alpha, 64, SIXTY_FOUR, prior, STALE + 100)
    assert picks == [1] * len(picks)
    # measurements move along the rows they were taken at (the cost model's per-row seconds), per band
    assert w.seconds(1, 70, 0.1) == pytest.approx(21.2 + 6 * 0.1)  # 64-127 rows: one band
    assert w.seconds(1, 8, 0.1) is None and w.seconds(3, 64, 0.1) is None


def test_a_width_near_the_best_is_tried_and_a_far_one_never() -> None:
    """An unmeasured width whose estimate comes within WORTH_TRYING of the best one's runs TRIAL steps, and
    a measured one again once its measurement is STALE; one far below is never tried. The first step of a
    new width (llama.cpp builds its graph again) is not measured."""
    near = {0: [0.78 ** (j + 1) for j in range(8)]}
    w = measured({0: 4.32}, 1)
    prior = linear(4.32, 0.4, 1)  # estimated expected tokens a ms: width 1 0.38, 3 0.52, 8 0.54 (the best)
    picks = [choose(w, near, 1, 1, cost=lambda k: w.seconds(k, 1, 0.0) or prior(k)) for _ in range(3 * TRIAL)]
    assert picks == [3] * TRIAL + [8] * (2 * TRIAL)  # drafting: 3 tried (0.52 >= 0.85 x 0.54); 1 not
    w.observe(1, 1, 4.79, changed=True)
    assert w.seconds(1, 1, 0.0) is None
    costs = measured({0: 4.32, 1: 4.79, 3: 5.43}, 1)
    likely = {0: [0.6, 0.25, 0.1]}  # three drafts: width 3 (1 at 0.93x of its speed; 8 would cost 100 ms)
    far = [choose(costs, likely, 1, 1, last=3, cost=lambda k: costs.seconds(k, 1, 0.0) or 100.0)
           for _ in range(STALE + TRIAL + 1)]
    assert far == [3] * STALE + [1] * TRIAL + [3]  # 1 stale, and near enough: tried again; 8 never


def test_while_none_stays_a_width_is_probed_now_and_then() -> None:
    """At 64 rows a new sequence's prior (alpha 0.5) promises 0.94x of none for three drafts, short of
    ENTER: a width is probed for TRIAL steps now and then, so the acceptance is learnt; as often as keeps
    a probe's extra seconds (its steps' over none's, and the settling steps there and back, as
    measured) at PROBE_SHARE of the steps' in between."""
    import itertools

    def probes(seconds: dict[int, float], rows: int, alpha: float, excess: float | None) -> tuple[list, list]:
        w = measured(seconds, rows, probing=True)
        if excess is not None:
            w.observe(0, rows, seconds[0] + excess, changed=True)  # a settling step: what a change costs
        prior = {i: [alpha, alpha**2, alpha**3] for i in range(rows)}
        picks = [choose(w, prior, rows, rows) for _ in range(3 * STALE)]
        runs = [(k, len(list(g))) for k, g in itertools.groupby(picks)]
        return [r for r in runs if r[0]], [r[1] for r in runs if not r[0]]

    def gap(first: float, none: float, settling: float) -> int:  # decisions of none between two probes
        every = int((TRIAL * (first - none) + 2 * SETTLING * settling) / (PROBE_SHARE * none))
        return min(STALE, max(PROBE_MIN, every)) - TRIAL + 1

    tried, between = probes(SIXTY_FOUR, 64, 0.5, 3.0)  # at once, then width 1 again (3: 0.83x, not)
    assert set(tried) == {(1, TRIAL)} and between[:3] == [gap(21.2, 14.5, 3.0)] * 3 == [264] * 3
    tried, between = probes(SIXTY_FOUR, 64, 0.5, None)  # a change's cost not measured: a whole step's
    assert between[:2] == [gap(21.2, 14.5, 14.5)] * 2 == [STALE - TRIAL + 1] * 2
    one = {0: 4.32, 1: 4.79, 3: 5.43, 8: 7.63}  # at alpha 0.25 width 1 promises 1.13x of none: probed
    tried, between = probes(one, 1, 0.25, 1.0)
    assert set(tried) <= {(1, TRIAL), (3, TRIAL)} and between[1] == gap(one[tried[1][0]], 4.32, 1.0)
    w = measured(SIXTY_FOUR, 64, probing=True)
    unlikely = {i: [0.05, 0.0025] for i in range(64)}  # under MIN_GAIN's share: never probed
    assert set(choose(w, unlikely, 64, 64) for _ in range(2 * STALE)) == {0}


def test_a_width_changes_cost_is_measured_from_its_settling_steps() -> None:
    w = measured(SIXTY_FOUR, 64)
    assert not w.change
    w.observe(1, 64, 24.2, changed=True)  # 3 over width 1's 21.2
    assert w.change[w.band(64)] == pytest.approx(3.0)
    w.observe(0, 64, 14.5 * (OUTLIER + 1), changed=True)  # a first capture (cuBLAS set up): left out
    w.observe(0, 64, 18.5, changed=True)  # 4 over none's
    assert w.change[w.band(64)] == pytest.approx(SETTLE * 3.0 + (1 - SETTLE) * 4.0)
    assert w.seconds(1, 64, 0.0) == pytest.approx(21.2)  # the settled steps' own estimate untouched


def test_the_request_field_is_checked_by_name() -> None:
    assert parse({"speculative": False}).speculative is False
    assert parse({"speculative": 3}).speculative == 3
    for bad in (9, -1, "yes", 1.5):
        with pytest.raises(ParamError) as e:
            parse({"speculative": bad})
        assert e.value.field == "speculative"


# ---------------------------------------------------------------- Gemma 3 270M: greedy text

@pytest.fixture(scope="module")
def gemma() -> str:
    from llamapool import default_model

    return str(default_model.fetch(Path(__file__).resolve().parent.parent / "models"))


@pytest.fixture(scope="module")
def on(gemma: str) -> Iterator[Engine]:
    template = str(Path(__file__).resolve().parent.parent / "configs" / "gemma3.jinja")
    engine = Engine(EngineConfig(gemma, slots=8, ctx_per_slot=1024, max_batch_tokens=512, threads=2,
                                 speculative="ngram", chat_template=template))
    yield engine
    engine.close()


def run(engine: Engine, runs: list[tuple[Any, SamplingParams]]) -> list[Any]:
    """Each run's Done, all in the engine at once."""
    for i, (prompt, p) in enumerate(runs):
        engine.submit(Run(i, prompt, p, False), Step())
    done: dict[int, Any] = {}
    while engine.busy:
        step = engine.step()
        assert not step.failed, step.failed
        done.update((d.rid, d) for d in step.done)
    return [done[i] for i in range(len(runs))]


def agreeing_tokens(ref: list[list[Any]], got: list[list[Any]]) -> int:
    """How many tokens ``got`` shares with ``ref`` before they differ; a difference must come at a
    near-tie of ``ref`` (its two likeliest tokens within NEAR_TIE nats)."""
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a[0] != b[0]:
            top = a[3]
            assert len(top) > 1 and top[0][1] - top[1][1] < NEAR_TIE, (i, a, b)
            return i
    return min(len(ref), len(got))


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


GROUNDED = [
    f"{CODE}\n# The same code, with the function total renamed to row_sum:\n\ndef load(path):\n",
    chat(f"{INVOICE}\n\nExtract the sender's name, email, total and IBAN as a JSON object."),
    chat(f"{DOCS}\n\nWhich car was produced the longest? Quote the document."),
]
OPEN = chat("Write a short poem about the sea.")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                           "total": {"type": "string"}},
          "required": ["name", "email", "total"], "additionalProperties": False}


def test_one_stream_of_a_grounded_prompt_accepts_drafts(on: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, copying its input, every step drafting what prompt lookup finds: most drafts are kept and
    a step gains more than a token (the step budget's choice is tested on its own, above)."""
    draft_always(monkeypatch)
    before = (on.spec.drafted_tokens, on.spec.accepted_tokens, on.sampled_tokens, on.sampling_steps)
    run(on, [(GROUNDED[0], SamplingParams(max_tokens=40, temperature=0.0))])
    drafted, accepted = on.spec.drafted_tokens - before[0], on.spec.accepted_tokens - before[1]
    tokens, steps = on.sampled_tokens - before[2], on.sampling_steps - before[3]
    assert drafted and accepted / drafted > 0.5, (drafted, accepted)
    assert tokens / steps > 1.5, (tokens, steps)


def test_greedy_text_is_the_same_with_speculation(on: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held prompts, greedy, each with speculation (every step drafts what prompt lookup finds: the step
    budget's choice is another test's) and without (the request's ``speculative: false``), in one
    batch: the same tokens, the same ends; a stop string, a length limit and a JSON schema included."""
    draft_always(monkeypatch)
    g = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2, speculative=4)
    runs = [(prompt, g) for prompt in [*GROUNDED, OPEN]]
    runs += [(GROUNDED[0], dataclasses.replace(g, stop=("\n\n",), max_tokens=40)),
             (GROUNDED[0], dataclasses.replace(g, max_tokens=5)),
             (chat(f"{INVOICE}\n\nExtract the sender's name, email and total as JSON."),
              dataclasses.replace(g, json_schema=SCHEMA, max_tokens=40))]
    before = (on.spec.drafted_tokens, on.spec.accepted_tokens, on.sampled_tokens, on.sampling_steps)
    got = run(on, runs + [(prompt, dataclasses.replace(p, speculative=False)) for prompt, p in runs])
    drafted, accepted = on.spec.drafted_tokens - before[0], on.spec.accepted_tokens - before[1]
    tokens, steps = on.sampled_tokens - before[2], on.sampling_steps - before[3]
    got, ref = got[: len(runs)], got[len(runs):]
    agree = [agreeing_tokens(r.logprobs, g.logprobs) for r, g in zip(ref, got, strict=True)]
    assert sum(agree) >= 0.8 * sum(len(r.logprobs) for r in ref), agree
    for r, g_, n in zip(ref, got, agree, strict=True):
        if n == len(r.logprobs):
            assert (g_.text, g_.reason, g_.completion_tokens, g_.stop) == \
                (r.text, r.reason, r.completion_tokens, r.stop)
    assert ref[4].stop == "\n\n" and ref[5].reason == "length"
    if got[6].reason == "stop":  # the grammar held (at the length limit the reply may be cut)
        assert set(json.loads(got[6].text)) == {"name", "email", "total"}
    assert got[6].text.startswith('{"name"'), got[6].text
    assert accepted > 0 and drafted >= accepted
    assert tokens > steps  # more than one token a step, on average


@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_cpu_greedy_text_on_and_off_over_held_prompts(which: str, request: pytest.FixtureRequest) -> None:
    """Real models (Gemma 3 270M, SmolLM2 135M), held input-grounded and free prompts, greedy, the worker's
    own policy deciding the drafts: ``"auto"`` on a CPU worker does not speculate, so its text is the text
    without speculation, token for token; with ``"ngram"`` the text is the same but where the reference's
    two likeliest tokens are within ``NEAR_TIE`` (llama.cpp's CPU kernels compute a row otherwise when a
    step holds several of a sequence's tokens: Gemma 3 270M's "code edit" task, 160 tokens, differed at its
    6th token). That is why ``"auto"`` stays off on CPU workers (docs/benchmarks.md, issue 43)."""
    model = request.getfixturevalue(which)
    template = str(Path(__file__).resolve().parent.parent / "configs" / "gemma3.jinja") if which == "gemma" else ""
    g = SamplingParams(max_tokens=32, temperature=0.0, logprobs=True, top_logprobs=2)
    runs = [(prompt, g) for prompt in [*GROUNDED, OPEN, chat("Why is the sky blue? Explain it to a child.")]]
    for setting in ("auto", "ngram"):
        eng = Engine(EngineConfig(model, slots=2 * len(runs), ctx_per_slot=1024, max_batch_tokens=512, threads=2,
                                  speculative=setting, chat_template=template))
        try:
            got = run(eng, runs + [(prompt, dataclasses.replace(p, speculative=False)) for prompt, p in runs])
            on, off = got[: len(runs)], got[len(runs):]
            if setting == "auto":
                assert eng.spec.mode == "off" and eng.spec.drafted_tokens == 0
                assert [x.text for x in on] == [x.text for x in off]
                continue
            assert eng.spec.drafted_tokens > 0  # the grounded prompts drafted
            agree = [agreeing_tokens(r.logprobs, x.logprobs) for r, x in zip(off, on, strict=True)]
            for r, x, n in zip(off, on, agree, strict=True):
                if n == len(r.logprobs):
                    assert x.text == r.text
        finally:
            eng.close()


def test_a_reply_whose_grammar_completes_in_a_verified_draft_keeps_its_last_tokens(
        on: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts of a constrained reply's own continuation (an oracle: the reply without speculation), so that
    the step that completes the grammar verifies several tokens: every one of them is in the reply (the
    matcher takes a step's tokens before they are taken one by one: the grammar completed only after the
    last; it once ended the reply at the first, dropping the closing '"}', which did not parse)."""
    draft_always(monkeypatch)
    finished: dict[int, np.ndarray] = {}
    finish = Engine._finish

    def keep(self: Engine, seq: Any, reason: str, out: Step, delta: str = "") -> None:
        finished[seq.rid] = seq.history[: seq.n_history].copy()
        finish(self, seq, reason, out, delta)

    monkeypatch.setattr(Engine, "_finish", keep)
    completing: list[int] = []  # the tokens of each step in which a reply's grammar completed
    take_rows = Engine._take_rows

    def watch(self: Engine, seq: Any, toks: list[int], records: Any, out: Step) -> list[int]:
        matcher = seq.sampling.matcher
        if matcher is not None and matcher.is_stopped():
            completing.append(len(toks))
        return take_rows(self, seq, toks, records, out)

    monkeypatch.setattr(Engine, "_take_rows", watch)
    g = SamplingParams(max_tokens=60, temperature=0.0, json_schema=SCHEMA, speculative=MAX_DRAFT_FOR_TESTS)
    asks = [chat(f"{INVOICE}\n\nExtract the sender's name, email and total as JSON."),
            chat(f"{INVOICE}\n\nGive the name, the email and the total of this invoice as JSON."),
            chat("Make up a person with a name, an email and a total amount, as JSON.")]
    ref = run(on, [(a, dataclasses.replace(g, speculative=False)) for a in asks])
    whole = {i: finished[i] for i in range(len(asks))}
    on.spec.proposer = Calls(lambda rid, hist, k: [int(t) for t in whole[rid][len(hist): len(hist) + k]])
    before = (on.spec.accepted_tokens, on.sampled_tokens, on.sampling_steps)
    completing.clear()
    try:
        got = run(on, [(a, g) for a in asks])
    finally:
        on.spec.proposer = PromptLookup()
    assert on.spec.accepted_tokens - before[0] > 0
    assert max(completing) > 1, completing  # a grammar completed in a step of several tokens
    # the made-up person may run on to max_tokens on some machine classes (its total's digits: an AVX2 CPU's
    # rounding), closed as JSON there; the grounded two end on their own, and those are the guarantee
    assert [r.reason for r in ref[:2]] == ["stop", "stop"], [(r.reason, r.text) for r in ref]
    for r, x in zip(ref, got, strict=True):
        assert json.loads(r.text) and set(json.loads(x.text)) == {"name", "email", "total"}, x.text
        if r.reason == "stop":
            assert x.reason == "stop", (x.reason, x.text)
            # the same text, but where the CPU kernels round a verified row otherwise at a near-tie
            assert x.text == r.text or x.text[:8] == r.text[:8], (x.text, r.text)


# ---------------------------------------------------------------- the sampling rule, statistically

def test_sampled_drafts_keep_the_distribution(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft token is kept exactly when the token sampled from its row is the draft, so the output's
    distribution is the model's: with every second token drafted as the one the model samples most
    often there, that token comes as often as without drafts, and the others keep their shares."""
    p = SamplingParams(max_tokens=3, temperature=0.5, top_k=0, top_p=1.0, min_p=0.0)
    prompt = [1, 5, 9, 13]  # token ids
    n = 240
    second: dict[int, int] = {}  # rid -> its second output token
    real_take = Engine._take_rows

    def recording(self: Engine, seq: Any, *args: Any) -> list[int]:
        toks = real_take(self, seq, *args)
        if seq.n_history >= len(seq.tokens) + 2:
            second.setdefault(seq.rid, int(seq.history[len(seq.tokens) + 1]))
        return toks

    def sample(speculative: str, first_seed: int) -> tuple[Counter[int], Engine]:
        second.clear()
        engine = Engine(EngineConfig(model_path, slots=1, ctx_per_slot=64, max_batch_tokens=64, threads=2,
                                     speculative=speculative))
        for i in range(n):
            engine.submit(Run(i, prompt, dataclasses.replace(p, seed=first_seed + i), False), Step())
            while engine.busy:
                assert not engine.step().failed
        engine.close()
        return Counter(second.values()), engine

    monkeypatch.setattr(Engine, "_take_rows", recording)
    off_counts, off = sample("off", 0)
    assert off.spec.drafted_tokens == 0
    draft = off_counts.most_common(1)[0][0]
    monkeypatch.setattr(Lookup, "draft", lambda self, hist, size, k: [draft])
    draft_always(monkeypatch)  # drafts cost nothing: always
    on_counts, on = sample("ngram", 10_000)  # other seeds: independent samples
    assert on.spec.drafted_tokens == n  # every second token came from a draft's row (or ended the text there)
    assert on.spec.accepted_tokens == on_counts[draft]  # kept exactly when the row's sample is the draft
    assert off_counts[draft] >= n // 8, off_counts.most_common(3)  # a draft taken often enough to test
    for tok in [draft] + [t for t, _ in off_counts.most_common(3)[1:]]:
        a, b = off_counts[tok] / n, on_counts[tok] / n
        sd = np.sqrt(max((a + b) / 2 * (1 - (a + b) / 2), 1e-4) * 2 / n)
        assert abs(a - b) < 4 * sd, (tok, off_counts[tok], on_counts[tok])


# ---------------------------------------------------------------- through the daemon

def test_the_daemon_speculates_reports_it_and_refuses_a_bad_setting(
        tmp_path_factory: pytest.TempPathFactory, model_path: str) -> None:
    """The tiny model's greedy reply to a repetition repeats itself: prompt lookup drafts it. The
    request's field turns it off, a bad value is a 400 naming it, and status and /metrics count it."""
    import signal
    import time

    import httpx

    from tests.test_gateway import start_gateway

    d, url = start_gateway(tmp_path_factory.mktemp("spec"), model_path, model={"speculative": "ngram"},
                           workers={"cpu_workers": 1, "slots": 2})
    try:
        greedy: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "max_tokens": 48}
        with d.client() as c:
            on = c.generate("hello hello hello hello", **greedy)
            off = c.generate("hello hello hello hello", speculative=False, **greedy)
            streamed = "".join(ch.text for ch in c.stream("hello hello hello hello", **greedy))
        assert on.text == streamed == off.text and on.usage.completion_tokens == off.usage.completion_tokens == 48
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "speculative": 9}, timeout=30)
        assert r.status_code == 400 and "speculative" in r.text
        for _ in range(50):  # the heartbeat carries the counts, once a second
            w = d.status()["workers"][0]
            if w.get("accepted_tokens"):
                break
            time.sleep(0.2)
        assert w["draft_tokens"] >= w["accepted_tokens"] > 0 and w["tokens_per_step"] > 1, w
        assert 0 < w["acceptance"] <= 1
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert "llamapool_speculative_draft_tokens_total" in text
        assert "llamapool_speculative_accepted_tokens_total" in text
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_a_backend_sampling_worker_verifies_greedy_drafts_in_the_graph(model_path: str) -> None:
    """On a GPU worker (backend sampling, forced here on the CPU) a speculating greedy request's rows, its
    token and its drafts, are all sampled in the graph (llamapool's greedy takes any number of a
    sequence's rows: no logits leave the GPU) and give the host verification's text; a sampled
    speculating request is verified on the host (its rule samples row after row with its chain)."""
    kw: dict[str, Any] = {"slots": 3, "ctx_per_slot": 256, "max_batch_tokens": 64, "threads": 2,
                          "speculative": "ngram"}
    graph, host = Engine(EngineConfig(model_path, **kw, backend_sampling=True)), Engine(EngineConfig(model_path, **kw))
    try:
        p = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
        assert graph.sampling.rows_per_seq > 1 and graph.sampling.verifies(p) and not graph.sampling.verifies(sampled)
        runs = [("hello hello hello hello", p), ("hello hello hello hello", dataclasses.replace(p, speculative=False)),
                ("a b a b a b a b", sampled)]
        for i, (prompt, q) in enumerate(runs):
            graph.submit(Run(i, prompt, q, False), Step())
        graph.step()
        assert {seq.rid: seq.sampling.in_graph for seq in graph.active.values()} == {0: True, 1: True, 2: False}
        while graph.busy:
            assert not graph.step().failed
        assert graph.spec.accepted_tokens > 0
        on, off, _ = run(graph, runs)
        assert on.text == off.text
        h_on, _, h_sampled = run(host, runs)
        assert on.text == h_on.text  # the same rows computed: the graph's argmax is the host's
        assert run(graph, runs[2:])[0].text == h_sampled.text  # seeded, on the host in both
    finally:
        graph.close()
        host.close()


def test_auto_speculates_on_gpu_workers_and_only_where_the_graph_verifies(model_path: str) -> None:
    """``speculative = "auto"`` (the default) is prompt lookup on a GPU worker for the requests whose rows
    the decode graph verifies (greedy, no grammar, no logprobs): a sampled request stays sampled in the
    graph without drafts rather than move to the host for them. On a CPU worker it is off ("ngram" turns
    it on for every request there)."""
    assert spec_mode("auto", True) == "graph" and spec_mode("auto", False) == "off"
    assert spec_mode("ngram", False) == spec_mode("ngram", True) == "all" and spec_mode("off", True) == "off"
    engine = Engine(EngineConfig(model_path, slots=3, ctx_per_slot=256, max_batch_tokens=64, threads=2,
                                 speculative="ngram", backend_sampling=True))
    engine.spec.mode = "graph"  # what "auto" gives a GPU worker (its context allows 1 + 8 rows a sequence)
    try:
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        runs = [("hello hello hello hello", greedy),
                ("a b a b a b a b", SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)),
                ("a b a b a b a b", dataclasses.replace(greedy, logprobs=True, top_logprobs=2))]
        for i, (prompt, q) in enumerate(runs):
            engine.submit(Run(i, prompt, q, False), Step())
        engine.step()
        seqs = {seq.rid: seq for seq in engine.active.values()}
        assert {rid: seq.sampling.in_graph for rid, seq in seqs.items()} == {0: True, 1: True, 2: True}
        assert {rid: seq.drafting is not None for rid, seq in seqs.items()} == {0: True, 1: False, 2: False}
        while engine.busy:
            assert not engine.step().failed
        assert engine.spec.accepted_tokens > 0
    finally:
        engine.close()


def test_a_step_with_prompt_work_carries_no_drafts(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp splits a step with prompt chunks into a micro-batch of every sequence's width and one a
    prompt after it, so drafts there are dearly verified: such a step carries none; the decode steps
    around it do."""
    draft_always(monkeypatch)
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=128, threads=2,
                              speculative="ngram", prefix_cache=False))
    shapes: list[tuple[int, int, int]] = []
    launch = Engine._launch

    def recording(self: Engine, order: list, out: Step) -> bool:  # type: ignore[type-arg]
        shapes.append(self._shape)
        return launch(self, order, out)

    monkeypatch.setattr(Engine, "_launch", recording)
    try:
        eng.spec.proposer = Calls(lambda rid, hist, k: [5, 6])
        p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        eng.submit(Run(1, "tok1 tok2 tok3", p, True), Step())
        for i in range(20):
            if i == 6:
                eng.submit(Run(2, "tok4 " * 40, p, True), Step())
            eng.step()
        assert any(prompt for _, prompt, _ in shapes[1:]), "the second prompt ran beside the first sequence"
        assert all(not drafts for _, prompt, drafts in shapes if prompt)
        assert any(drafts for _, prompt, drafts in shapes if not prompt)
    finally:
        eng.close()


def test_a_step_has_at_most_max_outputs_rows_with_logits(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp keeps n_vocab floats and ids a row with logits for its graph samplers, in pinned memory
    it reallocates when a step has more such rows than any before: 40 sequences drafting 8 tokens each
    get a width of 5 (40 x 6 rows: at most MAX_OUTPUTS)."""
    from llamapool.worker.engine.spec import MAX_OUTPUTS

    draft_always(monkeypatch)
    eng = Engine(EngineConfig(model_path, slots=40, ctx_per_slot=96, max_batch_tokens=1024, n_ubatch=1024,
                              threads=2, speculative="ngram", prefix_cache=False))
    try:
        eng.spec.proposer = Calls(lambda rid, hist, k: [5] * k)
        p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i in range(40):
            eng.submit(Run(i, "tok1 tok2", p, True), Step())
        widths = set()
        while eng.busy:
            eng.step()
            rows, _prompt, drafts = eng._shape
            if drafts:
                widths.add(drafts // rows)
                assert rows + drafts <= MAX_OUTPUTS
        assert max(widths) == MAX_OUTPUTS // 40 - 1
    finally:
        eng.close()


def test_drafts_a_step_does_not_verify_are_watched_and_learnt_from(model_path: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose width is none verifies no draft, but the tokens generated after a draft settle it
    (Drafting.watch): drafts that would have been kept raise an estimate just too low to win a width,
    and drafts that would not bring one down, with nothing verified either way; the worker's pool learns
    too. The text is the same."""
    monkeypatch.setattr(WidthCosts, "choose", lambda self, chances, outputs, rows, most, last, cost: 0)
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = Engine(EngineConfig(model_path, slots=2, ctx_per_slot=128, threads=2, speculative="ngram",
                              prefix_cache=False))
    try:
        done: dict[int, list[int]] = {}

        def drive(rid: int) -> Any:
            eng.submit(Run(rid, "tok1 tok2", p, True), Step())
            eng.step()
            seq = next(iter(eng.active.values()))
            d = seq.drafting
            assert d is not None
            d.kept_w, d.rate = 0.1 * d.tried_w, 0.1
            while eng.busy:
                out = eng.step()
                for x in out.done:
                    done[x.rid] = list(seq.history[len(seq.tokens): seq.n_history])
            return d

        eng.spec.proposer = Calls(lambda rid, hist, k: [5, 6])  # (not what this model writes after "tok1 tok2")
        never = drive(1)
        ref = done[1]
        assert ref[:2] != [5, 6] and never.rate < 0.1 and never.refused > 5
        prompt_len = len(eng.tokenize("tok1 tok2"))
        own = Calls(lambda rid, hist, k: [int(t) for t in ref[len(hist) - prompt_len:][:k]])  # the model's own
        eng.spec.proposer = own
        kept = drive(2)
        assert done[2] == ref and kept.rate > 0.9 and kept.refused == 0
        assert eng.spec.drafted_tokens == 0 and eng.spec.pool.recent > 0.5
    finally:
        eng.close()


def test_a_step_with_drafts_of_unequal_lengths_gives_every_sequence_as_many_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp computes per-sequence KV streams in micro-batches of equally many tokens a sequence, so a
    step whose drafts differ in length (3 tokens, 1, none; and a free slot between busy ones) is filled
    to one width with filler tokens: one micro-batch, not one a length. The fillers change no text, and
    leave the KV cache with the drafts not kept. A ``peaked`` model: its greedy output is the successor
    cycle whatever the batch, so the oracle's drafts are its true continuation, every one kept."""
    import llama_cpp as L

    from llamapool.modelgen import make_model, peaked_next

    path = make_model(tmp_path / "peaked.gguf", peaked=True)
    eng = Engine(EngineConfig(str(path), slots=4, ctx_per_slot=96, max_batch_tokens=64, threads=2,
                              speculative="ngram", prefix_cache=False))
    try:
        nxt = peaked_next(eng.n_vocab)
        lengths = {0: 3, 1: 1, 2: 0, 3: 2}

        def oracle(rid: int, hist: np.ndarray, k: int) -> list[int]:
            out, t = [], int(hist[-1])
            for _ in range(min(k, lengths[rid])):
                t = int(nxt[t])
                out.append(t)
            return out

        eng.spec.proposer = Calls(oracle)
        draft_always(monkeypatch)  # every draft pays
        p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        runs = [(f"tok{i} tok{i + 1} tok{i + 2}", p) for i in range(4)]
        runs[1] = (runs[1][0], dataclasses.replace(p, max_tokens=4))  # ends early: a free slot between busy ones
        for i, (prompt, q) in enumerate(runs):
            eng.submit(Run(i, prompt, q, False), Step())
        done: dict[int, Any] = {}
        widths = set()
        while eng.busy:
            prefill = bool(eng.waiting) or any(s.prefilling for s in eng.active.values())
            step = eng.step()
            assert not step.failed
            done.update((d.rid, d) for d in step.done)
            counts = Counter(eng.batch.seq[: eng.batch.n].tolist())
            if not prefill:
                assert len(set(counts.values())) == 1, counts  # one width: one micro-batch
                widths.add(max(counts.values()))
            for s in eng.active.values():  # drafts not kept and fillers left the cache
                assert L.llama_memory_seq_pos_max(eng.mem, s.seq_id) == s.n_past - 1
        assert max(widths) == 4 and eng.spec.accepted_tokens == eng.spec.drafted_tokens > 0
        off = run(eng, [(prompt, dataclasses.replace(q, speculative=False)) for prompt, q in runs])
        assert [done[i].text for i in range(4)] == [d.text for d in off]
    finally:
        eng.close()


def test_the_kept_up_lookup_drafts_what_a_scan_of_the_tokens_drafts() -> None:
    """spec.Lookup indexes a sequence's n-grams as its tokens come (a dict lookup a step, not a scan):
    at every length of random token streams, short-alphabet ones full of repeats, with tokens coming
    one and several at a time, its draft is ngram_draft's."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        toks = rng.integers(0, 2 + trial % 6, size=200).astype(np.int32)
        look = Lookup()
        size = int(rng.integers(1, 30))
        while size <= len(toks):
            k = int(rng.integers(1, 9))
            assert look.draft(toks, size, k) == ngram_draft(toks[:size], k), (trial, size)
            size += int(rng.integers(1, 4))


def test_a_draft_not_verified_is_watched_and_learnt_from_for_free() -> None:
    """A step without drafts still made some (or makes a few, SHADOWS a step): the tokens generated after
    a watched draft settle it as a verified one would be, at the first token that differs or when all
    of it matched, so an estimate that fell learns when the text turns copyable again."""
    d = Drafting(rate=0.2)
    d.kept_w, d.tried_w = 0.2, 1.0
    d.watch([5, 6, 7])
    assert d.saw([5]) is None and d.saw([6]) is None and d.shadow
    assert d.saw([7, 8]) == (3, 3) and not d.shadow and d.rate == pytest.approx((0.9 * 0.2 + 3) / (0.9 + 3))
    d.watch([5, 6, 7])
    assert d.saw([5, 9]) == (3, 1) and d.refused == 1
    d.watch([1, 2])
    d.verified(2, 2)  # a verified draft supersedes the watched one
    assert not d.shadow and d.saw([1]) is None


def test_a_sequence_whose_lookups_find_nothing_looks_up_less_often(model_path: str) -> None:
    """Text that repeats nothing costs a lookup a step for nothing (host time between two launches): after
    a lookup that finds no draft the next waits 1, 2, then LOOKUP_BACKOFF steps; one that finds a draft
    brings it back to every step."""
    d = Drafting()
    d.missed(10)
    assert d.quiet_until == 11
    d.missed(11)
    d.missed(13)
    d.missed(17)
    assert d.quiet_until == 17 + LOOKUP_BACKOFF
    eng = Engine(EngineConfig(model_path, slots=1, ctx_per_slot=128, threads=2, speculative="ngram",
                              prefix_cache=False))
    try:
        calls: list[int] = []
        eng.spec.proposer = Calls(lambda rid, hist, k: calls.append(len(hist)) or [])  # type: ignore[func-returns-value]
        eng.submit(Run(1, "tok1 tok2", SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True), True), Step())
        while eng.busy:
            eng.step()
        assert 40 / LOOKUP_BACKOFF <= len(calls) <= 40 / LOOKUP_BACKOFF + 3
    finally:
        eng.close()


def test_a_change_of_width_must_pay_for_its_measured_settling_steps() -> None:
    """Drafts at 0.92 promise width 8 1.18x of width 3's speed at one row: beyond STICKY's margin, so it
    is taken while a change's cost is unknown; once a change is measured at 5 ms a settling step (an
    8B graph captured again), the switch would not pay for its four settling steps in HORIZON steps."""
    one = {0: 4.5, 1: 4.95, 3: 5.55, 8: 8.77}
    likely = {0: [0.92 ** (j + 1) for j in range(8)]}
    w = measured(one, 1)
    assert choose(w, likely, 1, 1, last=3) == 8
    w = measured(one, 1)
    w.observe(3, 1, 5.55 + 5.0, changed=True)
    assert w.change[w.band(1)] == pytest.approx(5.0)
    assert 1 - 2 * SETTLING * 5.0 / (HORIZON * 5.55) < 1 / 1.18 < STICKY
    assert choose(w, likely, 1, 1, last=3) == 3


def test_a_width_not_measured_costs_no_less_than_the_widest_measured_below_it() -> None:
    """The cost model's line, fitted where width 1 had run only its first steps, put width 3 at 4x a plain
    step where it costs 2.2x (1B, 64 rows), and no draft looked worth it again. A width not measured
    costs what the widest measured one below it does (a lower bound), unless the model says less: it
    is tried, and then measured."""
    from llamapool.worker.engine.spec import step_costs

    w = measured({0: 0.0054, 1: 0.0100}, 64)
    coef = (0.0054, 0.0, 0.0, 0.0, 0.0046 / 64)  # base, per_row, per_prompt_token, prompt_step, per_draft_token
    cost = step_costs(coef, w, 64, 64, 64, 0.0)
    assert cost(0) == pytest.approx(0.0054) and cost(1) == pytest.approx(0.0100)
    assert cost(3) == pytest.approx(0.0100) and cost(8) == pytest.approx(0.0100)  # the model said 0.019, 0.042
    for _ in range(FIRST_STEPS):  # (fewer: estimated as unmeasured, test_spec_policy)
        w.observe(3, 64, 0.0117, changed=False)
    cost = step_costs(coef, w, 64, 64, 64, 0.002)
    assert cost(3) == pytest.approx(0.0137) and cost(8) == pytest.approx(0.0137)
    cheap = (0.0054, 0.0, 0.0, 0.0, 0.0001 / 64)  # a model that says less is believed
    assert step_costs(cheap, w, 64, 64, 64, 0.0)(8) == pytest.approx(0.0054 + 0.0008)
    alone = measured({0: 0.0054}, 64)  # only none measured: a draft looks free until it is tried
    assert step_costs(coef, alone, 64, 64, 64, 0.0)(3) == pytest.approx(0.0054)


def test_a_draft_token_too_unlikely_to_be_kept_is_not_made() -> None:
    """A sequence weighs in the step's choice (its draft made before the launch) when its estimate pays
    for a draft token at the cheapest width; and never below ``LEAST_CHANCE``: with only none measured a
    draft looks free (the lower bound above), and every sequence, however often refused, would make its
    draft every step."""
    from llamapool.worker.engine.spec import LEAST_CHANCE, step_costs, threshold

    coef = (0.0054, 0.0, 0.0, 0.0, 0.0046 / 64)
    free = step_costs(coef, measured({0: 0.0054}, 64), 64, 64, 64, 0.0)
    assert threshold(free, 64, 64) == LEAST_CHANCE and threshold(free, 64, 64, floor=0.0) == 0.0
    paid = step_costs(coef, measured({0: 0.0054, 1: 0.0076, 3: 0.0096, 8: 0.0170}, 64), 64, 64, 64, 0.0)
    assert threshold(paid, 64, 64) == pytest.approx((0.0096 - 0.0054) / 3 / 0.0054)  # three a row: 0.26
    refused = Drafting(prior=0.3)
    for _ in range(3):
        refused.verified(3, 0)
    assert refused.rate < LEAST_CHANCE
