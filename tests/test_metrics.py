"""Prometheus metrics, scraped from the real daemon: ``[metrics] listen`` and the gateway's ``/metrics``,
parsed with prometheus_client's own parser; and the same figures through a real Prometheus server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llamapool.router.metrics import RESTART_REASONS
from tests.conftest import Daemon
from tests.test_gateway import free_port, wait_http

PARAMS: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}

EXPECTED = {  # family name (without _total) -> type
    "llamapool_requests": "counter",
    "llamapool_prompt_tokens": "counter",
    "llamapool_generated_tokens": "counter",
    "llamapool_prompt_tokens_cached": "counter",
    "llamapool_engine_decode_seconds": "counter",
    "llamapool_time_to_first_token_seconds": "histogram",
    "llamapool_inter_token_latency_seconds": "histogram",
    "llamapool_request_duration_seconds": "histogram",
    "llamapool_queue_wait_seconds": "histogram",
    "llamapool_queue_depth": "gauge",
    "llamapool_requests_running": "gauge",
    "llamapool_worker_slots": "gauge",
    "llamapool_worker_slots_busy": "gauge",
    "llamapool_worker_state": "gauge",
    "llamapool_worker_restarts": "counter",
    "llamapool_kv_cache_used_cells": "gauge",
    "llamapool_kv_cache_cells": "gauge",
    "llamapool_step_budget_tokens": "gauge",
    "llamapool_step_cost_seconds": "gauge",
}


def scrape(url: str) -> dict[str, Any]:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    total = 0.0
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def run_load(d: Daemon, n_streams: int = 3, n_plain: int = 3) -> int:
    """Some streamed and some plain requests; the tokens the client counted."""
    counted = 0
    with d.client() as c:
        for i in range(n_streams):
            s = c.stream(f"stream {i}", max_tokens=12 + i, **PARAMS)
            chunks = list(s)
            assert s.completion is not None
            counted += s.completion.usage.completion_tokens
            assert chunks
        for done in c.generate_many([f"plain {i}" for i in range(n_plain)], max_tokens=7, **PARAMS):
            counted += done.usage.completion_tokens
    return counted


def wait_restarted(d: Daemon, name: str, old_pid: int) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        row = next(w for w in d.status()["workers"] if w["id"] == name)
        if row["state"] == "ready" and row["pid"] != old_pid:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} not restarted:\n{d.log_text()}")


def test_metrics_from_listen_and_gateway(start_daemon) -> None:  # type: ignore[no-untyped-def]
    mport, hport = free_port(), free_port()
    d = start_daemon(metrics={"listen": f"127.0.0.1:{mport}"}, http={"listen": f"127.0.0.1:{hport}"})
    wait_http(f"http://127.0.0.1:{hport}", d)
    listen, gateway = f"http://127.0.0.1:{mport}/metrics", f"http://127.0.0.1:{hport}/metrics"
    counted = run_load(d)

    fams = scrape(listen)
    for name, kind in EXPECTED.items():
        assert name in fams, f"{name} missing: {sorted(fams)}"
        assert fams[name].type == kind, name
        assert fams[name].documentation, f"{name} has no HELP"
    for fam in fams.values():
        assert fam.name.startswith(("llamapool_", "llamapool:"))  # ":" the pod's gauges (docs/metrics.md)
        for s in fam.samples:  # bounded labels only (tenants: the keys file's names, or trusted clients')
            assert set(s.labels) <= {"model", "worker", "device", "node", "outcome", "state", "reason", "gpu", "le",
                                      "target", "term", "block_size", "num_gpu_blocks", "tenant", "kind"}, s
    model = Path(d.config.read_text().split('path = "')[1].split('"')[0]).stem
    assert value(fams, "llamapool_generated_tokens", "llamapool_generated_tokens_total", model=model) == counted
    assert value(fams, "llamapool_requests", "llamapool_requests_total", outcome="ok") == 6
    assert value(fams, "llamapool_time_to_first_token_seconds",
                 "llamapool_time_to_first_token_seconds_count") == 3
    assert value(fams, "llamapool_request_duration_seconds", "llamapool_request_duration_seconds_count") == 6
    assert value(fams, "llamapool_queue_wait_seconds", "llamapool_queue_wait_seconds_count") == 6
    # one observation per streamed token after the first
    assert value(fams, "llamapool_inter_token_latency_seconds",
                 "llamapool_inter_token_latency_seconds_count") == (11 + 12 + 13)
    assert value(fams, "llamapool_worker_slots", "llamapool_worker_slots") == 8  # 2 workers x 4
    assert value(fams, "llamapool_worker_state", "llamapool_worker_state", state="ready") == 2
    assert value(fams, "llamapool_kv_cache_cells", "llamapool_kv_cache_cells") == 2 * 4 * 512
    assert value(fams, "llamapool_worker_restarts", "llamapool_worker_restarts_total") == 0
    assert {s.labels["reason"] for s in fams["llamapool_worker_restarts"].samples} == set(RESTART_REASONS)

    # a refused request is counted by its error code; the gateway serves the same figures
    with d.client() as c, pytest.raises(Exception, match="max_tokens"):
        c.generate("x", max_tokens=-1)
    via_gw = scrape(gateway)
    assert value(via_gw, "llamapool_generated_tokens", "llamapool_generated_tokens_total") == counted
    assert value(via_gw, "llamapool_requests", "llamapool_requests_total", outcome="invalid_request") == 1

    # kill -9 a worker: its restart shows, by reason, and the token counters do not go back
    victim = d.status()["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_restarted(d, victim["id"], victim["pid"])
    fams = scrape(listen)
    assert value(fams, "llamapool_worker_restarts", "llamapool_worker_restarts_total",
                 worker=victim["id"], reason="signal") == 1
    assert value(fams, "llamapool_worker_restarts", "llamapool_worker_restarts_total") == 1
    assert value(fams, "llamapool_generated_tokens", "llamapool_generated_tokens_total") == counted


# ---------------------------------------------------------------- a real Prometheus


def prom_query(base: str, query: str) -> float | None:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
    except OSError:  # not listening yet
        return None
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def prom_wait(base: str, query: str, want: float, timeout: float = 15) -> float | None:
    end, got = time.monotonic() + timeout, None
    while time.monotonic() < end:
        got = prom_query(base, query)
        if got == want:
            return got
        time.sleep(0.25)
    return got


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus is not installed (Debian: apt-get install prometheus; make test does it)")
def test_real_prometheus_scrapes_the_daemon(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    mport, pport = free_port(), free_port()
    d = start_daemon(metrics={"listen": f"127.0.0.1:{mport}"})
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: llamapool\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{mport}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{pport}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{pport}"
    try:
        assert prom_wait(base, 'up{job="llamapool"}', 1.0, timeout=30) == 1.0, \
            (tmp_path / "prometheus.log").read_text()[-3000:]
        counted = run_load(d, n_streams=4, n_plain=4)
        # the client's count, as Prometheus sees it after the next scrape (1 s; a little slack for
        # a loaded 2-core machine)
        t0 = time.monotonic()
        got = prom_wait(base, "sum(llamapool_generated_tokens_total)", counted)
        assert got == counted, f"Prometheus has {got}, the client counted {counted}"
        assert time.monotonic() - t0 < 4, "Prometheus saw the count more than a few scrapes late"
        assert prom_wait(base, 'sum(llamapool_requests_total{outcome="ok"})', 8) == 8
        assert prom_wait(base, "sum(llamapool_worker_state{state=\"ready\"})", 2) == 2
        victim = d.status()["workers"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_restarted(d, victim["id"], victim["pid"])
        query = f'llamapool_worker_restarts_total{{worker="{victim["id"]}",reason="signal"}}'
        assert prom_wait(base, query, 1.0) == 1.0
        rise = prom_query(base, f'sum(increase(llamapool_worker_restarts_total{{worker="{victim["id"]}"}}[1m]))')
        assert rise is not None and rise > 0, "the restart is a rise of the counter, not a new series"
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


def test_a_taken_metrics_port_is_a_start_up_error(start_daemon) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = start_daemon(wait_workers=None, metrics={"listen": f"127.0.0.1:{port}"})
        assert d.proc.wait(30) == 1
    assert f"metrics.listen: cannot listen on 127.0.0.1:{port}" in d.log_text()
