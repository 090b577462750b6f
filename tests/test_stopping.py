"""Stopping, and one daemon per runtime dir.

- A second ``serve`` on the same runtime dir is refused at once, naming the running daemon's pid.
- The first SIGINT/SIGTERM drains and says how to stop at once; a second one stops at once, and every
  stream in flight ends with a typed error that says how many tokens it delivered (over HTTP: an
  error event).
- Workers and gateways die with their supervisor, even when frozen; a daemon killed with -9 leaves
  nothing that blocks or joins the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from llamapool import LlamapoolError, UnavailableError, WorkerLostError

from .conftest import Daemon, free_port, launch

LONG = {"max_tokens": 100000, "ignore_eos": True, "temperature": 0.0}
# one slot with a long context: a stream that runs for seconds on the tiny model
ONE_LONG_SLOT = {"workers": {"cpu_workers": 1, "slots": 1}, "model": {"ctx_per_slot": 65536}}


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while _pids_alive(pids) and time.monotonic() < end:
        time.sleep(0.05)
    return _pids_alive(pids)


def test_a_second_daemon_on_the_same_runtime_dir_is_refused(start_daemon: Any, model_path: str) -> None:
    d: Daemon = start_daemon(wait_workers=1, workers={"cpu_workers": 1})
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(d.config)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    runtime = d.config.parent / "run"
    assert f"pid {d.proc.pid}" in r.stderr and str(runtime) in r.stderr, r.stderr
    with d.client() as c:  # the first one still serves, on its own sockets
        assert c.generate("hi", max_tokens=2).usage.completion_tokens == 2


def test_a_daemon_killed_with_9_takes_its_workers_along_and_leaves_no_lock(tmp_path: Path, model_path: str) -> None:
    d = launch(tmp_path / "a", model_path, workers={"cpu_workers": 2})
    d.wait_ready(2)
    pids = [w["pid"] for w in d.status()["workers"]]
    os.kill(pids[1], signal.SIGSTOP)  # a frozen worker dies too
    d.proc.kill()
    d.proc.wait()
    assert not _wait_gone(pids, 5.0), "workers outlived their supervisor"
    again = launch(tmp_path / "a", model_path, workers={"cpu_workers": 2})  # same runtime dir
    try:
        st = again.wait_ready(2)
        assert not {w["pid"] for w in st["workers"]} & set(pids)
        with again.client() as c:
            assert c.generate("hi", max_tokens=3).usage.completion_tokens == 3
    finally:
        again.stop(signal.SIGQUIT)


def test_a_worker_of_another_daemon_cannot_join(start_daemon: Any, model_path: str) -> None:
    from llamapool.worker.server import WorkerSpec

    d: Daemon = start_daemon(wait_workers=1, workers={"cpu_workers": 1})
    spec = WorkerSpec(name="cpu7", backend=f"ipc://{d.config.parent / 'run' / 'backend.sock'}", device="cpu",
                      model_path=model_path, slots=2, ctx_per_slot=512, max_batch_tokens=512, n_ubatch=512,
                      threads=1, flash_attn=True, heartbeat_interval=1.0, heartbeat_liveness=3,
                      boot_id="0123456789abcdef")
    stray = subprocess.Popen([sys.executable, "-m", "llamapool.worker", spec.to_json()],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        log = d.wait_log("refused worker cpu7", timeout=30)
        assert "a worker of another daemon" in log
        assert stray.wait(30) != 0  # told why, it exits
        assert "cpu7" not in {w["id"] for w in d.status()["workers"]}
    finally:
        stray.kill()
        stray.wait()


def _stream_until_error(d: Daemon, out: dict[str, Any], started: threading.Event) -> None:
    try:
        with d.client() as c:
            for chunk in c.stream("tell me a long story", **LONG):
                if chunk.tokens >= 3:
                    started.set()
    except LlamapoolError as e:
        out["error"] = e
    finally:
        started.set()


def test_a_second_sigint_stops_at_once_and_streams_end_with_a_typed_error(start_daemon: Any) -> None:
    d: Daemon = start_daemon(wait_workers=1, server={"drain_timeout": 60.0}, **ONE_LONG_SLOT)
    out: dict[str, Any] = {}
    started = threading.Event()
    t = threading.Thread(target=_stream_until_error, args=(d, out, started))
    t.start()
    assert started.wait(30)
    d.proc.send_signal(signal.SIGINT)
    log = d.wait_log("draining", timeout=10)
    assert "Ctrl-C again" in log
    time.sleep(0.5)
    assert d.proc.poll() is None, "the first SIGINT drains: the stream is still running"
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(20) == 0
    assert time.monotonic() - t0 < 15  # not the 60 s drain
    t.join(10)
    err = out.get("error")
    assert isinstance(err, (UnavailableError, WorkerLostError)), (t.is_alive(), out, d.log_text())
    assert err.tokens_delivered is not None and err.tokens_delivered >= 3


def test_a_fast_stop_ends_http_streams_with_an_error_event(start_daemon: Any) -> None:
    port = free_port()
    d: Daemon = start_daemon(wait_workers=1, http={"listen": f"127.0.0.1:{port}"}, **ONE_LONG_SLOT)
    d.wait_log("listening on", timeout=30)
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = {"prompt": "Once upon a time", "stream": True, "max_tokens": 100000, "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) >= 3:
                        started.set()
        started.set()

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(30)
    d.proc.send_signal(signal.SIGQUIT)
    assert d.proc.wait(30) == 0
    t.join(10)
    assert not t.is_alive()
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors, f"no error event at the end of the stream: {events[-3:]}"
    assert errors[-1]["code"] in ("unavailable", "worker_lost"), errors[-1]


def test_ready_then_health_go_503_while_the_router_cannot_be_reached(start_daemon: Any) -> None:
    """/ready fails once the router has not answered for 2 s (the endpoint picker's own staleness),
    /health (liveness) once it has not answered for 5 s; both come back with the router."""
    port = free_port()
    d: Daemon = start_daemon(wait_workers=1, workers={"cpu_workers": 1}, http={"listen": f"127.0.0.1:{port}"})
    d.wait_log("listening on", timeout=30)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 15
    while httpx.get(url + "/ready", timeout=10).status_code != 200:
        assert time.monotonic() < end, "not ready"
        time.sleep(0.05)
    os.kill(d.proc.pid, signal.SIGSTOP)  # the router (a thread of the supervisor) stops answering
    t0 = time.monotonic()
    try:
        first_503: dict[str, float] = {}
        while len(first_503) < 2 and time.monotonic() - t0 < 15:
            for path in ("/ready", "/health"):
                r = httpx.get(url + path, timeout=10)
                if r.status_code == 503 and path not in first_503:
                    assert r.json()["status"] == "unavailable" and "has not answered" in r.json()["error"], r.text
                    first_503[path] = time.monotonic() - t0
            time.sleep(0.05)
        assert 1.5 < first_503["/ready"] < 4.0 and 4.5 < first_503["/health"] < 8.0, first_503
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    end = time.monotonic() + 15
    while httpx.get(url + "/ready", timeout=10).status_code != 200 or httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < end, "the probes did not come back"
        time.sleep(0.2)


def test_the_first_stop_signal_drains_what_is_in_flight(start_daemon: Any) -> None:
    d: Daemon = start_daemon(wait_workers=1, **ONE_LONG_SLOT)
    result: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        with d.client() as c:
            s = c.stream("hello", max_tokens=4000, ignore_eos=True)
            for chunk in s:
                if chunk.tokens >= 3:
                    started.set()
            result["done"] = s.completion

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    d.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert d.proc.wait(30) == 0
    assert "done" in result, d.log_text()
    assert result["done"].usage.completion_tokens == 4000  # it finished, not cut
