"""Issue 46: what ``model.deterministic`` costs a CPU worker's engine, on and off in alternate runs (each run
a process of its own: llama.cpp reads ``GGML_CPU_TILED_MM`` once a process).

Workloads, all requests submitted at once to one engine (8 slots, the CPU defaults: 512-token steps):
``prefill`` 8 prompts of ~400 tokens, 8 tokens each; ``decode`` 8 prompts of ~30 tokens, 64 tokens each;
``mixed`` 16 prompts of 30-400 tokens, 32 tokens each, arriving 2 steps apart. Greedy, EOS ignored.
Tokens a second = (prompt + generated tokens) / wall seconds of the engine's steps.

    PYTHONPATH=src .venv/bin/python scripts/determinism_cost.py [--model ...] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORDS = "the river runs past the market and the mill while the town grows along its banks".split()


def prompt(i: int, n_words: int) -> str:
    return f"Story {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words))


def workload(name: str) -> list[tuple[str, int, int]]:
    """(prompt, max_tokens, arrival step) for each request."""
    if name == "prefill":
        return [(prompt(i, 380), 8, 0) for i in range(8)]
    if name == "decode":
        return [(prompt(i, 25), 64, 0) for i in range(8)]
    return [(prompt(i, 25 + 40 * (i % 10)), 32, 2 * i) for i in range(16)]


def one_run(model: str, det: bool, threads: int, name: str) -> dict[str, float]:
    from llamapool.protocol.messages import Run, Step
    from llamapool.protocol.params import SamplingParams
    from llamapool.worker.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model, slots=8, ctx_per_slot=1024, max_batch_tokens=512, n_ubatch=1024,
                              threads=threads, deterministic=det))
    reqs = workload(name)
    tokens = sum(len(eng.tokenize(p)) + g for p, g, _ in reqs)
    pending = list(enumerate(reqs))
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while pending or eng.busy:
        for rid, (p, g, at) in [x for x in pending if x[1][2] <= steps]:
            eng.submit(Run(rid, p, SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True), False), Step())
            pending.remove((rid, (p, g, at)))
        out = eng.step()
        assert not out.failed, out.failed
        steps += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    eng.close()
    # the process's CPU seconds too: on a shared machine they follow the work more closely than the wall time
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "cpu_seconds": cpu, "tokens_per_cpu_s": tokens / cpu,
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="prefill,decode,mixed")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "WORKLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.model, args.child[0] == "on", args.threads, args.child[1])))
        return
    for name in args.workloads.split(","):
        got: dict[str, list[float]] = {"on": [], "off": []}
        per_cpu: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                      "--child", mode, name], capture_output=True, text=True, env=os.environ,
                                     check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                got[mode].append(row["tokens_per_s"])
                per_cpu[mode].append(row["tokens_per_cpu_s"])
        for what, v in (("tok/s", got), ("tok/CPU-s", per_cpu)):
            on, off = sorted(v["on"])[len(v["on"]) // 2], sorted(v["off"])[len(v["off"]) // 2]
            print(f"{name:8} off {off:7.1f} {what}  on {on:7.1f} {what}  on/off {on / off:.2f}x (medians of "
                  f"{args.rounds}; off {[round(x) for x in v['off']]}, on {[round(x) for x in v['on']]})", flush=True)


if __name__ == "__main__":
    main()
