"""The ``speculation`` scenario (issue 43's copy task): prompt lookup on replies that copy their prompt,
speculation on against off, on the same requests.

The model is a ``llamapool make-model --peaked`` one (its greedy output is a fixed cycle of tokens, whatever
the context; ``--peaked-seed``: the seed it was written with). Each prompt holds a passage of that cycle
for the reply to copy: random tokens, the cycle's tokens c0 c1, the passage c2 c3 ... (with a share of
its tokens replaced by random ones), random tokens, then c0 c1 again, so that the greedy reply is c2 c3
...; the cases (``--cases``): ``full-copy`` (the passage intact), ``edits-10`` and ``edits-30`` (10 % or
30 % replaced) and ``nothing`` (no passage: random tokens instead, so that lookup finds nothing).

Each case's requests run at C streams with speculation on (the server's default: ``"speculative"`` not
sent) and off (``"speculative": false``), ``rounds`` times, alternating which goes first. A row per run:
tok/s (completion tokens over the run's wall time) and, against a llamapool daemon, the draft tokens its
workers verified and accepted during the run (read from its status a heartbeat later); and a row per
case saying whether the greedy texts on and off were the same (they must be). Over HTTP the field is
``/v1/completions``' ``"speculative"`` (llama-server's ``/completion`` has no such field: both modes are
its default). Any model works; only a peaked one's replies copy the passage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from llamapool.bench.drivers import HTTP_PATHS, MAX_ERROR_SAMPLES, Target

CASES = {"full-copy": 0.0, "edits-10": 0.1, "edits-30": 0.3, "nothing": None}
HEARTBEAT_WAIT = 1.2  # seconds after a run before the daemon's status holds its workers' counters
NOISE = 60  # random tokens around the passage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", choices=list(CASES), metavar="CASE",
                   help=f"--scenario speculation: the prompts ({', '.join(CASES)}; default all)")
    p.add_argument("--rounds", type=int, default=2, help="--scenario speculation: runs of each case and mode")
    p.add_argument("--peaked-seed", type=int, default=0,
                   help="--scenario speculation: the seed the peaked model was written with (make-model --seed)")


def copy_prompts(n_vocab: int, n: int, gen: int, edit: float | None, seed: int, model_seed: int = 0
                 ) -> list[list[int]]:
    """``n`` prompts whose greedy reply on a peaked model copies a passage of its cycle (``edit``: the share
    of the passage's tokens replaced; None: no passage)."""
    import numpy as np

    from llamapool.modelgen import _peaked_cycle

    order = _peaked_cycle(n_vocab, model_seed)[0]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        at = int(rng.integers(len(order)))
        cyc = [int(order[(at + i) % len(order)]) for i in range(gen + 42)]
        if edit is None:
            passage = [int(t) for t in rng.choice(order, gen + 40)]
        else:
            passage = [t if rng.random() >= edit else int(rng.choice(order)) for t in cyc[2:]]
        noise = [int(t) for t in rng.choice(order, NOISE)]
        out.append(noise[:40] + cyc[:2] + passage + noise[40:] + cyc[:2])
    return out


@dataclass
class Run:
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    seconds: float = 0.0
    texts: dict[int, str] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


async def _post(session: Any, target: Target, prompt: list[int], gen: int, on: bool) -> tuple[str, int]:
    """One greedy request over HTTP: (its text, its completion tokens)."""
    url = target.address.rstrip("/")
    if target.transport == "http-openai":
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True}
        if not on:
            body["speculative"] = False
        async with session.post(url.removesuffix(HTTP_PATHS["http-openai"]) + "/v1/completions", json=body) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {str(data)[:200]}")
        return data["choices"][0]["text"], int(data["usage"]["completion_tokens"])
    body = {"prompt": prompt, "n_predict": gen, "temperature": 0, "ignore_eos": True}
    async with session.post(url.removesuffix(HTTP_PATHS["http-llama"]) + "/completion", json=body) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {str(data)[:200]}")
    return data["content"], int(data["tokens_predicted"])


async def run_case(target: Target, prompts: list[list[int]], gen: int, streams: int, on: bool) -> Run:
    """All ``prompts``, ``streams`` at a time, greedy, EOS ignored: tokens, seconds, each reply's text."""
    res = Run(requests=len(prompts))
    todo = list(enumerate(prompts))
    session: Any = None
    if target.transport == "sdk":
        from llamapool import AsyncClient

        session = AsyncClient(target.address, timeout=target.timeout, **target.keys)
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                        timeout=aiohttp.ClientTimeout(total=target.timeout))

    async def one(prompt: list[int]) -> tuple[str, int]:
        if target.transport != "sdk":
            return await _post(session, target, prompt, gen, on)
        extra = {} if on else {"speculative": False}
        c = await session.generate(prompt, max_tokens=gen, temperature=0.0, ignore_eos=True, **extra)
        return c.text, int(c.usage.completion_tokens)

    async def client() -> None:
        while todo:
            i, prompt = todo.pop(0)
            try:
                res.texts[i], n = await one(prompt)
            except Exception as e:
                res.errors += 1
                if len(res.error_samples) < MAX_ERROR_SAMPLES:
                    res.error_samples.append(f"{type(e).__name__}: {e}"[:300])
                continue
            res.tokens += n
            if n != gen:
                res.errors += 1
                res.error_samples.append(f"{n} tokens, asked for {gen}")

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        res.seconds = time.perf_counter() - t0
    finally:
        await session.close()
    return res


async def _counters(target: Target) -> dict[str, int] | None:
    """The daemon's workers' draft tokens verified and accepted so far (None over HTTP)."""
    if target.transport != "sdk":
        return None
    from llamapool import AsyncClient

    async with AsyncClient(target.address, **target.keys) as c:
        workers = (await c.status())["workers"]
    return {k: sum(int(w.get(k) or 0) for w in workers) for k in ("draft_tokens", "accepted_tokens")}


async def _measured(target: Target, prompts: list[list[int]], gen: int, streams: int, on: bool
                    ) -> tuple[Run, dict[str, int] | None]:
    """:func:`run_case` and the draft counters' change over it (a heartbeat after it)."""
    before = await _counters(target)
    got = await run_case(target, prompts, gen, streams, on)
    if before is not None:
        await asyncio.sleep(HEARTBEAT_WAIT)
    after = await _counters(target)
    return got, None if before is None or after is None else {k: after[k] - before[k] for k in after}


def _row(target: Target, case: str, on: bool, rnd: int, streams: int, gen: int, got: Run,
         drafts: dict[str, int] | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "mode": "speculation", "transport": target.transport, "address": target.address, "case": case,
        "speculation": "on" if on else "off", "round": rnd, "concurrency": streams, "requests": got.requests,
        "out_tokens": gen, "gen_tokens": got.tokens, "wall_s": round(got.seconds, 3),
        "tok_s": round(got.tokens / got.seconds, 1) if got.seconds else 0.0, "errors": got.errors,
        "draft_tokens": None, "accepted_tokens": None, "acceptance": None, "error_samples": got.error_samples}
    if drafts is not None:
        row.update(drafts)
        row["acceptance"] = round(drafts["accepted_tokens"] / drafts["draft_tokens"], 3) if drafts[
            "draft_tokens"] else None
    return row


def run(args: argparse.Namespace, target: Target, n_vocab: int) -> tuple[int, list[dict[str, Any]]]:
    """``--scenario speculation``: (exit status, rows)."""
    if args.rounds < 1:
        print(f"llamapool bench: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2, []
    gen = args.gen_tokens or 128
    rows: list[dict[str, Any]] = []
    for c in args.concurrency or [1]:
        n = args.requests or max(4, 2 * c)
        for case in args.cases or list(CASES):
            prompts = copy_prompts(n_vocab, n, gen, CASES[case], seed=args.seed + 7, model_seed=args.peaked_seed)
            texts: dict[bool, list[dict[int, str]]] = {True: [], False: []}
            for rnd in range(args.rounds):
                for on in ((True, False) if rnd % 2 == 0 else (False, True)):
                    got, drafts = asyncio.run(_measured(target, prompts, gen, c, on))
                    texts[on].append(got.texts)
                    rows.append(_row(target, case, on, rnd, c, gen, got, drafts))
                    if not args.no_progress:
                        print(f"speculation {case:<9} C={c:<3} {rows[-1]['speculation']:<3} round {rnd}: "
                              f"{rows[-1]['tok_s']:9.1f} tok/s  acceptance {rows[-1]['acceptance']}", file=sys.stderr)
            same = all(t == texts[False][0] for t in texts[True] + texts[False])
            rows.append({"mode": "speculation-text", "case": case, "concurrency": c, "requests": n,
                         "same_text_on_and_off": same})
    bad = any(r.get("errors") for r in rows) or not all(r.get("same_text_on_and_off", True) for r in rows)
    return (1 if bad else 0), rows + summary(rows)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and concurrency: the mean tok/s on and off over the rounds, and their ratio."""
    out = []
    keys = sorted({(r["case"], r["concurrency"]) for r in rows if r.get("mode") == "speculation"},
                  key=lambda k: (k[1], list(CASES).index(k[0])))
    for case, c in keys:
        mean = {}
        for mode in ("on", "off"):
            xs = [r["tok_s"] for r in rows if r.get("mode") == "speculation" and r["case"] == case
                  and r["concurrency"] == c and r["speculation"] == mode]
            mean[mode] = sum(xs) / len(xs) if xs else 0.0
        out.append({"mode": "speculation-summary", "case": case, "concurrency": c, "on_tok_s": round(mean["on"], 1),
                    "off_tok_s": round(mean["off"], 1),
                    "on_over_off": round(mean["on"] / mean["off"], 3) if mean["off"] else None})
    return out

