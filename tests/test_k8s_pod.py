"""The chart's pod, run on this machine: the test is its kubelet and its endpoint picker.

It renders the chart (deploy/helm/llamapool, the CPU values file, with the InferencePool's endpoint
picker config), takes the Deployment's container command and arguments and the ConfigMap's
llamapool.toml, and starts llamapool with them (the tiny model for the pod's model, this machine's
port and runtime dir, 16 slots; a worker that takes 2 s to start, as a real model's load does). Then:

- as the kubelet, it polls the startup, readiness and liveness probes the manifest names: /ready is
  503 ("loading") until the worker serves, /health 200 all along;
- as the endpoint picker, it scrapes /metrics every 50 ms while 64 streams run through the gateway,
  and checks that each gauge the engine config names exists, is a gauge, is one series for the pod,
  and moves with the load;
- then it sends SIGTERM as the kubelet does after preStop: /ready goes 503 at once, /health stays
  200, every stream accepted runs to its end, and the pod exits 0 within its grace period.

The figures (scrapes a second, scrape latency, a gauge trace) are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.test_helm_chart import render, tools  # noqa: F401 (tools: the fixture)

STREAMS, TOKENS, SLOTS = 64, 192, 16
SCRAPE_EVERY = 0.05  # the endpoint picker's default (and floor)
SPECS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")


@dataclass
class Pod:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    container: dict[str, Any]
    grace: int
    engine: dict[str, str]
    kv_port: int = 0  # the pod's KV-events port (kvEvents.enabled, a free port here)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@dataclass
class Scrapes:
    """The endpoint picker's view: each scrape's latency and the gauges it read."""

    latencies: list[float] = field(default_factory=list)
    trace: list[tuple[float, float, float, float]] = field(default_factory=list)  # monotonic, waiting, running, kv
    problems: list[str] = field(default_factory=list)


def slow_worker_path(folder: Path) -> str:
    """A ``sitecustomize`` that delays the worker process 2 s (a model load), nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import time\nif b'llamapool.worker' in open('/proc/self/cmdline', 'rb').read():\n    time.sleep(2.0)\n")
    return os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture
def pod(tools: Path, tmp_path: Path, model_path: str) -> Iterator[Pod]:  # noqa: F811 (the imported fixture)
    kv_port, replay_port = free_port(), free_port()
    objs = render(tools, "values-cpu.yaml", "--set", "inferencePool.enabled=true",
                  "--set", "inferencePool.httpRoute.enabled=false", "--set", f"llamapool.slots={SLOTS}",
                  "--set", "kvEvents.enabled=true", "--set", f"kvEvents.port={kv_port}",
                  "--set", f"kvEvents.replayPort={replay_port}")
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    cms = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    config = next(d["llamapool.toml"] for d in cms.values() if "llamapool.toml" in d)
    plugins = yaml.safe_load(next(d["llamapool-plugins.yaml"] for d in cms.values() if "llamapool-plugins.yaml" in d))
    (extractor,) = [p for p in plugins["plugins"] if p["type"] == "core-metrics-extractor"]
    engine = next(e for e in extractor["parameters"]["engineConfigs"]
                  if e["name"] == dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"])
    spec = dep["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")

    raw = tomllib.loads(config)
    port = free_port()
    etc = tmp_path / "etc"
    etc.mkdir()
    text = config.replace(f'path = "{raw["model"]["path"]}"', f'path = "{model_path}"')
    text = text.replace(f'runtime_dir = "{raw["server"]["runtime_dir"]}"', f'runtime_dir = "{tmp_path / "run"}"')
    text = text.replace(f'listen = "{raw["http"]["listen"]}"', f'listen = "127.0.0.1:{port}"')
    (etc / "llamapool.toml").write_text(text)
    assert tomllib.loads(text)["model"]["path"] == model_path  # only these three values changed
    argv = [a.replace(mount, str(etc)) for a in container["args"]]
    assert container["command"] == ["llamapool"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["HF_HOME"] = str(tmp_path / env["HF_HOME"].lstrip("/"))
    log = tmp_path / "pod.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", *argv], stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, **env, "PYTHONPATH": slow_worker_path(tmp_path / "slow")})
    assert {p["containerPort"] for p in container["ports"]} == {8000, kv_port, replay_port}
    p = Pod(proc, f"http://127.0.0.1:{port}", log, container, spec["terminationGracePeriodSeconds"], engine, kv_port)
    yield p
    if proc.poll() is None:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(30)


def probe(pod: Pod, kind: str) -> httpx.Response | None:
    """One probe as the manifest defines it (its path, and its timeout)."""
    p = pod.container[f"{kind}Probe"]
    assert p["httpGet"]["port"] == "http"
    try:
        return httpx.get(pod.url + p["httpGet"]["path"], timeout=p["timeoutSeconds"])
    except httpx.HTTPError:
        return None


def scrape_forever(url: str, names: dict[str, str], stop: Any, drained: Any, accepted: Any, conn: Any) -> None:
    """Every 50 ms, as the endpoint picker does: one GET /metrics (1 s timeout), the engine's gauges
    read. Runs in a process of its own (the load's threads must not slow its clock); sends back a
    :class:`Scrapes` (and keeps ``accepted``, waiting + running, current)."""
    out = Scrapes()
    with httpx.Client(timeout=1.0) as http:
        due = time.monotonic()
        while not stop.is_set():
            start = time.monotonic()
            try:
                r = http.get(url + "/metrics")
            except httpx.HTTPError as e:  # after SIGTERM: the pod stopped listening once it drained
                if not (isinstance(e, httpx.ConnectError) and drained.is_set()):
                    out.problems.append(f"scrape failed: {e!r}")
                break
            out.latencies.append(time.monotonic() - start)
            if r.status_code != 200:
                out.problems.append(f"scrape {r.status_code}: {r.text[:200]}")
                break
            fams = {f.name: f for f in text_string_to_metric_families(r.text)}
            values = {}
            for key, name in names.items():
                fam = fams.get(name)
                if fam is None or fam.type != "gauge" or len(fam.samples) != 1:
                    out.problems.append(f"{key} {name}: {fam}")
                else:
                    values[key] = fam.samples[0].value
            if len(values) == len(names):
                out.trace.append((start, values["queuedRequestsSpec"], values["runningRequestsSpec"],
                                  values["kvUsageSpec"]))
                accepted.value = int(values["queuedRequestsSpec"] + values["runningRequestsSpec"])
            due = max(due + SCRAPE_EVERY, time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))
    conn.send(out)


async def one_stream(http: httpx.AsyncClient, url: str, model: str, started: list[int]) -> tuple[str | None, int]:
    """A streamed completion: its finish reason and its completion tokens (usage); ``started`` gets a 1
    once its 200 came (the pod accepted it)."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    finish, tokens = None, 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"http {r.status_code}: {(await r.aread())[:300]!r}", 0
        started.append(1)
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error {event['error']}", tokens
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event["choices"]:
                    finish = event["choices"][0]["finish_reason"] or finish
    return finish, tokens


def load(url: str, model: str, results: list[tuple[str | None, int]], started: list[int]) -> None:
    async def run() -> None:
        limits = httpx.Limits(max_connections=STREAMS + 8)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            results.extend(await asyncio.gather(*(one_stream(http, url, model, started) for _ in range(STREAMS))))

    asyncio.run(run())


def wait_ready(pod: Pod) -> list[tuple[int, str]]:
    """The kubelet until the startup probe passes: every readiness answer seen, liveness checked each time."""
    seen: list[tuple[int, str]] = []
    startup, failed_live = pod.container["startupProbe"], 0
    for _ in range(startup["failureThreshold"]):
        assert pod.proc.poll() is None, pod.log_text()
        r = probe(pod, "startup")
        if r is not None:
            seen.append((r.status_code, r.json()["status"]))
            live = probe(pod, "liveness")
            failed_live = 0 if live is not None and live.status_code == 200 else failed_live + 1
            # the kubelet restarts a container after failureThreshold failures in a row
            assert failed_live < pod.container["livenessProbe"]["failureThreshold"], live
            if r.status_code == 200:
                return seen
        time.sleep(0.05)  # the manifest's periodSeconds, 100 times faster
    raise AssertionError(f"the startup probe never passed: {seen[-3:]}\n{pod.log_text()}")


def test_the_pod_as_its_kubelet_and_its_endpoint_picker_see_it(pod: Pod) -> None:
    seen = wait_ready(pod)
    assert seen[0] == (503, "loading") and seen[-1] == (200, "ready"), seen
    assert {s for s in seen[:-1]} == {(503, "loading")}, seen
    model = httpx.get(pod.url + "/v1/models").json()["data"][0]["id"]
    import msgpack
    import zmq

    zctx = zmq.Context()
    kv_sub = zctx.socket(zmq.SUB)  # as the endpoint picker's precise prefix-cache producer: the pod's KV events
    kv_sub.connect(f"tcp://127.0.0.1:{pod.kv_port}")
    kv_sub.setsockopt(zmq.SUBSCRIBE, b"kv@")

    mp = multiprocessing.get_context("spawn")
    stop, drained, accepted = mp.Event(), mp.Event(), mp.Value("i", -1)
    mine, theirs = mp.Pipe()
    scraper = mp.Process(target=scrape_forever, args=(pod.url, {k: pod.engine[k] for k in SPECS}, stop, drained,
                                                      accepted, theirs), daemon=True)
    scraper.start()
    end = time.monotonic() + 30
    while accepted.value == -1:  # its first scrape: the idle pod
        assert time.monotonic() < end and scraper.is_alive(), "the scraper did not start"
        time.sleep(0.01)
    results: list[tuple[str | None, int]] = []
    started: list[int] = []
    loader = threading.Thread(target=load, args=(pod.url, model, results, started))
    t_load = time.monotonic()
    loader.start()
    # SIGTERM (after preStop) as soon as every stream is accepted: the gauges show all 64 held at once (three
    # waves of 16 still to run), or (on a loaded machine the first could end before that) every stream's 200
    # came (the gateway answers a stream's head with its first token: the last wave has started). Any wait
    # after that shortens the drain the probes below must see (on a fast machine a wave takes ~0.3 s).
    while accepted.value != STREAMS and len(started) != STREAMS and time.monotonic() - t_load < 30:
        time.sleep(0.01)
    t_term = time.monotonic()
    held, answered = accepted.value, len(started)  # what ended the wait (the figures print them)
    drained.set()
    pod.proc.send_signal(signal.SIGTERM)
    while (r := probe(pod, "readiness")) is not None and r.status_code == 200:
        time.sleep(0.002)
    flip = time.monotonic() - t_term
    assert r is not None and r.status_code == 503 and r.json()["status"] == "draining", r
    during = []  # (readiness, liveness) while the accepted streams drain, from the flip on
    live = probe(pod, "liveness")
    if loader.is_alive() and live is not None:  # the streams still ran after both probes: mid-drain
        during.append((r.status_code, live.status_code))
    try:
        late = httpx.post(pod.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2},
                          timeout=10)
    except httpx.ConnectError:  # the pod stops listening once drained: legitimate only at the drain's end
        t_refused = time.monotonic()
        loader.join(30)
        ended = time.monotonic() - t_refused
        assert ended < 1.0, f"the gateway stopped listening {ended:.1f}s before its streams ended\n{pod.log_text()}"
        assert results == [("length", TOKENS)] * STREAMS, sorted(set(results))
        pytest.skip("the last streams ended as the late request came (a fast run): the drain was over")
    assert late.status_code == 503, late.text  # a request the picker would not send any more is refused
    while loader.is_alive():
        ready, live = probe(pod, "readiness"), probe(pod, "liveness")
        if loader.is_alive() and ready is not None and live is not None:
            during.append((ready.status_code, live.status_code))
        time.sleep(0.1)
    loader.join()
    t_done = time.monotonic()
    stop.set()
    assert mine.poll(30), "the scraper sent nothing back"
    scrapes: Scrapes = mine.recv()
    scraper.join(5)
    code = pod.proc.wait(pod.grace - pod.container["lifecycle"]["preStop"]["sleep"]["seconds"])
    t_exit = time.monotonic()

    assert code == 0, pod.log_text()
    stored = []
    while kv_sub.poll(0):
        topic, _seq, payload = kv_sub.recv_multipart()
        stored += [(topic, e) for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
    kv_sub.close(linger=0)
    zctx.term()
    assert stored and all(t.endswith(f"@{model}".encode()) for t, _ in stored), stored[:3]
    assert set(during) == {(503, 200)}, during  # draining: not ready, alive
    assert results == [("length", TOKENS)] * STREAMS, sorted(set(results))  # every stream accepted ran to its end
    assert not scrapes.problems, scrapes.problems[:5]
    # "at once" for a kubelet probing every second or more: under 64 streams and a 50-ms scraper on 2 cores
    # the flip took 0.04-0.68 s (the gateway shares the cores with the worker and the scraper)
    assert flip < 2.0, f"/ready took {flip:.3f}s to go 503 after SIGTERM"
    trace = scrapes.trace
    for i, name in ((1, "waiting"), (2, "running"), (3, "kv")):
        assert trace[0][i] == 0 and max(s[i] for s in trace) > 0, f"{name} did not move: {trace[:5]}"
    assert max(s[1] for s in trace) >= STREAMS - SLOTS - 8 and max(s[2] for s in trace) == SLOTS, trace[:20]
    assert max(s[3] for s in trace) == 1.0  # every slot busy
    draining = [s[1] for s in trace if s[0] > t_term + flip]
    assert draining and draining == sorted(draining, reverse=True), draining  # not ready: nothing new queues

    lat = sorted(scrapes.latencies)
    elapsed = trace[-1][0] - trace[0][0]
    gap = max(b[0] - a[0] for a, b in itertools.pairwise(trace))
    figures = {
        "scrapes": len(lat), "scrapes_per_s": round(len(lat) / elapsed, 1), "max_gap_s": round(gap, 3),
        "scrape_ms_p50": round(lat[len(lat) // 2] * 1e3, 2), "scrape_ms_p99": round(lat[int(len(lat) * 0.99)] * 1e3, 2),
        "scrape_ms_max": round(lat[-1] * 1e3, 2), "ready_503_after_sigterm_ms": round(flip * 1e3, 1),
        "drain_s": round(t_done - t_term, 2), "exit_after_sigterm_s": round(t_exit - t_term, 2),
        "sigterm_at_s": round(t_term - trace[0][0], 2), "sigterm_after_load_s": round(t_term - t_load, 2),
        "held_at_sigterm": held, "answered_at_sigterm": answered,
        "trace (s, waiting, running, kv)": [(round(s[0] - trace[0][0], 2), *s[1:]) for s in trace[::10]],
    }
    print("\nk8s pod figures:", json.dumps(figures), f"load average {os.getloadavg()[0]:.1f}")
    # the picker's limits: 1 s a scrape, stale after 2 s (the figures say how far inside them it stays;
    # on an idle machine p99 is a few ms, on a loaded 2-core CI box tens of ms)
    assert figures["scrape_ms_p50"] < 50 and lat[-1] < 1.0 and gap < 2.0, figures
