"""The engine ceiling: C sequences in one llama context through the low-level API, no service.

This is what the service is measured against: same model, same device, same lengths, greedy,
one ``llama_decode`` per step for all sequences, sampling with ``llama_sampler_sample``.
"""

from __future__ import annotations

import random
import time
from typing import Any


def measure(model_path: str, concurrency: int, prompt_tokens: int, gen_tokens: int, *,
            gpu: bool = False, threads: int = 0, n_batch: int = 2048, seed: int = 0,
            gpu_sampling: bool = False) -> dict[str, Any]:
    """Prefill C random prompts, then decode G tokens each; ``gpu_sampling`` samples in the graph."""
    import ctypes

    import llama_cpp as L

    from llamapool.worker.engine import quiet_llama_logs

    quiet_llama_logs()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = -1 if gpu else 0
    mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
    model = L.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise RuntimeError(f"cannot load {model_path}")
    c = concurrency
    cp = L.llama_context_default_params()
    cp.n_ctx = c * (prompt_tokens + gen_tokens + 8)
    cp.n_batch = n_batch
    cp.n_ubatch = min(512, n_batch)
    cp.n_seq_max = c
    cp.kv_unified = True
    cp.no_perf = True
    if threads > 0:
        cp.n_threads = cp.n_threads_batch = threads
    samplers = []
    for _ in range(c):
        ch = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(ch, L.llama_sampler_init_greedy())
        samplers.append(ch)
    if gpu_sampling:
        seq_cfg = (L.llama_sampler_seq_config * c)(*[L.llama_sampler_seq_config(i, ctypes.cast(ch, ctypes.c_void_p))
                                                     for i, ch in enumerate(samplers)])
        cp.samplers = ctypes.cast(seq_cfg, ctypes.POINTER(L.llama_sampler_seq_config))
        cp.n_samplers = c
    ctx = L.llama_init_from_model(model, cp)

    def sample(s: int, i: int) -> int:
        if gpu_sampling:
            return int(L.llama_get_sampled_token_ith(ctx, i))
        return int(L.llama_sampler_sample(samplers[s], ctx, i))

    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, n_vocab) for _ in range(prompt_tokens)] for _ in range(c)]
    batch = L.llama_batch_init(max(n_batch, c), 0, c)

    def put(i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    t0 = time.perf_counter()
    # prefill: pack prompts into batches of up to n_batch tokens
    flat = [(s, j, t) for s, p in enumerate(prompts) for j, t in enumerate(p)]
    last_idx: dict[int, int] = {}
    nxt = [0] * c
    for start in range(0, len(flat), n_batch):
        part = flat[start:start + n_batch]
        for i, (s, j, t) in enumerate(part):
            is_last = j == prompt_tokens - 1
            put(i, t, j, s, is_last)
            if is_last:
                last_idx[s] = i
        batch.n_tokens = len(part)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed in prefill")
        for s, i in list(last_idx.items()):
            nxt[s] = sample(s, i)
        last_idx.clear()
    t1 = time.perf_counter()
    for step in range(gen_tokens - 1):
        for s in range(c):
            put(s, nxt[s], prompt_tokens + step, s, True)
        batch.n_tokens = c
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed in decode")
        for s in range(c):
            nxt[s] = sample(s, s)
    t2 = time.perf_counter()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    for ch in samplers:
        L.llama_sampler_free(ch)
    L.llama_model_free(model)
    generated = c * gen_tokens
    return {
        "mode": "ceiling", "gpu_sampling": gpu_sampling, "concurrency": c,
        "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
        "prefill_tok_s": c * prompt_tokens / (t1 - t0),
        "decode_tok_s": c * (gen_tokens - 1) / max(t2 - t1, 1e-9),
        "e2e_tok_s": generated / (t2 - t0),
        "step_ms": 1e3 * (t2 - t1) / max(1, gen_tokens - 1),
    }
