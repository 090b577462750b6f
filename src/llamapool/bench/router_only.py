"""Router-only benchmark: the daemon with the echo engine against a bare pyzmq ROUTER-DEALER echo,
in streamed tokens/s, measured side by side in one run with the same raw client.

The bare echo answers each request with ``G`` chunk messages and a result straight from one
ROUTER socket: the least any ZeroMQ streaming service can cost. The daemon adds the router hop,
the worker process, its engine loop and the protocol's validation.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq


def _bare_echo(endpoint: str, ready: Any) -> None:
    """A ROUTER that streams G one-token chunks and a final result for every generate."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    ready.set()
    while True:
        client, frame = sock.recv_multipart()
        req = msgpack.unpackb(frame)
        if req.get("type") == "stop":
            break
        rid, n = req["id"], req["params"]["max_tokens"]
        for i in range(1, n + 1):
            sock.send_multipart([client, msgpack.packb(
                {"v": 1, "type": "chunk", "id": rid, "index": 0, "text": "x", "tokens": i})])
        sock.send_multipart([client, msgpack.packb(
            {"v": 1, "type": "result", "id": rid, "index": 0, "text": "x" * n, "finish_reason": "length",
             "prompt_tokens": 1, "completion_tokens": n, "worker": "bare"})])
    ctx.destroy(linger=0)


def stream_load(endpoint: str, requests: int, concurrency: int, gen_tokens: int) -> dict[str, float]:
    """Keep ``concurrency`` streams in flight on one DEALER; return streamed tokens/s."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    sent = done = tokens = 0

    def send() -> None:
        nonlocal sent
        sock.send(msgpack.packb({"v": 1, "type": "generate", "id": f"r{sent}", "prompt": [1, 2, 3],
                                 "stream": True, "params": {"max_tokens": gen_tokens}}))
        sent += 1

    t0 = time.perf_counter()
    for _ in range(min(concurrency, requests)):
        send()
    while done < requests:
        msg = msgpack.unpackb(sock.recv())
        if msg["type"] == "chunk":
            tokens += 1
        else:
            done += 1
            if sent < requests:
                send()
    wall = time.perf_counter() - t0
    ctx.destroy(linger=0)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def run(requests: int = 400, concurrency: int = 64, gen_tokens: int = 64, workers: int = 2) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="lp-router-bench-"))
    bare_ep = f"ipc://{tmp / 'bare.sock'}"
    ready = multiprocessing.get_context("spawn").Event()
    bare = multiprocessing.get_context("spawn").Process(target=_bare_echo, args=(bare_ep, ready))
    bare.start()
    ready.wait(30)
    bare_res = stream_load(bare_ep, requests, concurrency, gen_tokens)
    stopper = zmq.Context()
    s = stopper.socket(zmq.DEALER)
    s.connect(bare_ep)
    s.send(msgpack.packb({"type": "stop"}))
    bare.join(10)
    stopper.destroy(linger=0)

    cfg = tmp / "echo.toml"
    cfg.write_text(f'[server]\nruntime_dir = "{tmp / "run"}"\n[model]\nengine = "echo"\n'
                   f'[workers]\ndevices = "cpu"\ncpu_workers = {workers}\nslots = {concurrency}\n')
    daemon = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from llamapool import Client

        ep = f"ipc://{tmp / 'run' / 'frontend.sock'}"
        with Client(ep) as c:
            end = time.monotonic() + 60
            while sum(w["state"] == "ready" for w in c.status()["workers"]) < workers:
                if time.monotonic() > end:
                    raise RuntimeError("echo daemon did not get ready")
                time.sleep(0.1)
        svc = stream_load(ep, requests, concurrency, gen_tokens)
    finally:
        daemon.terminate()
        daemon.wait(30)
    return {"mode": "router-only", "requests": requests, "concurrency": concurrency,
            "gen_tokens": gen_tokens, "workers": workers, "bare_tok_s": round(bare_res["tok_s"]),
            "daemon_tok_s": round(svc["tok_s"]), "daemon_over_bare": round(svc["tok_s"] / bare_res["tok_s"], 3)}
