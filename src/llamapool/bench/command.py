"""``llamapool bench``: drive a running daemon (SDK) or an HTTP server (``--http``) with a named
workload at C concurrent streams; optionally measure the engine ceiling (same model and lengths, no
service) in the same run; or, with ``--router-only``, the router path without a model; or, with
``--scenario agent``, sessions whose context grows turn after turn (:mod:`llamapool.bench.agent`);
``--scenario speculation``, replies that copy their prompt, speculation on and off
(:mod:`llamapool.bench.speculation`); ``--scenario pool-churn``, a busy model beside on-demand models
loaded and evicted (:mod:`llamapool.bench.churn`); or, with ``--kv-stall``, the workload with no, a live
and a stalled KV-event subscriber (:mod:`llamapool.bench.kvsub`).

Exits 1 when any request failed or came back short: a run with errors is not a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from llamapool.bench.workloads import DEFAULT_CTX, NAMES, AgentWorkload, Workload


def _spread(work: Workload, models: list[str]) -> Workload:
    """``work`` with request i asking ``models[i % len(models)]`` (no models: as it was)."""
    if not models:
        return work
    reqs = tuple(dataclasses.replace(r, model=models[i % len(models)]) for i, r in enumerate(work.requests))
    return dataclasses.replace(work, requests=reqs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--concurrency", type=int, nargs="+",
                   help="concurrent streaming clients (default 8; --scenario agent: turns in flight, default "
                        "16); several values run one after another")
    p.add_argument("-n", "--requests", type=int, default=0,
                   help="requests per run (default 4 x C; open loop: 20 s of arrivals, at least 64)")
    p.add_argument("--rate", type=float, nargs="+", metavar="R",
                   help="open loop instead of C streams: Poisson arrivals at R requests/s, whatever is in "
                        "flight; several values run one after another (reports TTFT/ITL/end-to-end p50/p99 "
                        "and the achieved rate)")
    p.add_argument("--ttft-slo", type=float, metavar="MS",
                   help="with --rate: also report the highest rate whose TTFT p99 is at most MS milliseconds")
    p.add_argument("-w", "--workload", choices=NAMES, default="short",
                   help="short: 128 prompt / 128 output tokens; rag: 1024/128; long: 4096/256; mixed: "
                        "log-normal lengths, median 512/128, sigma 0.8/0.6, clipped to --ctx")
    p.add_argument("--model", nargs="+", metavar="NAME", default=[],
                   help="the pool's models (or LoRA adapters) to ask, request i the (i mod N)th (default: the "
                        "server's first model)")
    p.add_argument("--prompt-tokens", type=int, help="override the workload's prompt length (mixed: its median)")
    p.add_argument("--image-px", type=int, default=64, help="the image workload's image side in pixels (default "
                   "64, the generated test projector's; its question is --prompt-tokens words, default 64)")
    p.add_argument("--gen-tokens", "--out-tokens", type=int,
                   help="override the workload's output length (mixed: its median; --scenario agent: each "
                        f"turn's, default {AgentWorkload.out})")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX,
                   help=f"prompt + output budget per request (default {DEFAULT_CTX}); mixed is clipped to it")
    p.add_argument("--seed", type=int, default=0, help="same seed, same requests")
    p.add_argument("--top-logprobs", type=int, metavar="K",
                   help="the logprobs workload's alternatives a token, 0 to 20 (default 5; over --http "
                        "/v1/completions, 0 to 5)")
    p.add_argument("--beside", choices=NAMES, metavar="WORKLOAD",
                   help="the measured C streams run beside C streams of this workload (one wave more than "
                        "the measured ones, started a second before): e.g. -w short --beside json for what "
                        "constrained neighbours cost plain streams, against -w short --beside short")
    _agent_arguments(p)
    _more_scenarios(p)
    p.add_argument("--kv-stall", nargs="?", const="", metavar="ENDPOINT",
                   help="against a daemon with [kv_events] on: the workload three times, with no KV-event "
                        "subscriber, a live one and a stalled one (never reads), side by side with the "
                        "publisher's drops; ENDPOINT: its PUB socket (default: --config's kv_events.endpoint)")
    p.add_argument("--n-vocab", type=int, default=0,
                   help="prompt ids are drawn below this (default: what the server reports)")
    p.add_argument("--http", metavar="URL",
                   help="drive an HTTP server instead of the daemon, e.g. http://127.0.0.1:8080")
    p.add_argument("--api", choices=("completions", "llama"), default="completions",
                   help="with --http: OpenAI-compatible POST /v1/completions, or llama-server's POST /completion")
    p.add_argument("--procs", type=int, default=1, help="client processes the streams are spread over")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--router-only", action="store_true",
                   help="no model: the daemon with an echo engine vs a bare pyzmq ROUTER-DEALER echo")
    p.add_argument("--ceiling", metavar="MODEL", help="also measure the engine alone on this GGUF")
    p.add_argument("--gpu", action="store_true", help="ceiling on the GPU (all layers offloaded)")
    p.add_argument("--threads", type=int, default=0, help="ceiling CPU threads (0 = llama.cpp default)")
    p.add_argument("--gpu-sampling", action="store_true", help="ceiling samples on the GPU")
    p.add_argument("--kv-unified", action="store_true",
                   help="ceiling with one KV cache for all sequences (default: one stream per sequence)")
    p.add_argument("--n-ubatch", type=int, default=512, help="ceiling's llama.cpp micro-batch")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", metavar="FILE", help="append each row to FILE as a JSON line")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _agent_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=("agent", "speculation", "pool-churn"),
                   help="a scenario instead of a workload: agent: sessions of turns whose prompt is the last "
                        "turn's, its reply and new tokens, taken round-robin (one JSON line a run); "
                        "speculation: replies copying their prompt (a make-model --peaked model), speculation "
                        "on vs off; pool-churn: C streams to --busy alone, then beside light requests to "
                        "on-demand models (JSON lines)")
    p.add_argument("--sessions", type=int, default=AgentWorkload.sessions,
                   help="--scenario agent: sessions")
    p.add_argument("--turns", type=int, default=AgentWorkload.turns,
                   help="--scenario agent: turns a session")
    p.add_argument("--shared-tokens", type=int, default=AgentWorkload.shared,
                   help="--scenario agent: tokens every session starts with")
    p.add_argument("--new-tokens", type=int, default=AgentWorkload.new,
                   help="--scenario agent: tokens each turn adds")
    p.add_argument("--reload-at", type=float, metavar="F",
                   help="--scenario agent: once this share of the turns (0 to 1) is done, ask the daemon for a "
                        "rolling reload (SIGHUP to the pid in --config's runtime dir, or --reload-pid) and report "
                        "returning turns' TTFT before and after it")
    p.add_argument("--reload-pid", type=int, metavar="PID", help="--reload-at: the daemon's pid")


def _agent(args: argparse.Namespace, target: Any, n_vocab: int, info: dict[str, int]) -> int:
    """``--scenario agent``: one run per concurrency, each printed (and appended to ``--out``) as a JSON line."""
    from llamapool.bench.agent import measure_agent

    if args.rate or args.beside or args.ceiling or args.procs > 1:
        print("llamapool bench: --scenario agent is a closed loop in one client process: no --rate, --beside, "
              "--ceiling or --procs", file=sys.stderr)
        return 2
    try:
        work = AgentWorkload(args.sessions, args.turns, args.shared_tokens, args.new_tokens,
                             args.gen_tokens or AgentWorkload.out, n_vocab, args.seed)
    except ValueError as e:
        print(f"llamapool bench: {e}", file=sys.stderr)
        return 2
    try:
        reload = _reloader(args, target)
    except ValueError as e:
        print(f"llamapool bench: {e}", file=sys.stderr)
        return 2
    after = round((args.reload_at or 0) * work.sessions * work.turns)
    slot = info.get("ctx_per_slot") or 0
    if slot and work.longest > slot:
        print(f"llamapool bench: warning: the last turns need {work.longest} tokens of context; the daemon has "
              f"{slot} per slot (model.ctx_per_slot), so they will fail", file=sys.stderr)
    errors = 0
    for c in args.concurrency or [16]:
        row = asyncio.run(measure_agent(target, work, c, not args.no_progress, reload, after)).as_dict()
        errors += row["errors"]
        _append(args.out, [row])
        print(json.dumps(row), flush=True)
    if errors:
        print(f"llamapool bench: {errors} turn(s) failed or came back short: not a figure", file=sys.stderr)
        return 1
    return 0


def _reloader(args: argparse.Namespace, target: Any) -> Callable[[], None] | None:
    """``--reload-at``'s action: SIGHUP to the daemon (a ValueError says why there is none)."""
    if args.reload_at is None:
        return None
    if not 0 < args.reload_at < 1:
        raise ValueError(f"--reload-at must be a share of the turns between 0 and 1 (got {args.reload_at:g})")
    if target.transport != "sdk":
        raise ValueError("--reload-at reloads the daemon: not with --http")
    pid = args.reload_pid
    if pid is None:
        if not args.config:
            raise ValueError("--reload-at needs --config (the daemon's pid is in its runtime dir) or --reload-pid")
        from llamapool.config import load_config
        from llamapool.supervisor.runlock import LOCK_NAME

        lock = load_config(args.config).runtime_dir / LOCK_NAME
        try:
            pid = int(lock.read_text().strip())
        except (OSError, ValueError) as e:
            raise ValueError(f"--reload-at: no daemon pid in {lock} ({e}): is the daemon running?") from e
    return lambda: os.kill(pid, signal.SIGHUP)


def _kv_stall(args: argparse.Namespace, target: Any, n_vocab: int) -> int:
    """``--kv-stall``: per concurrency, the workload with no, a live and a stalled KV-event subscriber
    (:mod:`llamapool.bench.kvsub`), printed side by side (JSON rows with ``--json``)."""
    from llamapool.bench import kvsub

    try:
        endpoint = _kv_endpoint(args, target)
    except ValueError as e:
        print(f"llamapool bench: {e}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for c in args.concurrency or [8]:
        try:
            runs = asyncio.run(kvsub.measure_modes(_kv_run(args, target, n_vocab, c), _kv_metrics(target),
                                                   endpoint, args.seed))
        except ValueError as e:
            print(f"llamapool bench: {e}", file=sys.stderr)
            return 2
        rows += runs
        _append(args.out, runs)
        if not args.json:
            print(kvsub.table(runs), flush=True)
        if not kvsub.stalled(runs)["kv_dropped"]:
            print("llamapool bench: warning: the stalled subscriber cost the publisher no drop in the measured run: "
                  "its queue never reached [kv_events] hwm (lower hwm, or send more requests)", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    errors = sum(r["errors"] for r in rows)
    if errors:
        print(f"llamapool bench: {errors} request(s) failed or came back short: not a figure", file=sys.stderr)
        return 1
    return 0


def _kv_endpoint(args: argparse.Namespace, target: Any) -> str:
    """``--kv-stall``'s publisher address (a ValueError says why there is none)."""
    from llamapool.bench.kvsub import local_endpoint

    if target.transport != "sdk" or args.rate or args.scenario or args.beside or args.ceiling:
        raise ValueError("--kv-stall drives the daemon (not --http) in a closed loop: no --rate, --scenario, "
                         "--beside or --ceiling")
    if args.kv_stall:
        if not args.kv_stall.startswith("tcp://"):
            raise ValueError(f"--kv-stall: ENDPOINT must be the PUB socket's tcp:// address, got {args.kv_stall!r}")
        return str(args.kv_stall)
    if not args.config:
        raise ValueError("--kv-stall needs ENDPOINT (e.g. tcp://127.0.0.1:5557) or --config with [kv_events]")
    from llamapool.config import load_config

    kv = load_config(args.config).kv_events
    if kv is None or not kv.endpoint.startswith("tcp://"):
        raise ValueError(f"--kv-stall: {args.config} has no [kv_events] enable = true with a tcp:// endpoint")
    return local_endpoint(kv.endpoint)


def _kv_run(args: argparse.Namespace, target: Any, n_vocab: int, c: int) -> Callable[[int], Any]:
    """``--kv-stall``'s one run of the workload at ``c`` streams, seeded ``seed``: its row as a dict."""
    from llamapool.bench.drivers import measure
    from llamapool.bench.workloads import make_workload

    async def run(seed: int) -> dict[str, Any]:
        work = make_workload(args.workload, args.requests or 4 * c, n_vocab, seed=seed, ctx=args.ctx,
                             prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                             top_logprobs=args.top_logprobs)
        return (await measure(target, work, c, args.procs, not args.no_progress)).as_dict()

    return run


def _kv_metrics(target: Any) -> Callable[[], Any]:
    async def metrics() -> str:
        from llamapool import AsyncClient

        async with AsyncClient(target.address, timeout=30, **target.keys) as client:
            return await client.metrics()

    return metrics


def _router_only(args: argparse.Namespace) -> int:
    from llamapool.bench.router_only import run as router_only

    row = router_only(requests=args.requests or 400, concurrency=max(args.concurrency or [8]),
                      gen_tokens=args.gen_tokens or 64)
    print(json.dumps(row, indent=2) if args.json else
          f"router-only: daemon {row['daemon_tok_s']} tok/s vs bare pyzmq echo {row['bare_tok_s']} tok/s "
          f"= {row['daemon_over_bare']:.3f}")
    _append(args.out, [row])
    return 0


def _append(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path:
        with open(path, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def main(args: argparse.Namespace, endpoint: str = "", server_public_key: str = "", client_key: str = "") -> int:
    """Run the bench described by ``args``; ``endpoint``: the daemon's (the SDK transport), with CURVE key
    files for a tcp:// endpoint."""
    if args.router_only:
        return _router_only(args)
    if args.peer_server:
        return _peer(args, endpoint, {"server_public_key": server_public_key, "client_key": client_key})
    from llamapool.bench.drivers import Target, measure, server_info
    from llamapool.bench.workloads import make_workload

    if args.http:
        target = Target("http-openai" if args.api == "completions" else "http-llama", args.http, args.timeout)
    else:
        target = Target("sdk", endpoint, args.timeout, server_public_key, client_key)
    info = asyncio.run(server_info(target)) if not args.n_vocab else {}
    n_vocab = args.n_vocab or info.get("n_vocab")
    if not n_vocab:
        print("llamapool bench: the server did not say its vocabulary size; pass --n-vocab", file=sys.stderr)
        return 2
    if args.kv_stall is not None:
        return _kv_stall(args, target, n_vocab)
    if args.scenario == "agent":
        return _agent(args, target, n_vocab, info)
    if args.scenario:
        return _scenario(args, target, n_vocab)
    if args.rate:
        return _open_loop(args, target, n_vocab)
    rows: list[dict[str, Any]] = []
    errors = 0
    for c in args.concurrency or [8]:
        try:
            work = make_workload(args.workload, args.requests or 4 * c, n_vocab, seed=args.seed, ctx=args.ctx,
                                 prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                                 top_logprobs=args.top_logprobs, image_px=args.image_px)
            work = _spread(work, args.model)
            side = None if not args.beside else make_workload(
                args.beside, len(work.requests) + c, n_vocab, seed=args.seed + 1, ctx=args.ctx,
                prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, top_logprobs=args.top_logprobs)
        except ValueError as e:
            print(f"llamapool bench: {e}", file=sys.stderr)
            return 2
        slot = info.get("ctx_per_slot") or 0
        if slot and work.longest >= slot:
            print(f"llamapool bench: warning: requests need up to {work.longest} tokens of context; the daemon "
                  f"has {slot} per slot (model.ctx_per_slot), so they will fail", file=sys.stderr)
        with _beside(target, side, c):
            res = asyncio.run(measure(target, work, c, args.procs, not args.no_progress))
        errors += res.errors
        row = res.as_dict()
        if args.top_logprobs is not None and args.workload == "logprobs":
            row["top_logprobs"] = args.top_logprobs
        if side is not None:
            row["beside"] = args.beside
        if args.model:
            row["models"] = args.model
        if args.ceiling:
            from llamapool.bench.ceiling import measure as ceiling

            ceil = ceiling(args.ceiling, c, gpu=args.gpu, threads=args.threads, gpu_sampling=args.gpu_sampling,
                           kv_unified=args.kv_unified, n_ubatch=args.n_ubatch, requests=work.requests[:c])
            row["ceiling_decode_tok_s"] = round(ceil["decode_tok_s"], 1)
            row["ceiling_e2e_tok_s"] = round(ceil["e2e_tok_s"], 1)
            row["ceiling_kv_unified"] = ceil["kv_unified"]
            row["over_ceiling"] = round(res.tok_s / ceil["e2e_tok_s"], 3)
        rows.append(row)
        _append(args.out, [row])
        if not args.json:
            line = res.line()
            if args.ceiling:
                line += f"  | ceiling {row['ceiling_e2e_tok_s']:9.1f} tok/s  over ceiling {row['over_ceiling']:.3f}"
            print(line, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    _plot(args.plot, rows)
    if errors:
        print(f"llamapool bench: {errors} request(s) failed or came back short: not a figure", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _beside(target: Any, side: Any, c: int) -> Iterator[None]:
    """What runs inside runs while C streams of the workload ``side`` do (if any), started a second before."""
    if side is None:
        yield
        return
    import threading
    import time

    from llamapool.bench.drivers import run

    t = threading.Thread(target=run, args=(target, side, c), daemon=True)
    t.start()
    time.sleep(1.0)
    yield
    t.join()


def _open_loop(args: argparse.Namespace, target: Any, n_vocab: int) -> int:
    """``--rate``: one open-loop run per rate, then the highest rate that met ``--ttft-slo``."""
    from llamapool.bench.drivers import measure_open
    from llamapool.bench.workloads import make_workload

    if any(r <= 0 for r in args.rate):
        print("llamapool bench: --rate: every rate must be > 0 requests/s", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    errors = 0
    for rate in args.rate:
        try:
            work = make_workload(args.workload, args.requests or max(64, int(20 * rate)), n_vocab, seed=args.seed,
                                 ctx=args.ctx, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens)
        except ValueError as e:
            print(f"llamapool bench: {e}", file=sys.stderr)
            return 2
        res = asyncio.run(measure_open(target, work, rate, not args.no_progress))
        errors += res.errors
        row = res.as_dict()
        rows.append(row)
        _append(args.out, [row])
        if not args.json:
            print(res.line() + f"  e2e p50 {res.e2e_p50_ms:7.1f} p99 {res.e2e_p99_ms:7.1f} ms  "
                  f"achieved {res.req_s:.2f} req/s", flush=True)
    if args.ttft_slo:
        met = [r["rate"] for r in rows if r["ttft_p99_ms"] <= args.ttft_slo and not r["errors"]]
        best = max(met) if met else 0.0
        summary = {"ttft_slo_ms": args.ttft_slo, "best_rate": best, "rates": [r["rate"] for r in rows]}
        _append(args.out, [summary])
        if not args.json:
            print(f"highest rate with TTFT p99 <= {args.ttft_slo:g} ms: " +
                  (f"{best:g} req/s" if met else "none of the rates tried"), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    if errors:
        print(f"llamapool bench: {errors} request(s) failed or came back short: not a figure", file=sys.stderr)
        return 1
    return 0


def _more_scenarios(p: argparse.ArgumentParser) -> None:
    from llamapool.bench import churn, peer, speculation

    speculation.add_arguments(p)
    churn.add_arguments(p)
    peer.add_arguments(p)
    p.add_argument("--plot", metavar="FILE", help="also draw the rows to FILE (a PNG; needs matplotlib)")


def _scenario(args: argparse.Namespace, target: Any, n_vocab: int) -> int:
    """``--scenario speculation`` or ``pool-churn``: each row printed (and appended to ``--out``) as a JSON line."""
    from llamapool.bench import churn, speculation

    if args.rate or args.beside or args.ceiling or args.procs > 1:
        print(f"llamapool bench: --scenario {args.scenario} is a closed loop in one client process: no --rate, "
              "--beside, --ceiling or --procs", file=sys.stderr)
        return 2
    status, rows = (speculation if args.scenario == "speculation" else churn).run(args, target, n_vocab)
    for row in rows:
        print(json.dumps(row), flush=True)
    _append(args.out, rows)
    _plot(args.plot, rows)
    if status == 1:
        print("llamapool bench: errors (or texts that differ): not a figure", file=sys.stderr)
    return status


def _peer(args: argparse.Namespace, endpoint: str, keys: dict[str, str]) -> int:
    """``--peer-server``: the daemon from ``--config``, then llama-server, the same workload (JSON lines)."""
    from llamapool.bench import peer

    try:
        status, rows = peer.run(args, endpoint, {k: v for k, v in keys.items() if v})
    except RuntimeError as e:
        print(f"llamapool bench: --peer-server: {e}", file=sys.stderr)
        return 1
    for row in rows:
        print(json.dumps(row), flush=True)
    _append(args.out, rows)
    _plot(args.plot, rows)
    if status == 1:
        print("llamapool bench: errors: not a figure", file=sys.stderr)
    return status


def _plot(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path and rows:
        from llamapool.bench.plot import plot

        print(f"llamapool bench: {plot(rows, path)}", file=sys.stderr)
