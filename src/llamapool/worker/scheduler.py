"""What one engine step computes: which prompt tokens run beside the decode tokens. No llama.cpp here.

The engine hands the planner what it holds (the decoding sequences, the prompts being computed and
those waiting for a slot) and a token budget; the planner returns the step's plan, which the engine
executes as one ``llama_decode`` batch (worker/engine/; the echo engine runs the same plans).

The rules, each a property test in tests/test_scheduler.py:

- every decoding sequence gets its one token, and every prompt being computed at least one: no
  running sequence ever waits a step;
- the rest of the budget goes to prompts **shortest remaining first**, so a short prompt that arrives
  behind a long one gets its first token after its own chunk, not after the long prompt's;
- **aging**: a prompt that arrived ``PASS_OVER_LIMIT`` steps ago or more goes before every younger
  one, oldest first: no prompt is passed over for longer than that by later arrivals;
- a waiting prompt is admitted only into a free slot, with the chunk it is given this step.

The budget itself comes from ``CostModel.step_budget``: a token count (``max_batch_tokens``), or a
step time, fitted from the worker's own step timings (see ``StepTarget``). With ``"auto"``, waiting
prompts that arrive one by one while sequences decode may wait for company first (``CostModel.hold``,
at most ``HOLD_STEPS`` steps).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

PASS_OVER_LIMIT = 8  # steps after its arrival a prompt stops yielding to shorter, younger ones


@dataclass(frozen=True, slots=True)
class PromptWork:
    """A prompt not all computed yet: running (holding slot ``key``) or waiting (``key``: its place in
    the engine's waiting queue)."""

    key: int
    remaining: int  # prompt tokens still to compute (at least 1)
    arrived: int  # the engine step at which its request arrived
    running: bool = True


@dataclass(slots=True)
class StepPlan:
    """Tokens per running sequence this step, and the waiting prompts admitted with their first chunk."""

    tokens: dict[int, int] = field(default_factory=dict)
    admit: list[tuple[int, int]] = field(default_factory=list)  # (waiting key, tokens this step)

    @property
    def total(self) -> int:
        return sum(self.tokens.values()) + sum(n for _, n in self.admit)


def priority(p: PromptWork, now: int) -> tuple[int, int, int]:
    """Sort key: aged prompts first, oldest first; then shortest remaining, oldest first on ties."""
    if now - p.arrived >= PASS_OVER_LIMIT:
        return (0, p.arrived, 0)
    return (1, p.remaining, p.arrived)


def plan_step(budget: int, decoding: Iterable[int], prompts: Iterable[PromptWork], free_slots: int,
              now: int) -> StepPlan:
    """Split ``budget`` tokens: one per decoding sequence, one per running prompt, then prompt chunks in
    ``priority`` order; a waiting prompt takes a free slot (at most ``free_slots``) with its chunk."""
    plan = StepPlan()
    for seq_id in decoding:
        plan.tokens[seq_id] = 1
    work = sorted(prompts, key=lambda p: priority(p, now))
    for p in work:
        if p.running:
            plan.tokens[p.key] = 1
    left = budget - len(plan.tokens)
    for p in work:
        if left <= 0:
            break
        if p.running:
            extra = min(p.remaining - 1, left)
            plan.tokens[p.key] += extra
            left -= extra
        elif free_slots > 0:
            n = min(p.remaining, left)
            plan.admit.append((p.key, n))
            free_slots -= 1
            left -= n
    return plan


def at_least_two(n: int, remaining: int, cap: int) -> int:
    """A prompt chunk in deterministic mode: ``n`` of the prompt's ``remaining`` tokens, moved so that the
    chunk and the rest it leaves are two tokens or more (a prompt of one token is one), and at most ``cap``
    (one micro-batch). llama.cpp's CPU kernels compute a sequence's attention otherwise for one query
    token than for several (docs/http.md#determinism): a prompt's tokens always go at least two at a time,
    a decode token alone."""
    n = min(max(n, 2), remaining, cap)
    if remaining - n == 1:
        n = n + 1 if n < cap else n - 1
    return n


# ---------------------------------------------------------------- step-time budgets

@dataclass(frozen=True, slots=True)
class StepTarget:
    """``model.target_step``, how large a step's prompt work may be (never above ``max_batch_tokens``):

    - ``"auto"`` (the default): the chunk that minimises the mean time to first token of the prompts
      that could run now, from the step costs the worker fitted (``auto_chunk``): small steps when
      few prompts wait (decoding streams wait less), large ones for a burst of prompts (they are
      computed faster), and always whole prompts;
    - ``"off"``: ``max_batch_tokens`` alone;
    - ``"<F>x"``: a step of F times the pure-decode step; ``"<N>ms"``: a step of N milliseconds.
    """

    factor: float = 0.0
    ms: float = 0.0
    auto: bool = False

    @property
    def on(self) -> bool:
        return self.auto or self.factor > 0 or self.ms > 0

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        if self.ms:
            return f"{self.ms:g}ms"
        return f"{self.factor:g}x" if self.factor else "off"

    @classmethod
    def parse(cls, text: str) -> StepTarget:
        """A ValueError says what is wrong with ``text``."""
        t = text.strip().lower()
        try:
            if t in ("", "off"):
                return cls()
            if t == "auto":
                return cls(auto=True)
            if t.endswith("ms") and float(t[:-2]) > 0:
                return cls(ms=float(t[:-2]))
            if t.endswith("x") and float(t[:-1]) >= 1:
                return cls(factor=float(t[:-1]))
        except ValueError:
            pass
        raise ValueError(f"must be \"auto\", \"off\", a factor of the decode step such as \"2.5x\" (at least 1), "
                         f"or a time such as \"40ms\"; got {text!r}")


class ArrivalRate:
    """Prompt tokens a second arriving at the engine, over the last ``window`` seconds."""

    def __init__(self, window: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self._seen: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._since = clock()

    def add(self, tokens: int) -> None:
        self._seen.append((self.clock(), tokens))
        self._sum += tokens

    def rate(self) -> float:
        now = self.clock()
        while self._seen and self._seen[0][0] < now - self.window:
            self._sum -= self._seen.popleft()[1]
        return self._sum / max(min(self.window, now - self._since), 0.25)


SOLVE_EVERY = 8  # CostModel: steps between two fits once fitted (a fit is ~50-100 µs of host time a step)


class CostModel:
    """A step's seconds, fitted while serving: ``base + per_row * rows + per_token * prompt_tokens``, plus
    ``prompt_step`` when the step has prompt work (such a step runs as several micro-batches and blocks
    the host, so it costs more than its tokens: 8-20 ms more on an H200, docs/benchmarks.md), plus
    ``per_draft_token`` for each token a decoding row carries after its own (speculation's drafts and
    fillers: a GPU verifies them in a small batch at several times a prompt token's cost, 0.4-0.5 ms
    a token at 8B and one stream on an H100). Least squares over the steps seen, older ones weighing
    less (a step's weight halves in ~35 steps)."""

    TERMS = ("base", "per_row", "per_prompt_token", "prompt_step", "per_draft_token")

    def __init__(self, decay: float = 0.98, warmup: int = 16):
        self.decay, self.warmup = decay, warmup
        n = len(self.TERMS)
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self.steps = 0
        self.coef: tuple[float, float, float, float, float] | None = None  # seconds, as TERMS

    def observe(self, rows: int, prompt_tokens: int, seconds: float, drafts: int = 0) -> None:
        x = (1.0, float(rows), float(prompt_tokens), 1.0 if prompt_tokens else 0.0, float(drafts))
        d = self.decay
        for i in range(len(x)):
            self._xty[i] = d * self._xty[i] + x[i] * seconds
            for j in range(len(x)):
                self._xtx[i][j] = d * self._xtx[i][j] + x[i] * x[j]
        self.steps += 1
        if self.steps >= self.warmup and (self.coef is None or self.steps % SOLVE_EVERY == 0):
            self.coef = self._solve()

    def predict(self, rows: int, prompt_tokens: int, drafts: int = 0) -> float | None:
        """The fitted seconds of such a step (None before the fit)."""
        if self.coef is None:
            return None
        base, per_row, per_token, prompt_step, per_draft = self.coef
        return base + per_row * rows + per_token * prompt_tokens + (prompt_step if prompt_tokens else 0.0) \
            + per_draft * drafts

    def _solve(self) -> tuple[float, float, float, float, float] | None:
        """The least-squares coefficients, or the last ones where the steps do not give a prompt token a
        positive cost. Prompt steps of nearly one size cannot tell ``prompt_step`` from
        ``per_prompt_token`` (noise on a busy host can then make the latter negative); with no fit yet,
        that case is solved again with ``prompt_step`` folded into the tokens (a fit good for steps of
        that size, not none)."""
        import numpy as np

        n = len(self.TERMS)
        a = np.array(self._xtx) + np.diag([1e-9] * n)  # a ridge: collinear steps stay solvable
        b = np.array(self._xty)
        folded = [i for i in range(n) if self.TERMS[i] != "prompt_step"]
        for keep in (list(range(n)), *([folded] if self.coef is None else [])):
            try:
                sol = np.linalg.solve(a[np.ix_(keep, keep)], b[keep])
            except np.linalg.LinAlgError:
                continue
            coef = [0.0] * n
            for i, v in zip(keep, sol, strict=True):
                coef[i] = max(0.0, float(v))
            base, row, tok, step, draft = coef
            if tok > 0:
                return (base, row, tok, step, draft)
        return self.coef

    def hold(self, waited: Sequence[int], decoding: int, rows: int, backlog: int, cap: int, drafts: int = 0) -> bool:
        """``"auto"``: the waiting prompts (``waited``: the steps each has waited; none running) wait for
        company rather than start a prompt step now. A prompt step costs each of the ``decoding`` sequences
        its overhead (``prompt_step``: its micro-batches block); a decode step of ``rows`` (and ``drafts``
        draft tokens, as the last step's) costs each waiting prompt that step. Prompts that arrive one by
        one (replies that end at different steps: with speculation, as each sequence's drafts are kept)
        would otherwise each start a prompt step of their own. So they wait while their summed waits stay
        under what a prompt step costs the decoding sequences (a ski rental: at most twice the better
        choice's cost), at most ``HOLD_STEPS`` steps, and not once their ``backlog`` of prompt tokens fills
        a step (``cap``); never before the fit, nor with nothing decoding. vLLM's
        ``scheduler_delay_factor`` holds prompts likewise."""
        if self.coef is None or not decoding or not waited or max(waited) >= HOLD_STEPS or backlog + rows >= cap:
            return False
        base, per_row, _, prompt_step, per_draft = self.coef
        return sum(w + 1 for w in waited) * (base + per_row * rows + per_draft * drafts) < decoding * prompt_step

    def step_budget(self, target: StepTarget, rows: int, cap: int, line: Sequence[int] = (),
                    arrivals: float = 0.0) -> int:
        """The token budget (decode rows included) of the next step: ``rows`` sequences hold a slot,
        ``line`` is what the prompts that could run now still need, first in line first, and
        ``arrivals`` the prompt tokens a second arriving lately. ``cap`` (``max_batch_tokens``) until
        the model is fitted, and always at most ``cap``."""
        if not target.on or self.coef is None:
            return cap
        base, per_row, per_token, prompt_step, _ = self.coef
        decode_s = base + per_row * rows
        if target.auto:
            prompt = auto_chunk(line, decode_s + prompt_step, per_token, arrivals)
        else:
            seconds = target.ms / 1e3 if target.ms else target.factor * decode_s
            prompt = int((seconds - decode_s - prompt_step) / per_token)
        return min(cap, rows + max(MIN_CHUNK, prompt))


def auto_chunk(line: Sequence[int], overhead: float, per_token: float, arrivals: float = 0.0) -> int:
    """``"auto"``: the prompt tokens of a step, for the least mean wait of the prompts in ``line``.

    Computing ``B`` prompt tokens in chunks of ``P``, at ``overhead`` seconds a step besides ``per_token``
    a token, takes ``B / P`` steps; their mean wait, about ``B·o / 2P + B·c / 2 + (o + P·c) / 2``, is
    least at ``P* = sqrt(B·o / c)``. That holds for the prompts held now; prompts keep arriving
    (``arrivals``: prompt tokens a second, lately), and a chunk so small that its steps' overhead
    leaves prefill busy more than ``MAX_PREFILL_LOAD`` of the time lets a queue grow, so the chunk is
    at least ``a·o / (MAX_PREFILL_LOAD - a·c)`` at ``a`` arriving tokens a second (all of ``line`` when
    even that cannot keep up). A prompt gets its first token only when its last chunk is done, so
    the chunk is rounded up to the end of a prompt: the step finishes the first ``k`` prompts in
    line, the fewest whose tokens reach it.
    """
    backlog = sum(line)
    want = math.sqrt(backlog * overhead / per_token)
    spare = MAX_PREFILL_LOAD - arrivals * per_token
    want = max(want, arrivals * overhead / spare if spare > 0 else backlog)
    done = 0
    for n in line:
        done += n
        if done >= want:
            break
    return done


HOLD_STEPS = 4  # "auto": the most steps a prompt waits for others to start with (CostModel.hold)
MAX_PREFILL_LOAD = 0.8  # "auto" sizes steps so prompts keep up with arrivals using at most this share of time
MIN_CHUNK = 64  # prompt tokens a step always has room for: prompts never stall
