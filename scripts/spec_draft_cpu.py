"""A draft model on this machine (or a GPU: ``--gpu``; issue 43, item 4), one stream or more, greedy, the worker's own
policy deciding: ``make-model --peaked`` target and drafts of its vocabulary, a "right" draft (the target's
seed: its greedy cycle, every draft token kept) and a "wrong" one (another seed: none kept), each against the
same engine's requests with ``speculative: false``, alternating, in one engine. Prints JSON lines (tok/s each
way, the ratio, draft tokens verified and kept, the draft model's calls and seconds a call).

    PYTHONPATH=src .venv/bin/python scripts/spec_draft_cpu.py --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from llamapool.modelgen import make_model
from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig
from llamapool.worker.engine.draft import DraftModel


def one(eng: Engine, rid: int, p: SamplingParams, streams: int = 1) -> tuple[float, int, str]:
    """``streams`` requests at once (rids from ``rid * streams``): their seconds, tokens and texts."""
    prompts = ["tok1 tok2 tok3", "tok7 tok5", "tok2 tok9 tok4 tok4", "tok11"]
    for i in range(streams):
        eng.submit(Run(rid * streams + i, prompts[i % len(prompts)], p, False), Step())
    t0, done = time.perf_counter(), []
    while eng.busy:
        step = eng.step()
        assert not step.failed, step.failed
        done += step.done
    done.sort(key=lambda d: d.rid)
    return time.perf_counter() - t0, sum(d.completion_tokens for d in done), "|".join(d.text for d in done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-embd", type=int, default=512, help="the target's width (the drafts': a quarter)")
    ap.add_argument("--layers", type=int, default=8, help="the target's layers (the drafts': 1)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=200, help="tokens a request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1, help="requests at once")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qtype", default="f32", help="the models' matrices (make-model: f32, f16, q8_0)")
    ap.add_argument("--gpu", action="store_true", help="a GPU worker (the draft model's argmax in the graph)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shape: dict[str, Any] = {"n_vocab": args.vocab, "n_head": 8, "n_head_kv": 4, "peaked": True,
                                 "qtype": args.qtype}
        target = make_model(Path(tmp) / "target.gguf", n_embd=args.n_embd, n_layer=args.layers,
                            n_ff=4 * args.n_embd, **shape)
        for name, seed in (("right", 0), ("wrong", 1)):
            draft = make_model(Path(tmp) / f"{name}.gguf", n_embd=max(args.n_embd // 4, 64), n_layer=1,
                               n_ff=args.n_embd, seed=seed, **shape)
            eng = Engine(EngineConfig(str(target), slots=max(2, args.streams), ctx_per_slot=args.tokens + 64,
                                      threads=args.threads, max_batch_tokens=256, speculative=f"draft:{draft}",
                                      prefix_cache=False, gpu=args.gpu))
            try:
                p = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                secs = {"on": 0.0, "off": 0.0}
                toks = dict.fromkeys(secs, 0)
                texts: dict[str, set[str]] = {"on": set(), "off": set()}
                one(eng, 0, p, args.streams)  # warm: both paths' first calls, the widths' first measurements
                one(eng, 1, dataclasses.replace(p, speculative=False), args.streams)
                for r in range(args.rounds):
                    for mode in ("off", "on") if r % 2 else ("on", "off"):
                        q = p if mode == "on" else dataclasses.replace(p, speculative=False)
                        s, n, text = one(eng, 10 + 2 * r + (mode == "off"), q, args.streams)
                        secs[mode] += s
                        toks[mode] += n
                        texts[mode].add(text)
                drafter = eng.spec.drafter
                assert isinstance(drafter, DraftModel)
                on, off = toks["on"] / secs["on"], toks["off"] / secs["off"]
                print(json.dumps({
                    "draft": name, "target": f"{args.n_embd}x{args.layers}", "gpu": args.gpu, "threads": args.threads,
                    "streams": args.streams,
                    "tok_s_on": round(on, 1), "tok_s_off": round(off, 1), "ratio": round(on / off, 3),
                    "same_text": texts["on"] == texts["off"], "draft_tokens": eng.spec.drafted_tokens,
                    "accepted": eng.spec.accepted_tokens, "draft_calls": drafter.calls,
                    "draft_call_ms": {b: round(1e3 * s, 3) for b, s in sorted(drafter.timing.items())},
                    "tokens_per_step": round(eng.sampled_tokens / max(eng.sampling_steps, 1), 2)}))
            finally:
                eng.close()


if __name__ == "__main__":
    main()
