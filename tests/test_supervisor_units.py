"""Supervisor pieces without processes: GPU inventory from a faked NVML, worker environments."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import pytest

from llamapool.config import ConfigError
from llamapool.router.policy import pick_worker, prefix_keys, remember
from llamapool.supervisor import gpus
from llamapool.supervisor.env import cpu_threads, worker_env


class FakeNvml:
    """Two H200s as NVML would list them."""

    def __init__(self, lost: set[int] | None = None):
        self.uuids = ["GPU-11111111-aaaa", "GPU-22222222-bbbb"]
        self.lost = lost or set()

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        i = self.uuids.index(uuid)
        if i in self.lost:
            raise RuntimeError("GPU is lost")
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return self.uuids[h].encode()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=f"00000000:{0x19 + h:02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=150_000 << 20, used=(1000 + h) << 20)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 40

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return 0


def test_inventory_comes_from_nvml() -> None:
    found = gpus.discover(FakeNvml())
    assert [g.uuid for g in found] == ["GPU-11111111-aaaa", "GPU-22222222-bbbb"]
    assert found[1].pci_bus_id == "00000000:1A:00.0" and found[0].name == "NVIDIA H200"
    assert gpus.discover(None) == []


def test_device_selection() -> None:
    found = gpus.discover(FakeNvml())
    assert gpus.select(found, "auto") == found
    assert gpus.select(found, "cpu") == []
    assert gpus.select(found, [1]) == [found[1]]
    assert gpus.select(found, ["GPU-11111111-aaaa"]) == [found[0]]
    with pytest.raises(ConfigError, match=r"workers\.devices"):
        gpus.select(found, [7])


def test_worker_env_pins_one_gpu_by_uuid_and_drops_systemd_vars() -> None:
    g = gpus.discover(FakeNvml())[1]
    base = {"PATH": "/bin", "NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "9",
            "CUDA_VISIBLE_DEVICES": "0,1"}
    env = worker_env(base, g, {"GGML_CUDA_DISABLE_GRAPHS": "1", "CUDA_VISIBLE_DEVICES": "0"}, 4)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-22222222-bbbb"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["GGML_CUDA_DISABLE_GRAPHS"] == "1" and env["PATH"] == "/bin"
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(env)


def test_cpu_worker_env_hides_gpus_and_splits_cores() -> None:
    env = worker_env({}, None, {}, 3)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "3"
    assert cpu_threads(2, 5) == 5
    assert cpu_threads(10_000) == 1


def test_gpu_health_reports_usage_and_lost_gpus() -> None:
    nv = FakeNvml(lost={1})
    rows = gpus.health(nv, gpus.discover(nv))
    assert rows[0]["memory_used"] == 1000 << 20 and rows[0]["lost"] is False
    assert rows[1]["lost"] is True and "lost" in rows[1]["error"]


def test_supervisor_plans_one_worker_per_gpu_from_faked_nvml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from llamapool.config import from_dict
    from llamapool.supervisor.arbiter import Supervisor

    cfg = from_dict({"model": {"path": "/m.gguf"}, "server": {"runtime_dir": str(tmp_path)}})
    sup = Supervisor(cfg, nvml=FakeNvml())
    slots = sup._plan(cfg)
    assert [(s.name, s.device) for s in slots] == [("gpu0", "GPU-11111111-aaaa"), ("gpu1", "GPU-22222222-bbbb")]
    sup.slots = slots
    env = worker_env({"NOTIFY_SOCKET": "x"}, slots[0].gpu, {}, sup._spec(slots[0]).threads)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-11111111-aaaa" and "NOTIFY_SOCKET" not in env
    cpu = Supervisor(cfg, use_nvml=False)
    assert [s.name for s in cpu._plan(cfg)] == ["cpu0", "cpu1"]


# ------------------------------------------------------------ routing policy


def _w(name: str, free: int, routable: bool = True, prefixes: tuple[int, ...] = ()) -> Any:
    return SimpleNamespace(name=name, free=free, routable=routable,
                           prefixes=OrderedDict((k, None) for k in prefixes))


def test_policy_prefers_most_free_slots() -> None:
    assert pick_worker([_w("a", 1), _w("b", 3), _w("c", 2)]).name == "b"


def test_policy_breaks_ties_by_name_and_skips_full_or_unroutable() -> None:
    assert pick_worker([_w("b", 2), _w("a", 2)]).name == "a"
    assert pick_worker([_w("a", 0), _w("b", 5, routable=False)]) is None
    assert pick_worker([]) is None


def test_policy_prefers_the_worker_holding_the_longest_shared_prefix() -> None:
    system = "You are a helpful assistant. " * 40
    keys = prefix_keys(system + "question A")
    assert len(keys) == 3 and prefix_keys(system + "question B")[:3] == keys[:3]
    a, b = _w("a", 6), _w("b", 8)
    remember(a, prefix_keys(system + "earlier question"))
    assert pick_worker([a, b], keys, slack=4) is a, "affinity wins while a is not much busier"
    assert pick_worker([a, b], keys, slack=1) is b, "but not when a is well above the least loaded"


def test_policy_affinity_never_picks_a_worker_out_of_routing_or_full() -> None:
    keys = prefix_keys([7] * 300)
    held = _w("a", 5, routable=False, prefixes=keys)
    full = _w("b", 0, prefixes=keys)
    other = _w("c", 1)
    assert pick_worker([held, full, other], keys, slack=100) is other


def test_remembered_prefixes_are_bounded() -> None:
    from llamapool.router import policy

    w = _w("a", 1)
    for i in range(policy.MAX_REMEMBERED + 10):
        remember(w, (i,))
    assert len(w.prefixes) == policy.MAX_REMEMBERED and 0 not in w.prefixes


def test_each_workers_readiness_is_logged_as_it_comes(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Issue 23 item 5: ``ready: 1 of 3 local workers`` before READY=1 is due, the READY=1 line itself,
    then ``ready: 3 of 3 local workers`` for the one after it."""
    from llamapool import log as logmod
    from llamapool.config import from_dict
    from llamapool.protocol.control import ReadyCount, WorkerJoined
    from llamapool.supervisor.arbiter import Supervisor

    cfg = from_dict({"model": {"path": "/m.gguf", "devices": "cpu", "cpu_workers": 3},
                     "server": {"runtime_dir": str(tmp_path), "min_ready_workers": 2}})
    sup = Supervisor(cfg, use_nvml=False)
    sup.slots = sup._plan(cfg)
    sup._router_stopping = True  # no router thread here: commands go nowhere
    logmod.configure("text", "info", env={})
    for n, name in enumerate(("cpu0", "cpu1", "cpu2"), 1):
        sup._on_router(WorkerJoined(name, 100 + n))
        sup._on_router(ReadyCount(n, 0))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "ready" in ln]
    assert [ln.removeprefix("llamapool: ") for ln in lines] == [
        "ready: 1 of 3 local workers",
        "ready (READY=1): 2 of 3 local worker(s) ready (server.min_ready_workers = 2)",
        "ready: 3 of 3 local workers",
    ], lines


def test_a_gone_workers_memory_counts_as_free_until_nvml_reads_it_so(model_path: str) -> None:
    """Pool.devices (the placement's view of a GPU): NVML is read every 5 s, so for a while after a worker
    exits its reading still counts the worker's memory as used; without crediting it back each placement pass
    in between evicted one more model for the same waiting one (an H200's churn run evicted four for one)."""
    from llamapool.config import from_dict
    from llamapool.supervisor.children import WorkerSlot
    from llamapool.supervisor.gpus import Gpu
    from llamapool.supervisor.lifecycle import State
    from llamapool.supervisor.pool import GONE_SETTLE, Pool

    gpu = Gpu(0, "GPU-x", "H200", "0000:00:01.0", 100 << 30)
    cfg = from_dict({"models": [{"name": "a", "path": model_path, "load": "on_demand", "ctx_per_slot": 512}]})
    pool = Pool(cfg, [gpu], {"a": [(gpu,)]})
    need = pool.needs["a"]
    assert need > 0
    w = WorkerSlot("a-gpu0", (gpu,), cfg.models[0])
    w.state = State.READY
    total = 100 << 30
    pool.on_gpu_rows([{"uuid": "GPU-x", "memory_total": total, "memory_used": need}], now=10.0)
    pool.plan([w], 11.0)
    assert pool.devices([w])[1].free == total - need
    w.state = State.STOPPED  # it exited; NVML's last reading still counts its memory
    pool.plan([w], 12.0)
    assert pool.devices([w])[1].free == total
    pool.on_gpu_rows([{"uuid": "GPU-x", "memory_total": total, "memory_used": need}], now=12.5)  # too soon
    assert pool.devices([w])[1].free == total
    pool.on_gpu_rows([{"uuid": "GPU-x", "memory_total": total, "memory_used": 0}], now=12.0 + GONE_SETTLE + 1)
    assert pool.devices([w])[1].free == total and pool.gone["GPU-x"] == []
