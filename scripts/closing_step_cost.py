"""What budget-aware closing costs a decode step, on the CPU: constrained batches with and without it.

    python scripts/closing_step_cost.py MODEL.gguf [--rows 8] [--max-tokens 128] [--repeats 3]

Runs ``rows`` sequences constrained by the ``json`` benchmark's schema (a free string, a list, an
integer: the grammar stays open for the whole reply) on the engine in-process, greedy, ``max_tokens``
each, three ways, alternating, ``repeats`` times: ``off`` (the closing never checks a token: every
token costs what it did before the closing existed, a counter and a byte scan beside the matcher's
``consume_token``), ``on`` (as served: tokens checked in a reply's last tokens) and ``on_all`` (every
token checked: the window covers the whole reply). Prints one JSON line: the mean step time of each
(decode steps only, the prompt's steps left out), and how many replies ended by ``length``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from llamapool.bench.workloads import BENCH_SCHEMA
from llamapool.protocol.messages import Run, Step
from llamapool.protocol.params import SamplingParams
from llamapool.worker.closing import Closing
from llamapool.worker.engine import Engine, EngineConfig


def run(eng: Engine, rows: int, max_tokens: int, window: int | None) -> tuple[float, int]:
    """Mean seconds of a decode step, and the replies that ended by length."""
    start = eng.grammars.start

    def started(compiled: Any, budget: int) -> Closing:
        c = start(compiled, budget)
        if window is not None:
            c.window = window
        return c

    eng.grammars.start = started  # type: ignore[method-assign]
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, json_schema=BENCH_SCHEMA)
    for i in range(rows):
        eng.submit(Run(i, [{"role": "user", "content": f"Write a JSON note number {i} about llamas."}], p,
                       False), Step())
    times, length = [], 0
    while eng.busy:
        prefilling = any(s.prefilling for s in eng.active.values()) or bool(eng.waiting)
        t = time.perf_counter()
        out = eng.step()
        if not prefilling:
            times.append(time.perf_counter() - t)
        length += sum(d.reason == "length" for d in out.done)
    eng.grammars.start = start  # type: ignore[method-assign]
    return statistics.fmean(times), length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    eng = Engine(EngineConfig(args.model, slots=args.rows, ctx_per_slot=1024, max_batch_tokens=512))
    ways: dict[str, int | None] = {"off": -1, "on": None, "on_all": 1 << 20}
    steps: dict[str, list[float]] = {k: [] for k in ways}
    lengths: dict[str, int] = {k: 0 for k in ways}
    try:
        run(eng, args.rows, 16, None)  # warm: grammar compiled, caches filled
        for _ in range(args.repeats):
            for name, window in ways.items():
                mean, length = run(eng, args.rows, args.max_tokens, window)
                steps[name].append(mean)
                lengths[name] += length
    finally:
        eng.close()
    print(json.dumps({"rows": args.rows, "max_tokens": args.max_tokens, "repeats": args.repeats,
                      **{f"step_ms_{k}": [round(v * 1e3, 2) for v in vs] for k, vs in steps.items()},
                      **{f"length_{k}": v for k, v in lengths.items()}}))


if __name__ == "__main__":
    main()
