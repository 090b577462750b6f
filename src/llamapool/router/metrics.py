"""Prometheus metrics: plain counters kept by the router thread, rendered by it on request.

One owner per figure: the router counts requests, tokens and latencies (it sees every request and
every reply); the workers report engine figures in their heartbeats (prefix-cache reuse, KV cells);
the supervisor reports restarts and NVML readings over the control socket (``info``, ``gpus``).
All of it lives in the router thread, so nothing here needs a lock: the exposition text is built
in that thread when a ``metrics`` request arrives (the gateway's ``GET /metrics`` and the
supervisor's ``[metrics] listen`` endpoint both send one). See docs/metrics.md.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from llamapool.protocol.control import STORE_FAILURES
from llamapool.router.fleet import HOST_COUNTERS, Fleet, FleetWorker

# the supervisor's reasons for a worker's unexpected exit (``llamapool_worker_restarts_total``)
RESTART_REASONS = ("exit", "signal", "heartbeat", "step_timeout", "start_timeout", "gpu_lost")
# the supervisor's lifecycle states (supervisor/lifecycle.py), and the router's "lost"
WORKER_STATES = ("starting", "joining", "ready", "backoff", "retiring", "failed", "stopped", "lost")

LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MODEL_STATES = ("loaded", "loading", "unloaded", "failed")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
               2.5)


def node_of(worker: str) -> str:
    """The ``node`` label: the node a worker belongs to ("" for the router's own; a node's worker is
    named "<node>/<slot>", which the router checks at its hello). One value per node: bounded."""
    return worker.split("/", 1)[0] if "/" in worker else ""


class Histogram:
    """Cumulative-on-render buckets; ``observe(v, n)`` counts ``n`` observations of ``v``."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(acc)))
        return out


class Latencies:
    """One model's latency histograms."""

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)


class RouterMetrics:
    """The router's counters; every method is called from the router thread. ``model`` is the label
    of what belongs to no model of the pool (a request that could not be read): the default model."""

    def __init__(self, model: str):
        self.model = model
        self.outcomes: defaultdict[tuple[str, str], int] = defaultdict(int)  # by (model, outcome)
        self.prompt_tokens: defaultdict[str, int] = defaultdict(int)  # by worker
        self.generated_tokens: defaultdict[str, int] = defaultdict(int)
        self.worker_model: dict[str, str] = {}  # the model of each worker that finished a sequence
        # heartbeat figures are cumulative per worker process: what earlier processes reported
        self.engine_base: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.latencies: dict[str, Latencies] = {}
        self.load_seconds: dict[str, Histogram] = {}  # by model: spawn to ready of its workers
        # responses a gateway served but could not store, by reason (the supervisor relays its report)
        self.store_failures: defaultdict[str, int] = defaultdict(int)
        self.extra: Callable[[], Iterator[Metric]] = lambda: iter(())  # the per-tenant series (router/tenants.py)

    def model_loaded(self, model: str, seconds: float) -> None:
        self.load_seconds.setdefault(model, Histogram(LOAD_BUCKETS)).observe(seconds)

    def of(self, model: str) -> Latencies:
        """``model``'s histograms."""
        if model not in self.latencies:
            self.latencies[model] = Latencies()
        return self.latencies[model]

    def outcome(self, outcome: str, n: int = 1, model: str | None = None) -> None:
        self.outcomes[(self.model if model is None else model, outcome)] += n

    def tokens(self, worker: str, prompt: int, generated: int, model: str | None = None) -> None:
        self.prompt_tokens[worker] += int(prompt)
        self.generated_tokens[worker] += int(generated)
        if model is not None:
            self.worker_model[worker] = model

    def worker_gone(self, name: str, figures: dict[str, float]) -> None:
        """A worker process left: keep its cumulative figures so the counters never go back."""
        base = self.engine_base[name]
        for k, v in figures.items():
            base[k] += v

    def render(self, fleet: Fleet) -> bytes:
        """The exposition text of these counters and of ``fleet`` (router/fleet.py)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self, fleet))
        return generate_latest(registry)


class _Snapshot(Collector):
    def __init__(self, m: RouterMetrics, fleet: Fleet):
        self.m, self.fleet = m, fleet
        # the fleet, and the workers known only from their counters (retired by a reload: their model removed)
        self.rows = {w.name: w for w in fleet.workers}
        for name in set(m.generated_tokens) - set(self.rows):
            self.rows[name] = FleetWorker(name, "", "", "stopped", 0, 0)
        self.names = sorted(self.rows)

    def collect(self) -> Iterator[Metric]:
        fleet = self.fleet
        yield self._requests()
        yield from self._tokens()
        yield from self._engine_counters()
        yield from self._host_tier()
        yield from self._latencies()
        yield GaugeMetricFamily("llamapool_queue_depth", "Prompts waiting in the router's queues (all models)",
                                value=fleet.queued_total)
        yield GaugeMetricFamily("llamapool_requests_running", "Prompts running on workers", value=fleet.running())
        yield from self._workers()
        yield from self._models()
        yield from _gpu_families(fleet.gpus, fleet.gpu_workers())
        yield self._store_failures()
        yield from self.m.extra()

    def _store_failures(self) -> Metric:
        fam = CounterMetricFamily("llamapool_responses_store_failures", "Responses served but not stored (POST "
                                  "/v1/responses with store), by reason: full (larger than http.responses_max_mb, "
                                  "or the disk is full) or unwritable (the store cannot be opened or written)",
                                  labels=["reason"])
        for reason in STORE_FAILURES:
            fam.add_metric([reason], self.m.store_failures.get(reason, 0))
        return fam

    def _model_of(self, worker: str) -> str:
        row = self.rows[worker]
        return row.model if row.live is not None else (row.model or self.m.worker_model.get(worker)
                                                       or self.fleet.models[0])

    def _requests(self) -> Metric:
        m = self.m
        req = CounterMetricFamily("llamapool_requests", "Prompts answered, by outcome: ok, cancelled, "
                                  "disconnected (the client left) or the error code", labels=["model", "outcome"])
        for name in self.fleet.models:
            m.outcomes.setdefault((name, "ok"), 0)
        for (name, outcome), n in sorted(m.outcomes.items()):
            req.add_metric([name, outcome], n)
        return req

    def _tokens(self) -> Iterator[Metric]:
        m = self.m
        pt = CounterMetricFamily("llamapool_prompt_tokens", "Prompt tokens of finished sequences",
                                 labels=["model", "worker", "node"])
        gt = CounterMetricFamily("llamapool_generated_tokens", "Tokens generated by finished sequences",
                                 labels=["model", "worker", "node"])
        for name in self.names:
            pt.add_metric([self._model_of(name), name, node_of(name)], m.prompt_tokens.get(name, 0))
            gt.add_metric([self._model_of(name), name, node_of(name)], m.generated_tokens.get(name, 0))
        yield pt
        yield gt

    def _engine_counters(self) -> Iterator[Metric]:
        for field, metric, help_text in (
            ("reused_tokens", "llamapool_prompt_tokens_cached", "Prompt tokens served from the prefix (KV) "
             "cache instead of being computed"),
            ("decode_s", "llamapool_engine_decode_seconds", "Seconds the engine spent inside llama_decode"),
            ("step_s", "llamapool_engine_step_seconds", "Seconds of whole engine steps"),
            ("steps", "llamapool_engine_steps", "Engine steps (one batched llama_decode each)"),
            ("draft_tokens", "llamapool_speculative_draft_tokens", "Draft tokens verified (speculative decoding)"),
            ("accepted_tokens", "llamapool_speculative_accepted_tokens", "Draft tokens accepted (speculative "
             "decoding): each saved a step of its sequence"),
        ):
            fam = CounterMetricFamily(metric, help_text, labels=["model", "worker", "node"])
            for name in self.names:
                live = self.rows[name].live
                value = self.m.engine_base[name][field] + (float(getattr(live, field)) if live else 0.0)
                fam.add_metric([self._model_of(name), name, node_of(name)], value)
            yield fam

    def _host_tier(self) -> Iterator[Metric]:
        """Each worker's host KV tier: its counters (kept when its process leaves) and what it holds now."""
        labels = ["model", "worker", "node"]
        for key, help_text in HOST_COUNTERS.items():
            fam = CounterMetricFamily(f"llamapool_kv_host_{key}", help_text, labels=labels)
            for name in self.names:
                live = self.rows[name].live
                value = self.m.engine_base[name][f"kv_host_{key}"] + (live.kv_host.get(key, 0.0) if live else 0.0)
                fam.add_metric([self._model_of(name), name, node_of(name)], value)
            yield fam
        for key, help_text in (("bytes", "Bytes of KV held in the host KV tier"),
                               ("entries", "Sequences held in the host KV tier"),
                               ("capacity", "The host KV tier's bound in bytes (workers.kv_host)")):
            gauge = GaugeMetricFamily(f"llamapool_kv_host_{key}", help_text, labels=labels)
            for name in self.names:
                live = self.rows[name].live
                if live is not None and live.kv_host:
                    gauge.add_metric([self._model_of(name), name, node_of(name)], live.kv_host.get(key, 0.0))
            yield gauge

    def _latencies(self) -> Iterator[Metric]:
        m = self.m
        for attr, metric, help_text in (
            ("ttft", "llamapool_time_to_first_token_seconds", "Seconds from a prompt's arrival at the router "
             "to its first streamed token (streamed prompts)"),
            ("itl", "llamapool_inter_token_latency_seconds", "Seconds between streamed tokens, one "
             "observation per token"),
            ("e2e", "llamapool_request_duration_seconds", "Seconds from a prompt's arrival at the router to "
             "its final reply"),
            ("queue_wait", "llamapool_queue_wait_seconds", "Seconds a prompt waited in the router's queue "
             "before a worker took it"),
        ):
            fam_h = HistogramMetricFamily(metric, help_text, labels=["model"])
            for name in sorted(set(self.fleet.models) | set(m.latencies)):
                hist: Histogram = getattr(m.of(name), attr)
                fam_h.add_metric([name], hist.buckets(), hist.sum)
            yield fam_h

    def _models(self) -> Iterator[Metric]:
        """The pool's models as the placement policy runs them (docs/configuration.md, "A pool that
        follows demand"): state, workers, loads, evictions, unloads, failed loads, load seconds."""
        rows = self.fleet.model_rows
        state = GaugeMetricFamily("llamapool_model_state", "1 for the model's state (loaded, loading, unloaded, "
                                  "failed), 0 for the others", labels=["model", "state"])
        replicas = GaugeMetricFamily("llamapool_model_replicas", "Workers of the model that are loaded or "
                                     "loading", labels=["model"])
        counters = {key: CounterMetricFamily(f"llamapool_model_{key}", text, labels=["model"]) for key, text in (
            ("loads", "Workers started for the model by the pool (on demand, for replicas, or by an operator)"),
            ("evictions", "Workers of the model drained to make room for another model"),
            ("unloads", "Workers of the model drained because it sat idle, by an operator, or as a replica "
                        "no longer needed"),
            ("load_failures", "Workers of the model that failed while loading"),
            ("rebounds", "Workers of the model started within pool.min_residency of its own eviction (thrash; such "
                         "a model is evicted again only when no other will do)"))}
        for model in self.fleet.models:
            row = rows.get(model)
            if row is None:
                continue
            for s in MODEL_STATES:
                state.add_metric([model, s], 1.0 if row.get("state") == s else 0.0)
            replicas.add_metric([model], float(row.get("replicas", 0)))
            for key, fam in counters.items():
                fam.add_metric([model], float(row.get(key, 0)))
        yield state
        yield replicas
        yield from counters.values()
        hist = HistogramMetricFamily("llamapool_model_load_seconds", "Seconds from a worker's spawn to its "
                                     "first hello (its model loaded)", labels=["model"])
        for model in sorted(set(self.fleet.models) | set(self.m.load_seconds)):
            h = self.m.load_seconds.get(model) or Histogram(LOAD_BUCKETS)
            hist.add_metric([model], h.buckets(), h.sum)
        yield hist

    def _workers(self) -> Iterator[Metric]:
        busy = GaugeMetricFamily("llamapool_worker_slots_busy", "Sequence slots in use",
                                 labels=["worker", "device", "node"])
        total = GaugeMetricFamily("llamapool_worker_slots", "Sequence slots (workers.slots)",
                                  labels=["worker", "device", "node"])
        kv_used = GaugeMetricFamily("llamapool_kv_cache_used_cells", "KV cache cells holding tokens "
                                    "(running sequences and kept prefixes)", labels=["worker", "device", "node"])
        kv_total = GaugeMetricFamily("llamapool_kv_cache_cells", "KV cache cells in all",
                                     labels=["worker", "device", "node"])
        kv_ratio = GaugeMetricFamily("llamapool_kv_cache_usage_ratio", "Used / total KV cache cells (0 to 1)",
                                     labels=["worker", "device", "node"])
        state = GaugeMetricFamily("llamapool_worker_state", "1 for the worker's current state, else 0",
                                  labels=["worker", "device", "node", "state"])
        restarts = CounterMetricFamily("llamapool_worker_restarts", "Unexpected exits of a worker process, "
                                       "by reason (the supervisor restarts it, or marks it failed)",
                                       labels=["worker", "node", "reason"])
        for name in self.names:
            row = self.rows[name]
            w, device, nd = row.live, row.device, node_of(name)
            busy.add_metric([name, device, nd], row.active)
            total.add_metric([name, device, nd], row.slots)
            kv_used.add_metric([name, device, nd], w.kv_used if w else 0)
            kv_total.add_metric([name, device, nd], w.kv_total if w else 0)
            kv_ratio.add_metric([name, device, nd], (w.kv_used / w.kv_total) if w and w.kv_total else 0.0)
            for s in WORKER_STATES:
                state.add_metric([name, device, nd, s], 1.0 if s == row.state else 0.0)
            counts = row.exits
            for reason in RESTART_REASONS:
                restarts.add_metric([name, nd, reason], counts.get(reason, 0))
        yield from (busy, total, kv_used, kv_total, kv_ratio, state, restarts)
        yield from self._scheduling()

    def _scheduling(self) -> Iterator[Metric]:
        budget = GaugeMetricFamily("llamapool_step_budget_tokens", "Token budget of the worker's last engine "
                                   "step (decode tokens + prompt chunks; model.target_step sizes it)",
                                   labels=["worker", "node", "target"])
        cost = GaugeMetricFamily("llamapool_step_cost_seconds", "The worker's fitted step cost: seconds per step "
                                 "(base), per sequence in the step (per_row), per prompt token (per_prompt_token), "
                                 "per step with prompt work (prompt_step), and per draft or filler token a decoding "
                                 "sequence carries (per_draft_token)", labels=["worker", "node", "term"])
        for name in self.names:
            w = self.rows[name].live
            if w is None or not w.schedule[0]:
                continue
            target, tokens, fitted = w.schedule
            budget.add_metric([name, node_of(name), target], tokens)
            for term, value in zip(("base", "per_row", "per_prompt_token", "prompt_step", "per_draft_token"), fitted,
                                   strict=False):
                cost.add_metric([name, node_of(name), term], value)
        yield budget
        yield cost


def _gpu_families(rows: list[dict[str, Any]], worker_of: dict[str, str]) -> Iterator[Metric]:
    labels = ["device", "gpu", "worker"]
    spec = (
        ("memory_used", "llamapool_gpu_memory_used_bytes", "GPU memory in use (NVML)", 1.0, GaugeMetricFamily),
        ("memory_total", "llamapool_gpu_memory_total_bytes", "GPU memory in all (NVML)", 1.0, GaugeMetricFamily),
        ("utilization", "llamapool_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample "
         "period (0 to 1)", 0.01, GaugeMetricFamily),
        ("temperature", "llamapool_gpu_temperature_celsius", "GPU core temperature (NVML)", 1.0,
         GaugeMetricFamily),
        ("power_mw", "llamapool_gpu_power_watts", "GPU power draw (NVML)", 0.001, GaugeMetricFamily),
        ("xid_errors", "llamapool_gpu_xid_errors", "Xid (critical) errors NVML reported for the GPU since "
         "the daemon started", 1.0, CounterMetricFamily),
        ("ecc_uncorrected", "llamapool_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors (NVML, "
         "aggregate)", 1.0, CounterMetricFamily),
    )
    lost = GaugeMetricFamily("llamapool_gpu_lost", "1 when NVML can no longer read the GPU", labels=labels)
    fams = [(key, scale, cls(name, help_text, labels=labels)) for key, name, help_text, scale, cls in spec]
    for row in rows:
        lv = [str(row.get("uuid", "")), str(row.get("index", "")), worker_of.get(str(row.get("uuid")), "")]
        lost.add_metric(lv, 1.0 if row.get("lost") else 0.0)
        for key, scale, fam in fams:
            if row.get(key) is not None:
                fam.add_metric(lv, float(row[key]) * scale)
    yield lost
    for _, _, fam in fams:
        yield fam
