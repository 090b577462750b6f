#!/usr/bin/env python3
"""scripts/spec_copy.py's 64-stream run through the scheduler's own rules, no GPU: why drafting made more
prompt steps, and what ``CostModel.hold`` does about it.

64 slots, 128 requests of 232 prompt tokens and 128-token replies, a stream sending its next request as
its reply ends (the first 64 at once). Each step: ``"auto"``'s budget (``CostModel.step_budget``) with
prompts finished whole, optionally the hold (``CostModel.hold``); a step's seconds from an H200's costs
at 8B (the fitted terms below: a decode step of 64 rows 15 ms, 36 ms with drafts of 3, a prompt step 45
ms more plus 0.072 ms a token; docs/results/h200-issue43-final/); with speculation a decode step's rows
each keep their draft's tokens up to the first refused one (each kept with ``--accept``), a prompt step
drafting nothing. Settling steps are not modelled. Prints tok/s, prompt steps and seconds, each way::

    PYTHONPATH=src python3 scripts/hold_sim.py
"""

from __future__ import annotations

import argparse
import random

from llamapool.worker.scheduler import CostModel, StepTarget

COEF = (0.008, 1.1e-4, 7.2e-5, 0.045, 1.1e-4)  # base, per row, per prompt token, prompt step, per draft token
WIDTH = 3


def simulate(spec: bool, hold: bool, accept: float, seed: int = 0, requests: int = 128, slots: int = 64,
             prompt: int = 232, gen: int = 128, cap: int = 4096) -> tuple[float, int, float]:
    """(tok/s, prompt steps, seconds)."""
    rng = random.Random(seed)
    cost = CostModel()
    cost.coef = COEF
    waiting = [0] * slots  # the step each waiting request arrived at
    left = requests - slots
    active: dict[int, list[int]] = {}  # slot -> [prompt tokens left, tokens generated]
    seconds, step, prompt_steps, drafts = 0.0, 0, 0, 0
    while waiting or active:
        ahead = waiting[: slots - len(active)]
        decoding = [s for s, v in active.items() if v[0] == 0]
        running = [s for s, v in active.items() if v[0] > 0]
        tokens = 0
        if (ahead or running) and not (hold and ahead and not running and cost.hold(
                [step - a for a in ahead], len(decoding), len(active), prompt * len(ahead), cap, drafts)):
            budget = cost.step_budget(StepTarget(auto=True), len(active), cap,
                                      [active[s][0] for s in running] + [prompt] * len(ahead))
            room = budget - len(decoding)
            for s in running:
                n = min(active[s][0], room)
                active[s][0] -= n
                room, tokens = room - n, tokens + n
            for a in list(ahead):
                if room <= 0:
                    break
                n = min(prompt, room)
                room, tokens = room - n, tokens + n
                active[next(i for i in range(slots) if i not in active)] = [prompt - n, 0]
                waiting.remove(a)
        drafting = spec and not tokens and bool(decoding)
        drafts = WIDTH * len(decoding) if drafting else 0
        base, per_row, per_token, prompt_step, per_draft = COEF
        seconds += base + per_row * len(active) + (prompt_step + per_token * tokens if tokens else 0.0) \
            + per_draft * drafts
        step += 1
        prompt_steps += tokens > 0
        for s in decoding:
            got = 1
            while drafting and got <= WIDTH and rng.random() < accept:
                got += 1
            active[s][1] += got
            if active[s][1] >= gen:
                del active[s]
                if left:
                    left -= 1
                    waiting.append(step)
    return requests * gen / seconds, prompt_steps, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accept", nargs="+", type=float, default=[1.0, 0.83, 0.6],
                    help="a draft token's chance of being kept")
    args = ap.parse_args()
    for accept in args.accept:
        for spec in (False, True):
            for hold in (False, True):
                tok_s, steps, seconds = simulate(spec, hold, accept)
                print(f"accept {accept:.2f} {'speculation' if spec else 'off        '} "
                      f"{'hold   ' if hold else 'no hold'}: {tok_s:7.0f} tok/s, {steps:3d} prompt steps, "
                      f"{seconds:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
