#!/usr/bin/env python3
"""Issue 31 item 2's check on a GPU: grammar masks applied in the decode graph against the host path.

One engine on one model (GPU 0 by default; ``--cpu``: the CPU, its backend sampling forced), C greedy
requests at once, constrained (JSON schema, regex, grammar, in turn), sampled each way of ``Sampling.graph_masks``:
``always`` (the graph adds each row's mask and only the allowed argmax leaves it:
worker/graph_samplers.py), ``keeping`` (llama.cpp's greedy chain keeps the row's logits, a refused argmax
is replaced on the host from them) and ``on_refusal`` (the masked chain, a row's mask applied only
where the host refused its plain argmax: that row is decoded again; ``retry_only``: it with every mask
taken as wide, none applied before a refusal); and ``plain`` (the same prompts, unconstrained), and
``mixed`` (half plain, half constrained, each way); ``--kinds json``: JSON schemas only. Each run twice, after a
warm-up. Prints, as one JSON line, whether the ways gave the same texts as ``keeping`` (token for token,
every request), the rows decoded again (``retries``), each run's tokens a
second and median decode step (ms, steps without prompt tokens), where a step's time went
(``gap_call_wait_after_ms``: the host's work from the tokens read to the next launch, the GPU idle; the
``llama_decode`` call; the wait for the GPU after it; the host's work after the launch), and the ratios
issue 31 names:
constrained over plain (target >= 0.95 at 64 streams on an H100, 8B) and plain rows beside constrained
ones over plain alone (target >= 0.97).

    PYTHONPATH=src python3 scripts/graph_mask_check.py MODEL.gguf --concurrency 64
    PYTHONPATH=src python3 scripts/graph_mask_check.py MODEL.gguf --cpu --concurrency 4 --gen-tokens 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker import sampling
from llamapool.worker.engine import Engine, EngineConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 400},
                                           "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
KINDS = ({"json_schema": SCHEMA}, {"regex": r"[a-z ]{1,400}( [0-9]{1,3}){1,20}"},
         {"grammar": 'root ::= "(" [a-z ]+ ", " ("yes" | "no") ")"'})


def run(engine: Engine, runs: list[Run]) -> tuple[dict[int, str], int, float, float, tuple[float, ...]]:
    """Each run's text, the tokens generated, the seconds, the median decode step's seconds, and the ms a
    step of: the host's work before the launch (the GPU idle), the llama_decode call, the wait for the
    GPU after it, the host's other work (after the launch)."""
    n0, gap0, call0, dec0, step0 = engine.steps, engine.gap_s, engine.call_s, engine.decode_s, engine.step_s
    for r in runs:
        engine.submit(r, Step())
    texts: dict[int, str] = {}
    tokens, steps = 0, []
    t0 = time.perf_counter()
    while engine.busy:
        t = time.perf_counter()
        prefill = any(seq.prefilling for seq in engine.active.values())
        step = engine.step()
        if not prefill:
            steps.append(time.perf_counter() - t)
        if step.failed:
            raise RuntimeError(f"failed: {step.failed}")
        for done in step.done:
            texts[done.rid] = done.text
            tokens += done.completion_tokens
    n = max(1, engine.steps - n0)
    gap, call, dec, whole = engine.gap_s - gap0, engine.call_s - call0, engine.decode_s - dec0, engine.step_s - step0
    split = (round(1e3 * gap / n, 3), round(1e3 * call / n, 3), round(1e3 * (dec - call) / n, 3),
             round(1e3 * (whole - dec - gap) / n, 3))
    return texts, tokens, time.perf_counter() - t0, statistics.median(steps) if steps else 0.0, split


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cpu", action="store_true", help="the CPU backend, its backend sampling forced")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--kinds", default="json,regex,grammar",
                    help="the constraints the constrained requests take in turn (of json, regex, grammar)")
    args = ap.parse_args()
    kinds = [dict(zip(("json", "regex", "grammar"), KINDS, strict=True))[k] for k in args.kinds.split(",")]
    c, gen = args.concurrency, args.gen_tokens
    kw = {"slots": c, "ctx_per_slot": 256 + gen, "max_batch_tokens": 4096, "gpu": not args.cpu,
          "threads": 2 if args.cpu else 8}
    eng = Engine(EngineConfig(args.model, **kw, **({"backend_sampling": True} if args.cpu else {})))  # type: ignore[arg-type]
    bare = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    prompts = [f"Request {i}: describe item {i * 7 % 13} and {i * 11 % 17} as asked:" for i in range(c)]
    cons = [Run(i, p, SamplingParams(max_tokens=gen, temperature=0.0, **kinds[i % len(kinds)]), False)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)]
    plain = [Run(i, p, bare, False) for i, p in enumerate(prompts)]
    mixed = [plain[i] if i % 2 else cons[i] for i in range(c)]
    res, retries, split = {}, {}, {}
    wide = sampling.WIDE
    try:
        run(eng, cons[:2])  # warm-up
        for rep in ("", "2"):
            for name, runs, masks in (("plain", plain, "always"), ("always", cons, "always"),
                                      ("keeping", cons, "keeping"), ("on_refusal", cons, "on_refusal"),
                                      ("retry_only", cons, "on_refusal"),
                                      ("mixed_always", mixed, "always"), ("mixed_keeping", mixed, "keeping"),
                                      ("mixed_on_refusal", mixed, "on_refusal"),
                                      ("mixed_retry_only", mixed, "on_refusal")):
                eng.sampling.graph_masks = masks
                # "retry_only": every mask taken as wide (none applied before it refuses a pick)
                sampling.WIDE = 0.0 if name.endswith("retry_only") else wide
                before = eng.sampling.retries
                res[name + rep] = run(eng, runs)
                split[name + rep] = res[name + rep][4]
                retries[name + rep] = eng.sampling.retries - before
        graph = eng.sampling._graph
        masked_inputs = graph.masked_inputs if graph is not None else 0
    finally:
        eng.close()
    same = {m: sum(res[m][0][i] == res["keeping"][0][i] for i in range(c))
            for m in ("always", "on_refusal", "retry_only")}
    same_mixed = {m: sum(res["mixed_" + m][0][i] == res["mixed_keeping"][0][i] for i in range(c))
                  for m in ("always", "on_refusal", "retry_only")}
    speed = {name: round(tokens / secs, 1) for name, (_, tokens, secs, _, _) in res.items()}
    ms = {name: round(1000 * step, 3) for name, (_, _, _, step, _) in res.items()}

    def ratio(a: str, b: str) -> list[float]:
        return [round(speed[a + rep] / speed[b + rep], 3) for rep in ("", "2")]

    print(json.dumps({"model": args.model, "gpu": not args.cpu, "concurrency": c, "gen_tokens": gen,
                      "same_text_as_keeping": same, "same_text_mixed": same_mixed, "of": c,
                      "masked_inputs": masked_inputs, "retries": retries, "tok_s": speed, "ms_step": ms,
                      "gap_call_wait_after_ms": split,
                      **{f"{m}_of_plain": ratio(m, "plain") for m in ("always", "keeping", "on_refusal", "retry_only")},
                      **{f"mixed_{m}_of_plain": ratio(f"mixed_{m}", "plain")
                         for m in ("always", "keeping", "on_refusal", "retry_only")}}))
    return 0 if all(v == c for v in [*same.values(), *same_mixed.values()]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
