"""Several models in one pool: routing by ``model``, ``unknown_model``, status and /v1/models, and a
SIGHUP that adds and removes models while another one serves (real daemon, two models on CPU)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llamapool import Completion, UnknownModelError
from tests.conftest import Daemon, free_port, launch, write_config
from tests.loadgen import Load
from tests.test_gateway import GREEDY, wait_http

TWO = [{"name": "alpha", "cpu_workers": 1}, {"name": "beta", "cpu_workers": 1, "slots": 2}]


def models(model_path: str, *tables: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"path": model_path, "ctx_per_slot": 512, "max_batch_tokens": 512, "n_ubatch": 512, **t}
            for t in tables]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    """alpha (1 worker, 4 slots) and beta (1 worker, 2 slots), with the HTTP gateway."""
    port = free_port()
    d = launch(tmp_path_factory.mktemp("models"), model_path, models=models(model_path, *TWO),
               http={"listen": f"127.0.0.1:{port}"})
    try:
        d.wait_ready(2)
        url = f"http://127.0.0.1:{port}"
        wait_http(url, d)
        yield d, url
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_each_model_is_served_by_its_own_workers_concurrently(pool: tuple[Daemon, str]) -> None:
    d, _ = pool
    results: list[tuple[str | None, Completion]] = []
    lock = threading.Lock()
    with d.client() as c:

        def one(i: int) -> None:
            model = (None, "alpha", "beta")[i % 3]
            r = c.generate(f"request {i}", model=model, max_tokens=12, temperature=0.0, ignore_eos=True)
            with lock:
                results.append((model, r))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(results) == 12
    for asked, r in results:
        want = asked or "alpha"  # no model: the first
        assert r.model == want and r.worker == f"{want}-cpu0", (asked, r)
        assert r.usage.completion_tokens == 12
    rows = {w["id"]: w for w in d.status()["workers"]}
    assert rows["alpha-cpu0"]["model"] == "alpha" and rows["beta-cpu0"]["model"] == "beta"
    assert rows["beta-cpu0"]["slots"] == 2 and rows["alpha-cpu0"]["slots"] == 4  # per-model slots


def test_client_default_model_and_async_client(pool: tuple[Daemon, str]) -> None:
    import asyncio

    from llamapool import AsyncClient

    d, _ = pool
    with d.client(model="beta") as c:
        assert c.generate("hi", max_tokens=2).model == "beta"
        assert c.generate("hi", max_tokens=2, model="alpha").model == "alpha"
        stream = c.stream("hi", max_tokens=3, ignore_eos=True)
        assert len(list(stream)) >= 1 and stream.completion is not None and stream.completion.model == "beta"

    async def run() -> list[str]:
        async with AsyncClient(d.endpoint, model="beta") as ac:
            one = await ac.generate("hi", max_tokens=2)
            many = await ac.generate_many(["a", "b"], max_tokens=2, model="alpha")
            return [one.model, *(m.model for m in many)]  # type: ignore[union-attr]

    assert asyncio.run(run()) == ["beta", "alpha", "alpha"]


def test_unknown_model_is_an_error_naming_it_and_the_known_ones(pool: tuple[Daemon, str]) -> None:
    d, _ = pool
    with d.client() as c, pytest.raises(UnknownModelError) as e:
        c.generate("hi", model="gamma", max_tokens=2)
    assert e.value.code == "unknown_model" and e.value.field == "model"
    assert "'gamma'" in e.value.message and "'alpha'" in e.value.message and "'beta'" in e.value.message
    with d.client() as c, pytest.raises(UnknownModelError):
        list(c.stream("hi", model="gamma", max_tokens=2))


def test_status_lists_models_with_their_workers(pool: tuple[Daemon, str]) -> None:
    d, _ = pool
    st = d.status()
    assert [(m["name"], m["workers"]) for m in st["models"]] == [("alpha", ["alpha-cpu0"]), ("beta", ["beta-cpu0"])]
    out = subprocess.run([sys.executable, "-m", "llamapool.cli", "status", "--endpoint", d.endpoint],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "model alpha (default): 1 worker(s) alpha-cpu0" in out.stdout
    assert "model beta: 1 worker(s) beta-cpu0" in out.stdout
    gen = subprocess.run([sys.executable, "-m", "llamapool.cli", "generate", "hi", "--max-tokens", "2",
                          "--model", "beta", "--endpoint", d.endpoint], capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0 and "model beta, worker beta-cpu0" in gen.stderr, gen.stderr
    bad = subprocess.run([sys.executable, "-m", "llamapool.cli", "generate", "hi", "--model", "gamma",
                          "--endpoint", d.endpoint], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unknown_model" in bad.stderr


def test_gateway_lists_both_models_and_routes_by_model(pool: tuple[Daemon, str]) -> None:
    _, url = pool
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
    beta = client.completions.create(model="beta", prompt="Hello", max_tokens=4, **GREEDY)
    assert beta.model == "beta"
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, **GREEDY)
    assert chat.model == "alpha"
    streamed = list(client.completions.create(model="beta", prompt="Hello", max_tokens=4, stream=True, **GREEDY))
    assert streamed and all(ch.model == "beta" for ch in streamed)
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="gamma", prompt="Hello", max_tokens=4, stream=stream)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"  # type: ignore[index]
        assert "gamma" in e.value.message
    r = httpx.post(url + "/v1/completions", json={"model": 5, "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_overlapping_devices_is_a_start_up_error_naming_both_models(tmp_path: Path, model_path: str) -> None:
    cfg = write_config(tmp_path / "c.toml", model_path, tmp_path / "run",
                       models=models(model_path, {"name": "a", "devices": [0, 1]}, {"name": "b", "devices": [[1, 2]]}))
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "models[1].devices" in r.stderr and "'a'" in r.stderr and "'b'" in r.stderr


def test_sighup_adds_and_removes_models_with_zero_failures_for_the_one_that_stays(
        tmp_path: Path, model_path: str) -> None:
    d = launch(tmp_path / "d", model_path, models=models(model_path, *TWO), server={"queue_timeout": 60.0})
    try:
        d.wait_ready(2)
        alpha_pid = next(w["pid"] for w in d.status()["workers"] if w["id"] == "alpha-cpu0")
        loads = [Load(d.endpoint, 16, max_tokens=60, model="alpha")]
        threads = [loads[0].start()]
        beta = Load(d.endpoint, 6, max_tokens=400, model="beta")  # 2 slots: 4 of them wait in beta's queue
        threads.append(beta.start())
        loads[0].wait_chunks(4)
        beta.wait_chunks(4)
        # beta leaves, gamma joins
        write_config(d.config, model_path, d.config.parent / "run", server={"queue_timeout": 60.0},
                     models=models(model_path, TWO[0], {"name": "gamma", "cpu_workers": 1}))
        d.proc.send_signal(signal.SIGHUP)
        assert not all(o.finals for o in beta.outcomes.values()), "beta's requests ended before the reload"
        time.sleep(0.5)
        loads.append(Load(d.endpoint, 16, max_tokens=30, model="alpha"))
        threads.append(loads[1].start())
        st = wait_models(d, ["alpha", "gamma"])
        assert {w["id"] for w in st["workers"]} == {"alpha-cpu0", "gamma-cpu0"}, st
        with d.client() as c:
            assert c.generate("hi", model="gamma", max_tokens=2).worker == "gamma-cpu0"
            with pytest.raises(UnknownModelError):
                c.generate("hi", model="beta", max_tokens=2)
        # and back: gamma leaves, beta returns
        write_config(d.config, model_path, d.config.parent / "run", server={"queue_timeout": 60.0},
                     models=models(model_path, *TWO))
        d.proc.send_signal(signal.SIGHUP)
        loads.append(Load(d.endpoint, 16, max_tokens=30, model="alpha"))
        threads.append(loads[2].start())
        wait_models(d, ["alpha", "beta"])
        for t in threads:
            t.join(180)
        for load in loads:
            load.check_every_request_answered_once()
            assert not load.failed(), load.summary()
        beta.check_every_request_answered_once()  # the removed model's accepted requests finished
        assert beta.summary() == {"sent": 6, "finals": 6, "result": 6}, beta.summary()
        with d.client() as c:
            assert c.generate("hi", model="beta", max_tokens=2).worker == "beta-cpu0"
        rows = {w["id"]: w for w in d.status()["workers"]}
        assert rows["alpha-cpu0"]["pid"] != alpha_pid, "the model that stays is rolled onto new processes"
        assert "reload done" in d.log_text()
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def wait_models(d: Daemon, names: list[str], timeout: float = 90.0) -> dict[str, Any]:
    """Wait until the pool has exactly ``names``, each with its workers ready and no other worker."""
    end = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < end:
        st = d.status()
        if [m["name"] for m in st["models"]] == names and {w.get("model") for w in st["workers"]} == set(names) \
                and all(w["state"] == "ready" for w in st["workers"]):
            return st
        time.sleep(0.1)
    raise AssertionError(f"models {names} not ready: {st}\n{d.log_text()}")
