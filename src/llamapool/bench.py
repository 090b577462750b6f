"""``llamapool bench``: drive a running daemon with C concurrent streams; optionally measure the
engine ceiling (same model, same device, no service) in the same run and print service/ceiling."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class BenchResult:
    mode: str
    concurrency: int
    requests: int
    prompt_tokens: int
    gen_tokens: int
    wall_s: float
    tokens: int
    tok_s: float
    req_s: float
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def prompts_for(n: int, length: int, n_vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts (ids above the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, n_vocab) for _ in range(length)] for _ in range(n)]


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled and sys.stderr.isatty()

    def tick(self) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_service(endpoint: str, concurrency: int, requests: int, prompt_tokens: int,
                      gen_tokens: int, progress: bool = True, prompts: list[list[int]] | None = None
                      ) -> BenchResult:
    """C concurrent streaming clients, ``requests`` in all, fixed lengths (ignore_eos)."""
    from llamapool import AsyncClient

    client = AsyncClient(endpoint, timeout=3600)
    st = await client.status()
    n_vocab = min((w.get("n_vocab") or 256) for w in st["workers"]) if st["workers"] else 256
    work = prompts or prompts_for(requests, prompt_tokens, n_vocab)
    ttft: list[float] = []
    itl: list[float] = []
    total = 0
    bar = _Progress(len(work), progress)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in work:
        queue.put_nowait(p)

    async def one_client() -> None:
        nonlocal total
        while not queue.empty():
            prompt = queue.get_nowait()
            t0 = last = time.perf_counter()
            seen = 0
            async for chunk in client.stream(prompt, max_tokens=gen_tokens, temperature=0.0,
                                             ignore_eos=True):
                now = time.perf_counter()
                if seen == 0:
                    ttft.append(now - t0)
                elif chunk.tokens > seen:
                    itl.extend([(now - last) / (chunk.tokens - seen)] * (chunk.tokens - seen))
                seen, last = chunk.tokens, now
            total += seen
            bar.tick()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return BenchResult("service", concurrency, len(work), prompt_tokens, gen_tokens, wall, total,
                       total / wall, len(work) / wall, 1e3 * _pct(ttft, 0.5), 1e3 * _pct(ttft, 0.99),
                       1e3 * _pct(itl, 0.5), 1e3 * _pct(itl, 0.99))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("-n", "--requests", type=int, default=0, help="requests per run (default 4 x C)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--ceiling", metavar="MODEL", help="also measure the engine alone on this GGUF")
    p.add_argument("--gpu", action="store_true", help="ceiling on the GPU (all layers offloaded)")
    p.add_argument("--threads", type=int, default=0, help="ceiling CPU threads (0 = llama.cpp default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from llamapool.cli import _endpoint

    endpoint = _endpoint(args)
    rows: list[dict[str, Any]] = []
    for c in args.concurrency:
        n = args.requests or 4 * c
        res = asyncio.run(run_service(endpoint, c, n, args.prompt_tokens, args.gen_tokens,
                                      not args.no_progress))
        row = asdict(res)
        if args.ceiling:
            from llamapool.ceiling import measure

            ceil = measure(args.ceiling, c, args.prompt_tokens, args.gen_tokens, gpu=args.gpu,
                           threads=args.threads)
            row["ceiling_tok_s"] = ceil["decode_tok_s"]
            row["ceiling_e2e_tok_s"] = ceil["e2e_tok_s"]
            row["service_over_ceiling"] = res.tok_s / ceil["e2e_tok_s"]
        rows.append(row)
        if not args.json:
            line = (f"C={c:<4} {res.tok_s:9.1f} tok/s  {res.req_s:7.2f} req/s  "
                    f"TTFT p50 {res.ttft_p50_ms:7.1f} p99 {res.ttft_p99_ms:7.1f} ms  "
                    f"ITL p50 {res.itl_p50_ms:6.2f} p99 {res.itl_p99_ms:6.2f} ms")
            if args.ceiling:
                line += (f"  | ceiling {row['ceiling_e2e_tok_s']:9.1f} tok/s  "
                         f"service/ceiling {row['service_over_ceiling']:.3f}")
            print(line, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0
