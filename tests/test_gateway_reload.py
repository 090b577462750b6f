"""A reload resets nothing: SIGHUP ten times while 200 streams run and new connections keep coming.

The daemon runs as a process tree on loopback; the client is raw HTTP/1.1 over asyncio streams, one
request per connection, so that nothing retries or hides a reset: every connection must get its
whole answer. The supervisor binds the listening socket and each gateway inherits it
(supervisor/listener.py), and a stopping gateway answers the connections it has accepted
(gateway/connections.py). With gateways that bound their own SO_REUSEPORT sockets, the connections
queued on an old gateway's socket when it closed were reset (36-42 a run of the first test), and with
uvicorn's own stop, those it had accepted but not yet read (25).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamapool.supervisor.listener import Listener
from tests.conftest import Daemon, launch, write_config
from tests.test_gateway import free_port, wait_http
from tests.test_gateway_lifecycle import gateway_pids

STREAMS = 200  # concurrent streams, each a new connection when the last one ends
PROBES = 2  # connections opened back to back, each for one GET /health
SURGE, SURGE_S = 32, 1.0  # as many more once a reload's new gateways listen, for this long: the old ones stop
RELOADS = 10
GATEWAYS = 1  # gateway processes (test_a_reload_moves_... runs two)
MAX_TOKENS = 8  # a stream's length: short, so that each reload's old gateways finish soon
DEADLINE = 30.0  # seconds one request may take (it waits for a slot while the worker is replaced)


@dataclass
class Tally:
    """What the clients saw: answers, resets, and every other failure by kind (with one example)."""

    streams: int = 0
    probes: int = 0
    streaming: int = 0  # stream requests under way now (their connection opened, their answer not all read)
    resets: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    example: dict[str, str] = field(default_factory=dict)

    def fail(self, kind: str, what: str, reset: bool = False) -> None:
        (self.resets if reset else self.failed)[kind] += 1
        self.example.setdefault(kind, what)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response: its status and its body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, bytes(body)
            body += chunk[:-2]
    return status, await reader.readexactly(int(headers.get("content-length", "0")))


async def exchange(port: int, request: bytes, tally: Tally) -> bytes | None:
    """Send ``request`` on a new connection, read its response, close: the body of a 200, else None
    (and the failure counted: a reset, or any other)."""
    writer = None
    try:
        async with asyncio.timeout(DEADLINE):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            status, body = await read_response(reader)
    except (ConnectionResetError, BrokenPipeError) as e:
        tally.fail(type(e).__name__, repr(e), reset=True)
        return None
    except asyncio.IncompleteReadError as e:  # the connection closed before the whole response
        tally.fail("closed before the response ended", f"{len(e.partial)} bytes: {e.partial[-200:]!r}", reset=True)
        return None
    except (OSError, TimeoutError, ValueError) as e:
        tally.fail(type(e).__name__, repr(e))
        return None
    finally:
        if writer is not None:
            writer.close()
    if status != 200:
        tally.fail(f"HTTP {status}", body[:300].decode(errors="replace"))
        return None
    return body


def stream_ok(body: bytes) -> str | None:
    """Why a completion's event stream is not whole (None: it is)."""
    events = [ln[6:] for ln in body.decode().split("\n") if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] at the end: {body[-300:]!r}"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return f"an error event: {body[-300:]!r}"
    finishes = [ch.get("finish_reason") for c in chunks for ch in c.get("choices", [])]
    return None if "length" in finishes else f"no finish_reason 'length': {body[-300:]!r}"


async def streamer(port: int, model: str, stop: asyncio.Event, tally: Tally) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": MAX_TOKENS, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    while not stop.is_set():
        tally.streaming += 1
        answer = await exchange(port, request, tally)
        tally.streaming -= 1
        if answer is not None:
            why = stream_ok(answer)
            if why is None:
                tally.streams += 1
            else:
                tally.fail("stream not whole", why)


async def prober(port: int, stop: asyncio.Event, tally: Tally) -> None:
    request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    while not stop.is_set():
        if await exchange(port, request, tally) is not None:
            tally.probes += 1


def log_count(d: Daemon, text: str) -> int:
    return d.log.read_text(errors="replace").count(text)


async def surge(port: int, tally: Tally) -> None:
    """``SURGE`` more probers for ``SURGE_S`` seconds: the old gateways stop accepting meanwhile, and
    connections are queued on the socket as they do."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(prober(port, stop, tally)) for _ in range(SURGE)]
    await asyncio.sleep(SURGE_S)
    stop.set()
    await asyncio.gather(*tasks)


async def reload_under_load(d: Daemon, port: int, model: str) -> tuple[Tally, list[float]]:
    """Run the load, SIGHUP ``RELOADS`` times (each once the last one's new gateways listen and its
    worker is replaced; a surge of new connections as the old gateways stop), stop the load once the
    last one is done: what the clients saw, and how long each reload took."""
    tally, stop = Tally(), asyncio.Event()
    tasks = [asyncio.create_task(streamer(port, model, stop, tally)) for _ in range(STREAMS)]
    tasks += [asyncio.create_task(prober(port, stop, tally)) for _ in range(PROBES)]
    took = []
    try:
        while not tally.streams and not tally.failed and not tally.resets:  # the streams flow
            await asyncio.sleep(0.05)
        listening, done = log_count(d, "listening on http"), log_count(d, "reload done")
        for _ in range(RELOADS):
            assert tally.streaming == STREAMS  # each streamer is in a request whenever this task runs
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGHUP)
            listening, done = listening + GATEWAYS, done + 1
            while log_count(d, "listening on http") < listening:
                assert time.monotonic() < t0 + 60 and d.proc.poll() is None, f"no new gateway:\n{d.log_text()}"
                await asyncio.sleep(0.02)
            await surge(port, tally)  # the supervisor tells the old gateways to stop as the new ones listen
            while log_count(d, "reload done") < done:
                assert time.monotonic() < t0 + 60 and d.proc.poll() is None, f"a reload did not end:\n{d.log_text()}"
                await asyncio.sleep(0.05)
            took.append(time.monotonic() - t0)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return tally, took


def test_ten_reloads_under_200_streams_reset_nothing(tmp_path: Path, model_path: str) -> None:
    """Every connection opened during ten reloads gets its whole answer, though 200 streams run all
    along (64 slots: the rest wait in the queue, across each reload's worker replacement)."""
    port = free_port()
    d = launch(tmp_path / "d", model_path, http={"listen": f"127.0.0.1:{port}", "processes": GATEWAYS},
               model={"ctx_per_slot": 64}, workers={"cpu_workers": 1, "slots": 64},
               server={"drain_timeout": 60.0, "queue_timeout": DEADLINE})
    try:
        d.wait_ready(1)
        wait_http(f"http://127.0.0.1:{port}", d)
        t0 = time.monotonic()
        tally, took = asyncio.run(reload_under_load(d, port, Path(model_path).stem))
        print(f"{RELOADS} reloads under {STREAMS} streams in {time.monotonic() - t0:.1f} s (each "
              f"{min(took):.1f}-{max(took):.1f} s); {tally.streams} streams and {tally.probes} probes answered "
              f"whole; resets {dict(tally.resets)}; failed {dict(tally.failed)}")
        assert not tally.resets and not tally.failed, (tally, d.log_text())
        assert tally.streams >= STREAMS and tally.probes >= RELOADS, tally
        assert log_count(d, "reload done") == RELOADS
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


# ---------------------------------------------------------------- [http] listen changed by a reload


def test_a_reload_moves_to_a_new_listen_address_or_refuses_a_taken_one(tmp_path: Path, model_path: str) -> None:
    """A new ``listen`` is bound and served by the new gateways (two, on the one new socket); the old
    address closes with the old ones. One that cannot be bound is refused with a log line, and the
    gateways stay as they are."""
    first, second = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"

    def http(url: str) -> dict[str, Any]:
        return {"listen": url.removeprefix("http://"), "processes": 2}

    sections: dict[str, Any] = {"workers": {"cpu_workers": 1}}
    d = launch(tmp_path / "d", model_path, http=http(first), **sections)
    try:
        d.wait_ready(1)
        wait_http(first, d)
        serving = gateway_pids(first)
        assert len(serving) == 2
        with socket.socket() as taken:  # no SO_REUSEPORT on it: the daemon's bind fails
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            write_config(d.config, model_path, d.config.parent / "run", http=http(f"http://127.0.0.1:{port}"),
                         **sections)
            d.proc.send_signal(signal.SIGHUP)
            d.wait_log(f"reload: http.listen: cannot listen on 127.0.0.1:{port}")
            d.wait_log("reload done")
        assert httpx.get(first + "/health", timeout=5).status_code == 200
        assert gateway_pids(first) == serving, "the gateways stay as they are"
        write_config(d.config, model_path, d.config.parent / "run", http=http(second), **sections)
        d.proc.send_signal(signal.SIGHUP)
        wait_http(second, d)
        end = time.monotonic() + 15
        while gateway_pids(first) or len(gateway_pids(second)) != 2:
            assert time.monotonic() < end, f"the old gateways did not leave:\n{d.log_text()}"
            time.sleep(0.1)
        with pytest.raises(httpx.ConnectError):  # the old socket closed with them
            httpx.get(first + "/health", timeout=5)
        assert f"HTTP gateway: {first.removeprefix('http://')} closes as its old gateways stop accepting" \
            in d.log_text()
        assert httpx.get(second + "/health", timeout=5).status_code == 200
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_once_every_gateway_has_failed_connections_are_refused_until_a_reload(tmp_path: Path,
                                                                              model_path: str) -> None:
    """The supervisor's socket would queue connections that no gateway will ever accept: once every
    gateway has failed for good it is closed (a client is refused at once), and a reload binds it again."""
    url = f"http://127.0.0.1:{free_port()}"
    d = launch(tmp_path / "d", model_path, workers={"cpu_workers": 1, "flap_limit": 1, "restart_backoff": 0.1},
               http={"listen": url.removeprefix("http://")})
    try:
        d.wait_ready(1)
        wait_http(url, d)
        for listened in (1, 2):  # the second death within flap_window is one too many
            end = time.monotonic() + 30
            while log_count(d, "listening on http") < listened:
                assert time.monotonic() < end, d.log_text()
                time.sleep(0.05)
            (pid,) = gateway_pids(url)
            os.kill(pid, signal.SIGKILL)
        d.wait_log("http0: FAILED, not restarting")
        end = time.monotonic() + 5
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.ConnectError:  # refused
                break
            except httpx.TimeoutException:
                assert time.monotonic() < end, "connections wait on a socket that no gateway accepts from"
        d.proc.send_signal(signal.SIGHUP)
        wait_http(url, d)
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_a_taken_http_port_is_a_start_up_error(tmp_path: Path, model_path: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = launch(tmp_path / "d", model_path, http={"listen": f"127.0.0.1:{port}"})
        try:
            assert d.proc.wait(30) == 1
        except Exception:
            d.stop(signal.SIGQUIT)
            raise
    assert f"http.listen: cannot listen on 127.0.0.1:{port}" in d.log_text()


def test_a_connection_opened_before_a_reload_is_served_whatever_it_had_sent(tmp_path: Path, model_path: str) -> None:
    """Two connections accepted before a reload, one with nothing sent yet and one with half of its
    request, send the rest once the old gateway has stopped accepting: the old gateway answers each
    (uvicorn alone closed both as it stopped, though a request may be on its way)."""
    port = free_port()
    d = launch(tmp_path / "d", model_path, workers={"cpu_workers": 1}, http={"listen": f"127.0.0.1:{port}"})
    try:
        d.wait_ready(1)
        wait_http(f"http://127.0.0.1:{port}", d)
        head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        fresh, half = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
        half.sendall(head[:10])
        time.sleep(0.3)  # both accepted by the one gateway
        (old,) = gateway_pids(f"http://127.0.0.1:{port}")
        d.proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 30
        while log_count(d, "listening on http") < 2:  # the new gateway runs: the old one is told to stop
            assert time.monotonic() < end, d.log_text()
            time.sleep(0.05)
        time.sleep(1.0)  # it has stopped accepting (uvicorn looks every 0.1 s) and asked each connection to end
        assert old in gateway_pids(f"http://127.0.0.1:{port}"), "the old gateway waits for the two requests"
        for conn, rest in ((fresh, head), (half, head[10:])):
            conn.settimeout(10)
            conn.sendall(rest)
            with conn, conn.makefile("rb") as f:
                status = f.readline()
                headers = list(iter(f.readline, b"\r\n"))
                length = next(int(ln.split(b":")[1]) for ln in headers if ln.lower().startswith(b"content-length:"))
                body = json.loads(f.read(length))
            assert status.startswith(b"HTTP/1.1 200") and body["status"] == "ok", (status, body)
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_the_socket_is_kept_when_listen_names_its_address_otherwise() -> None:
    """A reload keeps the socket when ``listen`` names its address, however written (a second socket
    bound next to it with SO_REUSEPORT would take half the connections, and reset those queued on it
    when it closed); another address gets a socket of its own."""
    listener = Listener.bind("127.0.0.1:0")
    try:
        port = listener.port
        assert listener.serves("127.0.0.1:0") and listener.serves(f"127.0.0.1:{port}")
        assert listener.serves(f"localhost:{port}")
        assert not listener.serves(f"127.0.0.1:{free_port()}") and not listener.serves(f"[::1]:{port}")
        assert not listener.serves(f"no-such-host.invalid:{port}")
        with socket.socket() as taken:  # without SO_REUSEPORT: a bind next to it fails
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(OSError):
                Listener.bind(f"127.0.0.1:{taken.getsockname()[1]}")
    finally:
        listener.close()
