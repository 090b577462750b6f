"""Speculation's drafting policy (spec.py) simulated over a closed batch, with step costs measured on an H100.

The engine's own policy objects make every decision (``Drafting``, ``Pool``, ``WidthCosts``,
``threshold``, ``step_costs``, ``choose_width``, the scheduler's ``CostModel``), as ``Speculator.propose``
and ``Engine._time_step`` call them; only the GPU is replaced: a step's seconds come from a table of
decode-step times per width and rows, measured with ``scripts/spec_oracle.py`` (docs/results/), with
the first ``SETTLING`` steps of a new width dearer (a graph built, then captured: ``CHANGE_MS``) and a little noise.
Drafts are an oracle's: each output position's draft token is right with probability ``alpha``, drawn
once a position (``iid``), or in spans (``bursty``: runs of right tokens of mean length ``span``, then
wrong ones), as ``scripts/spec_oracle.py``'s corruption does on the GPU.

It answers what a GPU job costs minutes to: how the policy's choice compares with fixed widths, per
shape, batch and acceptance, and how often it changes width::

    python3 scripts/spec_sim.py --shape 8b --batch 1 64 --alpha 0.7 0.8 1.0 0
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

from llamapool.worker.engine.spec import (
    MAX_DRAFT,
    MAX_OUTPUTS,
    SETTLING,
    SHADOWS,
    Drafting,
    Pool,
    WidthCosts,
    choose_width,
    ride,
    step_costs,
    threshold,
)
from llamapool.worker.scheduler import CostModel

# ms a decode step on an H100 at 1 and 64 rows per draft width (settled: not a width's first steps),
# q8_0 random weights, P128: 8B from jobs M-O (spec_oracle step traces and ms/step), 1B from job A's trace
# and the llama.cpp-alone table of issue 34 plus the engine's 0.2 ms a step; 64 rows of 8 (not run: at most
# 256 rows with logits) extrapolated; other widths and rows linear
COSTS = {
    "8b": {1: {0: 4.51, 1: 4.95, 3: 5.55, 8: 8.77}, 64: {0: 14.8, 1: 21.3, 3: 32.5, 8: 66.0}},
    "1b": {1: {0: 1.45, 1: 1.55, 3: 1.8, 8: 2.3}, 64: {0: 5.4, 1: 10.0, 3: 11.7, 7: 18.5, 8: 20.0}},
}
PROMPT_MS = {"8b": 0.1, "1b": 0.025}  # a prompt token's ms in a prompt step (8B: 2,048 tokens in ~0.2 s)
CHANGE_MS = {"8b": {1: 5.0, 64: 3.2}, "1b": {1: 1.0, 64: 1.5}}  # a new width's first SETTLING steps cost this
# much more (8B, 64 rows: 24-25 ms against 21; 1B, one stream: a probe there and back cost ~4 ms)


def table_ms(shape: str, rows: int, k: int) -> float:
    """A settled decode step's ms at ``rows`` rows and width ``k`` (linear between the table's)."""
    t = COSTS[shape]

    def at(r: int) -> float:
        ks = sorted(t[r])
        lo = max(x for x in ks if x <= k)
        hi = min((x for x in ks if x >= k), default=lo)
        return t[r][lo] if hi == lo else t[r][lo] + (t[r][hi] - t[r][lo]) * (k - lo) / (hi - lo)

    return at(1) + (at(64) - at(1)) * (rows - 1) / 63


@dataclass
class Seq:
    right: list[bool]  # each output position: is its draft token the model's own
    d: Drafting | None
    made: int = 0


def positions(n: int, alpha: float, span: float, rng: random.Random) -> list[bool]:
    """``n`` positions, right with probability ``alpha``: drawn one by one (``span`` 0) or in runs."""
    if not span:
        return [rng.random() < alpha for _ in range(n)]
    out: list[bool] = []
    while len(out) < n:  # runs of right tokens (mean ``span``), then wrong ones, ``alpha`` right overall
        right = rng.random() < alpha
        mean = span if right else max(span * (1 - alpha) / max(alpha, 1e-9), 1.0)
        out += [right] * max(1, round(rng.expovariate(1 / mean)))
    return out[:n]


def simulate(shape: str, batch: int, prompts: int, gen: int, alpha: float, span: float, fixed: int | None,
             seed: int, rounds: int = 2, prompt: int = 128, before: float | None = None) -> dict[str, float]:
    """Tokens a second (simulated) of ``prompts`` sequences of ``prompt`` and ``gen`` tokens, ``batch`` at a time, the
    last of ``rounds`` runs on the same policy objects (the first warms them, as a serving worker is; at
    acceptance ``before``, if given: the text changed);
    ``fixed``: every drafting sequence drafts that many tokens a step (spec_oracle's ``k``)."""
    rng = random.Random(seed)

    def draft(s: Seq, n: int) -> list[int]:
        return [int(r) for r in s.right[s.made: s.made + min(n, gen - s.made - 1)]]

    def drafts_of(seqs: list[Seq]) -> dict[int, tuple[Drafting, list[int]]]:
        """Engine._drafts: each sequence's draft (a draft token is 1 where it is right), or its estimate drifts."""
        out: dict[int, tuple[Drafting, list[int]]] = {}
        for s in seqs:
            assert s.d is not None
            s.d.draft = []
            x = draft(s, s.d.limit)
            if x:
                out[id(s)] = (s.d, x)
            else:
                s.d.idle()
        return out

    widths, pool, cost_model = WidthCosts(), Pool(), CostModel()
    last = launched = settled = 0
    prompted = False
    result: dict[str, float] = {}
    for r in range(rounds):
        a = before if before is not None and r < rounds - 1 else alpha
        waiting = [positions(gen + MAX_DRAFT, a, span, rng) for _ in range(prompts)]
        active: list[Seq] = []
        seconds = tokens = 0.0
        steps = changes = wide = 0
        while waiting or active:
            new = 0
            while waiting and len(active) < batch:
                active.append(Seq(waiting.pop(), Drafting(prior=pool.rate)))
                new += 1
            rows = len(active)
            if new:  # one prompt step: every sequence's next token, no drafts (as the engine's)
                secs = (table_ms(shape, rows, 0) + PROMPT_MS[shape] * prompt * new) / 1e3
                cost_model.observe(rows, prompt * new, secs, 0)
                seconds, steps, launched, last, prompted = seconds + secs, steps + 1, 0, 0, True
                for s in active:
                    s.made += 1
                    tokens += 1
                continue
            cost: Callable[[int], float] = step_costs(cost_model.coef, widths, rows, rows, rows, 0.0)
            least = threshold(cost, rows, rows)
            most = min(MAX_DRAFT, MAX_OUTPUTS // rows - 1)
            if fixed is not None:  # spec_oracle's every_step: each sequence's k drafts
                k = min(fixed, most)
                for s in active:
                    assert s.d is not None
                    s.d.draft = draft(s, k)
            else:  # Engine._propose
                weigh = [s for s in active if s.d is not None and s.d.rate >= least]
                others = [s for s in active if s.d is not None and s.d.rate < least]
                drafts = drafts_of(weigh)
                k = choose_width(drafts, rows, rows, most, last, cost, widths, pool) if drafts else 0
                if k:
                    ride(drafts_of(others), k)
                else:
                    every = max(1, len(active) // SHADOWS)
                    due = [s for s in others
                           if s.d is not None and not s.d.shadow and (id(s) // 16 + steps) % every == 0]
                    ride(drafts_of(due), 0)
                    for s in others:
                        assert s.d is not None
                        s.d.draft = []
                        if s not in due:
                            s.d.idle()
            last = k
            changes += k != launched
            changed = k != launched or prompted  # a decode graph built again
            settled = 0 if changed else settled + 1
            launched, prompted = k, False
            change = CHANGE_MS[shape][1] + (CHANGE_MS[shape][64] - CHANGE_MS[shape][1]) * (rows - 1) / 63
            ms = (table_ms(shape, rows, k) + (change if settled < SETTLING else 0.0)) * rng.gauss(1.0, 0.02)
            secs = ms / 1e3
            seconds += secs
            steps += 1
            wide += k
            cost_model.observe(rows, 0, secs, k * rows)
            widths.observe(k, rows, secs, settled < SETTLING)
            for s in list(active):
                d = s.d
                assert d is not None
                x = d.draft
                kept = next((j for j, r in enumerate(x) if not s.right[s.made + j]), len(x))
                if d.shadow and not x:  # Engine._take_rows: the model's token (1) against the watched draft's
                    seen = d.saw([1])
                    if seen is not None:
                        pool.verified(*seen)
                if x:
                    d.verified(len(x), kept)
                    pool.verified(len(x), kept)
                d.draft = []
                got = min(1 + kept, gen - s.made)
                s.made += got
                tokens += got
                if s.made >= gen:
                    active.remove(s)
        result = {"tok_s": tokens / seconds, "steps": steps, "changes": changes, "mean_width": wide / steps}
    return result


def mean(case: tuple[str, int, int, int, float, float], fixed: int | None, seeds: int) -> dict[str, float]:
    """:func:`simulate`'s figures over ``seeds`` seeds."""
    runs = [simulate(*case, fixed, seed) for seed in range(seeds)]
    return {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=["8b"], choices=sorted(COSTS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--alpha", nargs="+", type=float, default=[0.7, 0.8, 1.0, 0.0])
    ap.add_argument("--span", type=float, default=0.0, help="mean run of right drafts (0: drawn one by one)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=0, help="sequences a run (0: the batch; 8 at one stream)")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    print("| shape | B | alpha | off tok/s | k=1 | k=3 | k=8 | policy | policy / best k | changes a step "
          "| mean width |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shape:
        for b in args.batch:
            prompts = args.prompts or (8 if b == 1 else b)
            for alpha in args.alpha:
                case = (shape, b, prompts, args.gen, alpha, args.span)
                off, pol = mean(case, 0, args.seeds), mean(case, None, args.seeds)
                ks = {k: mean(case, k, args.seeds)["tok_s"] for k in (1, 3, 8) if k <= MAX_OUTPUTS // b - 1}
                best = max(ks.values())
                cells = " | ".join(f"{ks[k] / off['tok_s']:.2f}x" if k in ks else "-" for k in (1, 3, 8))
                print(f"| {shape} | {b} | {alpha} | {off['tok_s']:,.0f} | {cells} | {pol['tok_s'] / off['tok_s']:.2f}x "
                      f"| {pol['tok_s'] / best:.2f} | {pol['changes'] / pol['steps']:.3f} | {pol['mean_width']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
