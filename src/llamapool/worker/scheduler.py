"""What one engine step computes: the token budget split between sequences. No llama.cpp here.

A step has a budget of ``max_batch_tokens`` tokens. Every decoding sequence gets its one token and
every sequence still prefilling gets at least one prompt token, so no running sequence ever waits a
step; the rest of the budget goes to prompt chunks, oldest request first (a prompt admitted earlier
is never passed over by a later one), and what is left then admits waiting runs into free slots,
oldest first. The engine (worker/engine.py) turns the plan into one ``llama_decode`` batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Prefill:
    """A running sequence whose prompt is not all computed yet."""

    seq_id: int
    remaining: int  # prompt tokens still to compute (at least 1)
    order: int  # admission order: lower is older


@dataclass(slots=True)
class StepPlan:
    """Tokens per sequence this step, and the budget left for admitting waiting runs."""

    tokens: dict[int, int] = field(default_factory=dict)
    left: int = 0

    @property
    def can_admit(self) -> bool:
        return self.left > 0

    def admit(self, seq_id: int, remaining: int) -> int:
        """A run just given the slot ``seq_id`` with ``remaining`` prompt tokens: its first chunk."""
        n = min(remaining, self.left)
        self.tokens[seq_id] = n
        self.left -= n
        return n


def plan_step(budget: int, decoding: Iterable[int], prefilling: Iterable[Prefill]) -> StepPlan:
    """Split ``budget`` tokens: one per decoding sequence, at least one per prefilling sequence, then
    prompt chunks oldest first; the plan's ``left`` is what admitting waiting runs may use."""
    plan = StepPlan()
    for seq_id in decoding:
        plan.tokens[seq_id] = 1
    ordered = sorted(prefilling, key=lambda p: p.order)
    left = budget - len(plan.tokens) - len(ordered)
    for p in ordered:
        extra = min(p.remaining - 1, max(left, 0))
        plan.tokens[p.seq_id] = 1 + extra
        left -= extra
    plan.left = max(left, 0)
    return plan
