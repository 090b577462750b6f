"""A pool that follows demand (docs/configuration.md, "A pool that follows demand"): models loaded at
their first request and placed by memory, idle ones unloaded, the least recently used idle model evicted
when another needs the room, replicas that follow the load, an operator's load/unload/pin, and a load
that fails. The real daemon on CPU workers against a RAM budget (``[pool] ram_budget``), real sockets."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamapool import Client, LlamapoolError, UnknownModelError
from llamapool.supervisor.pool import worker_need
from tests.conftest import Daemon, free_port, launch
from tests.test_gateway import wait_http

SIZES = {"ctx_per_slot": 256, "max_batch_tokens": 256, "n_ubatch": 256, "slots": 4, "threads": 1}


def table(path: str, name: str, **kw: Any) -> dict[str, Any]:
    return {"path": path, "name": name, **SIZES, **kw}


def need(path: str) -> int:
    """What the pool estimates one worker of the test's models takes (the budget is set from it)."""
    from llamapool.config import ModelConfig

    return worker_need(ModelConfig(path=path, **{k: v for k, v in SIZES.items() if k != "threads"}), gpu=False)[0]


def model_row(d: Daemon, name: str) -> dict[str, Any]:
    return next(m for m in d.status()["models"] if m["name"] == name)


def wait_state(d: Daemon, name: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    row: dict[str, Any] = {}
    while time.monotonic() < end:
        row = model_row(d, name)
        if row.get("state") == state:
            return row
        time.sleep(0.05)
    raise AssertionError(f"model {name} not {state} in {timeout}s: {row}\n{d.log_text()}")


def greedy(c: Client, model: str, prompt: str = "Hello", n: int = 8) -> str:
    return c.generate(prompt, model=model, max_tokens=n, temperature=0.0, ignore_eos=True).text


@pytest.fixture
def copies(tmp_path: Path, model_path: str) -> list[str]:
    """Four files of the tiny model: four models as far as the pool can tell."""
    out = []
    for i in range(4):
        p = tmp_path / f"m{i}.gguf"
        shutil.copy(model_path, p)
        out.append(str(p))
    return out


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        if d.proc.poll() is None:
            d.stop(signal.SIGQUIT, timeout=30)


def start(daemons: list[Daemon], folder: Path, model_path: str, **sections: Any) -> Daemon:
    """The daemon, once its router answers (a pool of on-demand models has no worker to wait for)."""
    d = launch(folder, model_path, **sections)
    daemons.append(d)
    end = time.monotonic() + 30
    while True:
        try:
            d.status()
            return d
        except LlamapoolError:
            if time.monotonic() > end or d.proc.poll() is not None:
                raise AssertionError(f"the daemon does not answer:\n{d.log_text()}") from None
            time.sleep(0.05)


def test_an_on_demand_model_is_loaded_by_its_first_request_which_it_then_serves(
        tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    d = start(daemons, tmp_path / "d", model_path, models=[
        table(model_path, "always", cpu_workers=1), table(model_path, "lazy", load="on_demand")])
    d.wait_ready(1)
    assert model_row(d, "lazy")["state"] == "unloaded" and model_row(d, "lazy")["workers"] == []
    assert model_row(d, "always")["state"] == "loaded"
    with d.client() as c:
        lazy = greedy(c, "lazy")  # waits in the router while a worker starts for it
        assert lazy == greedy(c, "always")  # the same file: the same greedy text
    row = model_row(d, "lazy")
    assert row["state"] == "loaded" and row["workers"] == ["lazy-cpu0"] and row["loads"] == 1
    assert "placement: start lazy-cpu0" in d.log_text() and "placement: lazy loaded on lazy-cpu0" in d.log_text()
    with d.client() as c:
        metrics = c.metrics()
    assert 'llamapool_model_state{model="lazy",state="loaded"} 1.0' in metrics
    assert 'llamapool_model_loads_total{model="lazy"} 1.0' in metrics
    assert re.search(r'llamapool_model_load_seconds_count\{model="lazy"\} 1\.0', metrics)


def test_an_idle_model_is_unloaded_after_its_idle_unload_and_loaded_again_when_asked(
        tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    d = start(daemons, tmp_path / "d", model_path, models=[table(model_path, "lazy", load="on_demand",
                                                                  idle_unload="2s")],
              pool={"min_residency": 0.0})
    with d.client() as c:
        first = greedy(c, "lazy")
        t_used = time.monotonic()
        wait_state(d, "lazy", "unloaded", timeout=30)
        idle_for = time.monotonic() - t_used
        assert 2.0 <= idle_for < 10.0, idle_for
        assert greedy(c, "lazy") == first
    row = model_row(d, "lazy")
    assert row["loads"] == 2 and row["unloads"] == 1, row
    assert "placement: retire lazy-cpu0" in d.log_text()


def test_more_models_than_the_ram_budget_holds_serve_every_request_evicting_only_idle_ones(
        tmp_path: Path, copies: list[str], daemons: list[Daemon]) -> None:
    """Four on-demand models, two of which fit the budget; traffic moves between pairs of them, each
    phase with requests in flight: every request is answered, and only idle models are evicted."""
    budget = int(need(copies[0]) * 2.5)
    d = start(daemons, tmp_path / "d", copies[0],
              models=[table(p, f"m{i}", load="on_demand") for i, p in enumerate(copies)],
              pool={"ram_budget": f"{budget}B", "min_residency": 0.5}, server={"queue_timeout": 60.0})
    errors: list[str] = []
    answered = 0
    lock = threading.Lock()

    def traffic(model: str, n: int) -> None:
        nonlocal answered
        with Client(d.endpoint) as c:
            for i in range(n):
                try:
                    c.generate(f"phase {model} {i}", model=model, max_tokens=6, temperature=0.0, ignore_eos=True)
                    with lock:
                        answered += 1
                except LlamapoolError as e:
                    with lock:
                        errors.append(f"{model}: {e}")

    phases = [("m0", "m1"), ("m2", "m3"), ("m0", "m2"), ("m1", "m3")]
    for pair in phases:
        threads = [threading.Thread(target=traffic, args=(m, 4)) for m in pair for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        loaded = [m["name"] for m in d.status()["models"] if m["state"] in ("loaded", "loading")]
        assert len(loaded) <= 2, loaded  # the budget holds two
    assert errors == [] and answered == len(phases) * 2 * 2 * 4, errors
    log = d.log.read_text()
    evictions = re.findall(r"placement: evict (\S+): (.*)", log)
    assert evictions, log
    # the policy evicted only workers that ran nothing (the router's count), of models nothing waited for
    assert all(", idle," in why for _, why in evictions), evictions
    status = d.status()
    assert sum(m.get("evictions", 0) for m in status["models"]) == len(evictions)
    loads = sum(m.get("loads", 0) for m in status["models"])
    assert loads <= 2 * len(phases), loads  # no thrash: a load per model a phase at most


def test_operator_load_pin_unload_over_the_sdk_the_cli_and_http(
        tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    port = free_port()
    d = start(daemons, tmp_path / "d", model_path, http={"listen": f"127.0.0.1:{port}"}, models=[
        table(model_path, "always", cpu_workers=1), table(model_path, "lazy", load="on_demand", idle_unload=1.0)],
        pool={"min_residency": 0.0})
    d.wait_ready(1)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, d)
    with d.client() as c:
        reply = c.load_model("lazy", wait=True, timeout=60)
        assert reply["state"] == "loaded", reply
        assert c.pin_model("lazy")["action"] == "pin"
        time.sleep(2.5)  # past idle_unload: pinned, it stays
        assert model_row(d, "lazy")["state"] == "loaded" and model_row(d, "lazy")["pinned"] is True
        with pytest.raises(UnknownModelError, match="nope"):
            c.load_model("nope")
        with pytest.raises(LlamapoolError, match='load = "always"'):
            c.unload_model("always")
    cli = [sys.executable, "-m", "llamapool.cli"]
    out = subprocess.run([*cli, "unload", "lazy", "--endpoint", d.endpoint], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "unloading" in out.stdout, out
    wait_state(d, "lazy", "unloaded", timeout=30)
    assert model_row(d, "lazy")["pinned"] is False
    out = subprocess.run([*cli, "load", "lazy", "--endpoint", d.endpoint], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "(state: loaded)" in out.stdout, out
    r = httpx.post(f"{url}/models/unload", json={"model": "lazy"}, timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["model"] == "lazy", r.text
    wait_state(d, "lazy", "unloaded", timeout=30)
    r = httpx.post(f"{url}/models/load", json={"model": "ghost"}, timeout=30)
    assert r.status_code == 404 and "ghost" in r.text, r.text
    r = httpx.post(f"{url}/models/load", json={}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert listed["lazy"]["state"] == "unloaded" and listed["always"]["state"] == "loaded"
    assert listed["lazy"]["load"] == "on_demand"


def test_a_load_that_fails_fails_its_waiting_requests_naming_the_model_and_the_others_serve(
        tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    d = start(daemons, tmp_path / "d", model_path, models=[
        table(model_path, "good", cpu_workers=1), table(str(bad), "broken", load="on_demand")])
    d.wait_ready(1)
    with d.client() as c:
        with pytest.raises(LlamapoolError) as e:
            greedy(c, "broken")
        assert "broken" in str(e.value) and "failed to load" in str(e.value), e.value
        t0 = time.monotonic()
        with pytest.raises(LlamapoolError, match="next try in"):  # within the back-off: at once
            greedy(c, "broken")
        assert time.monotonic() - t0 < 2.0
        assert greedy(c, "good")
    row = model_row(d, "broken")
    assert row["state"] == "failed" and "failed to load" in row["reason"] and row["load_failures"] == 1, row


def test_a_model_that_can_never_fit_is_refused_with_both_numbers(
        tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    d = start(daemons, tmp_path / "d", model_path, models=[
        table(model_path, "good", cpu_workers=1), table(model_path, "huge", load="on_demand")],
        pool={"ram_budget": f"{need(model_path) // 2}B"})
    d.wait_ready(1)
    with d.client() as c, pytest.raises(LlamapoolError) as e:
        greedy(c, "huge")
    assert re.search(r"huge' can never be loaded: it needs .* \+ 96 MiB process = (\d+) MiB, more than the CPU "
                     r"workers' RAM budget \(pool.ram_budget\) holds \((\d+) MiB\)", str(e.value)), e.value
    assert "can never be loaded" in d.log_text()


def test_replicas_follow_the_load_up_and_back_down(tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    d = start(daemons, tmp_path / "d", model_path, models=[
        table(model_path, "busy", replicas=[1, 2], slots=2)],
        pool={"scale_up_wait": 0.2, "scale_down_idle": 1.5, "min_residency": 0.5})
    d.wait_ready(1)
    assert model_row(d, "busy")["replicas"] == 1
    # its floor's worker was spawned once (a second process of the same name would take turns with it)
    assert len(re.findall(r"busy-cpu0: started pid", d.log.read_text())) == 1, d.log_text()
    errors: list[str] = []
    served = threading.Event()  # the second replica took a share of the load
    deadline = time.monotonic() + 180  # a slow machine's load: the flood lasts until then at most

    def flood() -> None:
        with Client(d.endpoint) as c:
            i = 0
            while not served.is_set() and time.monotonic() < deadline:
                try:
                    c.generate(f"load {i}", model="busy", max_tokens=160, temperature=0.0, ignore_eos=True)
                except LlamapoolError as e:
                    errors.append(str(e))
                i += 1

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    seen = 1
    while any(t.is_alive() for t in threads):
        seen = max(seen, len([w for w in d.status()["workers"] if w["state"] == "ready"]))
        if "worker=busy-cpu1 outcome=ok" in d.log.read_text():
            served.set()
        time.sleep(0.1)
    assert errors == [] and seen == 2, (errors, seen, d.log_text())
    assert served.is_set(), d.log_text()  # the new replica took its share
    row = wait_state(d, "busy", "loaded")
    end = time.monotonic() + 30
    while model_row(d, "busy")["replicas"] > 1 and time.monotonic() < end:
        time.sleep(0.1)
    row = model_row(d, "busy")
    assert row["replicas"] == 1 and row["unloads"] >= 1, row


@pytest.mark.parametrize(("tables", "pool", "match"), [
    ([{"load": "lazy"}], {}, r'models\[0\]\.load: must be "always" .* or "on_demand"'),
    ([{"replicas": [3, 1]}], {}, r"models\[0\]\.replicas: must be \[at least, at most\]"),
    ([{"replicas": [0, 0]}], {}, r"models\[0\]\.replicas"),
    ([{"replicas": 2}], {}, r"models\[0\]\.replicas"),
    ([{"idle_unload": "soon"}], {}, r'models\[0\]\.idle_unload: must be seconds or a duration such as "90s"'),
    ([{"load": "on_demand", "devices": "remote"}], {}, r"models\[0\]\.devices: load = \"on_demand\" places"),
    ([{"replicas": [1, 2], "devices": [[0, 1]]}], {}, r"models\[0\]\.devices: replicas places each worker"),
    ([{}], {"ram_budget": "lots"}, r'pool\.ram_budget: must be a size such as "16GiB"'),
    ([{}], {"ram_budget": "150%"}, r"pool\.ram_budget: a share of the RAM must be"),
    ([{}], {"min_residency": -1}, r"pool\.min_residency: must be >= 0"),
    ([{}], {"surge": 1}, r"pool\.surge: unknown key"),
])
def test_bad_pool_settings_are_config_errors_naming_the_key(tables: list[dict[str, Any]], pool: dict[str, Any],
                                                            match: str) -> None:
    from llamapool.config import ConfigError, from_dict

    raw: dict[str, Any] = {"models": [{"path": "/m.gguf", "name": f"m{i}", **t} for i, t in enumerate(tables)]}
    if pool:
        raw["pool"] = pool
    with pytest.raises(ConfigError, match=match):
        from_dict(raw)


def test_pool_settings_parse_durations_sizes_and_defaults() -> None:
    from llamapool.config import from_dict, ram_budget

    cfg = from_dict({"pool": {"idle_unload": "1h30m", "scale_up_wait": 0.5},
                     "models": [{"path": "/a.gguf", "name": "a"},
                                {"path": "/b.gguf", "name": "b", "load": "on_demand", "idle_unload": "90s"},
                                {"path": "/c.gguf", "name": "c", "replicas": [1, 4], "devices": [0, 1]},
                                {"path": "/d.gguf", "name": "d", "devices": [0, 1]}]})
    a, b, c, _ = cfg.models
    assert cfg.pool.idle_unload == 5400.0 and b.idle_unload == 90.0 and a.idle_unload == -1
    assert not a.managed and b.managed and c.managed  # c shares GPUs 0 and 1 with d: a managed model may
    assert a.replica_bounds == (1, 1) and b.replica_bounds == (0, 1) and c.replica_bounds == (1, 4)
    assert ram_budget("", 100) == 80 and ram_budget("50%", 100) == 50 and ram_budget("2GiB", 0) == 2 << 30
    assert ram_budget("1500MB", 0) == 1_500_000_000


def test_a_cold_gemma_streams_its_first_token_within_its_load_time_and_half_a_second(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """The request that triggers a load is served as soon as the worker is ready: its first token comes
    within the load's own time (spawn to hello, from the log) + 0.5 s, beyond what a first token takes on
    the loaded worker (a warm request's, measured next: on a shared machine a step's time is not ours)."""
    gemma = str(Path(__file__).resolve().parent.parent / "models" / "gemma-3-270m-q4_k_m.gguf")
    if not Path(gemma).exists():
        pytest.skip("models/gemma-3-270m-q4_k_m.gguf is written by `make test` (llamapool fetch-model)")
    d = start(daemons, tmp_path / "d", gemma, models=[table(gemma, "gemma", load="on_demand")])

    def ttft(c: Client, prompt: str) -> float:
        t0, first = time.monotonic(), None
        for _chunk in c.stream(prompt, model="gemma", max_tokens=4, temperature=0.0):
            first = first or time.monotonic() - t0
        assert first is not None
        return first

    with d.client() as c:
        cold = ttft(c, "The capital of France is")
        warm = ttft(c, "Water boils at a temperature of")
    load = float(re.findall(r"placement: gemma loaded on \S+ \(cpu\) in ([\d.]+)s", d.log.read_text())[0])
    print(f"cold Gemma 3 270M: load {load:.2f} s, first token {cold:.2f} s after the request; warm {warm:.2f} s")
    assert cold <= load + warm + 0.5, (cold, load, warm)


def test_a_loaded_on_demand_worker_that_dies_is_replaced_at_the_next_request(
        tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    d = start(daemons, tmp_path / "d", model_path, models=[table(model_path, "lazy", load="on_demand")])
    with d.client() as c:
        first = greedy(c, "lazy")
        pid = next(w["pid"] for w in d.status()["workers"] if w["id"] == "lazy-cpu0")
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while model_row(d, "lazy")["state"] != "unloaded" and time.monotonic() < end:
            time.sleep(0.05)
        assert model_row(d, "lazy")["state"] == "unloaded"  # not failed: it had loaded
        assert greedy(c, "lazy") == first
    assert "its model lazy gets a new worker when it has demand" in d.log.read_text()


def test_a_reload_adds_and_removes_on_demand_models(tmp_path: Path, model_path: str, daemons: list[Daemon]) -> None:
    from tests.conftest import write_config

    d = start(daemons, tmp_path / "d", model_path, models=[table(model_path, "always", cpu_workers=1)])
    d.wait_ready(1)
    both = [table(model_path, "always", cpu_workers=1), table(model_path, "lazy", load="on_demand")]
    write_config(d.config, model_path, d.config.parent / "run", models=both)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("reload done")
    with d.client() as c:
        assert greedy(c, "lazy") == greedy(c, "always")
    assert model_row(d, "lazy")["state"] == "loaded"
    write_config(d.config, model_path, d.config.parent / "run", models=both[:1])
    d.proc.send_signal(signal.SIGHUP)
    end = time.monotonic() + 30
    while any(w["id"] == "lazy-cpu0" and w["state"] != "stopped" for w in d.status()["workers"]) \
            and time.monotonic() < end:
        time.sleep(0.1)
    assert [m["name"] for m in d.status()["models"]] == ["always"]
    assert all(w["id"] != "lazy-cpu0" or w["state"] == "stopped" for w in d.status()["workers"])
