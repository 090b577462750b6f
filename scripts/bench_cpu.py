#!/usr/bin/env python3
"""Issue-2 figure, on this machine's CPU, in one run: tokens/s through the SDK with 2 CPU workers x
4 slots and 8 concurrent clients, against one llama-cpp-python ``Llama`` serving the same requests
one after another (same model, same prompt and generation lengths, greedy, EOS banned).

    .venv/bin/python scripts/bench_cpu.py [--requests 32] [--prompt-tokens 64] [--gen-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "small": {"n_embd": 512, "n_layer": 4, "n_head": 8, "n_head_kv": 4, "n_ff": 1536, "n_vocab": 4096},
    "medium": {"n_embd": 1024, "n_layer": 8, "n_head": 16, "n_head_kv": 4, "n_ff": 2816, "n_vocab": 8192},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", help="GGUF to use (default: a random model of --shape)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="medium",
                    help="random model: small (512 wide, 4 layers) or medium (1024 wide, 8 layers)")
    args = ap.parse_args()

    from llamapool.bench.drivers import Target
    from llamapool.bench.drivers import run as run_bench
    from llamapool.bench.workloads import make_workload
    from llamapool.modelgen import make_model

    tmp = Path(tempfile.mkdtemp(prefix="lp-bench-"))
    model = args.model or str(make_model(tmp / "bench.gguf", qtype="q8_0", **SHAPES[args.shape]))
    ctx_per_slot = args.prompt_tokens + args.gen_tokens + 16
    cfg = tmp / "bench.toml"
    cfg.write_text(
        f'[server]\nruntime_dir = "{tmp / "run"}"\n'
        f'[model]\npath = "{model}"\nctx_per_slot = {ctx_per_slot}\nmax_batch_tokens = 512\nn_ubatch = 512\n'
        '[workers]\ndevices = "cpu"\ncpu_workers = 2\nslots = 4\n'
    )
    cores = len(os.sched_getaffinity(0))
    import llama_cpp

    n_vocab = llama_cpp.Llama(model, n_ctx=64, verbose=False, vocab_only=True).n_vocab()
    work = make_workload("short", args.requests, n_vocab, seed=1, prompt_tokens=args.prompt_tokens,
                         gen_tokens=args.gen_tokens)
    prompts = [list(r.prompt) for r in work.requests]

    daemon = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from llamapool import Client

        end = time.monotonic() + 120
        with Client(f"ipc://{tmp / 'run' / 'frontend.sock'}") as c:
            while sum(w["state"] == "ready" for w in c.status()["workers"]) < 2:
                if time.monotonic() > end:
                    raise SystemExit("daemon did not get ready")
                time.sleep(0.2)
        svc = run_bench(Target("sdk", f"ipc://{tmp / 'run' / 'frontend.sock'}"), work, args.concurrency)
    finally:
        daemon.terminate()
        daemon.wait(60)

    llm = llama_cpp.Llama(model, n_ctx=ctx_per_slot, n_batch=512, n_threads=cores, n_threads_batch=cores,
                          verbose=False)
    eos = llm.token_eos()
    t0 = time.perf_counter()
    generated = 0
    for p in prompts:
        out = llm.create_completion(p, max_tokens=args.gen_tokens, temperature=0.0, logit_bias={eos: -1e9})
        generated += out["usage"]["completion_tokens"]
    base_wall = time.perf_counter() - t0
    base_tok_s = generated / base_wall
    report = {
        "machine": f"{cores} CPU cores",
        "model": args.model or f"random q8_0, {args.shape}: {SHAPES[args.shape]}", "requests": args.requests,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "service": {"workers": "2 CPU x 4 slots", "clients": args.concurrency, "tok_s": round(svc.tok_s, 1),
                    "tokens": svc.gen_tokens, "errors": svc.errors, "wall_s": round(svc.wall_s, 2),
                    "ttft_p50_ms": round(svc.ttft_p50_ms, 1), "itl_p50_ms": round(svc.itl_p50_ms, 2)},
        "llama_sequential": {"tok_s": round(base_tok_s, 1), "tokens": generated, "wall_s": round(base_wall, 2)},
        "ratio_service_over_sequential": round(svc.tok_s / base_tok_s, 2),
    }
    print(json.dumps(report, indent=2))
    return 1 if svc.errors else 0


if __name__ == "__main__":
    sys.exit(main())
