#!/usr/bin/env python3
"""The engine's host time between two ``llama_decode`` calls, in process, on the CPU (issue 43 item 5).

One engine (backend sampling forced, as on a GPU worker: the pipelined step), ``--streams`` greedy requests
at once with speculation off for the request (``"speculative": false``) on a worker whose
``model.speculative`` is ``--speculative``. ``llama_synchronize`` and ``llama_decode`` are wrapped to time,
per decode step (no prompt work): ``gap`` (from the wait for the batch in flight returning to the next
``llama_decode`` call: on a GPU, the time it idles) and ``after`` (from a ``llama_decode`` call returning
to the next wait: the host's work while a GPU computes, ``Engine.step``'s return and the caller's loop
included). Prints one JSON line: the medians and means in µs over ``--repeats`` runs, and the gap's mean
in the engine thread's CPU time (``gap_cpu_us_mean``: steadier on a shared machine).

    PYTHONPATH=src .venv/bin/python scripts/host_gap.py MODEL.gguf --streams 1 --gen 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import llama_cpp as L

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative", default="ngram", help="model.speculative (the request turns it off)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    marks: list[tuple[str, float, float]] = []
    sync, decode = L.llama_synchronize, L.llama_decode

    def timed_sync(ctx):  # type: ignore[no-untyped-def]
        marks.append(("s0", time.perf_counter(), time.thread_time()))
        r = sync(ctx)
        marks.append(("s1", time.perf_counter(), time.thread_time()))
        return r

    def timed_decode(ctx, batch):  # type: ignore[no-untyped-def]
        marks.append(("d0", time.perf_counter(), time.thread_time()))
        r = decode(ctx, batch)
        marks.append(("d1", time.perf_counter(), time.thread_time()))
        return r

    L.llama_synchronize, L.llama_decode = timed_sync, timed_decode  # type: ignore[assignment]
    eng = Engine(EngineConfig(args.model, slots=args.streams, ctx_per_slot=args.gen + 64, threads=args.threads,
                              max_batch_tokens=max(512, 2 * args.streams), backend_sampling=True,
                              speculative=args.speculative))
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True, speculative=False)
    gaps: list[float] = []
    afters: list[float] = []
    cpu_gaps: list[float] = []
    try:
        for r in range(args.repeats + 1):  # the first a warm-up
            for i in range(args.streams):
                eng.submit(Run(1000 * r + i, list(range(3, 35)), params, True), Step())
            while eng.waiting or any(s.prefilling for s in eng.active.values()):
                eng.step()
            marks.clear()
            while eng.busy:
                eng.step()
            if r == 0:
                continue
            for (a, ta, ca), (b, tb, cb) in itertools.pairwise(marks):
                if a == "s1" and b == "d0":
                    gaps.append(tb - ta)
                    cpu_gaps.append(cb - ca)
                elif a == "d1" and b == "s0":
                    afters.append(tb - ta)
    finally:
        eng.close()
    print(json.dumps({"streams": args.streams, "speculative": args.speculative, "steps": len(gaps),
                      "gap_us_median": round(1e6 * statistics.median(gaps), 1),
                      "gap_us_mean": round(1e6 * statistics.fmean(gaps), 1),
                      "gap_cpu_us_mean": round(1e6 * statistics.fmean(cpu_gaps), 1),
                      "after_us_median": round(1e6 * statistics.median(afters), 1),
                      "after_us_mean": round(1e6 * statistics.fmean(afters), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
