"""The step planner (worker/scheduler.py), without a model: what every step guarantees."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llamapool.worker.scheduler import Prefill, plan_step

running = st.tuples(
    st.integers(0, 64),  # decoding sequences
    st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10_000)), max_size=32, unique_by=lambda t: t[1]),
    st.integers(1, 8192),  # the step's token budget
)


def _plan(n_decode: int, prefills: list[tuple[int, int]], budget: int):  # type: ignore[no-untyped-def]
    decoding = list(range(n_decode))
    pre = [Prefill(1000 + i, remaining, order) for i, (remaining, order) in enumerate(prefills)]
    return decoding, pre, plan_step(budget, decoding, pre)


@settings(max_examples=400, deadline=None)
@given(running)
def test_every_running_sequence_gets_a_token_every_step(case: tuple[int, list[tuple[int, int]], int]) -> None:
    decoding, pre, plan = _plan(*case)
    assert all(plan.tokens[s] == 1 for s in decoding)
    assert all(1 <= plan.tokens[p.seq_id] <= p.remaining for p in pre)


@settings(max_examples=400, deadline=None)
@given(running)
def test_a_step_stays_within_its_budget(case: tuple[int, list[tuple[int, int]], int]) -> None:
    decoding, pre, plan = _plan(*case)
    budget = case[2]
    floor = len(decoding) + len(pre)  # one token each is owed even past the budget
    assert sum(plan.tokens.values()) <= max(budget, floor)
    assert sum(plan.tokens.values()) + plan.left <= max(budget, floor)
    assert plan.left >= 0


@settings(max_examples=400, deadline=None)
@given(running)
def test_older_prompts_are_never_passed_over(case: tuple[int, list[tuple[int, int]], int]) -> None:
    """A prompt gets more than its one token only when every older prompt got all it needs: the
    oldest waiting prompt is done within ceil(remaining / (budget - running)) steps, whatever arrives."""
    _, pre, plan = _plan(*case)
    by_age = sorted(pre, key=lambda p: p.order)
    for i, p in enumerate(by_age):
        if plan.tokens[p.seq_id] > 1:
            assert all(plan.tokens[q.seq_id] == q.remaining for q in by_age[:i])


@settings(max_examples=200, deadline=None)
@given(running, st.lists(st.integers(1, 5000), max_size=16))
def test_admission_takes_only_what_is_left(case: tuple[int, list[tuple[int, int]], int], waiting: list[int]) -> None:
    _, _, plan = _plan(*case)
    before = sum(plan.tokens.values()) + plan.left
    for i, remaining in enumerate(waiting):
        if not plan.can_admit:
            break
        got = plan.admit(5000 + i, remaining)
        assert 1 <= got <= remaining
    assert sum(plan.tokens.values()) + plan.left == before and plan.left >= 0


def test_a_worked_example() -> None:
    plan = plan_step(512, [1, 2], [Prefill(3, 1000, order=7), Prefill(4, 100, order=3)])
    # 2 decode tokens, then the older prompt (seq 4) takes all its 100, the younger the rest
    assert plan.tokens == {1: 1, 2: 1, 4: 100, 3: 410} and plan.left == 0
    plan = plan_step(512, [1], [Prefill(4, 10, order=0)])
    assert plan.tokens == {1: 1, 4: 10} and plan.left == 501
    assert plan.admit(5, 2000) == 501 and not plan.can_admit


# ---------------------------------------------------------------- step-time budgets

import random  # noqa: E402

import pytest  # noqa: E402

from llamapool.worker.scheduler import MIN_CHUNK, CostModel, StepTarget  # noqa: E402


def _fitted(base: float, per_row: float, per_token: float, noise: float = 0.0) -> CostModel:
    rng = random.Random(0)
    cost = CostModel()
    for _ in range(200):
        rows, tokens = rng.randint(1, 256), rng.choice([0, 0, rng.randint(1, 4096)])
        cost.observe(rows, tokens, (base + per_row * rows + per_token * tokens) * (1 + rng.uniform(-noise, noise)))
    return cost


@pytest.mark.parametrize("shape", [(0.004, 2e-5, 1.8e-5), (0.012, 2.4e-4, 8e-5), (0.0005, 1e-6, 2e-6)])
def test_the_cost_model_learns_a_steps_cost_from_its_timings(shape: tuple[float, float, float]) -> None:
    cost = _fitted(*shape, noise=0.02)
    assert cost.coef is not None
    for got, want in zip(cost.coef, shape, strict=True):
        assert got == pytest.approx(want, rel=0.15, abs=1e-4 * want + 1e-7)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(0.004, 2e-5, 1.8e-5), (0.012, 2.4e-4, 8e-5)]), st.integers(1, 256),
       st.sampled_from(["auto", "1.5x", "3x", "20ms", "60ms"]), st.integers(512, 16384))
def test_a_time_target_keeps_the_predicted_step_within_it(shape: tuple[float, float, float], rows: int,
                                                          target: str, cap: int) -> None:
    cost = _fitted(*shape)
    t = StepTarget.parse(target)
    budget = cost.step_budget(t, rows, cap)
    assert rows + MIN_CHUNK <= budget or budget == cap
    assert budget <= max(cap, rows + MIN_CHUNK)
    base, per_row, per_token = shape
    decode = base + per_row * rows
    limit = t.ms / 1e3 if t.ms else t.factor * decode
    predicted = decode + per_token * (budget - rows)
    if budget > rows + MIN_CHUNK:  # above the floor that keeps prompts moving, the target holds
        assert predicted <= limit * 1.2 + 1e-4


def test_without_a_target_or_a_fit_the_token_budget_rules() -> None:
    assert CostModel().step_budget(StepTarget.parse("auto"), 64, 4096) == 4096  # not fitted yet
    assert _fitted(0.004, 2e-5, 1.8e-5).step_budget(StepTarget.parse("off"), 64, 4096) == 4096


@pytest.mark.parametrize("text", ["fast", "0.5x", "0ms", "-3ms", "x"])
def test_a_bad_target_is_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="auto"):
        StepTarget.parse(text)


def test_a_daemon_with_a_step_time_target_serves_the_same_text(start_daemon) -> None:  # type: ignore[no-untyped-def]
    prompts = [[1] + [5 + i % 500 for i in range(n)] for n in (300, 40, 700, 5)]
    texts = []
    for target in ("off", "auto"):
        d = start_daemon(wait_workers=1, workers={"cpu_workers": 1, "slots": 4},
                         model={"target_step": target, "ctx_per_slot": 1024, "max_batch_tokens": 512})
        with d.client() as c:
            done = c.generate_many(prompts, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert [x.usage.completion_tokens for x in done] == [40] * 4
        texts.append([x.text for x in done])
        d.stop()
    assert texts[0] == texts[1]
