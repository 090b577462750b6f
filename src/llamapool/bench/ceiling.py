"""The engine ceiling: C sequences in one llama context through the low-level API, no service.

This is what a service is measured against: same model, same device, same lengths, greedy, the
prompts prefilled in ``n_batch``-token batches, then one ``llama_decode`` per step for all sequences
still generating.

KV cache: ``kv_unified=False`` (the default) gives every sequence its own KV stream of
``n_ctx / C`` cells, as llama-server does and as the llamapool engine does since issue 7; ``True``
is one cache shared by all sequences, where every token attends over the cells of all of them.
With per-sequence streams llama.cpp splits a batch into micro-batches of *consecutive* sequence ids
(``split_equal(n_ubatch, sequential=true)``), so batches here are always filled in sequence-id
order, and with per-request lengths (``requests``) the sequences that generate longest get the
lowest ids, so that those still decoding are always ids ``0..k-1``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from llamapool.bench.workloads import FIRST_ID, Request


def measure(model_path: str, concurrency: int, prompt_tokens: int = 128, gen_tokens: int = 128, *,
            gpu: bool = False, threads: int = 0, n_batch: int = 2048, n_ubatch: int = 512, seed: int = 0,
            gpu_sampling: bool = False, kv_unified: bool = False,
            requests: Sequence[Request] | None = None) -> dict[str, Any]:
    """Prefill C prompts, then decode each to its length; ``gpu_sampling`` samples in the graph.

    ``requests`` (the first C are used) gives the prompts and output lengths, e.g. a benchmark
    workload's; otherwise C random prompts of ``prompt_tokens`` and ``gen_tokens`` each.
    """
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
    try:
        prompts, gens = _prompts(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)), concurrency,
                                 prompt_tokens, gen_tokens, seed, requests)
        run = _Run(model, prompts, gens, threads, n_batch, n_ubatch, gpu_sampling, kv_unified)
        try:
            t0 = time.perf_counter()
            run.prefill()
            t1 = time.perf_counter()
            steps, decoded = run.decode()
            t2 = time.perf_counter()
        finally:
            run.free()
    finally:
        L.llama_model_free(model)
    c, generated, prompted = len(prompts), sum(gens), sum(len(p) for p in prompts)
    return {
        "mode": "ceiling", "gpu_sampling": gpu_sampling, "kv_unified": kv_unified, "concurrency": c,
        "prompt_tokens": prompted // c if c else 0, "gen_tokens": generated // c if c else 0,
        "prompt_tokens_total": prompted, "gen_tokens_total": generated, "n_batch": n_batch, "n_ubatch": n_ubatch,
        "prefill_tok_s": prompted / (t1 - t0),
        "decode_tok_s": decoded / max(t2 - t1, 1e-9),
        "e2e_tok_s": generated / (t2 - t0),
        "step_ms": 1e3 * (t2 - t1) / max(1, steps),
    }


def _prompts(n_vocab: int, concurrency: int, prompt_tokens: int, gen_tokens: int, seed: int,
             requests: Sequence[Request] | None) -> tuple[list[list[int]], list[int]]:
    """The prompts and output lengths: the workload's (longest output first, so that sequences that
    finish leave the highest ids and the rest stay consecutive), or random ones."""
    import random

    if requests:
        reqs = sorted(requests[:concurrency], key=lambda r: -r.max_tokens)
        return [list(r.prompt) for r in reqs], [r.max_tokens for r in reqs]
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_ID, n_vocab) for _ in range(prompt_tokens)] for _ in range(concurrency)]
    return prompts, [gen_tokens] * concurrency


class _Run:
    """One context with a sequence per prompt, its greedy samplers and its batch."""

    def __init__(self, model: Any, prompts: list[list[int]], gens: list[int], threads: int, n_batch: int,
                 n_ubatch: int, gpu_sampling: bool, kv_unified: bool):
        import ctypes

        import llama_cpp as L

        self.L, self.prompts, self.gens, self.n_batch, self.gpu_sampling = L, prompts, gens, n_batch, gpu_sampling
        c = self.c = len(prompts)
        cp = L.llama_context_default_params()
        cp.n_ctx = c * (max(len(p) + g for p, g in zip(prompts, gens, strict=True)) + 8)
        cp.n_batch = max(n_batch, c)
        cp.n_ubatch = min(n_ubatch, cp.n_batch)
        cp.n_seq_max = c
        cp.kv_unified = kv_unified
        cp.no_perf = True
        if threads > 0:
            cp.n_threads = cp.n_threads_batch = threads
        self.samplers = []
        for _ in range(c):
            ch = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            L.llama_sampler_chain_add(ch, L.llama_sampler_init_greedy())
            self.samplers.append(ch)
        if gpu_sampling:
            cfgs = [L.llama_sampler_seq_config(i, ctypes.cast(ch, ctypes.c_void_p))
                    for i, ch in enumerate(self.samplers)]
            self.seq_cfg = (L.llama_sampler_seq_config * c)(*cfgs)
            cp.samplers = ctypes.cast(self.seq_cfg, ctypes.POINTER(L.llama_sampler_seq_config))
            cp.n_samplers = c
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"cannot create a context of {cp.n_ctx} tokens for {c} sequences")
        self.batch = L.llama_batch_init(max(n_batch, c), 0, c)
        self.nxt = [0] * c

    def sample(self, s: int, i: int) -> int:
        if self.gpu_sampling:
            return int(self.L.llama_get_sampled_token_ith(self.ctx, i))
        return int(self.L.llama_sampler_sample(self.samplers[s], self.ctx, i))

    def put(self, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
        b.seq_id[i][0] = seq

    def prefill(self) -> None:
        """The prompts in sequence-id order, packed into batches of up to n_batch tokens."""
        flat = [(s, j, t) for s, p in enumerate(self.prompts) for j, t in enumerate(p)]
        for start in range(0, len(flat), self.n_batch):
            part = flat[start:start + self.n_batch]
            last_idx: dict[int, int] = {}
            for i, (s, j, t) in enumerate(part):
                is_last = j == len(self.prompts[s]) - 1
                self.put(i, t, j, s, is_last)
                if is_last:
                    last_idx[s] = i
            self.batch.n_tokens = len(part)
            if self.L.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed in prefill")
            for s, i in last_idx.items():
                self.nxt[s] = self.sample(s, i)

    def decode(self) -> tuple[int, int]:
        """Every sequence to its length, one token each per step; (steps, tokens decoded)."""
        made = [1] * self.c  # the prefill sampled each sequence's first token
        steps = decoded = 0
        while True:
            active = [s for s in range(self.c) if made[s] < self.gens[s]]  # sequence-id order
            if not active:
                return steps, decoded
            for i, s in enumerate(active):
                self.put(i, self.nxt[s], len(self.prompts[s]) + made[s] - 1, s, True)
            self.batch.n_tokens = len(active)
            if self.L.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed in decode")
            for i, s in enumerate(active):
                self.nxt[s] = self.sample(s, i)
                made[s] += 1
            steps += 1
            decoded += len(active)

    def free(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        for ch in self.samplers:
            self.L.llama_sampler_free(ch)
