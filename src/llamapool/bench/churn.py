"""The ``pool-churn`` scenario (issues 42 and 52): one busy model beside on-demand models that come and go.

Two phases of ``seconds`` each, against one server:

1. ``alone``: C greedy streams to the busy model (``--busy``), nothing else;
2. ``churn``: the same C streams, and a light request (``light_prompt`` tokens in, ``light_out`` out) every
   ``every`` seconds to one of the on-demand models (``--light``), drawn with Zipf weights
   ``1 / rank ** zipf`` (the first named likeliest; ``zipf`` 0: each in turn, least-recently-used
   eviction's worst case). Where the light models do not all fit beside the busy one, the pool loads and
   evicts while the busy model decodes.

The row compares the busy model's tok/s and inter-token p99 in the two phases (``tok_s_vs_alone``,
``itl_p99_vs_alone``: what loading and evicting cost its decode), and gives the light requests' TTFT (a
request for a model not loaded waits for its load) and, against a llamapool daemon, the pool's loads and
evictions during the churn phase (None over HTTP). Before the phases, one request per stream warms the busy
model up (uncounted). Every request must be answered in full: a row with errors is not a figure.

The daemon's config is the caller's: e.g. the busy model with ``replicas = [1, 1]`` and seven
``load = "on_demand"`` models of which four fit beside it (docs/benchmarks.md has the H200 one).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from llamapool.bench.drivers import MAX_ERROR_SAMPLES, Tally, Target, _one, make_transport, pct
from llamapool.bench.workloads import Request

LIGHT_PROMPT = 16  # a light request's prompt tokens
LIGHT_OUT = 8  # and the tokens it asks for
BUSY_PROMPT = 128
BUSY_OUT = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--busy", metavar="MODEL", help="--scenario pool-churn: the busy model (its C streams)")
    p.add_argument("--light", nargs="+", metavar="MODEL", help="--scenario pool-churn: the on-demand models of "
                   "the light traffic, likeliest first")
    p.add_argument("--seconds", type=float, default=30.0, help="--scenario pool-churn: each phase's length")
    p.add_argument("--light-every", type=float, default=0.4, metavar="S",
                   help="--scenario pool-churn: seconds between two light requests")
    p.add_argument("--zipf", type=float, default=1.0, metavar="S",
                   help="--scenario pool-churn: light models drawn with weights 1/rank**S (0: in turn)")


@dataclass
class ChurnRow:
    transport: str
    address: str
    busy: str
    light: list[str]
    concurrency: int
    seconds: float
    light_every_s: float
    zipf: float
    seed: int
    prompt_tokens: int
    out_tokens: int
    alone_tok_s: float
    alone_itl_p50_ms: float
    alone_itl_p99_ms: float
    churn_tok_s: float
    churn_itl_p50_ms: float
    churn_itl_p99_ms: float
    tok_s_vs_alone: float
    itl_p99_vs_alone: float
    light_requests: int
    light_ttft_p50_ms: float
    light_ttft_p90_ms: float
    light_ttft_max_ms: float
    loads: int | None  # the pool's model loads during the churn phase (None: not a llamapool daemon)
    evictions: int | None
    errors: int
    error_samples: list[str] = field(default_factory=list)
    mode: str = "pool-churn"

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


async def _busy(target: Target, model: str, streams: int, seconds: float, prompt: int, out: int, n_vocab: int,
                rng: random.Random) -> Tally:
    """``streams`` closed-loop clients to ``model`` for ``seconds``, at least one request each (the last
    requests end after)."""
    transport = make_transport(target)
    tally = Tally()
    await transport.open()
    try:
        end = time.perf_counter() + seconds

        async def client() -> None:
            while True:
                req = Request(tuple(rng.randrange(3, n_vocab) for _ in range(prompt)), out, model=model)
                await _one(transport, req, tally)
                tally.done += 1
                if time.perf_counter() >= end:
                    return

        tally.start = time.time()
        await asyncio.gather(*(client() for _ in range(streams)))
        tally.end = time.time()
    finally:
        await transport.close()
    return tally


async def _light(target: Target, models: list[str], every: float, seconds: float, zipf: float, n_vocab: int,
                 rng: random.Random) -> Tally:
    """A light request every ``every`` seconds for ``seconds``, each to a model drawn by Zipf weights."""
    transport = make_transport(target)
    tally = Tally()
    weights = [1 / (r + 1) ** zipf for r in range(len(models))]
    await transport.open()
    try:
        async def one(req: Request) -> None:
            await _one(transport, req, tally)
            tally.done += 1

        tasks, k, t0 = [], 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            model = models[k % len(models)] if not zipf else rng.choices(models, weights)[0]
            req = Request(tuple(rng.randrange(3, n_vocab) for _ in range(LIGHT_PROMPT)), LIGHT_OUT, model=model)
            tasks.append(asyncio.create_task(one(req)))
            k += 1
            await asyncio.sleep(max(0.0, t0 + k * every - time.perf_counter()))
        await asyncio.gather(*tasks)
    finally:
        await transport.close()
    return tally


async def _pool_counts(target: Target) -> tuple[int, int] | None:
    """The daemon's loads and evictions so far, summed over its models (None over HTTP)."""
    if target.transport != "sdk":
        return None
    from llamapool import AsyncClient

    async with AsyncClient(target.address, **target.keys) as c:
        st = await c.status()
    models = st.get("models") or []
    return sum(int(m.get("loads", 0)) for m in models), sum(int(m.get("evictions", 0)) for m in models)


async def measure_churn(target: Target, busy: str, light: list[str], streams: int, seconds: float, every: float,
                        zipf: float, n_vocab: int, prompt: int = BUSY_PROMPT, out: int = BUSY_OUT,
                        seed: int = 0) -> ChurnRow:
    rng = random.Random(seed)
    warm = await _busy(target, busy, streams, 0.0, prompt, min(out, 8), n_vocab, rng)  # one request a stream
    alone = await _busy(target, busy, streams, seconds, prompt, out, n_vocab, rng)
    before = await _pool_counts(target)
    churn, lit = await asyncio.gather(_busy(target, busy, streams, seconds, prompt, out, n_vocab, rng),
                                      _light(target, light, every, seconds, zipf, n_vocab, random.Random(seed + 1)))
    after = await _pool_counts(target)

    def rate(t: Tally) -> float:
        return t.tokens / max(1e-9, t.end - t.start)

    def ms(t: Tally, q: float, xs: str = "itl") -> float:
        return 1e3 * pct(getattr(t, xs), q)

    a, c = rate(alone), rate(churn)
    parts = (warm, alone, churn, lit)
    return ChurnRow(
        transport=target.transport, address=target.address, busy=busy, light=light, concurrency=streams,
        seconds=seconds, light_every_s=every, zipf=zipf, seed=seed, prompt_tokens=prompt, out_tokens=out,
        alone_tok_s=a, alone_itl_p50_ms=ms(alone, 0.5), alone_itl_p99_ms=ms(alone, 0.99),
        churn_tok_s=c, churn_itl_p50_ms=ms(churn, 0.5), churn_itl_p99_ms=ms(churn, 0.99),
        tok_s_vs_alone=c / a if a else 0.0,
        itl_p99_vs_alone=ms(churn, 0.99) / ms(alone, 0.99) if ms(alone, 0.99) else 0.0,
        light_requests=lit.done, light_ttft_p50_ms=ms(lit, 0.5, "ttft"), light_ttft_p90_ms=ms(lit, 0.9, "ttft"),
        light_ttft_max_ms=1e3 * max(lit.ttft, default=0.0),
        loads=after[0] - before[0] if after and before else None,
        evictions=after[1] - before[1] if after and before else None,
        errors=sum(t.errors for t in parts),
        error_samples=[s for t in parts for s in t.error_samples][:MAX_ERROR_SAMPLES])


def run(args: argparse.Namespace, target: Target, n_vocab: int) -> tuple[int, list[dict[str, Any]]]:
    """``--scenario pool-churn``: one row per concurrency; (exit status, rows)."""
    if not args.busy or not args.light:
        print("llamapool bench: --scenario pool-churn needs --busy MODEL and --light MODEL [MODEL ...]",
              file=sys.stderr)
        return 2, []
    for name, v, ok, want in (("--seconds", args.seconds, args.seconds > 0, "> 0"),
                              ("--light-every", args.light_every, args.light_every > 0, "> 0"),
                              ("--zipf", args.zipf, args.zipf >= 0, ">= 0")):
        if not ok:
            print(f"llamapool bench: {name} must be {want}, got {v:g}", file=sys.stderr)
            return 2, []
    rows = []
    for c in args.concurrency or [8]:
        row = asyncio.run(measure_churn(target, args.busy, args.light, c, args.seconds, args.light_every,
                                        args.zipf, n_vocab, args.prompt_tokens or BUSY_PROMPT,
                                        args.gen_tokens or BUSY_OUT, args.seed)).as_dict()
        rows.append(row)
    return (1 if any(r["errors"] for r in rows) else 0), rows
