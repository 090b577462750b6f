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


# ---------------------------------------------------------------- step-time budgets

@dataclass(frozen=True, slots=True)
class StepTarget:
    """``model.target_step``: "off" (the token budget alone), "<F>x" (F times the pure-decode step the
    worker measures at its current number of decoding sequences; "auto" is 2x), or "<N>ms"."""

    factor: float = 0.0
    ms: float = 0.0

    @property
    def on(self) -> bool:
        return self.factor > 0 or self.ms > 0

    @classmethod
    def parse(cls, text: str) -> StepTarget:
        """A ValueError says what is wrong with ``text``."""
        t = text.strip().lower()
        try:
            if t in ("", "off"):
                return cls()
            if t == "auto":
                return cls(factor=AUTO_FACTOR)
            if t.endswith("ms") and float(t[:-2]) > 0:
                return cls(ms=float(t[:-2]))
            if t.endswith("x") and float(t[:-1]) >= 1:
                return cls(factor=float(t[:-1]))
        except ValueError:
            pass
        raise ValueError(f"must be \"off\", \"auto\", a factor of the decode step such as \"2.5x\" (at least 1), "
                         f"or a time such as \"40ms\"; got {text!r}")


AUTO_FACTOR = 2.0  # "auto": a step with prompt work takes at most twice a pure-decode step


class CostModel:
    """A step's seconds, ``base + per_row * rows + per_token * prompt_tokens``, fitted while serving:
    least squares over the steps seen, older ones weighing less (each step halves in ~35 steps)."""

    def __init__(self, decay: float = 0.98, warmup: int = 16):
        self.decay, self.warmup = decay, warmup
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self.steps = 0
        self.coef: tuple[float, float, float] | None = None  # (base, per_row, per_token) seconds

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        x = (1.0, float(rows), float(prompt_tokens))
        d = self.decay
        for i in range(3):
            self._xty[i] = d * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = d * self._xtx[i][j] + x[i] * x[j]
        self.steps += 1
        if self.steps >= self.warmup:
            self.coef = self._solve()

    def _solve(self) -> tuple[float, float, float] | None:
        import numpy as np

        a = np.array(self._xtx) + np.diag([1e-9, 1e-9, 1e-9])  # a ridge: collinear steps stay solvable
        try:
            base, row, tok = (max(0.0, float(v)) for v in np.linalg.solve(a, np.array(self._xty)))
        except np.linalg.LinAlgError:
            return self.coef
        return (base, row, tok) if tok > 0 else self.coef

    def step_budget(self, target: StepTarget, rows: int, cap: int) -> int:
        """The token budget (decode rows included) of a step that should take the target's time; ``cap``
        (``max_batch_tokens``) until the model is fitted, and always at most ``cap``."""
        if not target.on or self.coef is None:
            return cap
        base, per_row, per_token = self.coef
        decode_s = base + per_row * rows
        seconds = target.ms / 1e3 if target.ms else target.factor * decode_s
        prompt = int((seconds - decode_s) / per_token) if per_token > 0 else cap
        return max(rows + MIN_CHUNK, min(cap, rows + prompt))


MIN_CHUNK = 64  # prompt tokens a step always has room for: prompts never stall
