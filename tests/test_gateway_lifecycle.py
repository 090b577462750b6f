"""The HTTP gateway's edges: clients that leave before their answer, 503/504, reload, a dead supervisor.

Same setup as tests/test_gateway.py: the real ``openai`` client (or httpx) over a real socket, the
daemon as a process tree with the real engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Daemon, launch, write_config
from tests.test_gateway import GREEDY, free_port, model_name, start_gateway


def gateway_pids(url: str) -> set[int]:
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["pgrep", "-f", f"llamapool.gateway .*{port}"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def eventually(check: Callable[[], bool], timeout: float, what: str, daemon: Daemon) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}\n{daemon.log_text()}")


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    """One worker with one slot, so a second request has to wait in the queue."""
    d, url = start_gateway(tmp_path_factory.mktemp("gw1"), model_path, model={"ctx_per_slot": 8192},
                           workers={"cpu_workers": 1, "slots": 1})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


# ---------------------------------------------------------------- clients that leave early


def test_a_client_that_leaves_before_a_whole_answer_frees_the_slot(one_slot: tuple[Daemon, str]) -> None:
    """Not streamed: nothing is sent until the end, so the gateway must watch for the disconnect."""
    d, url = one_slot
    with pytest.raises(httpx.TimeoutException):  # ~6.5 s of generation; the client gives up after 0.5 s
        httpx.post(url + "/v1/completions", timeout=0.5, json={
            "prompt": "Hello", "max_tokens": 6000, "temperature": 0, "ignore_eos": True})
    eventually(lambda: d.status()["running"] == 0, 1.5, "the request cancelled on the worker", d)


def test_a_streaming_client_that_leaves_while_queued_leaves_the_queue(one_slot: tuple[Daemon, str]) -> None:
    """No event is sent before the first token; a client that gives up while queued must not hold a
    place in the queue (and then a slot) until its turn comes."""
    d, url = one_slot
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    holder = c.completions.create(model=model_name(c), prompt="Hello", max_tokens=6000, stream=True, **GREEDY)
    next(iter(holder))  # the only slot is taken
    try:
        with pytest.raises(httpx.TimeoutException):
            with httpx.stream("POST", url + "/v1/completions", timeout=0.5, json={
                    "prompt": "Hi", "max_tokens": 8, "stream": True}) as r:
                r.read()
        assert d.status()["running"] == 1
        eventually(lambda: d.status()["queued"] == 0, 1.0, "the queued request withdrawn", d)
    finally:
        holder.close()
    eventually(lambda: d.status()["running"] == 0, 2.0, "the holder cancelled", d)


# ---------------------------------------------------------------- error parameters


def test_errors_from_the_router_name_the_openai_parameter(one_slot: tuple[Daemon, str]) -> None:
    c = openai.OpenAI(base_url=one_slot[1] + "/v1", api_key="x", max_retries=0)
    name = model_name(c)
    with pytest.raises(openai.BadRequestError) as e:  # the router refuses an empty prompt of a batch
        c.completions.create(model=name, prompt=["Hello", ""], max_tokens=2)
    assert e.value.body["param"] == "prompt[1]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # an empty role (the gateway's check), named as a message
        c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"},
                                                        {"role": "", "content": "x"}])  # type: ignore[list-item]
    assert e.value.body["param"] == "messages[1].role"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # a worker's check on a streamed prompt
        c.completions.create(model=name, prompt=[5] * 9000, max_tokens=2, stream=True)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]


# ---------------------------------------------------------------- 503, and a supervisor killed with -9


def test_no_worker_is_503_and_the_gateway_dies_with_its_supervisor(tmp_path: Path, model_path: str) -> None:
    """A pool that served and then lost every worker for good (its model file became corrupt) runs on
    (a pool that never had a ready worker exits 78 instead: test_faults): /ready is 503 (the process
    still answers: /health is 200), requests get OpenAI's 503 with code ``unavailable``."""
    model = tmp_path / "broken.gguf"
    model.write_bytes(Path(model_path).read_bytes())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    d = launch(tmp_path / "d", str(model), http={"listen": f"127.0.0.1:{port}"})
    try:
        def ready() -> bool:
            try:
                rows = d.status()["workers"]
            except Exception:
                return False
            return bool(rows) and all(w["state"] == "ready" for w in rows)

        eventually(ready, 30, "every worker ready", d)
        model.write_bytes(b"not a model" * 100)
        for w in d.status()["workers"]:
            os.kill(w["pid"], signal.SIGKILL)  # each restart now fails for good (exit 78)

        def failed() -> bool:
            try:
                return all(w["state"] == "failed" for w in d.status()["workers"])
            except Exception:
                return False

        eventually(failed, 30, "every worker failed", d)
        eventually(lambda: bool(gateway_pids(url)), 10, "the gateway started", d)

        def probe(path: str) -> httpx.Response | None:
            try:
                return httpx.get(url + path, timeout=2)
            except httpx.HTTPError:
                return None

        eventually(lambda: probe("/ready") is not None, 10, "the gateway answers", d)
        r = probe("/ready")
        assert r is not None and r.status_code == 503 and r.json()["workers_ready"] == 0, r
        assert r.json()["status"] == "unavailable" and r.json()["states"] == {"failed": 2}, r.json()
        h = probe("/health")
        assert h is not None and h.status_code == 200, h
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="broken", prompt="Hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "unavailable"  # type: ignore[index]
        pids = gateway_pids(url)
        d.proc.kill()  # no drain, no SIGTERM to the gateway: it must notice on its own
        d.proc.wait()
        eventually(lambda: not gateway_pids(url) & pids, 5, "the orphaned gateway exited", d)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGQUIT)
        for pid in gateway_pids(url):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- reload, and 504


def test_reload_replaces_the_gateway_and_its_streams_finish(tmp_path: Path, model_path: str) -> None:
    """SIGHUP starts a gateway with the new [http] (here: API keys and a 1 s request timeout) next to
    the old one, which finishes its stream and exits."""
    d, url = start_gateway(tmp_path / "d", model_path, model={"ctx_per_slot": 8192},
                           workers={"cpu_workers": 1, "slots": 2})
    try:
        old = gateway_pids(url)
        assert len(old) == 1
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        name = model_name(c)
        stream = iter(c.completions.create(model=name, prompt="Hello", max_tokens=2500, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
        next(stream)
        keys = tmp_path / "keys"
        keys.write_text("k-1\n")
        sections: dict[str, Any] = {
            "model": {"ctx_per_slot": 8192}, "workers": {"cpu_workers": 1, "slots": 2},
            "http": {"listen": url.removeprefix("http://"), "api_keys_file": str(keys), "request_timeout": 1.0}}
        write_config(d.config, model_path, d.config.parent / "run", **sections)
        worker = d.status()["workers"][0]["pid"]
        d.proc.send_signal(signal.SIGHUP)

        def refused() -> bool:  # no connection is reset meanwhile: both accept on the supervisor's socket
            return httpx.get(url + "/v1/models", timeout=5).status_code == 401

        eventually(refused, 15, "the new gateway (with keys) serving", d)
        chunks = list(stream)  # the old gateway lets it finish
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2500
        eventually(lambda: not gateway_pids(url) & old, 10, "the old gateway exited", d)
        assert len(gateway_pids(url)) == 1
        d.wait_ready(1, exclude_pids={worker})
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="k-1", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:  # the new request_timeout: 504
            keyed.completions.create(model=name, prompt="Hello", max_tokens=6000, **GREEDY)
        assert e.value.status_code == 504 and e.value.body["code"] == "timeout"  # type: ignore[index]
        with pytest.raises(openai.APIError) as e2:  # mid-stream, an error event ends the stream
            for _ in keyed.completions.create(model=name, prompt="Hello", max_tokens=6000, stream=True, **GREEDY):
                pass
        assert e2.value.body["code"] == "timeout"  # type: ignore[index]
        assert d.status()["running"] == 0
    finally:
        d.stop(signal.SIGQUIT, timeout=30)
