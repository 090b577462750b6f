"""Prompt-lookup speculation on this machine (issue 34, measurement (b)): per held task (scripts/spec_tasks.py),
one stream, greedy, each task run with ``speculative: false`` and then on, in one engine: draft tokens
verified and accepted, tokens a step, and the seconds each way. Prints JSON lines and markdown rows.

    PYTHONPATH=src .venv/bin/python scripts/spec_acceptance.py models/gemma-3-270m-q4_k_m.gguf \\
        --template configs/gemma3.jinja
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_tasks import TASKS

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig
from llamapool.worker.engine.spec import WidthCosts
from llamapool.worker.engine.speculator import Speculator

# ms a step verifying n tokens of one sequence (one llama_decode, logits for each), llama.cpp alone on an
# H100, from issue 34 (measurement (a) of this code on a GPU is still to be made)
H100_VERIFY_MS = {"1B q8_0": {1: 1.23, 2: 1.33, 4: 1.56, 6: 1.76, 8: 1.95},
                  "8B q8_0": {1: 4.32, 2: 4.79, 4: 5.43, 6: 6.71, 8: 7.63}}


def projected(alpha: float, verify_ms: dict[int, float]) -> tuple[float, int]:
    """(c): the one-stream speed-up over decoding without drafts at per-token acceptance ``alpha``, and the
    draft length giving it. A step verifying ``k`` drafts yields ``(1 - a^(k+1)) / (1 - a)`` tokens
    (the accepted prefix and the token after it) in ``verify_ms[k + 1]``, against 1 token in ``verify_ms[1]``."""
    best = (1.0, 0)
    for n, ms in verify_ms.items():
        k = n - 1
        tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        best = max(best, (tokens * verify_ms[1] / ms, k))
    return best


def one(engine: Engine, prompt: Any, p: SamplingParams) -> dict[str, Any]:
    before = (engine.spec.drafted_tokens, engine.spec.accepted_tokens, engine.sampled_tokens, engine.sampling_steps)
    engine.submit(Run(0, prompt, p, False), Step())
    first, done = 0.0, None
    while engine.busy:
        step = engine.step()
        if step.failed:
            raise RuntimeError(step.failed)
        if not first and engine.sampled_tokens > before[2]:
            first = time.perf_counter()
        done = step.done[0] if step.done else done
    end = time.perf_counter()
    assert done is not None and done.completion_tokens > 1
    drafted, accepted = engine.spec.drafted_tokens - before[0], engine.spec.accepted_tokens - before[1]
    tokens, steps = engine.sampled_tokens - before[2], engine.sampling_steps - before[3]
    return {"text": done.text, "tokens": done.completion_tokens, "drafted": drafted, "accepted": accepted,
            "tokens_per_step": tokens / max(steps, 1), "tok_s": (done.completion_tokens - 1) / (end - first)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--template", default="", help="a chat template file (Gemma 3 270M's GGUF has none)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every-step", action="store_true",
                    help="every step drafts what prompt lookup finds (the step budget's cost model bypassed): "
                         "the proposer's own acceptance, not the budget's choice")
    args = ap.parse_args()
    if args.every_step:
        Speculator.width_cost = lambda self, n_rows, rows, prefilling: (lambda k: 1.0)  # type: ignore[method-assign]
        WidthCosts.choose = lambda self, chances, outputs, rows, most, last, cost: min(  # type: ignore[method-assign]
            max((len(c) for c in chances.values()), default=0), most)
    engine = Engine(EngineConfig(args.model, slots=1, ctx_per_slot=2048, max_batch_tokens=512, threads=args.threads,
                                 speculative="ngram", chat_template=args.template, prefix_cache=False))
    if args.every_step:
        engine.spec.least_chance = 0.0  # every draft made, however often refused
    p = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    one(engine, TASKS[0][2], dataclasses.replace(p, max_tokens=24))  # warm up (and fit the cost model)
    rows = []
    for name, kind, prompt in TASKS:
        off = one(engine, prompt, dataclasses.replace(p, speculative=False))
        on = one(engine, prompt, p)
        row = {"model": Path(args.model).name, "budget": "every step" if args.every_step else "step budget",
               "task": name, "kind": kind, "tokens": on["tokens"],
               "drafted": on["drafted"], "accepted": on["accepted"],
               "acceptance": round(on["accepted"] / on["drafted"], 3) if on["drafted"] else None,
               "tokens_per_step": round(on["tokens_per_step"], 2),
               "off_tok_s": round(off["tok_s"], 1), "on_tok_s": round(on["tok_s"], 1),
               "speedup": round(on["tok_s"] / off["tok_s"], 2),
               "same_text": on["text"] == off["text"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.close()
    print("| model | drafts | task | kind | tokens | drafted | accepted | acceptance | tokens/step | off tok/s | "
          "on tok/s | speed-up (CPU) | same text | projected 1B / 8B H100 (k) |")
    print("|---" * 14 + "|")
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {r['task']} | {r['kind']} | {r['tokens']} | {r['drafted']} | "
              f"{r['accepted']} | {r['acceptance']} | {r['tokens_per_step']} | {r['off_tok_s']} | {r['on_tok_s']} | "
              f"{r['speedup']}x | "
              f"{'yes' if r['same_text'] else 'no'} | {project(r['acceptance'])} |")


def project(alpha: float | None) -> str:
    if not alpha:
        return "1.00x / 1.00x"
    parts = [projected(alpha, ms) for ms in H100_VERIFY_MS.values()]
    return " / ".join(f"{x:.2f}x ({k})" for x, k in parts)


if __name__ == "__main__":
    main()
