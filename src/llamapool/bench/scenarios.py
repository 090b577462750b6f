"""Benchmark scenarios against a running daemon: a long prompt among streams, prefix reuse."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from llamapool.bench.drivers import pct as _pct


async def _stream(client: Any, prompt: list[int], gen: int, gaps: list[float] | None,
                  first: asyncio.Event | None = None) -> float:
    """Stream one request; append its inter-token gaps to ``gaps``; return its TTFT."""
    t0 = last = time.perf_counter()
    seen = 0
    ttft = 0.0
    async for chunk in client.stream(prompt, max_tokens=gen, temperature=0.0, ignore_eos=True):
        now = time.perf_counter()
        if seen == 0:
            ttft = now - t0
            if first is not None:
                first.set()
        elif gaps is not None and chunk.tokens > seen:
            gaps.extend([(now - last) / (chunk.tokens - seen)] * (chunk.tokens - seen))
        seen, last = chunk.tokens, now
    return ttft


async def long_prompt(endpoint: str, others: int = 63, long_tokens: int = 8000, gen_tokens: int = 256,
                      n_vocab: int = 32000) -> dict[str, Any]:
    """p99 inter-token latency of ``others`` streams, without and then with one long prompt."""
    from llamapool import AsyncClient

    rng = random.Random(3)
    prompts = [[rng.randrange(3, n_vocab) for _ in range(128)] for _ in range(others)]
    long_prompt_ids = [rng.randrange(3, n_vocab) for _ in range(long_tokens)]
    out: dict[str, Any] = {"mode": "long-prompt", "others": others, "long_tokens": long_tokens}
    async with AsyncClient(endpoint, timeout=600) as client:
        for label in ("without", "with"):
            gaps: list[float] = []
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(client, p, gen_tokens, gaps, started)) for p in prompts]
            long_ttft = None
            if label == "with":
                await started.wait()
                await asyncio.sleep(0.3)  # the others are streaming in steady state
                long_ttft = await _stream(client, long_prompt_ids, 8, None)
            await asyncio.gather(*tasks)
            out[f"itl_p50_ms_{label}"] = round(1e3 * _pct(gaps, 0.5), 2)
            out[f"itl_p99_ms_{label}"] = round(1e3 * _pct(gaps, 0.99), 2)
            out[f"itl_max_ms_{label}"] = round(1e3 * max(gaps), 2)
            if long_ttft is not None:
                out["long_prompt_ttft_ms"] = round(1e3 * long_ttft, 1)
    out["p99_ratio"] = round(out["itl_p99_ms_with"] / out["itl_p99_ms_without"], 3)
    return out


async def shared_prefix(endpoint: str, requests: int = 64, concurrency: int = 16, prefix_tokens: int = 1000,
                        suffix_tokens: int = 24, gen_tokens: int = 32, n_vocab: int = 32000) -> dict[str, Any]:
    """``requests`` prompts sharing one ``prefix_tokens`` system prompt, ``concurrency`` at a time."""
    from llamapool import AsyncClient

    rng = random.Random(4)
    system = [rng.randrange(3, n_vocab) for _ in range(prefix_tokens)]
    prompts = [system + [rng.randrange(3, n_vocab) for _ in range(suffix_tokens)] for _ in range(requests)]
    ttfts: list[float] = []
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    async with AsyncClient(endpoint, timeout=600) as client:
        before = sum(w.get("reused_tokens", 0) for w in (await client.status())["workers"])

        async def worker() -> None:
            while not queue.empty():
                ttfts.append(await _stream(client, queue.get_nowait(), gen_tokens, None))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(1.2)  # a heartbeat carries the engines' counters
        after = sum(w.get("reused_tokens", 0) for w in (await client.status())["workers"])
    return {"mode": "shared-prefix", "requests": requests, "concurrency": concurrency,
            "prefix_tokens": prefix_tokens, "wall_s": round(wall, 3),
            "req_s": round(requests / wall, 2), "tok_s": round(requests * gen_tokens / wall, 1),
            "ttft_p50_ms": round(1e3 * _pct(ttfts, 0.5), 1), "ttft_p99_ms": round(1e3 * _pct(ttfts, 0.99), 1),
            "reused_prompt_tokens": after - before}


def run(scenario: str, endpoint: str, **kw: Any) -> dict[str, Any]:
    fn = {"long-prompt": long_prompt, "shared-prefix": shared_prefix}[scenario]
    return asyncio.run(fn(endpoint, **kw))  # type: ignore[operator]
