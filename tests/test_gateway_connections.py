"""Connection hygiene of the HTTP gateway (gateway/connections.py), against a real daemon whose
processes run under a low fd limit: half-open connections (slowloris) neither lock clients out nor
stay open, and clients that never read their stream are cut and their requests cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Daemon, launch
from tests.test_gateway import free_port, wait_http

FD_LIMIT = 256  # soft and hard: the gateway cannot raise it


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def start(folder: Path, model_path: str, http: dict[str, Any], low_fds: bool = True,
          **sections: Any) -> tuple[Daemon, str]:
    port = free_port()
    d = launch(folder, model_path, preexec=low_fd_limit if low_fds else None,
               http={"listen": f"127.0.0.1:{port}", **http}, **sections)
    d.wait_ready(2)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, d)
    return d, url


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    """A gateway with short idle and read timeouts."""
    d, url = start(tmp_path_factory.mktemp("timeouts"), model_path, http={"idle_timeout": 2.0, "read_timeout": 1.0})
    yield d, url
    d.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def sends(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    """A gateway with a short send timeout and a small send buffer, and a slot for 82 streams; the fd limit
    the login shell gives (the router's sockets for 80 streams and the test's clients outgrew 256: ZeroMQ
    aborts the router on EMFILE)."""
    d, url = start(tmp_path_factory.mktemp("sends"), model_path, http={"send_timeout": 1.0, "send_buffer_bytes": 16384},
                   low_fds=False, model={"ctx_per_slot": 4096}, workers={"slots": 41})
    yield d, url
    d.stop(signal.SIGTERM)


def gateway_pid(url: str) -> int:
    out = subprocess.run(["pgrep", "-f", f"llamapool.gateway .*{url.rsplit(':', 1)[1]}"], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def is_open(s: socket.socket) -> bool:
    """Whether the server still holds ``s`` open (reads what it sent: a 408, say)."""
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return False  # end of file: closed
    except BlockingIOError:
        return True
    except OSError:  # reset: closed
        return False


def served_in(url: str) -> float:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"], r.text
    return time.monotonic() - t0


def test_half_open_connections_past_the_fd_limit(timeouts: tuple[Daemon, str]) -> None:
    """400 connections against a gateway whose fd limit is 256 (it keeps at most 192 open): half send
    nothing, half stop in the middle of their headers. Before: all held open for good, and past the
    limit every new client was locked out. Now the oldest idle ones are shed (logged), a client is
    served at once, and the rest are closed by idle_timeout / read_timeout (the latter with a 408)."""
    d, url = timeouts
    assert "at most 192 connections; fd limit 256" in d.log_text()
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    socks = []
    try:
        for i in range(400):
            s = socket.create_connection((host, port), timeout=5)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
            socks.append(s)
        took = served_in(url)
        held = sum(is_open(s) for s in socks)
        time.sleep(3.5)  # past both timeouts
        left = sum(is_open(s) for s in socks)
        print(f"\nslowloris: a client served in {took:.2f} s with 400 half-open connections; "
              f"{held} of them open then, {left} after 3.5 s")
        assert took < 5, f"a client waited {took:.1f} s"
        assert held <= 192 and left == 0
        log = d.wait_log("http.read_timeout")
        assert "connections open (http.max_connections): closed the oldest idle one" in log
        assert served_in(url) < 5
    finally:
        for s in socks:
            s.close()


def test_a_late_request_is_cut(timeouts: tuple[Daemon, str]) -> None:
    """A header trickling in a byte at a time gets a 408 at read_timeout; a body that stops half-way
    is cut then too (its handler sees the client go)."""
    d, url = timeouts
    addr = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
    with socket.create_connection(addr, timeout=10) as s, socket.create_connection(addr, timeout=10) as b:
        t0 = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        for _ in range(3):  # a byte every 0.4 s does not keep it open
            time.sleep(0.4)
            try:
                s.sendall(b"X")
            except OSError:
                break
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"request_timeout"' in answer and b"http.read_timeout" in answer
        assert 0.9 < time.monotonic() - t0 < 3
        while is_open(b) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        assert not is_open(b) and time.monotonic() - t0 < 3
    d.wait_log("did not arrive within 1 s of its first byte (http.read_timeout)")


def never_reading_stream(host: str, port: int, max_tokens: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, port))
    body = json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def test_clients_that_never_read_are_cut_and_their_requests_cancelled(sends: tuple[Daemon, str]) -> None:
    """80 streams of 4,000 tokens whose clients never read. Before: each held its slot to the end
    (over 90 s here; a new client got a 503 after queue_timeout) and its connection for good, the
    unread replies waiting in the kernel and then in the gateway. Now each is cut once its unread bytes
    pass send_buffer_bytes or it has read nothing for send_timeout, its request is cancelled on the
    worker (the slots are freed), the gateway's memory stays put, and a client that reads is served."""
    d, url = sends
    pid, port = gateway_pid(url), int(url.rsplit(":", 1)[1])
    before = rss_mb(pid)
    socks = [never_reading_stream("127.0.0.1", port, 4000) for _ in range(80)]
    reader = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        t0 = time.monotonic()
        running = 0  # requests admitted: running, or cut already (a fast gateway cuts the first ones before the
        while running < 80 and time.monotonic() - t0 < 20:  # last are admitted; slower on a busy machine)
            running = d.status()["running"] + d.log.read_text(errors="replace").count("finish=cancelled")
            time.sleep(0.05)
        chunks = list(reader.completions.create(model="tiny", prompt="Hi", max_tokens=200, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length", "a client that reads was cut"
        peak, freed = before, None
        while time.monotonic() - t0 < 40:
            peak = max(peak, rss_mb(pid))
            st = d.status()
            if st["running"] == 0 and sum(w["active"] for w in st["workers"]) == 0:
                freed = time.monotonic() - t0
                break
            time.sleep(0.2)
        after = rss_mb(pid)
        while (left := sum(is_open(s) for s in socks)) and time.monotonic() - t0 < 40:
            time.sleep(0.2)
        print(f"\nnever-reading streams: gateway RSS {before:.1f} MB -> peak {peak:.1f} MB, {after:.1f} MB after; "
              f"{running} running, all cancelled after {freed} s; {left} of 80 connections open")
        assert running >= 80 and freed is not None and freed < 35, (running, freed, d.log_text())
        assert peak - before < 20 and left == 0
        log = d.log.read_text()
        assert "its request is cancelled" in log and ("http.send_timeout" in log or "http.send_buffer_bytes" in log)
    finally:
        for s in socks:
            s.close()


def test_a_slow_reader_of_a_large_reply_is_not_cut(sends: tuple[Daemon, str]) -> None:
    """A client that takes a large reply slowly makes progress every second, though its unread
    bytes stay over the high-water mark throughout: send_timeout counts time without progress."""
    d, url = sends
    body = json.dumps({"content": "hello world " * 40000}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    port = s.getsockname()[1]
    with s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        t0, got = time.monotonic(), b""
        while chunk := s.recv(16384):
            got += chunk
            time.sleep(0.05)  # about 300 KB/s at most
        took = time.monotonic() - t0
    head, _, reply = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and len(json.loads(reply)["tokens"]) > 70000, head
    print(f"\n{len(got)} bytes in {took:.1f} s")
    assert took > 2.5, f"the reply took {took:.1f} s: not slow enough to test send_timeout"
    assert f"disconnected 127.0.0.1:{port} " not in d.log.read_text()


def test_settings() -> None:
    from llamapool.config import ConfigError, from_dict
    from llamapool.gateway.connections import ConnectionLimits

    http = from_dict({"model": {"path": "m"}, "http": {"max_connections": 100, "send_buffer_bytes": 65536}}).http
    assert http is not None and http.max_connections == 100 and http.idle_timeout == 30.0
    for key, value in (("max_connections", -1), ("send_timeout", 0), ("read_timeout", -1.0),
                       ("idle_timeout", 0), ("send_buffer_bytes", 0), ("max_connections", 1.5)):
        with pytest.raises(ConfigError, match=f"http.{key}: must be"):
            from_dict({"model": {"path": "m"}, "http": {key: value}})
    assert ConnectionLimits().resolved(1024) == (ConnectionLimits(max_connections=960), "")
    assert ConnectionLimits().resolved(1 << 20)[0].max_connections == 4096
    limits, warning = ConnectionLimits(max_connections=5000).resolved(1024)
    assert limits.max_connections == 960 and "does not fit the fd limit (1024" in warning


def test_a_caller_that_falls_behind_its_queue_bound_is_cancelled(sends: tuple[Daemon, str]) -> None:
    """The gateway's router client holds at most QUEUED_REPLIES replies a request's handler has not
    taken (it only falls behind when the process cannot keep up): the SDK's ``max_queued``."""
    from llamapool import AsyncClient, OverloadedError

    d = sends[0]

    async def main() -> tuple[int, str]:
        async with AsyncClient(d.endpoint, max_queued=16) as ac:
            kw: dict[str, Any] = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
            stream = ac.stream("Hello", **kw)
            got = [await stream.__anext__()]
            await asyncio.sleep(1.5)  # the caller looks away; replies keep coming
            with pytest.raises(OverloadedError, match=r"fell 16 replies behind .*max_queued.*cancelled"):
                async for chunk in stream:
                    got.append(chunk)
            unbounded = AsyncClient(d.endpoint)  # the default: no bound
            async with unbounded:
                s2 = unbounded.stream("Hello", **{**kw, "max_tokens": 100})
                first = await s2.__anext__()
                await asyncio.sleep(1.0)
                rest = [c async for c in s2]
            return len(got), f"{len([first, *rest])} {s2.completion.finish_reason if s2.completion else None}"

    n, full = asyncio.run(main())
    assert n <= 17 and full.endswith("length"), (n, full)
    end = time.monotonic() + 5
    while d.status()["running"] and time.monotonic() < end:
        time.sleep(0.1)
    assert d.status()["running"] == 0
    with pytest.raises(ValueError, match="max_queued"):
        AsyncClient(d.endpoint, max_queued=0)


class Reader:
    """A long streaming request whose client reads all it is sent, in a thread, until closed: its
    connection has a request in progress as long as the generation lasts (a never-reading client would
    be cut at send_buffer_bytes, sooner on a fast machine)."""

    def __init__(self, port: int, max_tokens: int):
        self.sock = never_reading_stream("127.0.0.1", port, max_tokens)
        self.got = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                self.got += chunk

    @property
    def status(self) -> bytes:
        return bytes(self.got[:12])

    @property
    def finished(self) -> bool:
        return b"data: [DONE]" in self.got

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


def wait_running(d: Daemon, n: int, within: float = 20.0) -> None:
    end = time.monotonic() + within
    while d.status()["running"] < n:
        assert time.monotonic() < end, f"{d.status()['running']} requests running, not {n}"
        time.sleep(0.05)


def test_past_max_connections_the_oldest_idle_goes_and_busy_ones_stay(tmp_path: Path, model_path: str) -> None:
    """max_connections = 3: a fourth connection sheds the oldest idle one (not a busy one, not a
    younger idle one); when all three are busy, the fourth gets a 503 and they go on."""
    long = 30000  # tokens: tens of seconds of the tiny model; the streams are closed when checked
    d, url = start(tmp_path, model_path, http={"max_connections": 3}, model={"ctx_per_slot": 32768})
    assert "at most 3 connections" in d.log_text()
    port = int(url.rsplit(":", 1)[1])
    old = socket.create_connection(("127.0.0.1", port))
    time.sleep(0.1)
    young = socket.create_connection(("127.0.0.1", port))
    busy = Reader(port, long)
    readers = [busy]
    try:
        wait_running(d, 1)
        assert served_in(url) < 5  # a fourth connection: the oldest idle one is shed
        assert not busy.finished, "the busy request ended before the check: make it longer"
        assert not is_open(old) and is_open(young)
        d.wait_log("closed the oldest idle one")

        young.close()
        readers += [Reader(port, long) for _ in range(2)]  # with `busy`, three requests in progress
        wait_running(d, 3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=10)
        assert not any(b.finished for b in readers), "a busy request ended before the check: make it longer"
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "too_many_connections" and "http.max_connections" in r.text
        end = time.monotonic() + 10  # their heads (they run: on a loaded machine the bytes may lag)
        while not all(b.status for b in readers) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(b.status.startswith(b"HTTP/1.1 200") for b in readers), [b.status for b in readers]
        time.sleep(0.3)
        assert d.status()["running"] == 3  # the busy ones went on
    finally:
        for b in readers:
            b.close()
    d.wait_log("refused a connection from 127.0.0.1:")
    assert served_in(url) < 5
    d.stop(signal.SIGTERM)
