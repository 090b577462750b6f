"""The pod-level gauges an inference gateway's endpoint picker reads (GIE's model-server protocol).

The Gateway API Inference Extension's endpoint picker (the EPP) scrapes each model server's
``/metrics`` every 50 ms and picks a pod for each request from four figures: requests waiting,
requests running, KV-cache use (0 to 1) and the cache's size (an info gauge with ``block_size`` and
``num_gpu_blocks``). It reads gauges only, and where several series match it takes the first: so
each figure here is one series for the whole daemon (the pod), with no per-worker labels; the
per-worker detail stays in ``llamapool_worker_*`` (router/metrics.py). See docs/metrics.md.

:class:`PodGauges` is built from the router's ``status`` reply, so every figure has one owner. Its
users are the HTTP endpoints that serve ``/metrics``: the gateway's (gateway/pod.py) and the
supervisor's ``[metrics] listen`` (supervisor/metrics_http.py); it imports nothing of the router.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

# the classic text format, which every Prometheus reads (generate_latest writes it): the content type of
# every /metrics answer (the router's exposition followed by these gauges)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# llama.cpp keeps its KV cache per token cell, not in blocks; the EPP's prefix scorer wants a block
# size and clamps one under 64 tokens to 64, so the cache is counted in blocks of 64 cells.
BLOCK_SIZE = 64

# (llamapool's name, vLLM's name, HELP) of each figure
NAMES = {
    "waiting": ("llamapool:num_requests_waiting", "vllm:num_requests_waiting",
                "Prompts waiting in the router's queues for a worker slot (all models of the pod)"),
    "running": ("llamapool:num_requests_running", "vllm:num_requests_running",
                "Prompts running on the pod's workers"),
    "kv": ("llamapool:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
           "Share of the serving workers' KV cache (0 to 1) that a new request cannot use: the cells of "
           "busy slots (a slot's cells belong to its sequence; kept prefixes in free slots count as free)"),
    "cache": ("llamapool:cache_config_info", "vllm:cache_config_info",
              "The serving workers' KV cache: block_size (tokens a block) and num_gpu_blocks (blocks in all)"),
}


@dataclass(frozen=True, slots=True)
class PodGauges:
    """What the pod's workers are doing, summed over the pod (the router's ``status``).

    ``slots``, ``busy`` and ``kv_cells`` count the workers that serve (``ready``, connected);
    ``states`` counts every worker by its lifecycle state."""

    waiting: int = 0
    running: int = 0
    slots: int = 0
    busy: int = 0
    kv_cells: int = 0
    draining: bool = False
    states: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> PodGauges:
        rows = list(status.get("workers") or [])
        serving = [w for w in rows if w.get("state") == "ready" and "ctx_per_slot" in w]
        slots = sum(int(w.get("slots") or 0) for w in serving)
        return cls(waiting=int(status.get("queued") or 0), running=int(status.get("running") or 0), slots=slots,
                   busy=min(slots, sum(int(w.get("active") or 0) for w in serving)),
                   kv_cells=sum(int(w.get("slots") or 0) * int(w.get("ctx_per_slot") or 0) for w in serving),
                   draining=bool(status.get("draining")),
                   states=dict(Counter(str(w.get("state")) for w in rows)))

    @property
    def ready(self) -> int:
        """Workers serving."""
        return self.states.get("ready", 0)

    @property
    def workers(self) -> int:
        return sum(self.states.values())

    @property
    def kv_usage(self) -> float:
        return self.busy / self.slots if self.slots else 0.0

    @property
    def num_blocks(self) -> int:
        return self.kv_cells // BLOCK_SIZE

    def render(self, vllm_names: bool = False) -> bytes:
        """The exposition text of the four gauges (and vLLM's names of them with ``vllm_names``)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Gauges(self, vllm_names))
        return generate_latest(registry)


class _Gauges(Collector):
    def __init__(self, g: PodGauges, vllm_names: bool):
        self.g, self.which = g, (0, 1) if vllm_names else (0,)

    def collect(self) -> Iterator[Metric]:
        g = self.g
        for i in self.which:
            yield GaugeMetricFamily(NAMES["waiting"][i], NAMES["waiting"][2], value=g.waiting)
            yield GaugeMetricFamily(NAMES["running"][i], NAMES["running"][2], value=g.running)
            yield GaugeMetricFamily(NAMES["kv"][i], NAMES["kv"][2], value=g.kv_usage)
            info = GaugeMetricFamily(NAMES["cache"][i], NAMES["cache"][2], labels=["block_size", "num_gpu_blocks"])
            info.add_metric([str(BLOCK_SIZE), str(g.num_blocks)], 1.0)
            yield info
