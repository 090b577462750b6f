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
from llamapool.protocol.control import PoolModels, RetireWorker
from llamapool.supervisor.surge import plan_name
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


def test_metrics_carry_each_models_name(pool: tuple[Daemon, str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    d, _ = pool
    with d.client() as c:
        c.generate("hi", model="beta", max_tokens=3, ignore_eos=True)
        c.generate("hi", model="alpha", max_tokens=3, ignore_eos=True)
        fams = {f.name: f for f in text_string_to_metric_families(c.metrics())}
    ok = {s.labels["model"]: s.value for s in fams["llamapool_requests"].samples
          if s.name == "llamapool_requests_total" and s.labels["outcome"] == "ok"}
    assert ok["alpha"] >= 1 and ok["beta"] >= 1
    gen = {s.labels["worker"]: s.labels["model"] for s in fams["llamapool_generated_tokens"].samples}
    assert gen["alpha-cpu0"] == "alpha" and gen["beta-cpu0"] == "beta"
    ttft = {s.labels["model"] for s in fams["llamapool_request_duration_seconds"].samples}
    assert ttft == {"alpha", "beta"}


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
    assert "model alpha (default): loaded, load always: 1 worker(s) alpha-cpu0" in out.stdout
    assert "model beta: loaded, load always: 1 worker(s) beta-cpu0" in out.stdout
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
    listed = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m["workers"]) for m in listed] == [("alpha", ["alpha-cpu0"]), ("beta", ["beta-cpu0"])]
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
        assert {plan_name(w["id"]) for w in st["workers"]} == {"alpha-cpu0", "gamma-cpu0"}, st
        with d.client() as c:
            assert c.generate("hi", model="gamma", max_tokens=2).worker == "gamma-cpu0"
            with pytest.raises(UnknownModelError):
                c.generate("hi", model="beta", max_tokens=2)
            text = c.metrics()  # the retired worker keeps its counters and shows as stopped, not starting
        beta_states = {ln.split('state="')[1].split('"')[0]: ln.rsplit(" ", 1)[1] for ln in text.splitlines()
                       if ln.startswith("llamapool_worker_state{") and 'worker="beta-cpu0"' in ln}
        assert beta_states.get("stopped") == "1.0" and beta_states.get("starting") == "0.0", beta_states
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
        rows = {plan_name(w["id"]): w for w in d.status()["workers"]}  # alpha-cpu0~2 after two reloads
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


# ---------------------------------------------------------------- units: planning, env, engine parameters


class FourGpus:
    """FakeNvml with four GPUs."""

    def __new__(cls) -> Any:
        from tests.test_supervisor_units import FakeNvml

        nv = FakeNvml()
        nv.uuids = [f"GPU-{i}{i}{i}{i}" for i in range(4)]
        return nv


def plan(raw: dict[str, Any], nvml: Any = None) -> tuple[Any, list[Any]]:
    from llamapool.config import from_dict
    from llamapool.supervisor.arbiter import Supervisor

    cfg = from_dict(raw)
    sup = Supervisor(cfg, nvml=nvml, use_nvml=nvml is not None)
    sup.slots = sup._plan(cfg)
    return sup, sup.slots


def test_a_gpu_group_worker_gets_its_group_and_a_split_spec() -> None:
    from llamapool.supervisor.env import worker_env

    sup, slots = plan({"models": [
        {"name": "big", "path": "/b.gguf", "devices": [[0, 1], ["GPU-2222", 3]], "tensor_split": [3, 1]},
    ]}, FourGpus())
    assert [(s.name, s.device) for s in slots] == [("big-gpu0+1", "GPU-0000,GPU-1111"),
                                                   ("big-gpu2+3", "GPU-2222,GPU-3333")]
    env = worker_env({"CUDA_VISIBLE_DEVICES": "0"}, slots[1].gpus, {"CUDA_VISIBLE_DEVICES": "1"}, 4)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-2222,GPU-3333" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    spec = sup._spec(slots[0])
    assert spec.device == "GPU-0000,GPU-1111" and spec.n_gpus == 2 and spec.tensor_split == (3.0, 1.0)
    assert spec.model_name == "big"
    info = slots[1].info()
    assert info["gpu_indices"] == [2, 3] and info["model"] == "big"


def test_models_share_the_gpus_without_overlap_and_auto_takes_the_rest() -> None:
    _, slots = plan({"models": [{"name": "a", "path": "/a.gguf"},
                                {"name": "b", "path": "/b.gguf", "devices": [["GPU-1111", 2]]}]}, FourGpus())
    assert [s.name for s in slots] == ["a-gpu0", "a-gpu3", "b-gpu1+2"]
    _, legacy = plan({"model": {"path": "/m.gguf"}}, FourGpus())
    assert [s.name for s in legacy] == ["gpu0", "gpu1", "gpu2", "gpu3"], "one [model]: the names stay"


@pytest.mark.parametrize("models, match", [
    ([{"devices": [1]}, {"devices": ["GPU-1111"]}], r"models\[1\]\.devices: GPU 1 \(GPU-1111\) of model 'b' is "
                                                    r"also given to model 'a'"),
    ([{}, {}], r"models\[1\]\.devices: \"auto\" finds no GPU left for model 'b'"),
    ([{"devices": [7]}, {}], r"models\[0\]\.devices: no GPU 7"),
])
def test_gpu_conflicts_found_with_nvml_name_both_models(models: list[dict[str, Any]], match: str) -> None:
    from llamapool.config import ConfigError

    tables = [{"name": n, "path": f"/{n}.gguf", **m} for n, m in zip("ab", models, strict=True)]
    with pytest.raises(ConfigError, match=match):
        plan({"models": tables}, FourGpus())


def test_cpu_cores_are_split_between_all_cpu_workers_of_all_models(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    sup, slots = plan({"workers": {"devices": "cpu"}, "models": [
        {"name": "a", "path": "/a.gguf", "cpu_workers": 2}, {"name": "b", "path": "/b.gguf", "cpu_workers": 1},
        {"name": "c", "path": "/c.gguf", "cpu_workers": 1, "threads": 5}]})
    assert [s.name for s in slots] == ["a-cpu0", "a-cpu1", "b-cpu0", "c-cpu0"]
    assert [sup._spec(s).threads for s in slots] == [3, 3, 3, 5]  # 12 cores / 4 CPU workers; c sets its own
    assert [sup._spec(s).device for s in slots] == ["cpu"] * 4


def test_engine_splits_layers_over_a_group_and_checks_it_sees_exactly_its_gpus() -> None:
    import llama_cpp as L

    from llamapool.worker.engine import EngineConfig, model_params
    from llamapool.worker.server import WorkerSpec, gpu_mismatch

    one, _ = model_params(EngineConfig("/m.gguf", gpu=True))
    assert one.split_mode == L.LLAMA_SPLIT_MODE_NONE and one.n_gpu_layers == -1
    cpu, _ = model_params(EngineConfig("/m.gguf"))
    assert cpu.n_gpu_layers == 0 and cpu.split_mode == L.LLAMA_SPLIT_MODE_NONE
    two, keep = model_params(EngineConfig("/m.gguf", gpu=True, n_gpus=2, tensor_split=(3.0, 1.0)))
    assert two.split_mode == L.LLAMA_SPLIT_MODE_LAYER and two.n_gpu_layers == -1 and two.main_gpu == 0
    assert [two.tensor_split[i] for i in range(3)] == [3.0, 1.0, 0.0] and keep is not None
    auto, _ = model_params(EngineConfig("/m.gguf", gpu=True, n_gpus=2))
    assert auto.split_mode == L.LLAMA_SPLIT_MODE_LAYER and not auto.tensor_split  # llama.cpp's own split

    base = {"name": "w", "backend": "ipc://x", "model_path": "/m", "slots": 1, "ctx_per_slot": 8,
            "max_batch_tokens": 8, "n_ubatch": 8, "threads": 1, "flash_attn": True, "heartbeat_interval": 1.0,
            "heartbeat_liveness": 3}
    group = WorkerSpec(device="GPU-a,GPU-b", **base)  # type: ignore[arg-type]
    assert group.n_gpus == 2 and gpu_mismatch(group, ["H200 (0:19)", "H200 (0:1A)"]) == ""
    assert "expected exactly 2" in gpu_mismatch(group, ["H200 (0:19)"])
    assert "expected exactly one" in gpu_mismatch(WorkerSpec(device="GPU-a", **base), [])  # type: ignore[arg-type]
    assert "expected none" in gpu_mismatch(WorkerSpec(device="cpu", **base), ["H200"])  # type: ignore[arg-type]
    assert WorkerSpec.from_json(group.to_json()) == group


def test_router_keeps_a_removed_models_worker_until_its_queue_is_served() -> None:
    import zmq

    from llamapool.protocol import codec
    from llamapool.protocol.messages import Error, Generate, Hello, Result, Run, Step
    from llamapool.router.broker import Router, RouterConfig

    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.bind("inproc://ctl-models")
    r = Router(RouterConfig("inproc://f-models", "inproc://b-models", models=("a", "b")), ctx, "inproc://ctl-models")
    sent: list[tuple[str, Any]] = []
    replies: list[Any] = []
    r._send_worker = lambda w, msg: sent.append((w.name, msg))  # type: ignore[method-assign]
    r._reply = lambda client, msg: replies.append(msg)  # type: ignore[method-assign]
    try:
        r._on_worker(b"b-cpu0:7", [codec.encode(Hello("b-cpu0", 7, "cpu", "desc", 1, 64, 10, [], "b"))])
        r._on_worker(b"a-cpu0:8", [codec.encode(Hello("a-cpu0", 8, "cpu", "desc", 1, 64, 10, [], "a"))])
        r._on_client(b"c", [codec.encode(Generate("x", ["p1", "p2"], batch=True, model="b"))])
        r._dispatch()
        runs = [(n, m.rid) for n, m in sent if isinstance(m, Run)]
        assert [n for n, _ in runs] == ["b-cpu0"] and len(r.queues["b"]) == 1, "b's jobs wait for b's worker"
        r._on_control(PoolModels(["a"]))
        r._on_control(RetireWorker("b-cpu0"))
        r._housekeeping(time.monotonic())
        assert not any(type(m).__name__ == "Shutdown" for _, m in sent), "retired before its queue was served"
        r._on_client(b"c", [codec.encode(Generate("y", ["p"], model="b"))])
        assert isinstance(replies[-1], Error) and replies[-1].code == "unknown_model"
        assert "'a'" in replies[-1].message and "'b'" in replies[-1].message
        r._on_step(r.workers["b-cpu0"], Step(done=[[runs[0][1], "length", "t", 1, 1]]))
        r._dispatch()
        second = [m.rid for n, m in sent if isinstance(m, Run)][-1]
        assert second != runs[0][1] and not r.queues["b"]
        r._housekeeping(time.monotonic())
        assert type(sent[-1][1]).__name__ == "Shutdown" and sent[-1][0] == "b-cpu0"
        r._on_step(r.workers["b-cpu0"], Step(done=[[second, "length", "t", 1, 1]]))
        assert [m.model for m in replies if isinstance(m, Result)] == ["b", "b"]
    finally:
        for sock in (r.front, r.back, r.control, ctl):
            sock.close(linger=0)
        ctx.term()


def test_generate_model_field_on_the_wire() -> None:
    import msgpack

    from llamapool.client.calls import generate_frame
    from llamapool.protocol import codec
    from llamapool.protocol.messages import Generate, Hello, StatusReply

    msg = codec.decode([generate_frame("r", ["p"], False, False, None, {}, "beta")], codec.CLIENT_TYPES)
    assert isinstance(msg, Generate) and msg.model == "beta"
    plain = codec.decode([generate_frame("r", ["p"], False, False, None, {})], codec.CLIENT_TYPES)
    assert isinstance(plain, Generate) and plain.model is None and "model" not in codec.to_dict(plain)
    assert codec.decode([codec.encode(msg)], codec.CLIENT_TYPES) == msg
    for bad in (5, "", "x" * 129, ["a"]):
        frame = msgpack.packb({"v": 1, "type": "generate", "id": "r", "prompt": "p", "model": bad})
        with pytest.raises(codec.ProtocolError) as e:
            codec.decode([frame], codec.CLIENT_TYPES)
        assert e.value.field == "model" and e.value.id == "r"
    with pytest.raises(TypeError, match="model must be a string"):
        generate_frame("r", ["p"], False, False, None, {}, 5)  # type: ignore[arg-type]
    # older peers: a hello without model_name, a status reply without models
    old_hello = {"v": 1, "type": "hello", "worker": "w", "pid": 1, "device": "cpu", "model": "d", "slots": 1,
                 "ctx_per_slot": 8, "n_vocab": 8, "visible_devices": []}
    hello = codec.decode([msgpack.packb(old_hello)], codec.WORKER_TYPES)
    assert isinstance(hello, Hello) and hello.model_name == ""
    reply = codec.decode([msgpack.packb({"v": 1, "type": "status_reply", "id": "s", "workers": [], "queued": 0,
                                         "running": 0})], codec.REPLY_TYPES)
    assert isinstance(reply, StatusReply) and reply.models == []


def test_router_dispatch_skips_a_worker_lost_on_send() -> None:
    """A worker whose socket is gone is lost on the send; its job goes to another worker of the model
    (it once looped on the lost worker)."""
    import zmq

    from llamapool.protocol import codec
    from llamapool.protocol.messages import Generate, Hello, Run
    from llamapool.router.broker import Router, RouterConfig

    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.bind("inproc://ctl-lost")
    r = Router(RouterConfig("inproc://f-lost", "inproc://b-lost", models=("a",)), ctx, "inproc://ctl-lost")
    sent: list[str] = []

    def send(w: Any, msg: Any) -> None:
        if w.name == "a-cpu0":
            r._lose_worker(w, "its socket disconnected")
        elif isinstance(msg, Run):
            sent.append(w.name)

    r._send_worker = send  # type: ignore[method-assign]
    r._reply = lambda client, msg: None  # type: ignore[method-assign]
    try:
        for i in (0, 1):
            hello = Hello(f"a-cpu{i}", i, "cpu", "d", 2, 64, 10, [], "a")
            r._on_worker(f"a-cpu{i}:{i}".encode(), [codec.encode(hello)])
        r._on_client(b"c", [codec.encode(Generate("x", ["p"]))])
        t = threading.Thread(target=r._dispatch, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "dispatch loops on a lost worker"
        assert sent == ["a-cpu1"] and set(r.workers) == {"a-cpu1"} and not r.queues["a"]
    finally:
        for sock in (r.front, r.back, r.control, ctl):
            sock.close(linger=0)
        ctx.term()


def test_a_bad_models_list_on_sighup_is_refused_and_the_pool_keeps_serving(tmp_path: Path, model_path: str) -> None:
    d = launch(tmp_path / "d", model_path, models=models(model_path, TWO[0]))
    try:
        d.wait_ready(1)
        write_config(d.config, model_path, d.config.parent / "run",
                     models=models(model_path, TWO[0], {"name": "alpha", "devices": [0]}))
        d.proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 30
        while "reload refused" not in d.log_text() and time.monotonic() < end:
            time.sleep(0.1)
        assert "reload refused, keeping the running config: models[1].name: 'alpha'" in d.log_text()
        with d.client() as c:
            assert c.generate("still here", model="alpha", max_tokens=2).worker == "alpha-cpu0"
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_a_remote_only_model_without_a_node_says_so(tmp_path: Path, model_path: str) -> None:
    from llamapool.client.errors import UnavailableError

    d = launch(tmp_path / "d", model_path, workers={"devices": "remote"}, server={"queue_timeout": 1.0})
    try:
        end = time.monotonic() + 30
        while "no local worker" not in d.log_text() and time.monotonic() < end:
            time.sleep(0.1)
        with d.client() as c, pytest.raises(UnavailableError) as e:
            c.generate("anyone?", max_tokens=2)
        assert "no node's worker has joined" in e.value.message and "authorized_keys" in e.value.message
    finally:
        d.stop(signal.SIGQUIT, timeout=30)
