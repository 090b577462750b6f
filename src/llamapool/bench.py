"""``llamapool bench``: drive a running daemon with C concurrent streams; optionally measure the
engine ceiling (same model, same device, no service) in the same run and print service/ceiling."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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


async def _drive(endpoint: str, concurrency: int, prompts: list[list[int]], gen_tokens: int,
                 progress: bool) -> tuple[int, list[float], list[float], float, float]:
    """C streaming clients over ``prompts``: (tokens, TTFTs, inter-token gaps, start, end)."""
    from llamapool import AsyncClient

    client = AsyncClient(endpoint, timeout=3600)
    ttft: list[float] = []
    itl: list[float] = []
    total = 0
    bar = _Progress(len(prompts), progress)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
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

    start = time.time()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    end = time.time()
    await client.close()
    return total, ttft, itl, start, end


def _drive_in_process(job: tuple[str, int, list[list[int]], int, float]
                      ) -> tuple[int, list[float], list[float], float, float]:
    endpoint, c, prompts, gen_tokens, start_at = job
    time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(_drive(endpoint, c, prompts, gen_tokens, False))


async def _n_vocab(endpoint: str) -> int:
    from llamapool import AsyncClient

    async with AsyncClient(endpoint) as client:
        st = await client.status()
    return min((w.get("n_vocab") or 256) for w in st["workers"]) if st["workers"] else 256


async def run_service(endpoint: str, concurrency: int, requests: int, prompt_tokens: int,
                      gen_tokens: int, progress: bool = True, prompts: list[list[int]] | None = None,
                      procs: int = 1) -> BenchResult:
    """C concurrent streaming clients, ``requests`` in all, fixed lengths (ignore_eos).

    With ``procs`` > 1 the clients are spread over that many client processes, so that one Python
    client process is not what limits the figure (real clients are separate programs too).
    """
    work = prompts or prompts_for(requests, prompt_tokens, await _n_vocab(endpoint))
    procs = max(1, min(procs, concurrency))
    if procs == 1:
        total, ttft, itl, start, end = await _drive(endpoint, concurrency, work, gen_tokens, progress)
    else:
        import concurrent.futures
        import multiprocessing

        start_at = time.time() + 3.0  # every process starts sending at the same moment
        jobs = [(endpoint, concurrency // procs + (i < concurrency % procs), work[i::procs], gen_tokens,
                 start_at) for i in range(procs)]
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context(
                "spawn")) as pool:
            parts = await asyncio.get_running_loop().run_in_executor(
                None, lambda: list(pool.map(_drive_in_process, jobs)))
        total = sum(p[0] for p in parts)
        ttft = [x for p in parts for x in p[1]]
        itl = [x for p in parts for x in p[2]]
        start, end = min(p[3] for p in parts), max(p[4] for p in parts)
    wall = end - start
    return BenchResult("service", concurrency, len(work), prompt_tokens, gen_tokens, wall, total,
                       total / wall, len(work) / wall, 1e3 * _pct(ttft, 0.5), 1e3 * _pct(ttft, 0.99),
                       1e3 * _pct(itl, 0.5), 1e3 * _pct(itl, 0.99))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[8],
                   help="concurrent streaming clients; several values run one after another")
    p.add_argument("-n", "--requests", type=int, default=0, help="requests per run (default 4 x C)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="random prompt length in tokens")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per request (EOS ignored)")
    p.add_argument("--router-only", action="store_true",
                   help="no model: the daemon with an echo engine vs a bare pyzmq ROUTER-DEALER echo")
    p.add_argument("--ceiling", metavar="MODEL", help="also measure the engine alone on this GGUF")
    p.add_argument("--gpu", action="store_true", help="ceiling on the GPU (all layers offloaded)")
    p.add_argument("--threads", type=int, default=0, help="ceiling CPU threads (0 = llama.cpp default)")
    p.add_argument("--procs", type=int, default=1, help="client processes the streams are spread over")
    p.add_argument("--gpu-sampling", action="store_true", help="ceiling samples on the GPU")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    if args.router_only:
        from llamapool.bench_router import run as router_only

        row = router_only(requests=args.requests or 400, concurrency=max(args.concurrency),
                          gen_tokens=args.gen_tokens)
        print(json.dumps(row, indent=2) if args.json else
              f"router-only: daemon {row['daemon_tok_s']} tok/s vs bare pyzmq echo {row['bare_tok_s']} tok/s "
              f"= {row['daemon_over_bare']:.3f}")
        return 0
    from llamapool.cli import _endpoint

    endpoint = _endpoint(args)
    rows: list[dict[str, Any]] = []
    for c in args.concurrency:
        n = args.requests or 4 * c
        res = asyncio.run(run_service(endpoint, c, n, args.prompt_tokens, args.gen_tokens,
                                      not args.no_progress, procs=args.procs))
        row = asdict(res)
        if args.ceiling:
            from llamapool.ceiling import measure

            ceil = measure(args.ceiling, c, args.prompt_tokens, args.gen_tokens, gpu=args.gpu,
                           threads=args.threads, gpu_sampling=args.gpu_sampling)
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


