"""Metrics pieces without processes: NVML figures (power, Xid events) from a faked NVML, their
exposition, the restart reasons, the histogram, the [metrics] table, old/new heartbeats."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llamapool.config import ConfigError, from_dict
from llamapool.protocol import codec
from llamapool.protocol.messages import Heartbeat
from llamapool.router.fleet import Fleet
from llamapool.router.metrics import RESTART_REASONS, Histogram, RouterMetrics
from llamapool.supervisor import gpus
from llamapool.supervisor.lifecycle import restart_reason
from tests.test_supervisor_units import FakeNvml


class XidNvml(FakeNvml):
    """FakeNvml with power readings and a queue of Xid events."""

    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        super().__init__()
        self.pending: deque[int] = deque()
        self.registered: list[int] = []

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 250_000 + h  # milliwatts

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, kinds: int, event_set: str) -> None:
        self.registered.append(h)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if not self.pending:
            raise RuntimeError("NVML_ERROR_TIMEOUT")
        return SimpleNamespace(device=self.pending.popleft(), eventData=79)


def test_xid_events_are_counted_per_gpu_and_power_is_read() -> None:
    nv = XidNvml()
    found = gpus.discover(nv)
    watch = gpus.XidWatch(nv, found)
    assert nv.registered == [0, 1]
    assert watch.poll() == {"GPU-11111111-aaaa": 0, "GPU-22222222-bbbb": 0}
    nv.pending.extend([1, 1, 0])
    assert watch.poll() == {"GPU-11111111-aaaa": 1, "GPU-22222222-bbbb": 2}
    assert watch.poll()["GPU-22222222-bbbb"] == 2  # counted once
    rows = gpus.health(nv, found)
    assert rows[1]["power_mw"] == 250_001
    assert "power_mw" not in gpus.health(FakeNvml(), found)[0]  # a board without power readings
    assert gpus.XidWatch(FakeNvml(), found).poll() == {g.uuid: 0 for g in found}  # no event support


def test_gpu_figures_in_the_exposition() -> None:
    nv = XidNvml()
    found = gpus.discover(nv)
    rows = gpus.health(nv, found)
    for row in rows:
        row["xid_errors"] = 3 if row["index"] == 1 else 0
    fleet = Fleet.build(["m"], {"gpu1": {"device": found[1].uuid, "state": "ready"}}, [], {}, gpus=rows)
    text = RouterMetrics("m").render(fleet).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def sample(fam: str, name: str | None = None, **labels: str) -> float:
        return next(s.value for s in fams[fam].samples if s.name == (name or fam)
                    and all(s.labels.get(k) == v for k, v in labels.items()))

    one = {"device": found[1].uuid, "gpu": "1"}
    assert sample("llamapool_gpu_power_watts", **one) == pytest.approx(250.001)
    assert sample("llamapool_gpu_utilization_ratio", **one) == 0.5
    assert sample("llamapool_gpu_memory_used_bytes", **one) == 1001 << 20
    assert sample("llamapool_gpu_memory_total_bytes", **one) == 150_000 << 20
    assert sample("llamapool_gpu_temperature_celsius", **one) == 40
    assert sample("llamapool_gpu_xid_errors", "llamapool_gpu_xid_errors_total", **one) == 3
    assert sample("llamapool_gpu_lost", **one) == 0
    assert sample("llamapool_gpu_xid_errors", "llamapool_gpu_xid_errors_total", worker="gpu1") == 3
    assert sample("llamapool_worker_state", worker="gpu1", state="ready") == 1
    assert sample("llamapool_worker_state", worker="gpu1", state="failed") == 0


def test_restart_reasons_from_the_supervisors_kill_reasons() -> None:
    assert restart_reason(-9, None) == "signal"
    assert restart_reason(1, None) == "exit"
    assert restart_reason(-6, "missed 3 heartbeats") == "heartbeat"
    assert restart_reason(-6, "engine step ran 61.0s > workers.step_timeout") == "step_timeout"
    assert restart_reason(-9, "no hello within workers.start_timeout=300s") == "start_timeout"
    assert restart_reason(-6, "GPU lost: NVML_ERROR_GPU_IS_LOST") == "gpu_lost"
    assert {restart_reason(c, k) for c in (-9, 1) for k in (None, "missed 3 heartbeats", "workers.step_timeout",
            "workers.start_timeout", "GPU lost")} == set(RESTART_REASONS)


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    h.observe(0.05)
    h.observe(0.5, 3)
    h.observe(7.0)
    assert h.buckets() == [("0.1", 1.0), ("1.0", 4.0), ("+Inf", 5.0)]
    assert h.sum == pytest.approx(0.05 + 1.5 + 7.0)


def test_metrics_table_is_optional_and_checked() -> None:
    assert from_dict({"model": {"path": "m"}}).metrics is None
    cfg = from_dict({"model": {"path": "m"}, "metrics": {"listen": "0.0.0.0:9464"}})
    assert cfg.metrics is not None and cfg.metrics.host_port == ("0.0.0.0", 9464)
    for bad in ("9464", "host:port", "h:70000"):
        with pytest.raises(ConfigError, match=r"metrics\.listen"):
            from_dict({"model": {"path": "m"}, "metrics": {"listen": bad}})


def test_heartbeats_interoperate_across_versions() -> None:
    old = {"v": 1, "type": "heartbeat", "active": 1, "steps": 2, "reused_tokens": 5}  # no KV fields
    hb = codec.decode([msgpack.packb(old)], codec.WORKER_TYPES)
    assert isinstance(hb, Heartbeat) and hb.kv_used == 0 and hb.kv_total == 0 and hb.reused_tokens == 5
    new = codec.decode([codec.encode(Heartbeat(kv_used=7, kv_total=2048))], codec.WORKER_TYPES)
    assert isinstance(new, Heartbeat) and (new.kv_used, new.kv_total) == (7, 2048)
