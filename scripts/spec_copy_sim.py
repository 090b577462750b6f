"""scripts/spec_copy.py's one-stream workload through the engine's own speculation policy, no GPU.

The speculator (``worker/engine/speculator.py``) with real prompt lookup decides every step's drafts and
width for one stream copying a passage of a cycle of tokens (intact, with 10 % or 30 % of its tokens
replaced, or absent); only the GPU is replaced: a decode step's ms come from a table of an H100's
(scripts/spec_sim.py's), its first ``SETTLING`` steps after a change of width dearer, a prompt step 20 ms.
It prints tok/s with the policy and without speculation::

    PYTHONPATH=src python3 scripts/spec_copy_sim.py
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from llamapool.protocol.params import SamplingParams
from llamapool.worker.engine.model import EngineConfig
from llamapool.worker.engine.ngram import PromptLookup
from llamapool.worker.engine.sequence import Sequence
from llamapool.worker.engine.spec import Drafting
from llamapool.worker.engine.speculator import Speculator
from llamapool.worker.scheduler import CostModel

# ms a decode step by width at one stream, and what a settling step costs more (scripts/spec_sim.py)
COSTS = {"1b": ({0: 1.45, 1: 1.55, 3: 1.8, 8: 2.3}, 1.0), "8b": ({0: 4.51, 1: 4.95, 3: 5.55, 8: 8.77}, 5.0)}
EDITS = {"full copy": 0.0, "10% edits": 0.1, "30% edits": 0.3, "nothing": None}


def ms_at(table: dict[int, float], k: int) -> float:
    ks = sorted(table)
    lo, hi = max(x for x in ks if x <= k), min((x for x in ks if x >= k), default=max(ks))
    return table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (k - lo) / (hi - lo)


def workload(edit: float | None, rng: random.Random, gen: int, vocab: int = 32000) -> tuple[list[int], list[int]]:
    """A prompt (noise, c0 c1, the passage, noise, c0 c1) and the reply that copies the passage."""
    start = rng.randrange(vocab)
    cyc = [(start + i) % vocab for i in range(gen + 42)]
    if edit is None:
        passage = [rng.randrange(vocab) for _ in cyc[2:]]
    else:
        passage = [t if rng.random() >= edit else rng.randrange(vocab) for t in cyc[2:]]
    noise = [rng.randrange(vocab) for _ in range(60)]
    return noise[:40] + cyc[:2] + passage + noise[40:] + cyc[:2], cyc[2 : 2 + gen]


def run(shape: str, edit: float | None, seed: int, speculate: bool, gen: int = 256, requests: int = 8) -> float:
    """tok/s of ``requests`` replies one after the other."""
    table, change = COSTS[shape]
    rng = random.Random(seed)
    cfg = EngineConfig("unused.gguf", slots=1, ctx_per_slot=4096, max_batch_tokens=8192, n_ubatch=8192)
    sp = Speculator("all", cfg, SimpleNamespace(gpu=False, verifies=lambda p: True), CostModel())  # type: ignore[arg-type]
    sp.cost.coef = (table[0] / 1e3, 0.0, 0.0, 0.0, (table[8] - table[0]) / 8e3)
    sp.proposer = PromptLookup()
    seconds, tokens, steps = 0.0, 0, 0
    for rid in range(requests):
        prompt, truth = workload(edit, rng, gen)
        hist = np.zeros(len(prompt) + gen + 16, np.int32)
        hist[: len(prompt)] = prompt
        seq = Sequence(rid=rid, seq_id=0, tokens=np.array(prompt, np.int32), stream=False,
                       params=SamplingParams(max_tokens=gen, temperature=0.0), sampling=SimpleNamespace(matcher=None),
                       text=None, n_past=len(prompt), history=hist, n_history=len(prompt),  # type: ignore[arg-type]
                       drafting=Drafting(prior=sp.pool.rate) if speculate else None)
        sp.width = 0
        sp.launching(True)  # the prompt step
        seconds += 0.02
        got = 0
        while got < gen:
            k = sp.propose({0: 1}, {0: seq}, steps)
            _, settling = sp.launching(False)
            ms = ms_at(table, k) + (change if settling else 0.0)
            seconds += ms / 1e3
            steps += 1
            draft = seq.draft
            kept = 0
            while kept < len(draft) and got + kept < gen and draft[kept] == truth[got + kept]:
                kept += 1
            new = truth[got : got + kept + 1]
            sp.verified(seq, draft, new, new)
            sp.observe(k, 1, ms / 1e3 * rng.gauss(1.0, 0.02), settling)
            for t in new:
                seq.generated_token(t)
            seq.n_past += len(new)
            got += len(new)
            tokens += len(new)
            sp.after_launch({0: seq}, steps)
    return tokens / seconds


def main() -> None:
    print("| shape | workload | policy tok/s | off tok/s | policy / off |")
    print("|---|---|---|---|---|")
    for shape in COSTS:
        for name, edit in EDITS.items():
            on = sum(run(shape, edit, seed, True) for seed in range(3)) / 3
            off = sum(run(shape, edit, seed, False) for seed in range(3)) / 3
            print(f"| {shape} | {name} | {on:,.0f} | {off:,.0f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
