"""The gateway's probes and the pod's gauges (gateway/pod.py, gateway/podgauges.py), on the real daemon.

- ``/health`` (liveness) is 200 while the gateway and its router answer, while loading and while
  draining; ``/ready`` is 200 only with ``min_ready_workers`` workers serving, 503 while the model
  loads, at once after SIGTERM (while the requests in flight finish), and when every worker is lost.
- ``/metrics`` carries the four figures an inference gateway's endpoint picker reads, each a gauge
  with one series for the pod, under llamapool's names and (``[metrics] vllm_compatible_names``)
  vLLM's, answered from the snapshot.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from llamapool.config import ConfigError, from_dict
from llamapool.gateway.podgauges import BLOCK_SIZE, PodGauges
from tests.conftest import Daemon, free_port

POD_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info")


def slow_load_env(folder: Path, seconds: float) -> dict[str, str]:
    """``[workers.env]`` that makes each worker process start ``seconds`` late, as a large model's
    load would (a ``sitecustomize`` on the worker's path; the tiny test model loads in a blink)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"import time\ntime.sleep({seconds})\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)}


def wait_ready(url: str) -> None:
    end = time.monotonic() + 30
    while (r := get(url + "/ready")) is None or r.status_code != 200:
        assert time.monotonic() < end, r.text if r is not None else "no answer"
        time.sleep(0.02)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


def test_pod_gauges_from_status_count_serving_workers_only() -> None:
    status = {"queued": 3, "running": 5, "draining": False, "workers": [
        {"id": "cpu0", "state": "ready", "slots": 4, "active": 4, "ctx_per_slot": 512},
        {"id": "cpu1", "state": "ready", "slots": 4, "active": 1, "ctx_per_slot": 512},
        {"id": "cpu2", "state": "backoff", "slots": 4},  # not connected: neither its slots nor its cells
    ]}
    g = PodGauges.from_status(status)
    assert (g.waiting, g.running, g.slots, g.busy, g.ready, g.workers) == (3, 5, 8, 5, 2, 3)
    assert g.kv_usage == 5 / 8 and g.num_blocks == 2 * 4 * 512 // BLOCK_SIZE
    fams = families(g.render(vllm_names=True).decode())
    assert sorted(fams) == sorted(f"{p}:{n}" for p in ("llamapool", "vllm") for n in POD_GAUGES)
    assert fams["vllm:cache_config_info"].samples[0].labels == {"block_size": "64", "num_gpu_blocks": "64"}
    assert PodGauges.from_status({"workers": []}).kv_usage == 0.0


def test_metrics_options_of_the_config() -> None:
    model = {"model": {"path": "m.gguf"}}
    cfg = from_dict({**model, "metrics": {"listen": "", "vllm_compatible_names": True}})
    assert cfg.metrics is not None and cfg.metrics.vllm_compatible_names and not cfg.metrics.listen
    try:
        from_dict({**model, "metrics": {"vllm_compatible_names": "yes"}})
    except ConfigError as e:
        assert "metrics.vllm_compatible_names" in str(e)
    else:
        raise AssertionError("a string for a boolean was accepted")


def test_ready_waits_for_the_model_and_goes_503_at_once_on_sigterm(start_daemon: Any, tmp_path: Path) -> None:
    """The kubelet's view of a pod: liveness 200 from the start, readiness 200 only once a worker
    serves; SIGTERM turns readiness 503 at once while a stream in flight runs to its end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    d: Daemon = start_daemon(wait_workers=None, http={"listen": f"127.0.0.1:{port}"},
                             workers={"cpu_workers": 1, "slots": 2, "env": slow_load_env(tmp_path / "slow", 2.0)},
                             model={"ctx_per_slot": 2048})
    seen: list[tuple[int, str]] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        r, h = get(url + "/ready"), get(url + "/health")
        if r is not None and h is not None:
            assert h.status_code == 200, h.text
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
        time.sleep(0.02)
    assert seen and seen[-1] == (200, "ready"), (seen, d.log_text())
    assert all(s == (503, "loading") for s in seen[:-1]), seen  # never ready before the worker
    assert seen[0] == (503, "loading"), "the probe never saw the model loading: the test proves nothing"

    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = c.completions.create(model="tiny", prompt="Hello", max_tokens=2000, stream=True, temperature=0,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    finished: list[str | None] = []
    reader = threading.Thread(target=lambda: finished.extend(ch.choices[0].finish_reason for ch in stream
                                                             if ch.choices))
    reader.start()
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    while (r := get(url + "/ready")) is not None and r.status_code == 200:
        time.sleep(0.005)
    flipped = time.monotonic() - t0
    assert r is not None and r.status_code == 503 and r.json()["status"] == "draining", r
    assert flipped < 0.5, f"/ready took {flipped:.3f}s to go 503"
    during: list[tuple[int, int]] = []  # (/ready, /health) while the stream drains, from the flip on
    h = get(url + "/health")
    if h is not None and reader.is_alive():
        during.append((r.status_code, h.status_code))
    while reader.is_alive():
        r, h = get(url + "/ready"), get(url + "/health")
        if r is not None and h is not None and reader.is_alive():
            during.append((r.status_code, h.status_code))
        time.sleep(0.02)
    assert during and set(during) == {(503, 200)}, during
    reader.join(60)
    assert finished[-1] == "length", finished  # the stream in flight ran to its end
    assert d.proc.wait(30) == 0


def test_pod_gauges_on_the_gateway_are_pod_level_gauges_under_both_names(start_daemon: Any) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    d: Daemon = start_daemon(workers={"cpu_workers": 2, "slots": 2}, http={"listen": f"127.0.0.1:{port}"},
                             metrics={"listen": "", "vllm_compatible_names": True}, model={"ctx_per_slot": 2048})
    assert "metrics: http://" not in d.log_text()  # listen = "": no listener of its own
    wait_ready(url)
    blocks = str(2 * 2 * 2048 // BLOCK_SIZE)  # both workers' cells (the snapshot may predate the second)
    end = time.monotonic() + 5
    while (idle := families(httpx.get(url + "/metrics").text))["vllm:cache_config_info"].samples[0].labels[
            "num_gpu_blocks"] != blocks and time.monotonic() < end:
        time.sleep(0.02)
    for prefix in ("llamapool", "vllm"):
        for name in POD_GAUGES:
            fam = idle[f"{prefix}:{name}"]
            assert fam.type == "gauge" and len(fam.samples) == 1 and fam.documentation, fam
    assert idle["llamapool:num_requests_running"].samples[0].value == 0
    assert idle["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"] == blocks
    assert "llamapool_generated_tokens_total" in httpx.get(url + "/metrics").text  # the router's too

    with d.client() as c:
        streams = [c.stream("Hello", max_tokens=1800, ignore_eos=True) for _ in range(6)]  # 4 slots
        busy: dict[str, Any] = {}
        end = time.monotonic() + 10
        while time.monotonic() < end:
            fams = families(httpx.get(url + "/metrics").text)
            busy = {n: fams[f"vllm:{n}"].samples[0].value for n in POD_GAUGES[:3]}
            if busy["num_requests_waiting"] == 2 and busy["num_requests_running"] == 4:
                break
            time.sleep(0.02)
        for s in streams:
            s.close()
    assert busy == {"num_requests_waiting": 2, "num_requests_running": 4, "kv_cache_usage_perc": 1.0}, busy


def test_a_scrape_during_a_worker_restart_is_a_full_exposition(start_daemon: Any) -> None:
    """kill -9 one of two workers and scrape every 20 ms until it is back: every scrape is a 200
    that parses whole, with the router's figures and each pod gauge (one series); the gauges follow
    the restart (the lost worker's slots leave the cache info, then come back)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    d: Daemon = start_daemon(workers={"cpu_workers": 2, "slots": 2}, http={"listen": f"127.0.0.1:{port}"})
    wait_ready(url)
    victim = d.status()["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    blocks: set[str] = set()
    rows: list[dict[str, Any]] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        r = httpx.get(url + "/metrics", timeout=5)
        assert r.status_code == 200, r.text
        fams = families(r.text)  # the parser raises on a partial or malformed exposition
        assert "llamapool_worker_restarts" in fams and "llamapool_generated_tokens" in fams
        for name in POD_GAUGES:
            assert len(fams[f"llamapool:{name}"].samples) == 1, name
        blocks.add(fams["llamapool:cache_config_info"].samples[0].labels["num_gpu_blocks"])
        rows = d.status()["workers"]
        back = all(w["state"] == "ready" for w in rows) and victim["pid"] not in {w.get("pid") for w in rows}
        if back and len(blocks) > 1:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"the worker did not come back, or the gauges never saw it go: {blocks} {rows}\n"
                             f"{d.log_text()}")
    assert blocks >= {str(2 * 512 // BLOCK_SIZE), str(2 * 2 * 512 // BLOCK_SIZE)}, blocks


def test_ready_needs_min_ready_workers(start_daemon: Any, tmp_path: Path) -> None:
    """server.min_ready_workers = 2: one worker serving is not enough (cpu1 starts 3 s late)."""
    slow = tmp_path / "slow1"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import time\nif b'\"cpu1\"' in open('/proc/self/cmdline', 'rb').read():\n    time.sleep(3.0)\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(slow), os.environ.get("PYTHONPATH", "")) if p)}
    d: Daemon = start_daemon(wait_workers=None, http={"listen": f"127.0.0.1:{port}"}, server={"min_ready_workers": 2},
                             workers={"cpu_workers": 2, "slots": 2, "env": env})
    one_ready: list[dict[str, Any]] = []
    end = time.monotonic() + 60
    while (r := get(url + "/ready")) is None or r.status_code != 200:
        assert time.monotonic() < end, d.log_text()
        if r is not None and r.json().get("workers_ready") == 1:
            one_ready.append(r.json())
        time.sleep(0.02)
    assert one_ready and one_ready[-1]["status"] == "loading" and one_ready[-1]["min_ready_workers"] == 2, one_ready
    assert r.json()["workers_ready"] == 2
