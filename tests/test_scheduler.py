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
