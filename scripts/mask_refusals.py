#!/usr/bin/env python3
"""How often a model's plain argmax is refused by its grammar's mask, with constrained greedy rows sampled
"on_refusal" (``Sampling.graph_masks``): each refused pick costs its row one more step (the row is decoded
again under its mask). Runs the graph path where it runs (backend sampling; forced on the CPU here), C
requests at once, a JSON schema of a person and the bench schema, and prints each one's retries over its
tokens and the first reply.

    PYTHONPATH=src python3 scripts/mask_refusals.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
from typing import Any

from llamapool.bench.workloads import BENCH_SCHEMA
from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig

PERSON: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args()
    eng = Engine(EngineConfig(args.model, slots=args.concurrency, ctx_per_slot=512, threads=2,
                              backend_sampling=True))
    eng.sampling.graph_masks = "on_refusal"
    try:
        for name, schema in (("person", PERSON), ("bench", BENCH_SCHEMA)):
            p = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, json_schema=schema)
            runs = [Run(i, f"Describe person number {i} as JSON with name, age, city and hobbies.", p, False)
                    for i in range(args.concurrency)]
            before = eng.sampling.retries
            for r in runs:
                eng.submit(r, Step())
            tokens, texts = 0, {}
            while eng.busy:
                for d in eng.step().done:
                    tokens += d.completion_tokens
                    texts[d.rid] = d.text
            retries = eng.sampling.retries - before
            print(f"{name}: {retries} retries over {tokens} tokens ({100 * retries / max(tokens, 1):.1f} %); "
                  f"first reply {texts[0][:100]!r}")
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
