#!/usr/bin/env python3
"""What sharing a prompt prefix between per-sequence KV streams costs, against recomputing it.

``llama_memory_seq_cp`` between two streams copies the donor's whole stream buffer on the device
(applied at the next decode); the copy is then trimmed to the shared prefix. This times, on one
context shaped like a worker's (``slots`` streams of ``ctx`` tokens), one decode of the next prompt
token after (a) nothing, (b) a cross-stream copy of a ``prefix``-token prompt, (c) recomputing the
prefix instead. Prints one JSON line.

    python3 scripts/kv_copy_cost.py MODEL.gguf [--gpu] [--slots 64] [--ctx 1100] [--prefix 1000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llama_cpp as L


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1100)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = -1 if args.gpu else 0
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = args.slots * args.ctx, args.slots, False
    cp.n_batch = cp.n_ubatch = 2048
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = random.Random(0)
    prompt = [rng.randrange(3, n_vocab) for _ in range(args.prefix + 1)]
    batch = L.llama_batch_init(2048, 0, 1)

    def decode(seq: int, tokens: list[int], start: int) -> None:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = seq, i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        assert L.llama_decode(ctx, batch) == 0
        L.llama_synchronize(ctx)

    decode(0, prompt[: args.prefix], 0)  # the donor holds the prefix
    n = args.prefix
    timings: dict[str, list[float]] = {"next_token_only": [], "copy_then_next_token": [],
                                       "recompute_then_next_token": []}
    for _ in range(args.repeat):
        for mode, runs in timings.items():
            L.llama_memory_seq_rm(mem, 1, -1, -1)
            t0 = time.perf_counter()
            if mode == "next_token_only":
                decode(1, [prompt[n]], 0)
            elif mode == "copy_then_next_token":
                L.llama_memory_seq_cp(mem, 0, 1, -1, -1)
                L.llama_memory_seq_rm(mem, 1, n, -1)
                decode(1, [prompt[n]], n)
            else:
                decode(1, prompt[: n + 1], 0)
            runs.append(time.perf_counter() - t0)
    row = {k: round(1e3 * statistics.median(v), 3) for k, v in timings.items()}
    kv_bytes = L.llama_state_seq_get_size(ctx, 0)
    print(json.dumps({"mode": "kv-copy-cost", "gpu": args.gpu, "slots": args.slots, "ctx_per_slot": args.ctx,
                      "prefix_tokens": n, "donor_state_bytes": kv_bytes, "median_ms": row,
                      "copy_ms": round(row["copy_then_next_token"] - row["next_token_only"], 3),
                      "recompute_ms": round(row["recompute_then_next_token"] - row["next_token_only"], 3)}))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
