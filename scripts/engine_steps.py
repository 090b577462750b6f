#!/usr/bin/env python3
"""The engine alone (no router, no sockets), one process: host time a step for a batch of sequences of
each kind, as ``Engine`` counts it (a whole step's time less the time inside ``llama_decode``), and the
engine thread's CPU time a step (``cpu_us``: with one llama.cpp thread, the decode runs on it too; on a
shared machine a steadier figure than the wall-clock ones).

    PYTHONPATH=src .venv/bin/python scripts/engine_steps.py MODEL [--slots 8] [--gen 192] [--repeats 3]

Kinds: ``plain`` (greedy), ``logprobs1``/``logprobs5``/``logprobs20`` (each token with its logprob and
that many alternatives), ``json`` (each constrained by the bench schema), ``half_json`` (half plain, half
constrained). Prints one JSON line: per kind the median over repeats of host µs and decode µs a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from llamapool.bench.workloads import BENCH_SCHEMA
from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig


def kinds(gen: int) -> dict[str, list[SamplingParams]]:
    plain = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    lp = {f"logprobs{k}": dataclasses.replace(plain, logprobs=True, top_logprobs=k) for k in (1, 5, 20)}
    js = dataclasses.replace(plain, json_schema=BENCH_SCHEMA)
    return {"plain": [plain], **{k: [v] for k, v in lp.items()}, "json": [js], "half_json": [plain, js]}


def measure(eng: Engine, params: list[SamplingParams], slots: int, prompt: list[int], rid: int,
            stream: bool = True) -> dict[str, float]:
    for i in range(slots):
        eng.submit(Run(rid + i, prompt, params[i % len(params)], stream), Step())
    while eng.waiting or any(s.prefilling for s in eng.active.values()):  # prompts in: time decode steps only
        eng.step()
    steps, step_s, decode_s, t0, c0 = eng.steps, eng.step_s, eng.decode_s, time.perf_counter(), time.thread_time()
    while eng.busy:
        eng.step()
    n = max(1, eng.steps - steps)
    return {"host_us": 1e6 * ((eng.step_s - step_s) - (eng.decode_s - decode_s)) / n,
            "decode_us": 1e6 * (eng.decode_s - decode_s) / n, "steps": n,
            "wall_us": 1e6 * (time.perf_counter() - t0) / n, "cpu_us": 1e6 * (time.thread_time() - c0) / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--gen", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    eng = Engine(EngineConfig(args.model, slots=args.slots, ctx_per_slot=args.gen + 48, max_batch_tokens=512,
                              n_ubatch=512, threads=args.threads))
    prompt = list(range(3, 35))
    rows: dict[str, list[dict[str, float]]] = {}
    rid = 0
    try:
        for _ in range(args.repeats):
            for name, params in kinds(args.gen).items():
                rid += 1000
                rows.setdefault(name, []).append(measure(eng, params, args.slots, prompt, rid))
    finally:
        eng.close()
    kinds_ = ("host_us", "decode_us", "wall_us", "cpu_us")
    print(json.dumps({k: {m: round(statistics.median(r[m] for r in v), 1) for m in kinds_}
                      for k, v in rows.items()}))


if __name__ == "__main__":
    main()
