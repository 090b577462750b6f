#!/usr/bin/env python3
"""Issue 31's value check on a GPU: logprobs computed in the decode graph against the host path.

One engine on one model (GPU 0 with ``--gpu``; on the CPU its backend sampling forced), C greedy
requests run three times: without logprobs (``plain``), with ``top_logprobs`` computed in the decode
graph (``graph``: worker/graph_samplers.py), and with them computed on the host as before it (``host``:
the engine's ``in_graph`` made to refuse logprob requests, so their logits rows are copied and
log-softmaxed in numpy while the next step runs). Prints, as one JSON line, whether graph and host gave
the same texts, the largest difference of a token's and an alternative's logprob, the alternatives
that differ (outside ties), and each run's tokens a second and time a step (``graph``/``host`` over
``plain``: the cost of logprobs, the engine alone).

    PYTHONPATH=src python3 scripts/graph_logprobs_check.py MODEL.gguf --gpu --concurrency 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from llamapool.protocol.messages import Run, SamplingParams, Step, TokenLogprob
from llamapool.worker.engine import Engine, EngineConfig


def run(engine: Engine, runs: list[Run]) -> tuple[dict[int, tuple[str, list[TokenLogprob]]], float, int]:
    for r in runs:
        engine.submit(r, Step())
    out: dict[int, tuple[str, list[TokenLogprob]]] = {}
    t0, steps = time.perf_counter(), 0
    while engine.busy:
        step = engine.step()
        steps += 1
        if step.failed:
            raise RuntimeError(f"failed: {step.failed}")
        for done in step.done:
            out[done.rid] = (done.text, list(done.logprobs or []))
    return out, time.perf_counter() - t0, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    c = args.concurrency
    kw = {"slots": c, "ctx_per_slot": 512, "max_batch_tokens": 4096, "gpu": args.gpu, "threads": 8 if args.gpu else 2}
    p = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True, logprobs=True,
                       top_logprobs=args.top)
    runs = [Run(i, f"Request {i}: the numbers {i * 7 % 13} and {i * 11 % 17} mean", p, False) for i in range(c)]
    eng = Engine(EngineConfig(args.model, **kw, **({} if args.gpu else {"backend_sampling": True})))  # type: ignore[arg-type]
    bare = dataclasses.replace(p, logprobs=False, top_logprobs=0)
    plain = [Run(i, r.prompt, bare, False) for i, r in enumerate(runs)]
    graph_rule = eng.sampling.in_graph
    res = {}
    try:
        run(eng, runs[:2])  # warm-up
        for name in ("plain", "graph", "host", "plain2", "graph2", "host2"):
            eng.sampling.in_graph = graph_rule if "host" not in name else (  # type: ignore[method-assign]
                lambda q: graph_rule(q) and not q.logprobs)
            res[name] = run(eng, plain if "plain" in name else runs)
    finally:
        eng.close()
    g, h = res["graph"][0], res["host"][0]
    same_text = sum(g[i][0] == h[i][0] for i in range(c))
    d_tok = d_alt = 0.0
    alt_diff = 0
    for i in range(c):
        if g[i][0] != h[i][0]:
            continue
        for a, b in zip(g[i][1], h[i][1], strict=True):
            assert a.logprob is not None and b.logprob is not None
            d_tok = max(d_tok, abs(a.logprob - b.logprob))
            for x, y in zip(a.top, b.top, strict=True):
                d_alt = max(d_alt, abs(x.logprob - y.logprob))
                alt_diff += x.token != y.token and abs(x.logprob - y.logprob) > 1e-4
    speed = {name: round(c * args.gen_tokens / secs) for name, (_, secs, _) in res.items()}
    ms = {name: round(1000 * secs / steps, 3) for name, (_, secs, steps) in res.items()}
    print(json.dumps({"model": args.model, "gpu": args.gpu, "concurrency": c, "gen_tokens": args.gen_tokens,
                      "top": args.top, "same_text": f"{same_text}/{c}", "max_token_logprob_diff": d_tok,
                      "max_alt_logprob_diff": d_alt, "alternatives_differing_outside_ties": alt_diff,
                      "tok_s": speed, "ms_step": ms,
                      **{f"{path}_of_plain": [round(speed[path + rep] / speed["plain" + rep], 3) for rep in ("", "2")]
                         for path in ("graph", "host")}}))
    return 0 if same_text == c and d_tok < 1e-3 and d_alt < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
