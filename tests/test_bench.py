"""The benchmark: workloads, the SDK driver against the real daemon, the HTTP driver against a fake
peer that streams OpenAI-style and llama-server-style events, the CLI, the router-only bench, the
agent scenario."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from llamapool.bench.drivers import Target, drive, measure, row
from llamapool.bench.workloads import DEFAULT_CTX, FIXED, MIN_TOKENS, AgentWorkload, make_workload
from tests.conftest import free_port

# ---------------------------------------------------------------- workloads

def test_workloads_are_seeded_and_within_bounds() -> None:
    for name, (p, g) in FIXED.items():
        w = make_workload(name, 6, 1000, seed=3)
        assert [(len(r.prompt), r.max_tokens) for r in w.requests] == [(p, g)] * 6
        assert all(3 <= t < 1000 for r in w.requests for t in r.prompt)
    a = make_workload("mixed", 400, 32000, seed=7)
    assert a == make_workload("mixed", 400, 32000, seed=7)  # same seed: exactly the same requests
    assert a.requests != make_workload("mixed", 400, 32000, seed=8).requests
    assert make_workload("short", 4, 32000, seed=1) != make_workload("short", 4, 32000, seed=2)
    lens = [(len(r.prompt), r.max_tokens) for r in a.requests]
    assert all(MIN_TOKENS <= p and MIN_TOKENS <= g and p + g <= DEFAULT_CTX for p, g in lens)
    assert 350 < a.prompt_tokens_p50 < 700 and 90 < a.gen_tokens_p50 < 180  # medians 512 / 128
    assert len({p for p, _ in lens}) > 100  # lengths really vary
    tight = make_workload("mixed", 400, 32000, seed=7, ctx=600)
    assert all(len(r.prompt) + r.max_tokens <= 600 for r in tight.requests)
    assert max(len(r.prompt) + r.max_tokens for r in tight.requests) == 600  # some were clipped
    w = make_workload("rag", 2, 500, prompt_tokens=40, gen_tokens=5)
    assert [(len(r.prompt), r.max_tokens) for r in w.requests] == [(40, 5)] * 2
    with pytest.raises(ValueError, match="context budget"):
        make_workload("long", 1, 32000, ctx=4000)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("huge", 1, 32000)


# ---------------------------------------------------------------- the SDK driver, real daemon

def test_sdk_driver_counts_every_token_and_every_error(start_daemon: Callable[..., Any]) -> None:
    d = start_daemon()  # 2 CPU workers x 4 slots, ctx_per_slot 512
    target = Target("sdk", d.endpoint, timeout=60)
    work = make_workload("short", 8, 500, prompt_tokens=16, gen_tokens=12)
    tally = asyncio.run(drive(target, work.requests, 4))
    assert (tally.tokens, tally.errors, tally.done) == (96, 0, 8)
    assert len(tally.ttft) == 8 and 0 < len(tally.itl) <= 8 * 11
    res = row(work, target, 4, 1, [tally])
    assert res.errors == 0 and res.gen_tokens == res.expected_gen_tokens == 96 and res.tok_s > 0
    assert res.decode_tok_s == pytest.approx(4 / (res.itl_p50_ms / 1e3))
    # a prompt the daemon refuses (longer than a slot) and replies cut short by the slot's context
    refused = make_workload("short", 2, 500, prompt_tokens=600, gen_tokens=4, ctx=1000)
    res = asyncio.run(measure(target, refused, 2))
    assert res.errors == 2 and res.gen_tokens == 0 and "BadRequestError" in res.error_samples[0]
    cut = make_workload("short", 2, 500, prompt_tokens=480, gen_tokens=100, ctx=1000)
    res = asyncio.run(measure(target, cut, 2))
    assert res.errors == 2 and 0 < res.gen_tokens < 200 and "asked for 100" in res.error_samples[0]


def _bench_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamapool.cli", "bench", "--no-progress", *argv],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ})


def test_cli_bench_workload_against_the_daemon(start_daemon: Callable[..., Any]) -> None:
    d = start_daemon()
    out = _bench_cli("--endpoint", d.endpoint, "--workload", "short", "-c", "4", "-n", "8", "--json")
    assert out.returncode == 0, out.stderr
    [r] = json.loads(out.stdout)
    assert (r["workload"], r["transport"], r["requests"], r["errors"]) == ("short", "sdk", 8, 0)
    assert r["gen_tokens"] == 8 * 128 and r["prompt_tokens"] == 8 * 128 and r["tok_s"] > 0
    out = _bench_cli("--endpoint", d.endpoint, "-c", "2")
    assert out.returncode == 0 and "short" in out.stdout and "tok/s" in out.stdout, out.stderr
    # issue 31's rows: logprobs with K alternatives, and streams measured beside others
    out = _bench_cli("--endpoint", d.endpoint, "-w", "logprobs", "--top-logprobs", "20", "--beside", "short", "-c", "2",
                     "-n", "4", "--prompt-tokens", "8", "--gen-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    [r] = json.loads(out.stdout)
    assert (r["workload"], r["top_logprobs"], r["beside"], r["errors"]) == ("logprobs", 20, "short", 0)
    assert r["gen_tokens"] == 4 * 16


def test_open_loop_bench_at_poisson_rates_against_the_daemon(start_daemon: Callable[..., Any], tmp_path: Any
                                                          ) -> None:
    """``--rate``: requests go out at Poisson arrivals whatever is in flight; each rate is a row with the
    achieved rate and TTFT/ITL/end-to-end percentiles, then the highest rate that met the TTFT target."""
    d = start_daemon()
    rows_file = tmp_path / "open.jsonl"
    out = _bench_cli("--endpoint", d.endpoint, "--workload", "short", "--prompt-tokens", "16", "--gen-tokens", "8",
                     "--rate", "5", "40", "-n", "40", "--ttft-slo", "1e9", "--out", str(rows_file))
    assert out.returncode == 0, out.stderr
    *rows, summary = [json.loads(x) for x in rows_file.read_text().splitlines()]
    assert [r["rate"] for r in rows] == [5, 40] and all(r["errors"] == 0 and r["requests"] == 40 for r in rows)
    assert all(r["gen_tokens"] == 40 * 8 and r["e2e_p99_ms"] >= r["e2e_p50_ms"] >= r["ttft_p50_ms"] > 0 for r in rows)
    # 40 arrivals at 5/s span ~8 s (Poisson: well over 3 s); at 40/s, about 1 s
    assert 40 / rows[0]["req_s"] > 3 and rows[1]["req_s"] > 2 * rows[0]["req_s"]
    assert summary == {"ttft_slo_ms": 1e9, "best_rate": 40, "rates": [5, 40]}
    assert "highest rate with TTFT p99 <= 1e+09 ms: 40 req/s" in out.stdout
    out = _bench_cli("--endpoint", d.endpoint, "--rate", "0")
    assert out.returncode == 2 and "--rate" in out.stderr


# ---------------------------------------------------------------- the HTTP driver, fake peer

class FakePeer:
    """An HTTP server that streams like llama-server: ``/v1/completions`` and ``/completion``; its final
    event says half of each prompt was cached.

    ``mode``: "ok"; "truncate" (the stream stops half way, no final event); "status" (HTTP 500);
    "holdback" (every 4th token is sent with the next one, as llama-server does inside a UTF-8
    character: fewer events than tokens, the final counts are right).
    """

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/completion", self._handle)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "meta": {"n_vocab": 100}}]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        openai = request.path == "/v1/completions"
        n = body.get("max_tokens" if openai else "n_predict")
        ok = (isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"])
              and isinstance(n, int) and body.get("stream") is True and body.get("ignore_eos") is True
              and body.get("temperature") == 0)
        if not ok or self.mode == "status":
            return web.json_response({"error": {"message": "bad request"}}, status=400 if not ok else 500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        last = n // 2 if self.mode == "truncate" else n
        for i in range(1, last + 1):
            await asyncio.sleep(0.001)
            if self.mode == "holdback" and i % 4 == 2 and i < n:
                continue  # held back: goes out with the next token
            text = "ab"[i % 2]
            if openai:
                ev: dict[str, Any] = {"choices": [{"text": text, "index": 0, "finish_reason": None}],
                                      "object": "text_completion"}
            else:
                ev = {"index": 0, "content": text, "tokens": [7], "stop": False, "tokens_predicted": i}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
            sent = i
        if self.mode != "truncate":
            if openai:
                final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                         "usage": {"completion_tokens": sent, "prompt_tokens": len(body["prompt"]),
                                   "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}}
                await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            else:
                final = {"index": 0, "content": "", "tokens": [], "stop": True, "tokens_predicted": sent,
                         "timings": {"predicted_n": sent, "cache_n": len(body["prompt"]) // 2},
                         "prompt": "word " * 60_000}  # the prompt's text
                await resp.write(f": ping\n\ndata: {json.dumps(final)}\n\n".encode())
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def peer() -> Iterator[FakePeer]:
    p = FakePeer()
    yield p
    p.close()


@pytest.mark.parametrize("transport", ["http-openai", "http-llama"])
@pytest.mark.parametrize("mode", ["ok", "holdback"])
def test_http_driver_counts_tokens(peer: FakePeer, transport: str, mode: str) -> None:
    peer.mode = mode
    peer.bodies.clear()
    work = make_workload("short", 6, 100, prompt_tokens=10, gen_tokens=9)
    target = Target(transport, peer.url, timeout=30)
    tally = asyncio.run(drive(target, work.requests, 3))
    assert (tally.tokens, tally.errors, tally.done, len(tally.ttft)) == (54, 0, 6, 6)
    if mode == "ok" or transport == "http-llama":
        assert len(tally.itl) == 6 * 8  # one gap per token after the first (a 2-token event: 2 half gaps)
    else:  # OpenAI events do not say how many tokens they carry: one per event, the count from usage
        assert len(tally.itl) < 6 * 8
    assert sorted(tuple(b["prompt"]) for b in peer.bodies) == sorted(r.prompt for r in work.requests)


@pytest.mark.parametrize("transport", ["http-openai", "http-llama"])
@pytest.mark.parametrize("mode", ["truncate", "status"])
def test_http_driver_reports_broken_replies_as_errors(peer: FakePeer, transport: str, mode: str) -> None:
    peer.mode = mode
    work = make_workload("short", 4, 100, prompt_tokens=10, gen_tokens=8)
    res = asyncio.run(measure(Target(transport, peer.url, timeout=30), work, 2))
    assert res.errors == 4 and res.requests == 4
    assert ("HTTP 500" if mode == "status" else "stream ended") in res.error_samples[0]


def test_cli_http_exit_code_and_procs(peer: FakePeer, tmp_path: Any) -> None:
    peer.mode = "ok"
    out_file = tmp_path / "rows.jsonl"
    out = _bench_cli("--http", peer.url, "--api", "llama", "-c", "4", "-n", "8", "--gen-tokens", "6",
                     "--prompt-tokens", "5", "--procs", "2", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    [r] = [json.loads(x) for x in out_file.read_text().splitlines()]
    assert (r["transport"], r["procs"], r["errors"], r["gen_tokens"]) == ("http-llama", 2, 0, 48)
    peer.mode = "truncate"
    out = _bench_cli("--http", peer.url, "-c", "2", "-n", "4", "--gen-tokens", "6", "--prompt-tokens", "5")
    assert out.returncode == 1
    assert "ERRORS 4/4" in out.stdout and "not a figure" in out.stderr


# ---------------------------------------------------------------- the ceiling

def test_ceiling_per_sequence_kv_with_workload_lengths(model_path: str) -> None:
    from llamapool.bench.ceiling import measure as ceiling

    work = make_workload("mixed", 4, 512, seed=2, ctx=160)
    r = ceiling(model_path, 4, requests=work.requests, kv_unified=False, n_ubatch=64, n_batch=128, threads=1)
    assert (r["kv_unified"], r["concurrency"], r["gen_tokens_total"]) == (False, 4, work.gen_tokens)
    assert r["prompt_tokens_total"] == work.prompt_tokens and r["e2e_tok_s"] > 0 and r["decode_tok_s"] > 0
    r = ceiling(model_path, 2, 24, 6, kv_unified=True, threads=1)
    assert (r["kv_unified"], r["gen_tokens_total"], r["prompt_tokens_total"]) == (True, 12, 48)


# ---------------------------------------------------------------- router only

def test_router_only_bench_runs() -> None:
    from llamapool.bench.router_only import run

    r = run(requests=40, concurrency=8, gen_tokens=8, workers=1)
    assert r["bare_tok_s"] > 0 and r["daemon_tok_s"] > 0 and r["mode"] == "router-only"


# ---------------------------------------------------------------- the agent scenario

def test_agent_workload_prompts_grow_by_the_reply_and_new_tokens() -> None:
    w = AgentWorkload(sessions=3, turns=4, shared=10, new=6, out=2, n_vocab=50, seed=1)
    ctxs = w.contexts()
    assert ctxs == w.contexts() and ctxs != AgentWorkload(3, 4, 10, 6, 2, 50, seed=2).contexts()
    assert [w.prompt_len(k) for k in range(4)] == [16, 24, 32, 40] and w.longest == 42
    assert w.prompt_tokens == 3 * (16 + 24 + 32 + 40)
    assert all(len(c) == 10 + 4 * 8 and all(3 <= t < 50 for t in c) for c in ctxs)
    assert ctxs[0][:10] == ctxs[1][:10] == ctxs[2][:10] and ctxs[0][10:16] != ctxs[1][10:16]
    for bad in ({"sessions": 0}, {"turns": 0}, {"new": 0}, {"out": 0}, {"shared": -1}, {"n_vocab": 3}):
        with pytest.raises(ValueError):
            AgentWorkload(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["http-openai", "http-llama"])
def test_agent_takes_sessions_round_robin_and_reads_the_cached_tokens(peer: FakePeer, transport: str) -> None:
    from llamapool.bench.agent import measure_agent

    peer.mode = "ok"
    peer.bodies.clear()
    work = AgentWorkload(sessions=3, turns=3, shared=8, new=4, out=3, n_vocab=100)
    r = asyncio.run(measure_agent(Target(transport, peer.url, timeout=30), work, 1)).as_dict()
    ctxs = work.contexts()
    # one turn in flight: each session's first turn, then each one's second, ...; every body asks llama-server
    # to reuse its cache, and every prompt is its session's context up to the turn
    assert [tuple(b["prompt"]) for b in peer.bodies] == [
        tuple(ctxs[s][:work.prompt_len(k)]) for k in range(3) for s in range(3)]
    assert all(b["cache_prompt"] is True for b in peer.bodies)
    assert (r["mode"], r["turns"], r["errors"], r["reply_tokens"], r["kv_host"]) == ("agent", 9, 0, "placeholder", None)
    assert r["prompt_tokens_sent"] == work.prompt_tokens == 3 * (12 + 19 + 26)
    assert r["prompt_tokens_cached"] == 3 * (12 // 2 + 19 // 2 + 26 // 2)
    assert r["prompt_tokens_cached_return"] == 3 * (19 // 2 + 26 // 2)
    assert r["ttft_first_p50_ms"] > 0 and r["ttft_return_p90_ms"] >= r["ttft_return_p50_ms"] > 0


def test_cli_agent_against_the_daemon(start_daemon: Callable[..., Any], peer: FakePeer, tmp_path: Any) -> None:
    """``--scenario agent`` against a real daemon: every turn counted, the prompt tokens the workload
    defines, and returning turns served from the prefix cache; a run with errors exits 1. One worker (4
    slots), so that no returning turn is routed away from the KV it left (with two, the router's prefix keys,
    of 64 tokens at these lengths, cannot tell the sessions apart)."""
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1})
    rows_file = tmp_path / "agent.jsonl"
    out = _bench_cli("--endpoint", d.endpoint, "--scenario", "agent", "--sessions", "3", "--turns", "3",
                     "--shared-tokens", "64", "--new-tokens", "32", "--out-tokens", "4", "-c", "2",
                     "--out", str(rows_file))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert [r] == [json.loads(x) for x in rows_file.read_text().splitlines()]
    assert (r["mode"], r["transport"], r["sessions"], r["turns_per_session"]) == ("agent", "sdk", 3, 3)
    assert r["concurrency"] == 2
    assert (r["shared_tokens"], r["new_tokens"], r["out_tokens"], r["reply_tokens"]) == (64, 32, 4, "placeholder")
    assert (r["turns"], r["errors"]) == (9, 0) and r["turns_s"] > 0 and r["wall_s"] > 0
    assert r["prompt_tokens_sent"] == 3 * sum(64 + 32 * (k + 1) + 4 * k for k in range(3))
    assert r["ttft_first_p90_ms"] >= r["ttft_first_p50_ms"] > 0
    assert r["ttft_return_p90_ms"] >= r["ttft_return_p50_ms"] > 0
    # a returning turn finds at least the shared tokens cached, at most its last prompt (the reply's
    # placeholder tokens differ from the reply); today often just the shared ones: a first turn that
    # arrives while a finished session's slot is free takes that slot for the shared tokens, in place
    previous = 3 * sum(64 + 32 * (k + 1) + 4 * k for k in range(2))
    assert 6 * 64 <= r["prompt_tokens_cached_return"] <= previous
    assert r["prompt_tokens_cached"] >= r["prompt_tokens_cached_return"] + 64  # a first turn's shared tokens
    assert r["kv_host"] is None or r["kv_host"].keys() >= {"hits", "misses", "restores", "saves"}
    peer.mode = "truncate"
    out = _bench_cli("--http", peer.url, "--api", "llama", "--scenario", "agent", "--sessions", "2", "--turns", "2",
                     "--shared-tokens", "4", "--new-tokens", "4", "--out-tokens", "6")
    assert out.returncode == 1 and "not a figure" in out.stderr
    r = json.loads(out.stdout)
    assert (r["turns"], r["errors"], r["transport"]) == (4, 4, "http-llama") and "stream ended" in r["error_samples"][0]
    out = _bench_cli("--endpoint", d.endpoint, "--scenario", "agent", "--procs", "2")
    assert out.returncode == 2 and "--scenario agent" in out.stderr


def test_cli_agent_reload_at_reloads_the_daemon_mid_run(start_daemon: Callable[..., Any]) -> None:
    """``--reload-at``: once that share of the turns is done the daemon gets SIGHUP (its pid from the
    config's runtime dir) and reloads while the run goes on; every turn is answered, and the returning
    turns' TTFT comes apart before and after the signal. A share outside (0, 1) is refused."""
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1})
    out = _bench_cli("--config", str(d.config), "--scenario", "agent", "--sessions", "4", "--turns", "3",
                     "--shared-tokens", "64", "--new-tokens", "32", "--out-tokens", "4", "-c", "2",
                     "--reload-at", "0.5")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["turns"], r["errors"], r["reload_after_turns"]) == (12, 0, 6), r
    assert r["ttft_return_before_reload_p50_ms"] > 0 and r["ttft_return_after_reload_p50_ms"] > 0, r
    d.wait_log("reload done", timeout=120)
    bad = _bench_cli("--config", str(d.config), "--scenario", "agent", "--reload-at", "1.5")
    assert bad.returncode == 2 and "--reload-at must be a share" in bad.stderr


# ---------------------------------------------------------------- scenarios: speculation, pool churn

def _rows(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


def test_cli_speculation_on_and_off_against_the_daemon(start_daemon: Callable[..., Any], tmp_path: Any) -> None:
    """``--scenario speculation`` on a peaked model: the copy prompts' drafts are all kept with speculation
    on, none are made with it off or when the prompt holds nothing to copy, and the greedy texts are the
    same on and off; the same requests through the daemon's HTTP gateway (``/v1/completions``)."""
    from llamapool.modelgen import make_model

    from .conftest import free_port
    from .test_gateway import wait_http

    peaked = str(make_model(tmp_path / "peaked.gguf", peaked=True))
    port = free_port()
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1}, model={"path": peaked, "speculative": "ngram"},
                     http={"listen": f"127.0.0.1:{port}"})
    args = ("--scenario", "speculation", "--cases", "full-copy", "nothing", "--rounds", "1", "-c", "1", "-n", "2",
            "--gen-tokens", "48")
    out = _bench_cli("--endpoint", d.endpoint, *args, "--out", str(tmp_path / "spec.jsonl"))
    assert out.returncode == 0, out.stderr
    rows = _rows(out)
    assert rows == [json.loads(x) for x in (tmp_path / "spec.jsonl").read_text().splitlines()]
    runs = {(r["case"], r["speculation"]): r for r in rows if r["mode"] == "speculation"}
    assert set(runs) == {("full-copy", "on"), ("full-copy", "off"), ("nothing", "on"), ("nothing", "off")}
    assert all(r["errors"] == 0 and r["gen_tokens"] == 2 * 48 and r["tok_s"] > 0 for r in runs.values())
    copy = runs["full-copy", "on"]
    assert copy["draft_tokens"] > 48 and copy["acceptance"] > 0.9, copy  # the reply is the passage
    assert runs["full-copy", "off"]["draft_tokens"] == 0 and runs["nothing", "off"]["draft_tokens"] == 0
    assert runs["nothing", "on"]["accepted_tokens"] <= 2  # nothing to copy: hardly a draft kept
    texts = [r for r in rows if r["mode"] == "speculation-text"]
    assert [(r["case"], r["same_text_on_and_off"]) for r in texts] == [("full-copy", True), ("nothing", True)]
    summary = {r["case"]: r for r in rows if r["mode"] == "speculation-summary"}
    assert summary.keys() == {"full-copy", "nothing"} and summary["full-copy"]["on_tok_s"] == copy["tok_s"]
    wait_http(f"http://127.0.0.1:{port}", d)
    png = tmp_path / "spec.png"
    out = _bench_cli("--http", f"http://127.0.0.1:{port}", "--n-vocab", "512", *args, "--plot", str(png))
    assert out.returncode == 0, out.stderr
    try:  # --plot draws where matplotlib is installed (no dependency of llamapool), and says so where not
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 0 and f"plot written to {png}" in out.stderr
    except ImportError:
        assert not png.exists() and "no plot: matplotlib is not installed" in out.stderr
    rows = _rows(out)
    assert all(r["transport"] == "http-openai" and r["errors"] == 0 and r["draft_tokens"] is None
               for r in rows if r["mode"] == "speculation")
    assert all(r["same_text_on_and_off"] for r in rows if r["mode"] == "speculation-text")
    bad = _bench_cli("--endpoint", d.endpoint, "--scenario", "speculation", "--rounds", "0")
    assert bad.returncode == 2 and "--rounds must be >= 1" in bad.stderr


def test_cli_pool_churn_loads_and_evicts_beside_the_busy_model(start_daemon: Callable[..., Any], model_path: str,
                                                               tmp_path: Any) -> None:
    """``--scenario pool-churn``: a busy model alone, then beside light requests to three on-demand models of
    which one fits beside it (the RAM budget): the pool loads and evicts during the churn phase, every
    request is answered, and the row compares the busy model's two phases."""
    from llamapool.supervisor.memory import estimate

    need = estimate(model_path, 4, 512, 512, gpu=False).total
    light = [{"name": n, "path": str(tmp_path / f"{n}.gguf"), "load": "on_demand", "ctx_per_slot": 512}
             for n in ("a", "b", "c")]
    for m in light:
        os.symlink(model_path, m["path"])
    busy = {"name": "busy", "path": model_path, "cpu_workers": 1, "ctx_per_slot": 512}
    from .conftest import free_port
    from .test_gateway import wait_http

    port = free_port()
    d = start_daemon(wait_workers=1, models=[busy, *light], http={"listen": f"127.0.0.1:{port}"},
                     pool={"ram_budget": f"{int(need * 2.5)}B", "min_residency": 0.5})
    churn = ("--scenario", "pool-churn", "--busy", "busy", "--light", "a", "b", "c", "-c", "2", "--light-every", "0.2",
             "--prompt-tokens", "16", "--gen-tokens", "32")
    out = _bench_cli("--endpoint", d.endpoint, *churn, "--seconds", "2")
    assert out.returncode == 0, out.stderr
    [r] = _rows(out)
    assert (r["mode"], r["busy"], r["light"], r["concurrency"], r["errors"]) == ("pool-churn", "busy", ["a", "b", "c"],
                                                                                  2, 0)
    assert r["alone_tok_s"] > 0 and r["churn_tok_s"] > 0
    assert r["tok_s_vs_alone"] == round(r["churn_tok_s"] / r["alone_tok_s"], 3)
    assert r["light_requests"] >= 8 and r["light_ttft_p90_ms"] >= r["light_ttft_p50_ms"] > 0
    assert r["loads"] >= 2 and r["evictions"] >= 1, r  # three models take turns in room for one
    wait_http(f"http://127.0.0.1:{port}", d)  # the same through the gateway: each request names its model
    loads = sum(m.get("loads", 0) for m in d.status()["models"])
    out = _bench_cli("--http", f"http://127.0.0.1:{port}", "--n-vocab", "512", *churn, "--seconds", "1")
    assert out.returncode == 0, out.stderr
    [h] = _rows(out)
    assert (h["transport"], h["errors"], h["loads"]) == ("http-openai", 0, None) and h["light_requests"] >= 4, h
    assert sum(m.get("loads", 0) for m in d.status()["models"]) > loads  # the light models were asked for by name
    bad = _bench_cli("--endpoint", d.endpoint, "--scenario", "pool-churn", "--busy", "busy")
    assert bad.returncode == 2 and "--light" in bad.stderr
    bad = _bench_cli("--endpoint", d.endpoint, "--scenario", "pool-churn", "--busy", "busy", "--light", "a",
                     "--light-every", "0")
    assert bad.returncode == 2 and "--light-every must be > 0" in bad.stderr


def test_cli_peer_server_runs_the_daemon_then_the_peer(tmp_path: Any, model_path: str) -> None:
    """``--peer-server PATH --config TOML``: the bench starts the daemon from the config, measures it, stops
    it, then starts the peer binary on the config's model with its slots and context (llama-server's
    arguments; here a stand-in binary, tests/fake_llama_server.py: no llama-server on the CPU machines) and
    measures the same workload; a side-by-side row per concurrency. No daemon is left running."""
    from .conftest import write_config

    cfg = write_config(tmp_path / "pool.toml", model_path, tmp_path / "run", workers={"cpu_workers": 1, "slots": 2})
    fake = tmp_path / "llama-server"
    here = os.path.dirname(os.path.abspath(__file__))
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {here}/fake_llama_server.py \"$@\"\n")
    fake.chmod(0o755)
    env_args = tmp_path / "peer-args.json"
    os.environ["FAKE_LLAMA_SERVER_ARGS"] = str(env_args)
    try:
        out = _bench_cli("--config", str(cfg), "--peer-server", str(fake), "--peer-logs", str(tmp_path / "logs"),
                         "-c", "2", "-n", "4", "--prompt-tokens", "16", "--gen-tokens", "8", timeout=180)
    finally:
        del os.environ["FAKE_LLAMA_SERVER_ARGS"]
    assert out.returncode == 0, out.stderr
    rows = _rows(out)
    assert [(r.get("service"), r["mode"]) for r in rows] == [("llamapool", "service"), ("llama-server", "service"),
                                                             (None, "side-by-side")]
    mine, peer_row, both = rows
    assert (mine["transport"], peer_row["transport"]) == ("sdk", "http-llama")
    assert all(r["errors"] == 0 and r["gen_tokens"] == 4 * 8 for r in (mine, peer_row))
    assert both["llamapool_over_llama_server"] == round(mine["tok_s"] / peer_row["tok_s"], 3)
    args = json.loads(env_args.read_text())
    assert args[:2] == ["-m", model_path] and args[args.index("-np") + 1] == "2"
    assert args[args.index("-c") + 1] == str(2 * 512) and args[args.index("-ngl") + 1] == "0"
    assert "ready" in (tmp_path / "logs" / "llamapool.log").read_text()
    assert not (tmp_path / "run" / "frontend.sock").exists()  # the daemon it started has stopped
    bad = _bench_cli("--config", str(cfg), "--peer-server", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "--peer-server" in bad.stderr and "not an executable" in bad.stderr


def test_cli_kv_stall_runs_no_live_and_stalled_subscribers_side_by_side(start_daemon: Callable[..., Any],
                                                                        tmp_path: Any) -> None:
    """``--kv-stall`` against a daemon with ``[kv_events]`` on (its endpoint from ``--config``): the workload with
    no subscriber, a live one (every batch read, none missed), a stalled one (never reads), measured once the
    publisher drops, and none again (the stalled one gone, nothing dropped); every request answered in each.
    (1-token blocks: more bytes of events a request, so that the stalled subscriber's kernel buffers fill in a
    few runs.) Bad ``--kv-stall`` input is refused."""
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1},
                     kv_events={"enable": True, "endpoint": f"tcp://*:{free_port()}", "hwm": 8, "block_size": 1})
    rows_file = tmp_path / "kv.jsonl"
    out = _bench_cli("--config", str(d.config), "--kv-stall", "-w", "short", "--prompt-tokens", "400",
                     "--gen-tokens", "4", "-c", "4", "-n", "64", "--out", str(rows_file), timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    assert [r["kv_subscriber"] for r in rows] == ["none", "live", "stalled", "none"]
    for r in rows:
        assert (r["mode"], r["requests"], r["errors"], r["gen_tokens"]) == ("kv-stall", 64, 0, 64 * 4)
        assert r["tok_s"] > 0 and r["ttft_p90_ms"] >= r["ttft_p50_ms"] > 0
        assert r["engine_step_ms"] is None or r["engine_step_ms"] > 0  # None: no heartbeat counted in a short run
    none, live, stalled, after = rows
    assert none["kv_batches"] > 0 and "received_batches" not in none and after["kv_dropped"] == 0
    assert live["gaps"] == 0 and live["bad_batches"] == 0 and live["received_batches"] >= live["kv_batches"] > 0
    assert live["received_events"] > 0 and live["kv_dropped"] == 0
    assert 1 <= stalled["kv_prime_runs"] <= 5  # until a drop or a let-go (the heartbeat's), at most PRIME_RUNS
    # the live one beside the stalled one is never cut off for long (the heartbeat lets the stalled one go)
    assert stalled["beside_received_batches"] > 0 and stalled["beside_bad_batches"] == 0, stalled
    lines = out.stdout.splitlines()
    assert "stalled / none (mean of both): tok/s" in lines[-1] and lines[-4].startswith("stalled")
    for bad, why in (("udp://x", "ENDPOINT must be the PUB socket's tcp://"), ("", "--kv-stall needs ENDPOINT")):
        out = _bench_cli("--endpoint", d.endpoint, "--kv-stall", bad, "--n-vocab", "100")
        assert out.returncode == 2 and why in out.stderr, out.stderr
    out = _bench_cli("--endpoint", d.endpoint, "--kv-stall", "--rate", "5", "--n-vocab", "100")
    assert out.returncode == 2 and "--kv-stall" in out.stderr, out.stderr
