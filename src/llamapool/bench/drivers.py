"""One client-side measurement core, two transports: the llamapool SDK and HTTP.

``C`` streaming clients, spread over ``procs`` client processes that all start at the same moment,
send a workload's requests (each client takes the next request when its last one ends) and time
every reply event on arrival:

- TTFT: from sending a request to the first event that carries a token;
- ITL: the gap between two events that carry tokens, per token: an event that brings ``k`` tokens
  contributes ``k`` gaps of ``gap / k``;
- tok/s: tokens received divided by the wall time from the first send to the last reply;
- decode tok/s: ``C / ITL p50``, the steady rate at which the C streams receive tokens;
- end-to-end: from sending a request to its last event.

Closed loop (``drive``): each of the C clients sends its next request when its last one ends. Open
loop (``drive_open``): requests are sent at Poisson arrivals of a given rate, whatever is in flight,
as independent users would; the achieved rate is requests / wall time.

Every reply is counted. A request that fails, or ends with a token count other than the one it asked
for (generation ignores EOS), is an error; a row with errors is not a figure.

Transports (the same requests and measurement for each; greedy, ``temperature: 0``, unless the workload
gives a temperature); each one's :meth:`~_Transport.reply` also says how many prompt tokens the server
reports it took from its cache (the SDK's ``usage.cached_tokens``; over HTTP, OpenAI's
``usage.prompt_tokens_details.cached_tokens`` or llama-server's ``timings.cache_n``), where it does:

- ``sdk``: a llamapool daemon through :class:`llamapool.AsyncClient` (``stream``, ``ignore_eos``);
  a chunk carries the request's running token count, and the final result's ``completion_tokens`` is
  the request's count.
- ``http-openai``: ``POST /v1/completions`` with ``"prompt": [token ids]``, ``max_tokens``,
  ``temperature: 0``, ``stream: true``, ``ignore_eos: true`` (llama.cpp's extension) and
  ``stream_options: {include_usage: true}``; server-sent events. A chunk counts as one token (the API
  does not say more), and the final ``usage.completion_tokens`` is the request's count when present
  (llama-server holds back a token that ends inside a UTF-8 character and sends it with the next one).
- ``http-llama``: llama-server's ``POST /completion`` with ``"prompt": [token ids]``, ``n_predict``,
  ``stream: true``, ``ignore_eos: true``, ``temperature: 0``; each event carries the running count
  ``tokens_predicted``, and the last one ``"stop": true``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing
import queue as queue_mod
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llamapool.bench.workloads import Request, Workload

TRANSPORTS = ("sdk", "http-openai", "http-llama")
HTTP_PATHS = {"http-openai": "/v1/completions", "http-llama": "/completion"}
MAX_ERROR_SAMPLES = 5

MEDIA_MARKER = "<__media__>"  # where llama-server puts the image (its LLAMA_MEDIA_MARKER: bench/peer.py sets it)


class ReplyError(Exception):
    """A reply that is not a complete answer: an error event, a bad status, a cut stream."""


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (the sample at rank ``q * n``), 0 when empty."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass(frozen=True)
class Target:
    """Where to send: ``transport`` one of :data:`TRANSPORTS`; ``address`` a ZeroMQ endpoint or a base URL."""

    transport: str
    address: str
    timeout: float = 600.0  # seconds one request may take (SDK) or go without a byte (HTTP)
    server_public_key: str = ""  # SDK over CURVE: the router's .pub file
    client_key: str = ""  # and the client's .key file

    @property
    def keys(self) -> dict[str, str]:
        if not self.client_key:
            return {}
        return {"server_public_key": self.server_public_key, "client_key": self.client_key}

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; one of {', '.join(TRANSPORTS)}")


@dataclass
class BenchRow:
    """One measured run; the same fields whichever transport."""

    workload: str
    transport: str
    concurrency: int
    procs: int
    requests: int
    errors: int
    prompt_tokens: int  # sum over the requests
    prompt_tokens_p50: float
    gen_tokens: int  # tokens received
    expected_gen_tokens: int  # tokens asked for
    wall_s: float
    tok_s: float
    req_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    decode_tok_s: float  # C / ITL p50
    e2e_p50_ms: float = 0.0
    e2e_p99_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    rate: float = 0.0  # open loop: the offered Poisson rate, requests/s (0: closed loop at C streams)
    seed: int = 0
    ctx: int = 0
    address: str = ""
    error_samples: list[str] = field(default_factory=list)
    mode: str = "service"
    prompt_tokens_cached: int | None = None  # what the replies said came from the server's cache (None: none said)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 3)
        return d

    def line(self) -> str:
        load = f"rate={self.rate:<6g}" if self.rate else f"C={self.concurrency:<4}"
        s = (f"{self.workload:<6} {self.transport:<11} {load} {self.tok_s:9.1f} tok/s "
             f"{self.req_s:7.2f} req/s  TTFT p50 {self.ttft_p50_ms:7.1f} p99 {self.ttft_p99_ms:7.1f} ms  "
             f"ITL p50 {self.itl_p50_ms:6.2f} p99 {self.itl_p99_ms:6.2f} ms  decode {self.decode_tok_s:8.1f} tok/s")
        if self.errors:
            s += f"  ERRORS {self.errors}/{self.requests}: {'; '.join(self.error_samples[:2])}"
        return s


# ---------------------------------------------------------------- transports

OnTokens = Callable[[int], None]


@dataclass(frozen=True)
class Reply:
    """What a finished request's reply says: its generated tokens, and the prompt tokens the server says
    it served from its cache (None: the server does not say)."""

    tokens: int
    cached_tokens: int | None = None


class _Transport:
    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def reply(self, req: Request, on_tokens: OnTokens) -> Reply:
        """Send ``req``; call ``on_tokens(running count)`` as tokens arrive; return what its reply says."""
        raise NotImplementedError

    async def run(self, req: Request, on_tokens: OnTokens) -> int:
        """:meth:`reply`'s token count."""
        return (await self.reply(req, on_tokens)).tokens


class SdkTransport(_Transport):
    def __init__(self, endpoint: str, timeout: float, keys: dict[str, str] | None = None):
        self.endpoint, self.timeout, self.keys = endpoint, timeout, keys or {}
        self.client: Any = None

    async def open(self) -> None:
        from llamapool import AsyncClient

        self.client = AsyncClient(self.endpoint, timeout=self.timeout, **self.keys)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def reply(self, req: Request, on_tokens: OnTokens) -> Reply:
        # the final result's completion_tokens also counts tokens whose text came in no chunk
        extra: dict[str, Any] = {} if req.json_schema is None else {"json_schema": req.json_schema}
        if req.top_logprobs >= 0:
            extra.update(logprobs=True, top_logprobs=req.top_logprobs)
        if req.n > 1:
            extra["n"] = req.n
        prompt: Any = req.messages() if req.image else list(req.prompt)
        stream = self.client.stream(prompt, max_tokens=req.max_tokens, temperature=req.temperature,
                                    ignore_eos=True, model=req.model or None, **extra)
        counts = [0] * req.n  # tokens so far of each choice
        async with stream:
            async for chunk in stream:
                counts[chunk.index] = chunk.tokens
                on_tokens(sum(counts))
        assert stream.completion is not None  # a failed request raised instead
        return Reply(sum(int(c.usage.completion_tokens) for c in stream.completions),
                     int(stream.completion.usage.cached_tokens))  # the first choice's


async def _sse(content: Any) -> AsyncIterator[str]:
    """The data of each server-sent event in an aiohttp response body.

    Read in chunks, not lines: llama-server's last ``/completion`` event carries the whole prompt as
    text, longer than aiohttp's line limit for long prompts.
    """
    buf = b""
    data: list[str] = []
    async for chunk in content.iter_any():
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
                continue
            if line.startswith(":"):  # a comment (llama-server's keep-alive ping)
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if buf.strip() and buf.startswith(b"data:"):
        data.append(buf[5:].decode("utf-8", "replace").strip())
    if data:
        yield "\n".join(data)


def _event(data: str) -> dict[str, Any]:
    try:
        ev = json.loads(data)
    except ValueError:
        raise ReplyError(f"not JSON: {data[:120]!r}") from None
    if not isinstance(ev, dict):
        raise ReplyError(f"not an object: {data[:120]!r}")
    if ev.get("error"):
        raise ReplyError(f"error event: {json.dumps(ev['error'])[:200]}")
    return ev


class HttpTransport(_Transport):
    """``extra_body``: fields every request body also carries (e.g. llama-server's ``cache_prompt``)."""

    def __init__(self, url: str, transport: str, timeout: float, extra_body: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        if not any(self.url.endswith(p) for p in HTTP_PATHS.values()):
            self.url += HTTP_PATHS[transport]
        self.openai = transport == "http-openai"
        self.timeout = timeout
        self.extra_body = extra_body or {}
        self.session: Any = None

    async def open(self) -> None:
        import aiohttp

        # llama-server closes kept-alive connections; aiohttp would report the next request on one
        # as ServerDisconnectedError, so every request gets its own connection.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.timeout))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, req: Request) -> dict[str, Any]:
        extra: dict[str, Any] = dict(self.extra_body)
        if req.model:
            extra["model"] = req.model
        if req.image:
            return self._image_body(req, extra)
        if req.json_schema is not None:
            extra["json_schema"] = req.json_schema  # both's field
        if self.openai:
            if req.top_logprobs >= 0:
                extra["logprobs"] = req.top_logprobs
            return {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": req.temperature,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
        if req.top_logprobs >= 0:  # llama-server's: the probabilities of the n likeliest tokens
            extra["n_probs"] = max(1, req.top_logprobs)
        return {"prompt": list(req.prompt), "n_predict": req.max_tokens, "temperature": req.temperature, "stream": True,
                "ignore_eos": True, **extra}

    def _image_body(self, req: Request, extra: dict[str, Any]) -> dict[str, Any]:
        """An image request: OpenAI's chat with an ``image_url`` data: URL (the URL's /v1/chat/completions), or
        llama-server's /completion with ``multimodal_data`` (its marker where the image goes)."""
        b64 = base64.b64encode(req.image).decode()
        if self.openai:
            return {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                {"type": "text", "text": req.text}]}], "max_tokens": req.max_tokens, "temperature": req.temperature,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
        return {"prompt": {"prompt_string": f"{MEDIA_MARKER}{req.text}", "multimodal_data": [b64]},
                "n_predict": req.max_tokens, "temperature": req.temperature, "stream": True, "ignore_eos": True,
                **extra}

    async def reply(self, req: Request, on_tokens: OnTokens) -> Reply:
        """A request of ``n`` choices is ``n`` requests at once (an HTTP server's one choice each)."""
        if req.n == 1:
            return await self._run_one(req, on_tokens)
        counts = [0] * req.n

        def one(i: int) -> OnTokens:
            def seen(total: int) -> None:
                counts[i] = total
                on_tokens(sum(counts))
            return seen

        done = await asyncio.gather(*(self._run_one(req, one(i)) for i in range(req.n)))
        return Reply(sum(r.tokens for r in done), done[0].cached_tokens)

    async def _run_one(self, req: Request, on_tokens: OnTokens) -> Reply:
        url = self.url[: -len("/completions")] + "/chat/completions" if req.image and self.openai else self.url
        async with self.session.post(url, json=self.body(req)) as resp:
            if resp.status != 200:
                raise ReplyError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            return await (self._openai(resp, on_tokens) if self.openai else self._llama(resp, on_tokens))

    @staticmethod
    async def _openai(resp: Any, on_tokens: OnTokens) -> Reply:
        counted, usage, finished, cached = 0, None, False, None
        async for data in _sse(resp.content):
            if data.strip() == "[DONE]":
                break
            ev = _event(data)
            for choice in ev.get("choices") or []:
                reason = choice.get("finish_reason")
                if reason is None or choice.get("text"):
                    counted += 1
                    on_tokens(counted)
                finished = finished or reason is not None
            if isinstance(ev.get("usage"), dict):
                usage = ev["usage"].get("completion_tokens")
            cached = _cached(ev) if cached is None else cached
        if not finished:
            raise ReplyError(f"stream ended after {counted} tokens without a finish_reason")
        return Reply(int(usage) if usage is not None else counted, cached)

    @staticmethod
    async def _llama(resp: Any, on_tokens: OnTokens) -> Reply:
        last = 0
        async for data in _sse(resp.content):
            ev = _event(data)
            n = ev.get("tokens_predicted")
            if n is None:
                n = last + len(ev.get("tokens") or [0])
            if ev.get("stop"):
                return Reply(int(n), _cached(ev))
            if n > last:
                last = int(n)
                on_tokens(last)
        raise ReplyError(f"stream ended after {last} tokens without its final event")


def _cached(ev: dict[str, Any]) -> int | None:
    """The prompt tokens an event says the server took from its cache: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``, else llama-server's ``timings.cache_n``; None if neither."""
    usage = ev.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    if n is None and isinstance(ev.get("timings"), dict):
        n = ev["timings"].get("cache_n")
    return int(n) if isinstance(n, int) and not isinstance(n, bool) else None


def make_transport(target: Target, extra_body: dict[str, Any] | None = None) -> _Transport:
    """``extra_body``: fields an HTTP transport adds to every request body (the SDK's ignores them)."""
    if target.transport == "sdk":
        return SdkTransport(target.address, target.timeout, target.keys)
    return HttpTransport(target.address, target.transport, target.timeout, extra_body)


# ---------------------------------------------------------------- the measurement core

@dataclass
class Tally:
    """What one client process measured."""

    tokens: int = 0
    errors: int = 0
    done: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error_samples: list[str] = field(default_factory=list)
    cached: int = 0  # prompt tokens the server said it served from its cache
    cached_reported: int = 0  # replies that said so

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < MAX_ERROR_SAMPLES:
            self.error_samples.append(what)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled and sys.stderr.isatty()

    def tick(self) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _one(transport: _Transport, req: Request, tally: Tally) -> None:
    t0 = last = time.perf_counter()
    seen = 0

    def on_tokens(total: int) -> None:
        nonlocal seen, last
        now = time.perf_counter()
        if total <= seen:
            return
        if seen == 0:
            tally.ttft.append(now - t0)
        else:
            k = total - seen
            tally.itl.extend([(now - last) / k] * k)
        seen, last = total, now

    try:
        reply = await transport.reply(req, on_tokens)
    except Exception as e:
        tally.tokens += seen
        tally.error(f"{type(e).__name__}: {e}"[:300])
        return
    n = reply.tokens
    tally.tokens += n
    if reply.cached_tokens is not None:
        tally.cached += reply.cached_tokens
        tally.cached_reported += 1
    tally.e2e.append(time.perf_counter() - t0)
    want = req.max_tokens * req.n
    if n != want and (req.json_schema is None or n > want):  # a grammar may end early
        tally.error(f"{n} tokens, asked for {want}")


async def drive(target: Target, requests: Sequence[Request], concurrency: int, progress: bool = False,
                barrier: Any = None) -> Tally:
    """``concurrency`` clients in this event loop over ``requests``; ``barrier``: wait on it to start."""
    transport = make_transport(target)
    tally = Tally()
    bar = _Progress(len(requests), progress)
    work: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        work.put_nowait(r)

    async def client() -> None:
        while True:
            try:
                req = work.get_nowait()
            except asyncio.QueueEmpty:
                return
            await _one(transport, req, tally)
            tally.done += 1
            bar.tick()

    await transport.open()
    try:
        if barrier is not None:
            barrier.wait(300)  # every client process starts sending at the same moment
        tally.start = time.time()
        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
        tally.end = time.time()
    finally:
        await transport.close()
    return tally


async def drive_open(target: Target, requests: Sequence[Request], rate: float, seed: int = 0,
                     progress: bool = False) -> Tally:
    """Send ``requests`` at Poisson arrivals of ``rate`` per second (exponential gaps drawn with
    ``seed``), each as soon as its time comes, however many are in flight."""
    transport = make_transport(target)
    tally = Tally()
    bar = _Progress(len(requests), progress)
    gaps = random.Random(seed)

    async def one(req: Request) -> None:
        await _one(transport, req, tally)
        tally.done += 1
        bar.tick()

    await transport.open()
    try:
        tally.start, t0, at = time.time(), time.perf_counter(), 0.0
        tasks = []
        for req in requests:
            at += gaps.expovariate(rate)
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
        tally.end = time.time()
    finally:
        await transport.close()
    return tally


def _child(target: Target, requests: Sequence[Request], concurrency: int, barrier: Any, out: Any,
           index: int) -> None:
    try:
        out.put((index, asyncio.run(drive(target, requests, concurrency, False, barrier)), None))
    except BaseException as e:
        barrier.abort()
        out.put((index, None, f"{type(e).__name__}: {e}"))


def drive_processes(target: Target, requests: Sequence[Request], concurrency: int, procs: int) -> list[Tally]:
    """The clients spread over ``procs`` processes (spawned), all starting together."""
    procs = max(1, min(procs, concurrency))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    children = [ctx.Process(target=_child, daemon=True, args=(
        target, list(requests[i::procs]), concurrency // procs + (i < concurrency % procs), barrier, out, i))
        for i in range(procs)]
    for p in children:
        p.start()
    got: dict[int, Tally] = {}
    try:
        while len(got) < procs:
            try:
                index, tally, err = out.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for i, p in enumerate(children) if i not in got and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"client process exited {dead[0].exitcode} without a result") from None
                continue
            if err is not None:
                raise RuntimeError(f"client process {index}: {err}")
            got[index] = tally
    finally:
        barrier.abort()
        for p in children:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(procs)]


def row(workload: Workload, target: Target, concurrency: int, procs: int, parts: Sequence[Tally]) -> BenchRow:
    tokens = sum(p.tokens for p in parts)
    errors = sum(p.errors for p in parts)
    done = sum(p.done for p in parts)
    errors += len(workload.requests) - done  # never happens; if it did, unanswered requests are errors
    ttft = [x for p in parts for x in p.ttft]
    itl = [x for p in parts for x in p.itl]
    e2e = [x for p in parts for x in p.e2e]
    wall = max(1e-9, max(p.end for p in parts) - min(p.start for p in parts)) if parts else 1e-9
    itl50 = pct(itl, 0.5)
    return BenchRow(
        workload=workload.name, transport=target.transport, concurrency=concurrency, procs=procs,
        requests=len(workload.requests), errors=errors, prompt_tokens=workload.prompt_tokens,
        prompt_tokens_p50=workload.prompt_tokens_p50, gen_tokens=tokens, expected_gen_tokens=workload.gen_tokens,
        wall_s=wall, tok_s=tokens / wall, req_s=len(workload.requests) / wall,
        ttft_p50_ms=1e3 * pct(ttft, 0.5), ttft_p99_ms=1e3 * pct(ttft, 0.99),
        itl_p50_ms=1e3 * itl50, itl_p99_ms=1e3 * pct(itl, 0.99),
        decode_tok_s=concurrency / itl50 if itl50 > 0 else 0.0, seed=workload.seed, ctx=workload.ctx,
        e2e_p50_ms=1e3 * pct(e2e, 0.5), e2e_p99_ms=1e3 * pct(e2e, 0.99), ttft_p90_ms=1e3 * pct(ttft, 0.9),
        address=target.address, error_samples=[s for p in parts for s in p.error_samples][:MAX_ERROR_SAMPLES],
        prompt_tokens_cached=sum(p.cached for p in parts) if any(p.cached_reported for p in parts) else None)


async def measure(target: Target, workload: Workload, concurrency: int, procs: int = 1,
                  progress: bool = False) -> BenchRow:
    """Run ``workload`` against ``target`` with ``concurrency`` streams over ``procs`` client processes."""
    procs = max(1, min(procs, concurrency))
    if procs == 1:
        parts = [await drive(target, workload.requests, concurrency, progress)]
    else:
        parts = await asyncio.get_running_loop().run_in_executor(
            None, drive_processes, target, workload.requests, concurrency, procs)
    return row(workload, target, concurrency, procs, parts)


async def measure_open(target: Target, workload: Workload, rate: float, progress: bool = False) -> BenchRow:
    """Run ``workload`` against ``target`` at Poisson arrivals of ``rate`` requests/s (open loop)."""
    tally = await drive_open(target, workload.requests, rate, workload.seed, progress)
    result = row(workload, target, 0, 1, [tally])
    result.rate = rate
    return result


def run(target: Target, workload: Workload, concurrency: int, procs: int = 1, progress: bool = False) -> BenchRow:
    return asyncio.run(measure(target, workload, concurrency, procs, progress))


# ---------------------------------------------------------------- what the server says about itself

async def server_info(target: Target) -> dict[str, int]:
    """``n_vocab`` (and ``ctx_per_slot`` where known) from the daemon's status or llama-server's /v1/models."""
    if target.transport == "sdk":
        from llamapool import AsyncClient

        async with AsyncClient(target.address, **target.keys) as client:
            st = await client.status()
        workers = [w for w in st["workers"] if w.get("n_vocab")]
        if not workers:
            return {}
        return {"n_vocab": min(w["n_vocab"] for w in workers),
                "ctx_per_slot": min(w.get("ctx_per_slot") or 0 for w in workers)}
    import aiohttp

    base = target.address.rstrip("/")
    for p in HTTP_PATHS.values():
        base = base.removesuffix(p)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None)
        meta = body["data"][0].get("meta") or {}
        return {"n_vocab": int(meta["n_vocab"])} if meta.get("n_vocab") else {}
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError):
        return {}
