"""Constrained greedy text, the row sampled in the decode graph against on the host (a GPU check).

    python scripts/constrained_paths.py MODEL.gguf [--gpu]

A constrained greedy row keeps the graph's argmax when the grammar allows it and otherwise takes the
likeliest allowed token from the row's logits, which llama.cpp keeps beside the sampled token. This
prints for how many of 16 prompts under a JSON schema that gives the host path's text (and, as the
measure of what is noise, for how many two host runs agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from llamapool.bench.workloads import BENCH_SCHEMA
from llamapool.protocol.messages import Run, Step
from llamapool.protocol.params import SamplingParams
from llamapool.worker.engine import Engine, EngineConfig


def texts(cfg: EngineConfig, runs: list[Run]) -> dict[int, str]:
    eng = Engine(cfg)
    out: dict[int, str] = {}
    try:
        for r in runs:
            eng.submit(r, Step())
        for w in eng.waiting:  # every grammar compiled first: both engines admit the same runs at once
            if w.grammar is not None:
                w.grammar.result()
        while eng.busy:
            for d in eng.step().done:
                out[d.rid] = d.text
    finally:
        eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, json_schema=BENCH_SCHEMA)
    runs = [Run(i, [1] + [100 + 37 * i + k for k in range(32)], p, False) for i in range(16)]
    cfg = EngineConfig(args.model, slots=16, ctx_per_slot=256, gpu=args.gpu, gpu_sampling=True)
    graph = texts(cfg, runs)
    host = texts(dataclasses.replace(cfg, gpu_sampling=False), runs)
    again = texts(dataclasses.replace(cfg, gpu_sampling=False), runs)  # how far the host path repeats itself
    print(json.dumps({"prompts": len(runs), "graph_equals_host": sum(graph[i] == host[i] for i in graph),
                      "host_equals_host": sum(again[i] == host[i] for i in host),
                      "example_graph": graph[0][:60], "example_host": host[0][:60]}))


if __name__ == "__main__":
    main()
