"""A rolling reload keeps a model serving (supervisor/surge.py): where the device has room for both, a
replaced worker's successor starts beside it and the old worker retires only once the successor is ready, so
no request waits for a model load; with ``server.reload_surge = false`` (or without room) the old worker exits
first and the requests that come meanwhile wait for the successor's load.

The successor's load is made slow (``LLAMAPOOL_INJECT_FAULT=load=4``, written into the reloaded config's
``[workers] env``), as an 8B model's is on a GPU: on the CPU the tiny model loads too fast to tell."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.conftest import Daemon, launch

SLOW_LOAD = 4.0  # seconds the successor waits before it loads


def _daemon(folder: Path, model_path: str, surge: bool) -> Daemon:
    d = launch(folder, model_path, server={"reload_surge": surge},
               workers={"devices": "cpu", "cpu_workers": 1, "slots": 2, "threads": 1})
    d.wait_ready(1)
    return d


def _latencies_across_a_slow_reload(d: Daemon) -> list[float]:
    """Each request's seconds while a reload replaces the worker by one that loads slowly, sent one after
    another from the SIGHUP until the reload is done."""
    text = d.config.read_text()
    d.config.write_text(text.replace("[workers]\n", f'[workers]\nenv = {{ LLAMAPOOL_INJECT_FAULT = '
                                                   f'"load={SLOW_LOAD}" }}\n', 1))
    seen: list[float] = []
    with d.client(timeout=60) as c:
        c.generate([1, 2, 3], max_tokens=2)
        d.proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 60
        while "reload done" not in d.log_text() and time.monotonic() < end:
            t0 = time.monotonic()
            reply = c.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert reply.usage.completion_tokens == 4
            seen.append(time.monotonic() - t0)
    assert "reload done" in d.log_text(), d.log_text()
    return seen


def _reload_run(folder: Path, model_path: str, surge: bool) -> tuple[list[float], list[str], str]:
    """The latencies across a slow reload, the ready workers after it, and the daemon's log."""
    d = _daemon(folder, model_path, surge)
    try:
        seen = _latencies_across_a_slow_reload(d)
        workers = d.wait_ready(1)["workers"]
    finally:
        d.stop()
    return seen, [w["id"] for w in workers if w["state"] == "ready"], d.log.read_text()


def test_a_reload_with_room_keeps_serving_while_the_successor_loads(tmp_path: Path, model_path: str) -> None:
    seen, ready, log = _reload_run(tmp_path, model_path, surge=True)
    assert "cpu0: its successor cpu0~1 starts beside it" in log, log[-3000:]
    assert len(seen) >= 5, seen  # requests were served during the successor's load
    assert max(seen) < SLOW_LOAD / 2, f"a request waited {max(seen):.2f} s: the reload stalled the model"
    assert ready == ["cpu0~1"]


def test_without_surge_requests_wait_for_the_successors_load(tmp_path: Path, model_path: str) -> None:
    seen, ready, _ = _reload_run(tmp_path, model_path, surge=False)
    assert max(seen) >= SLOW_LOAD, seen
    assert ready == ["cpu0"]


def test_a_second_reload_replaces_the_successor_by_the_next_generation(tmp_path: Path, model_path: str) -> None:
    """The planned name, not the generation, is what a reload matches: cpu0~1 is replaced by cpu0~2, not
    retired beside a new cpu0."""
    d = _daemon(tmp_path, model_path, surge=True)
    try:
        for gen in (1, 2):
            d.proc.send_signal(signal.SIGHUP)
            d.wait_log(f"its successor cpu0~{gen} starts beside it", timeout=60)
            end = time.monotonic() + 60
            while d.log.read_text().count("reload done") < gen and time.monotonic() < end:
                time.sleep(0.1)
        workers = d.wait_ready(1)["workers"]
        with d.client(timeout=30) as c:
            assert c.generate([1, 2, 3], max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    finally:
        d.stop()
    assert [w["id"] for w in workers if w["state"] == "ready"] == ["cpu0~2"], workers
    assert d.log.read_text().count(": retired") == 2


def test_a_successor_starts_beside_only_where_its_estimate_fits_the_free_memory(model_path: str) -> None:
    """surge.room on a GPU slot, NVML faked: the worker's estimated need (+10 % and 512 MiB) against the
    GPU's free bytes, and a page-locked host KV tier against the RAM available; names go by generation."""
    import dataclasses
    from types import SimpleNamespace

    from llamapool.config import from_dict
    from llamapool.supervisor import surge
    from llamapool.supervisor.children import WorkerSlot
    from llamapool.supervisor.gpus import Gpu
    from llamapool.supervisor.pool import worker_need

    model = from_dict({"model": {"path": model_path, "ctx_per_slot": 512}}).models[0]
    need, _ = worker_need(model, gpu=True)

    def nvml(free: int) -> SimpleNamespace:
        return SimpleNamespace(nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
                               nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(free=free))

    slot = WorkerSlot("gpu0", (Gpu(0, "GPU-x", "H200", "0000:00:01.0", 141 << 30),), model)
    assert surge.room(nvml(need * 2 + (1 << 30)), slot, model)[0]
    fits, why = surge.room(nvml(need), slot, model)
    assert not fits and "free" in why
    assert not surge.room(None, slot, model)[0]  # no NVML: no reading, no surge
    huge = dataclasses.replace(model, kv_host="1000000GiB")
    fits, why = surge.room(nvml(need * 2 + (1 << 30)), slot, huge)
    assert not fits and "host KV tier" in why
    assert surge.successor("gpu0", {"gpu0"}) == "gpu0~1"
    assert surge.successor("gpu0~1", {"gpu0~1", "gpu0~2"}) == "gpu0~3"
    assert surge.plan_name("chat-gpu0+1~4") == "chat-gpu0+1"

