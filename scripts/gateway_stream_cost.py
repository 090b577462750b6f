"""The HTTP gateway's own cost per streamed token and per request, on this CPU, without a model.

A fake router (a ZeroMQ ROUTER in a child process) answers each generate request with ``--tokens``
chunks of one token each, either at once (``--interval 0``: the gateway is the bottleneck) or one
every ``--interval`` ms (a worker's token interval), then the result; status queries get an empty
status. A real gateway process (``python -m llamapool.gateway``, uvloop + httptools, as the supervisor
starts it) sits in front of it, and this process streams ``POST /v1/completions`` (or
``/v1/chat/completions``) over a fresh connection per request, as ``llamapool bench --http`` does.

Printed per run: the gateway process's CPU time per request (from /proc, less its idle rate), its CPU per chunk (the
difference between ``--tokens`` and 1-token runs), TTFT / ITL / end-to-end p50 over HTTP, and the same
through the SDK straight to the fake router (the gateway's added latency is the difference).

    .venv/bin/python scripts/gateway_stream_cost.py [--requests 200] [--tokens 128] [--interval 1.3]
    .venv/bin/python scripts/gateway_stream_cost.py --profile /tmp/gw.prof   # cProfile the gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from llamapool.protocol import codec
from llamapool.protocol.messages import Chunk, Result, StatusReply

TICK = os.sysconf("SC_CLK_TCK")
IDLE_SECONDS = 5.0  # the gateway's background CPU is measured over this long, and taken off the runs' CPU


def fake_router(endpoint: str, interval: float) -> None:
    """Answer generate requests with one-token chunks (every ``interval`` seconds), status with nothing."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        client, frame = sock.recv_multipart()
        d = msgpack.unpackb(frame)
        if d["type"] == "status":
            sock.send_multipart([client, codec.encode(StatusReply(d["id"], [], 0, 0, models=[
                {"name": "m", "workers": 1, "queued": 0}]))])
        elif d["type"] == "generate":
            _answer(sock, client, d["id"], int(d["params"].get("max_tokens", 16)), interval)


def _answer(sock: zmq.Socket[bytes], client: bytes, rid: str, n: int, interval: float) -> None:
    due = time.perf_counter()
    for i in range(1, n + 1):
        if interval:
            due += interval
            while (left := due - time.perf_counter()) > 0:
                time.sleep(left)
        extra = (128, 0) if i == 1 else (None, None)
        sock.send_multipart([client, codec.encode(Chunk(rid, 0, f" tok{i}", i, None, *extra))])
    sock.send_multipart([client, codec.encode(Result(rid, 0, "", "length", 128, n, "w0", "m"))])


def cpu_seconds(pid: int, kernel: bool = False) -> float:
    """A process's CPU time, all threads: from the scheduler's nanosecond runtimes (``kernel``: only the
    system time, from the tick-sampled /proc/PID/stat, which misses short, frequent wakeups)."""
    if kernel:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[12]) / TICK
    return sum(int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
               for t in os.listdir(f"/proc/{pid}/task")) / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def http_stream(port: int, path: str, body: bytes) -> tuple[float, list[float], float, int]:
    """One streamed request on a new connection: TTFT, the gaps between token events, e2e, tokens."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
    ttft, last, gaps, tokens = 0.0, 0.0, [], 0
    while data := await reader.read(65536):
        k = data.count(b'"finish_reason":null') - data.count(b'"role":"assistant"')
        if k <= 0:
            continue
        now = time.perf_counter()
        if tokens == 0:
            ttft = now - t0
        else:
            gaps.extend([(now - last) / k] * k)
        tokens, last = tokens + k, now
    writer.close()
    return ttft, gaps, time.perf_counter() - t0, tokens


async def sdk_stream(client: Any, n: int) -> tuple[float, list[float], float, int]:
    t0 = last = time.perf_counter()
    ttft, gaps, tokens = 0.0, [], 0
    async for _ in client.stream([1, 2, 3], max_tokens=n):
        now = time.perf_counter()
        if tokens == 0:
            ttft = now - t0
        else:
            gaps.append(now - last)
        tokens, last = tokens + 1, now
    return ttft, gaps, time.perf_counter() - t0, tokens


def summary(name: str, runs: list[tuple[float, list[float], float, int]]) -> dict[str, Any]:
    gaps = [g for r in runs for g in r[1]]
    row = {"run": name, "ttft_p50_ms": 1e3 * statistics.median(r[0] for r in runs),
           "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
           "e2e_p50_ms": 1e3 * statistics.median(r[2] for r in runs), "tokens": sum(r[3] for r in runs)}
    return row


async def http_phase(args: argparse.Namespace, port: int, gw_pid: int, n: int, idle: float
                     ) -> tuple[list[tuple[float, list[float], float, int]], float, float]:
    """``--requests`` streams of ``n`` tokens: their timings, the gateway's CPU seconds a request (less
    its idle rate) and the share of that CPU spent in the kernel."""
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "max_tokens": n, "stream": True, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if args.chat else {"prompt": [1, 2, 3]})
    raw = json.dumps(body).encode()
    for _ in range(5):  # warm-up
        await http_stream(port, path, raw)
    c0, k0, t0 = cpu_seconds(gw_pid), cpu_seconds(gw_pid, True), time.perf_counter()
    runs = [await http_stream(port, path, raw) for _ in range(args.requests)]
    used = cpu_seconds(gw_pid) - c0
    busy = used - idle * (time.perf_counter() - t0)
    return runs, busy / len(runs), (cpu_seconds(gw_pid, True) - k0) / max(used, 1e-9)


async def measure(args: argparse.Namespace, port: int, gw_pid: int, endpoint: str) -> list[dict[str, Any]]:
    """``--rounds`` rounds of 1-token and ``--tokens``-token streams; per chunk: the medians' difference."""
    from llamapool.client.aio import AsyncClient

    c0 = cpu_seconds(gw_pid)
    await asyncio.sleep(IDLE_SECONDS)
    idle = (cpu_seconds(gw_pid) - c0) / IDLE_SECONDS  # the pod's status queries, every 25 ms
    per_request: dict[int, list[float]] = {1: [], args.tokens: []}
    runs: dict[int, list[tuple[float, list[float], float, int]]] = {1: [], args.tokens: []}
    kernel = []
    for _ in range(args.rounds):
        for n in per_request:
            r, cpu, k = await http_phase(args, port, gw_pid, n, idle)
            runs[n] += r
            per_request[n].append(cpu)
            kernel.append(k)
    rows: list[dict[str, Any]] = [{"gateway_idle_cpu_percent": 100 * idle}]
    for n in per_request:
        rows.append({**summary(f"http max_tokens={n}", runs[n]),
                     "gateway_cpu_us_per_request": 1e6 * statistics.median(per_request[n]),
                     "rounds_us": [round(1e6 * x) for x in per_request[n]]})
    async with AsyncClient(endpoint, model="m") as client:
        for _ in range(5):
            await sdk_stream(client, args.tokens)
        rows.append(summary(f"sdk max_tokens={args.tokens}",
                            [await sdk_stream(client, args.tokens) for _ in range(args.requests)]))
    one, many = rows[1]["gateway_cpu_us_per_request"], rows[2]["gateway_cpu_us_per_request"]
    rows.append({"gateway_cpu_us_per_chunk": (many - one) / (args.tokens - 1),
                 "gateway_system_cpu_share": statistics.median(kernel)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="streams per round and length")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--interval", type=float, default=0.0, help="ms between the fake router's chunks")
    ap.add_argument("--chat", action="store_true", help="/v1/chat/completions rather than /v1/completions")
    ap.add_argument("--profile", default="", help="run the gateway under cProfile, writing this file")
    ap.add_argument("--router", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.router:
        fake_router(args.router[0], float(args.router[1]))
        return
    tmp = Path(tempfile.mkdtemp(prefix="gwcost-"))
    endpoint, port = f"ipc://{tmp / 'front.sock'}", free_port()
    router = subprocess.Popen([sys.executable, __file__, "--router", endpoint, str(args.interval / 1e3)])
    spec = {"name": "gw0", "frontend": endpoint, "host": "127.0.0.1", "port": port, "model": "m"}
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    gw = subprocess.Popen([sys.executable, *prof, "-m", "llamapool.gateway", json.dumps(spec)],
                          stderr=None if args.profile else subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        for row in asyncio.run(measure(args, port, gw.pid, endpoint)):
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        gw.send_signal(signal.SIGINT if args.profile else signal.SIGTERM)  # SIGINT: cProfile writes its file
        gw.wait(30)
        router.kill()
        router.wait()


if __name__ == "__main__":
    main()
