"""The ``agent`` scenario (issue 51): sessions whose context grows turn after turn and comes back.

``sessions`` sessions of ``turns`` turns each. A session's first prompt is ``shared`` tokens (the same
for every session: a system prompt and tool definitions) and ``new`` tokens of its own; each later
turn's prompt is the previous turn's prompt, that turn's reply (``out`` tokens) and ``new`` tokens
more. Every turn asks for ``out`` tokens, greedy, EOS ignored. ``concurrency`` turns are in flight;
a session's next turn is sent only after its last one ended, and sessions are taken round-robin
(a queue of ready sessions: a client takes the first, and puts it back at the end when its turn is
done), so that with more sessions than slots a returning session finds its slot taken.

Prompts are token ids drawn from a seeded RNG in ``[3, n_vocab)``; the reply tokens appended to the
next prompt are placeholders drawn from the same RNG, not the reply's own ids, so every server sees
exactly the same prompts whatever it generates (``"reply_tokens": "placeholder"`` in the row).

With ``reload_after`` (``--reload-at``), once that many turns are done the daemon is asked for a rolling
reload (SIGHUP) while the run goes on, and the returning turns' TTFT is also given apart for the turns
sent in the ``RELOAD_WINDOW`` seconds before the signal and in those after it: what a reload costs
sessions whose KV the old workers held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from llamapool.bench.drivers import MAX_ERROR_SAMPLES, Tally, Target, _Progress, _Transport, make_transport, pct
from llamapool.bench.workloads import AgentWorkload, Request

RELOAD_WINDOW = 30.0  # --reload-at: seconds of returning turns compared before and after the signal
# llama-server reuses a slot's KV for a prompt that extends it only when asked (its default, said anyway)
HTTP_EXTRA = {"cache_prompt": True}


@dataclass
class AgentTally(Tally):
    """What the turns measured: :class:`Tally`'s ``ttft`` holds first turns', ``ttft_return`` the others'."""

    ttft_return: list[float] = field(default_factory=list)
    sent_return: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT) of returning turns
    reloaded_at: float | None = None  # perf_counter time the reload was asked for
    cached: int = 0  # prompt tokens the server said it served from its cache
    cached_return: int = 0  # of those, in returning turns
    reported: int = 0  # turns whose reply said how many were cached


@dataclass
class AgentRow:
    """One agent run: its parameters and what it measured (TTFT None where no turn of its kind got a token;
    cached counts None where the server reported none)."""

    transport: str
    address: str
    sessions: int
    turns_per_session: int
    shared_tokens: int
    new_tokens: int
    out_tokens: int
    concurrency: int
    seed: int
    n_vocab: int
    wall_s: float
    turns: int  # turns answered or failed
    turns_s: float
    errors: int
    ttft_first_p50_ms: float | None
    ttft_first_p90_ms: float | None
    ttft_return_p50_ms: float | None
    ttft_return_p90_ms: float | None
    prompt_tokens_sent: int
    prompt_tokens_cached: int | None
    prompt_tokens_cached_return: int | None
    kv_host: dict[str, float] | None  # the daemon's host-RAM KV tier over the run (None: no tier, or HTTP)
    reply_tokens: str = "placeholder"
    error_samples: list[str] = field(default_factory=list)
    mode: str = "agent"
    reload_after_turns: int | None = None  # --reload-at: the turns done when the reload was asked for
    ttft_return_before_reload_p50_ms: float | None = None
    ttft_return_before_reload_p90_ms: float | None = None
    ttft_return_after_reload_p50_ms: float | None = None
    ttft_return_after_reload_p90_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _turn(transport: _Transport, req: Request, first: bool, tally: AgentTally) -> None:
    """One turn: its TTFT (once a token came), what the server says it had cached, and whether it failed."""
    t0 = time.perf_counter()
    ttft: list[float] = []

    def on_tokens(total: int) -> None:
        if total > 0 and not ttft:
            ttft.append(time.perf_counter() - t0)

    try:
        reply = await transport.reply(req, on_tokens)
    except Exception as e:
        tally.error(f"{type(e).__name__}: {e}"[:300])
        reply = None
    (tally.ttft if first else tally.ttft_return).extend(ttft)
    if not first:
        tally.sent_return.extend((t0, x) for x in ttft)
    if reply is None:
        return
    tally.tokens += reply.tokens
    if reply.cached_tokens is not None:
        tally.reported += 1
        tally.cached += reply.cached_tokens
        tally.cached_return += 0 if first else reply.cached_tokens
    if reply.tokens != req.max_tokens:
        tally.error(f"{reply.tokens} tokens, asked for {req.max_tokens}")


async def drive_agent(target: Target, work: AgentWorkload, concurrency: int, progress: bool = False,
                      reload: Callable[[], None] | None = None, reload_after: int = 0) -> AgentTally:
    """Every turn of every session, ``concurrency`` at a time, sessions taken round-robin; ``reload`` is
    called once ``reload_after`` turns are done (when given)."""
    contexts = work.contexts()
    transport = make_transport(target, HTTP_EXTRA)
    tally = AgentTally()
    bar = _Progress(work.sessions * work.turns, progress)
    clients = max(1, concurrency)
    ready: asyncio.Queue[int | None] = asyncio.Queue()  # sessions whose next turn may go; None: stop
    for s in range(work.sessions):
        ready.put_nowait(s)
    next_turn = [0] * work.sessions
    open_sessions = [work.sessions]

    async def client() -> None:
        while (s := await ready.get()) is not None:
            k = next_turn[s]
            await _turn(transport, Request(tuple(contexts[s][:work.prompt_len(k)]), work.out), k == 0, tally)
            next_turn[s] += 1
            tally.done += 1
            bar.tick()
            if reload is not None and tally.reloaded_at is None and tally.done >= reload_after:
                tally.reloaded_at = time.perf_counter()
                reload()
            if next_turn[s] < work.turns:
                ready.put_nowait(s)  # at the back: the other ready sessions go first
                continue
            open_sessions[0] -= 1
            if not open_sessions[0]:
                for _ in range(clients):
                    ready.put_nowait(None)

    await transport.open()
    try:
        tally.start = time.time()
        await asyncio.gather(*(client() for _ in range(clients)))
        tally.end = time.time()
    finally:
        await transport.close()
    return tally


def _kv_hosts(status: dict[str, Any]) -> dict[tuple[Any, Any], dict[str, float]]:
    """Each worker's ``kv_host`` counters by (name, pid): a restarted worker's count from zero."""
    return {(w.get("id"), w.get("pid")): {k: v for k, v in w["kv_host"].items()
                                            if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for w in status.get("workers", []) if isinstance(w.get("kv_host"), dict)}


def kv_host_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | None:
    """The tier's counters over a run, from two ``status()`` answers, summed over the workers: each counter's
    increase (a worker that started during the run: from zero), except ``bytes`` (what the tier holds), the
    value after. None when no worker reports the tier."""
    a, b = _kv_hosts(after), _kv_hosts(before)
    if not a:
        return None
    total: dict[str, float] = {}
    for key, tier in a.items():
        was = b.get(key, {})
        for k, v in tier.items():
            total[k] = total.get(k, 0) + (v if k == "bytes" else v - was.get(k, 0))
    return {k: round(v, 6) for k, v in total.items()}


def _ms(xs: list[float], q: float) -> float | None:
    return round(1e3 * pct(xs, q), 1) if xs else None


def agent_row(target: Target, work: AgentWorkload, concurrency: int, tally: AgentTally,
              kv_host: dict[str, float] | None, reload_after: int | None = None) -> AgentRow:
    wall = max(1e-9, tally.end - tally.start)
    total = work.sessions * work.turns
    reported = tally.reported > 0
    row = AgentRow(
        transport=target.transport, address=target.address, sessions=work.sessions, turns_per_session=work.turns,
        shared_tokens=work.shared, new_tokens=work.new, out_tokens=work.out, concurrency=concurrency,
        seed=work.seed, n_vocab=work.n_vocab, wall_s=round(wall, 3), turns=tally.done,
        turns_s=round(tally.done / wall, 3), errors=tally.errors + total - tally.done,
        ttft_first_p50_ms=_ms(tally.ttft, 0.5), ttft_first_p90_ms=_ms(tally.ttft, 0.9),
        ttft_return_p50_ms=_ms(tally.ttft_return, 0.5), ttft_return_p90_ms=_ms(tally.ttft_return, 0.9),
        prompt_tokens_sent=work.prompt_tokens, prompt_tokens_cached=tally.cached if reported else None,
        prompt_tokens_cached_return=tally.cached_return if reported else None, kv_host=kv_host,
        error_samples=tally.error_samples[:MAX_ERROR_SAMPLES])
    if reload_after is not None:
        at = tally.reloaded_at if tally.reloaded_at is not None else float("inf")
        before = [x for t, x in tally.sent_return if at - RELOAD_WINDOW <= t < at]
        after = [x for t, x in tally.sent_return if at <= t < at + RELOAD_WINDOW]
        row.reload_after_turns = reload_after if tally.reloaded_at is not None else None
        row.ttft_return_before_reload_p50_ms, row.ttft_return_before_reload_p90_ms = _ms(before, 0.5), _ms(before, 0.9)
        row.ttft_return_after_reload_p50_ms, row.ttft_return_after_reload_p90_ms = _ms(after, 0.5), _ms(after, 0.9)
    return row


async def _status(target: Target) -> dict[str, Any]:
    from llamapool import AsyncClient

    async with AsyncClient(target.address, timeout=30, **target.keys) as client:
        return await client.status()


async def measure_agent(target: Target, work: AgentWorkload, concurrency: int, progress: bool = False,
                        reload: Callable[[], None] | None = None, reload_after: int = 0) -> AgentRow:
    """Run the scenario against ``target``; for the daemon (SDK), with its host-tier counters over the run;
    with ``reload``, a rolling reload asked for after ``reload_after`` turns."""
    sdk = target.transport == "sdk"
    before = await _status(target) if sdk else {}
    tally = await drive_agent(target, work, concurrency, progress, reload, reload_after)
    delta = None
    if sdk:
        await asyncio.sleep(1.2)  # a heartbeat carries the workers' counters
        delta = kv_host_delta(before, await _status(target))
    return agent_row(target, work, concurrency, tally, delta, reload_after if reload is not None else None)
