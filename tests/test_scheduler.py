"""The step planner (worker/scheduler.py), without a model: what every step guarantees."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamapool.worker.scheduler import (
    HOLD_STEPS,
    MAX_PREFILL_LOAD,
    MIN_CHUNK,
    PASS_OVER_LIMIT,
    ArrivalRate,
    CostModel,
    PromptWork,
    StepPlan,
    StepTarget,
    auto_chunk,
    plan_step,
    priority,
)
from tests.test_gateway import free_port
from tests.test_metrics import scrape, value

NOW = 100

held = st.tuples(
    st.integers(0, 64),  # decoding sequences
    # prompts: (remaining, arrived, running)
    st.lists(st.tuples(st.integers(1, 5000), st.integers(0, NOW), st.booleans()), max_size=40),
    st.integers(0, 64),  # free slots
    st.integers(1, 8192),  # the step's token budget
)


def _plan(n_decode: int, prompts: list[tuple[int, int, bool]], free: int, budget: int
          ) -> tuple[list[int], list[PromptWork], StepPlan]:
    decoding = list(range(n_decode))
    work = [PromptWork(1000 + i, remaining, arrived, running)
            for i, (remaining, arrived, running) in enumerate(prompts)]
    return decoding, work, plan_step(budget, decoding, work, free, NOW)


def _given(plan: StepPlan, p: PromptWork) -> int:
    """Tokens ``p`` gets this step (0: a waiting prompt not admitted)."""
    if p.running:
        return plan.tokens[p.key]
    return dict(plan.admit).get(p.key, 0)


@settings(max_examples=400, deadline=None)
@given(held)
def test_every_running_sequence_gets_a_token_every_step(case: tuple[int, list[tuple[int, int, bool]], int, int]
                                                        ) -> None:
    decoding, work, plan = _plan(*case)
    assert all(plan.tokens[s] == 1 for s in decoding)
    assert all(1 <= plan.tokens[p.key] <= p.remaining for p in work if p.running)


@settings(max_examples=400, deadline=None)
@given(held)
def test_a_step_stays_within_its_budget_and_admits_only_into_free_slots(
        case: tuple[int, list[tuple[int, int, bool]], int, int]) -> None:
    decoding, work, plan = _plan(*case)
    free, budget = case[2], case[3]
    floor = len(decoding) + sum(p.running for p in work)  # one token each is owed even past the budget
    assert plan.total <= max(budget, floor)
    assert len(plan.admit) <= free
    waiting = {p.key: p for p in work if not p.running}
    assert all(k in waiting and 1 <= n <= waiting[k].remaining for k, n in plan.admit)


@settings(max_examples=400, deadline=None)
@given(held)
def test_chunks_go_shortest_first_and_an_aged_prompt_before_every_younger_one(
        case: tuple[int, list[tuple[int, int, bool]], int, int]) -> None:
    """A prompt gets more than its minimum only when every prompt ahead of it in ``priority`` (aged
    ones oldest first, then shortest remaining) that could run got all it needs."""
    _, work, plan = _plan(*case)
    free = case[2]
    line = sorted(work, key=lambda p: priority(p, NOW))
    minimum = {p.key: 1 if p.running else 0 for p in work}
    for i, p in enumerate(line):
        if _given(plan, p) > minimum[p.key]:
            for q in line[:i]:
                slotless = not q.running and len(plan.admit) == free and _given(plan, q) == 0
                assert _given(plan, q) == q.remaining or slotless, (p, q)


def test_a_worked_example() -> None:
    plan = plan_step(512, [1, 2], [PromptWork(3, 1000, arrived=NOW - 1), PromptWork(4, 100, arrived=NOW - 2),
                                   PromptWork(0, 50, arrived=NOW, running=False)], free_slots=1, now=NOW)
    # 2 decode tokens and 1 per running prompt; the waiting 50-token prompt is shortest: admitted whole,
    # then the 100-token one completes, and the 1000-token one takes the rest
    assert plan.admit == [(0, 50)]
    assert plan.tokens == {1: 1, 2: 1, 3: 360, 4: 100} and plan.total == 512
    # the same 1000-token prompt, aged: it goes first
    plan = plan_step(512, [1, 2], [PromptWork(3, 1000, arrived=NOW - PASS_OVER_LIMIT),
                                   PromptWork(4, 100, arrived=NOW - 2)], free_slots=0, now=NOW)
    assert plan.tokens == {1: 1, 2: 1, 3: 509, 4: 1}


# ---------------------------------------------------------------- many steps: arrival traces

Budget = Callable[[int, list[int]], int]  # (rows, the prompts in line) -> the step's token budget
Cost4 = tuple[float, float, float, float]  # a step's seconds: base, per row, per prompt token, per prompt step


def _simulate(trace: list[tuple[int, int, int]], budget: int | Budget, slots: int, cost: Cost4 = (0, 0, 0, 0),
              steps: int = 4000) -> dict[int, tuple[int, int, float]]:
    """Run the planner over ``trace`` ((arrival step, prompt tokens, tokens to generate) per request)
    as an engine would; each request's (arrival, step its first token came, seconds from arrival to then when a
    step costs ``cost``: its time to first token)."""
    clock = 0.0
    pending = sorted(enumerate(trace), key=lambda e: e[1][0])
    waiting: list[tuple[int, int, int]] = []  # (request, remaining, arrived)
    since: dict[int, float] = {}  # request -> the clock at its arrival
    running: dict[int, list[int]] = {}  # slot -> [request, prompt left, tokens left, arrived]
    first: dict[int, tuple[int, int]] = {}
    for now in range(steps):
        while pending and pending[0][1][0] <= now:
            r, (t, n, _) = pending.pop(0)
            waiting.append((r, n, t))
            since[r] = clock
        work = [PromptWork(s, v[1], v[3]) for s, v in running.items() if v[1] > 0]
        work += [PromptWork(i, n, t, running=False) for i, (_, n, t) in enumerate(waiting)]
        free = [s for s in range(slots) if s not in running]
        decoding = [s for s, v in running.items() if v[1] == 0]
        if callable(budget):
            ahead, slots_left = [], len(free)
            for p in sorted(work, key=lambda p: priority(p, now)):
                if p.running or slots_left > 0:
                    ahead.append(p.remaining)
                    slots_left -= not p.running
            size = budget(len(running), ahead)
        else:
            size = budget
        plan = plan_step(size, decoding, work, len(free), now)
        assert plan.total <= max(size, len(running))
        clock += _seconds(cost, len(running) + len(plan.admit), plan.total - len(decoding))
        for (key, n), slot in zip(plan.admit, free, strict=False):
            r, remaining, t = waiting[key]
            running[slot] = [r, remaining, trace[r][2], t]
            plan.tokens[slot] = n
        taken = {waiting[k][0] for k, _ in plan.admit}
        waiting = [w for w in waiting if w[0] not in taken]
        for slot, n in plan.tokens.items():
            v = running[slot]
            if v[1] > 0:
                v[1] -= n
                if v[1] > 0:
                    continue
                first[v[0]] = (v[3], now, clock - since[v[0]])
            v[2] -= 1
            if v[2] <= 0:
                del running[slot]
        if not pending and not waiting and not running:
            break
    return first


traces = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 3000), st.integers(1, 40)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(traces, st.integers(256, 4096))
def test_no_prompt_starves(trace: list[tuple[int, int, int]], budget: int) -> None:
    """With a slot for every request, each prompt's first token comes within PASS_OVER_LIMIT steps plus
    the steps that all prompts arrived up to it need at the budget left after the running sequences."""
    slots = len(trace)
    first = _simulate(trace, budget, slots)
    assert len(first) == len(trace), "every request got its first token"
    for r, (t, _, _) in enumerate(trace):
        before = sum(m for (u, m, _) in trace if u <= t)
        bound = t + PASS_OVER_LIMIT + math.ceil(before / (budget - slots)) + 1
        assert first[r][1] <= bound


def test_a_short_prompt_behind_a_long_one_does_not_wait_for_all_of_it() -> None:
    """A 100-token prompt arriving one step after a 4,000-token one, at a 512-token budget: it gets its
    first token in its first step, not after the ~8 steps the long prompt takes."""
    first = _simulate([(0, 4000, 4), (1, 100, 4)], budget=512, slots=4)
    assert first[1][:2] == (1, 1)
    assert first[0][1] == math.ceil((4000 + 100) / 512) - 1  # the long one lost only the short one's tokens


def test_equal_prompts_arriving_together_finish_in_arrival_order() -> None:
    first = _simulate([(0, 300, 4)] * 10, budget=1024, slots=10)
    assert [first[r][1] for r in range(10)] == sorted(first[r][1] for r in range(10))


# ---------------------------------------------------------------- step-time budgets

# a step's seconds (base, per row, per prompt token, per step with prompt work), near those fitted on an
# H200 at 64 streams (docs/benchmarks.md)
SHAPE_1B = (0.004, 3e-5, 1.8e-5, 0.008)
SHAPE_8B = (0.008, 1.8e-4, 8.5e-5, 0.018)


def _seconds(shape: Cost4, rows: int, tokens: int) -> float:
    base, per_row, per_token, prompt_step = shape
    return base + per_row * rows + per_token * tokens + (prompt_step if tokens else 0.0)


def _fitted(shape: Cost4, noise: float = 0.0) -> CostModel:
    rng = random.Random(0)
    cost = CostModel()
    for _ in range(200):
        rows, tokens = rng.randint(1, 256), rng.choice([0, 0, rng.randint(1, 4096)])
        cost.observe(rows, tokens, _seconds(shape, rows, tokens) * (1 + rng.uniform(-noise, noise)))
    return cost


@pytest.mark.parametrize("shape", [SHAPE_1B, SHAPE_8B, (0.0005, 1e-6, 2e-6, 0.0)])
def test_the_cost_model_learns_a_steps_cost_from_its_timings(shape: Cost4) -> None:
    cost = _fitted(shape, noise=0.02)
    assert cost.coef is not None
    for got, want in zip(cost.coef[:4], shape, strict=True):
        assert got == pytest.approx(want, rel=0.15, abs=1e-3 * max(shape))


def test_the_cost_model_learns_a_draft_tokens_cost_apart_from_a_prompt_tokens() -> None:
    """Drafts and fillers (tokens a decoding row carries after its own) cost what the steps show, not a
    prompt token's: at one stream of 8B on an H100 ~0.45 ms against ~0.1 ms."""
    rng = random.Random(1)
    cost = CostModel()
    base, per_row, per_token, _ = SHAPE_8B
    per_draft = 4.5e-4
    for _ in range(300):
        rows = rng.choice([1, 1, 2, 64])
        tokens = rng.choice([0, 0, 0, rng.randint(1, 2048)])
        drafts = 0 if tokens else rows * rng.choice([0, 1, 3, 8])
        cost.observe(rows, tokens, _seconds(SHAPE_8B, rows, tokens) + per_draft * drafts, drafts)
    assert cost.coef is not None
    assert cost.coef[4] == pytest.approx(per_draft, rel=0.05)
    assert cost.coef[2] == pytest.approx(per_token, rel=0.15)
    assert cost.predict(1, 0, 3) == pytest.approx(base + per_row + 3 * per_draft, rel=0.05)


def test_prompt_steps_of_one_size_still_give_a_prompt_token_a_cost() -> None:
    """Chunks all of one size cannot tell a prompt step's cost from its tokens'; where the noise of a
    busy host makes the per-token term negative, the fit folds the step's cost into its tokens instead
    of never fitting (the CI flake where a worker reported no step cost)."""
    cost = CostModel()
    cost.observe(4, 124, 0.0012)  # prompt steps of ~124 tokens; the smaller one slower (noise)
    cost.observe(4, 120, 0.0030)
    for i in range(30):
        cost.observe(4, 0, 0.0010 + (i % 3) * 1e-5)
    assert cost.coef is not None and cost.coef[2] > 0
    assert cost.predict(4, 122) == pytest.approx((0.0030 + 0.0012) / 2, rel=0.3)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([SHAPE_1B, SHAPE_8B]), st.integers(1, 256),
       st.sampled_from(["1.5x", "3x", "20ms", "60ms"]), st.integers(512, 16384))
def test_a_time_target_keeps_the_predicted_step_within_it(shape: Cost4, rows: int, target: str, cap: int) -> None:
    cost = _fitted(shape)
    t = StepTarget.parse(target)
    budget = cost.step_budget(t, rows, cap)
    assert rows + MIN_CHUNK <= budget or budget == cap
    assert budget <= max(cap, rows + MIN_CHUNK)
    decode = _seconds(shape, rows, 0)
    limit = t.ms / 1e3 if t.ms else t.factor * decode
    if budget > rows + MIN_CHUNK:  # above the floor that keeps prompts moving, the target holds
        assert _seconds(shape, rows, budget - rows) <= limit * 1.1 + 1e-4


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([SHAPE_1B, SHAPE_8B]), st.integers(0, 256),
       st.lists(st.integers(1, 4000), min_size=1, max_size=64), st.integers(512, 16384))
def test_auto_finishes_whole_prompts_for_the_least_mean_wait(shape: Cost4, rows: int, line: list[int],
                                                             cap: int) -> None:
    """"auto" gives a step the first k prompts in line, the fewest whose tokens reach
    P* = sqrt(B·o / c) (the chunk of least mean wait for B tokens at o seconds a step besides c a
    token), capped at ``max_batch_tokens``."""
    cost = _fitted(shape)
    assert cost.coef is not None
    base, per_row, per_token, prompt_step, _ = cost.coef
    o = base + per_row * rows + prompt_step
    got = cost.step_budget(StepTarget.parse("auto"), rows, cap, line) - rows
    want = math.sqrt(sum(line) * o / per_token)
    ends = [sum(line[:k]) for k in range(1, len(line) + 1)]
    k = next((k for k, e in enumerate(ends) if e >= want), len(ends) - 1)
    assert got == min(cap - rows, max(MIN_CHUNK, ends[k])) or (rows + MIN_CHUNK > cap and got == cap - rows)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([SHAPE_1B, SHAPE_8B]), st.lists(st.integers(1, 4000), min_size=1, max_size=64),
       st.floats(0, 50_000))
def test_auto_chunks_keep_up_with_the_prompts_arriving(shape: Cost4, line: list[int], arrivals: float) -> None:
    """Whatever the prompts in line, a step's prompt work keeps prefill busy at most MAX_PREFILL_LOAD of
    the time at the current arrival rate, or takes every prompt in line when nothing smaller can."""
    base, per_row, per_token, prompt_step = shape
    o = base + per_row * 64 + prompt_step
    got = auto_chunk(line, o, per_token, arrivals)
    assert got in {sum(line[:k]) for k in range(1, len(line) + 1)}, "whole prompts only"
    if got < sum(line):
        assert arrivals * (o + got * per_token) / got <= MAX_PREFILL_LOAD + 1e-9


def test_arrival_rate_is_the_prompt_tokens_of_the_last_window() -> None:
    now = [100.0]
    rate = ArrivalRate(window=2.0, clock=lambda: now[0])
    assert rate.rate() == 0
    rate.add(1000)
    now[0] += 1.0
    rate.add(1000)
    assert rate.rate() == pytest.approx(2000 / 1.0)  # over the time seen so far
    now[0] += 1.5  # the first arrival leaves the window
    assert rate.rate() == pytest.approx(1000 / 2.0)
    now[0] += 10
    assert rate.rate() == 0


def _auto(shape: Cost4, cap: int) -> Budget:
    cost = _fitted(shape)
    return lambda rows, line: cost.step_budget(StepTarget.parse("auto"), rows, cap, line)


def _mean_ttft(trace: list[tuple[int, int, int]], budget: int | Budget, shape: Cost4) -> float:
    first = _simulate(trace, budget, slots=len(trace), cost=shape)
    return sum(t for _, _, t in first.values()) / len(first)


@pytest.mark.parametrize("shape", [SHAPE_1B, SHAPE_8B], ids=["1B", "8B"])
@pytest.mark.parametrize("prompt", [128, 1024, 4096], ids=["short", "rag", "long"])
def test_auto_matches_the_best_fixed_budget_at_each_model_shape_without_a_sweep(shape: Cost4, prompt: int) -> None:
    """64 streams decoding (long replies), then a burst of 64 prompts: the mean time to first token with
    "auto" is within 5 % of the best of eight fixed budgets, whichever model shape sets the costs."""
    trace = [(0, 8, 10_000)] * 64 + [(2, prompt, 100)] * 64
    fixed = {b: _mean_ttft(trace, b, shape) for b in (256, 512, 1024, 1536, 2048, 3072, 4096, 8192)}
    auto = _mean_ttft(trace, _auto(shape, 8192), shape)
    assert auto <= 1.05 * min(fixed.values()), (auto, fixed)


@pytest.mark.parametrize("shape", [SHAPE_1B, SHAPE_8B], ids=["1B", "8B"])
def test_auto_beats_a_fixed_budget_when_prompts_arrive_one_by_one(shape: Cost4) -> None:
    """Prompts arriving one at a time, of mixed lengths, among 64 decoding streams: "auto" never splits a
    prompt that fits a step, so each waits no longer than with the 4,096-token budget."""
    rng = random.Random(1)
    trace = [(0, 8, 10_000)] * 64 + [(3 + 20 * i, rng.choice([100, 700, 2000, 4000]), 50) for i in range(40)]
    assert _mean_ttft(trace, _auto(shape, 4096), shape) <= _mean_ttft(trace, 4096, shape) * 1.001


def test_without_a_target_or_a_fit_the_token_budget_rules() -> None:
    assert CostModel().step_budget(StepTarget.parse("auto"), 64, 4096, [100] * 100) == 4096  # not fitted yet
    assert _fitted(SHAPE_1B).step_budget(StepTarget.parse("off"), 64, 4096, [100] * 100) == 4096


@pytest.mark.parametrize("text", ["fast", "0.5x", "0ms", "-3ms", "x"])
def test_a_bad_target_is_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="auto"):
        StepTarget.parse(text)
def test_a_daemon_with_a_step_time_target_serves_the_same_text(start_daemon) -> None:  # type: ignore[no-untyped-def]
    """Step sizes change the batches, never the text; and a worker reports what it scheduled by:
    ``status`` and /metrics show its target, its last budget and the step cost it fitted."""
    prompts = [[1] + [5 + i % 500 for i in range(n)] for n in (300, 40, 700, 5)]
    texts = []
    for target in ("off", "auto"):
        mport = free_port()
        d = start_daemon(wait_workers=1, workers={"cpu_workers": 1, "slots": 4},
                         metrics={"listen": f"127.0.0.1:{mport}"},
                         model={"target_step": target, "ctx_per_slot": 1024, "max_batch_tokens": 128})
        with d.client() as c:
            done = c.generate_many(prompts, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert [x.usage.completion_tokens for x in done] == [40] * 4
        texts.append([x.text for x in done])
        row = _worker_row_after_a_heartbeat(d)
        assert row["step_target"] == target and 0 < row["step_budget"] <= 128
        cost = row["step_cost_ms"]  # fitted from the 50-odd steps just run (prompts in chunks of various sizes)
        assert cost["per_prompt_token"] > 0 and cost["base"] + cost["per_row"] > 0
        fams = scrape(f"http://127.0.0.1:{mport}/metrics")
        assert value(fams, "llamapool_step_budget_tokens", "llamapool_step_budget_tokens", target=target) > 0
        per_token = value(fams, "llamapool_step_cost_seconds", "llamapool_step_cost_seconds", term="per_prompt_token")
        assert per_token == pytest.approx(cost["per_prompt_token"] / 1e3, rel=0.5)
        shown = subprocess.run([sys.executable, "-m", "llamapool.cli", "status", "--endpoint", d.endpoint],
                               capture_output=True, text=True, timeout=60)
        assert f"steps sized by target_step {target}, last budget" in shown.stdout, shown.stdout + shown.stderr
        assert "ms a prompt token" in shown.stdout
        d.stop()
    assert texts[0] == texts[1]


def _worker_row_after_a_heartbeat(d) -> dict:  # type: ignore[no-untyped-def,type-arg]
    end = time.monotonic() + 10
    while True:
        row = next(w for w in d.status()["workers"] if w.get("pid"))
        if "step_cost_ms" in row or time.monotonic() > end:
            return row
        time.sleep(0.2)


@pytest.mark.parametrize(("fitted", "waited", "decoding", "rows", "backlog", "hold"), [
    (True, [0], 64, 64, 232, True),  # one prompt among 64 streams: it waits for company
    (True, [0, 1, 2, 3], 64, 64, 928, True),  # 10 waits of 19.5 ms: under 64 streams' 18 ms each
    (True, [HOLD_STEPS, 0], 64, 64, 464, False),  # one has waited its most
    (True, [3] * 40, 64, 64, 9280, False),  # a step's worth of prompts (the budget)
    (True, [3] * 15, 64, 64, 3480, False),  # their waits (60 x 19.5 ms) reach the streams' cost (64 x 18 ms)
    (True, [0], 0, 0, 232, False),  # nothing decodes: nobody waits for the prompt step
    (True, [0], 1, 1, 232, True),  # one stream: a decode step (8.2 ms) costs less than a prompt step (18 ms)
    (True, [1], 1, 1, 232, True),  # two steps' wait, 16.4 ms
    (True, [2], 1, 1, 232, False),  # three, 24.5 ms: more than the stream would lose
    (False, [0], 64, 64, 232, False),  # not fitted: no hold
])
def test_prompts_arriving_one_by_one_wait_for_company_while_streams_decode(
        fitted: bool, waited: list[int], decoding: int, rows: int, backlog: int, hold: bool) -> None:
    """``"auto"``'s hold (8B costs): a prompt step costs every decoding stream its overhead, so prompts that
    arrive one by one wait until their summed waits reach it, at most HOLD_STEPS steps, never once a step's
    budget waits or with nothing decoding."""
    cost = _fitted(SHAPE_8B) if fitted else CostModel()
    if fitted:
        cost.coef = (*SHAPE_8B, 0.0)  # exact, for the table's arithmetic
    assert cost.hold(waited, decoding, rows, backlog, 4096) is hold


@pytest.mark.parametrize("speculative", [True, False], ids=["speculation", "off"])
def test_prompts_arriving_over_a_few_steps_start_in_one_prompt_step(model_path: str, speculative: bool) -> None:
    """The engine, 4 streams decoding, then 3 prompts arriving a step apart (as replies that end at
    different steps, as they do with speculation, bring their next prompts): while the streams
    speculate, one prompt step computes all three (each would otherwise take a step of its own, every
    decoding stream waiting for each); without speculation each starts at once (no hold: a prompt beside a
    busy batch keeps its time to first token). The streams get their token every step meanwhile."""
    from llamapool.protocol.messages import Run, SamplingParams, Step
    from llamapool.worker.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model_path, slots=8, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
                              threads=2, speculative="ngram"))
    try:
        eng.cost.coef = (0.01, 0.0, 1e-4, 0.05, 0.0)  # a prompt step 50 ms dearer than a 10 ms decode step
        eng.cost.observe = lambda *a, **k: None  # type: ignore[method-assign]  # kept (not fitted to this CPU)
        long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, speculative=speculative)
        for i in range(4):
            eng.submit(Run(i, [5 + i] * 12, long, False), Step())
        eng.step()  # their prompts (nothing decodes yet: no hold)
        assert not eng.waiting and not any(s.prefilling for s in eng.active.values())
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, speculative=speculative)
        prompt_steps = 0
        for step in range(8):
            if step < 3:
                eng.submit(Run(10 + step, [40 + step] * 20, short, False), Step())
            generated = {s.rid: s.generated for s in eng.active.values() if s.rid < 4}
            eng.step()
            prompt_steps += eng._shape[1] > 0
            assert all(s.generated > generated[s.rid] for s in eng.active.values() if s.rid in generated)
        assert prompt_steps == (1 if speculative else 3)
        assert not eng.waiting and not any(s.prefilling for s in eng.active.values())
    finally:
        eng.close()


def test_a_held_prompts_wait_is_priced_at_the_decode_step_with_its_drafts() -> None:
    """Drafts make a decode step dearer (``per_draft_token``), and so each step a prompt waits."""
    cost = CostModel()
    cost.coef = (*SHAPE_8B, 1e-4)
    assert cost.hold([0, 0, 0], 64, 64, 696, 4096)  # 3 x 19.5 ms against 64 x 18 ms
    assert not cost.hold([0, 0, 0], 64, 64, 696, 4096, drafts=64 * 3 * 20)  # 3 x 403 ms
