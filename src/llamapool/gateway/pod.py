"""What a load balancer and a kubelet read from a gateway: ``/health``, ``/ready`` and ``/metrics``.

A task of the gateway process asks the router for its ``status`` every :data:`REFRESH` seconds and
keeps the pod's figures (:class:`~llamapool.gateway.podgauges.PodGauges`) and their exposition text:
the probes and the endpoint picker's 50-ms scrapes are answered from that snapshot, with no round
trip to the router of their own. The router's full exposition (counters, histograms, per-worker
gauges) is fetched at most once per :data:`FULL_EVERY` seconds while scrapes come faster than that
(a Prometheus scraping every 15 s gets a fresh one each time). See docs/metrics.md, docs/kubernetes.md.

- ``/health`` (liveness): 200 while the gateway answers and its router answered within
  :data:`LIVENESS_AFTER` seconds, draining included (a kubelet must not kill a draining pod).
- ``/ready`` (readiness): 200 only while at least ``min_ready_workers`` workers serve and the pod is
  not draining; 503 while the model loads, after SIGTERM, when every worker is lost, and when the
  router has not answered for :data:`STALE_AFTER` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llamapool.client.aio import AsyncClient
from llamapool.client.errors import LlamapoolError
from llamapool.gateway import GatewaySpec
from llamapool.gateway.podgauges import CONTENT_TYPE, PodGauges

REFRESH = 0.025  # seconds between snapshots: the EPP scrapes every 50 ms
STALE_AFTER = 2.0  # a snapshot this old means the router is not answering: not ready (the EPP's own limit)
LIVENESS_AFTER = 5.0  # the router silent this long: /health fails too (the kubelet restarts the pod)
FULL_EVERY = 1.0  # seconds the router's full exposition is reused while scrapes come faster
QUERY_TIMEOUT = 1.0  # one status query

Guard = Callable[[Request], Response | None]  # the API keys' check: an error response, or None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The pod's figures as the router last gave them, when (monotonic), and their exposition text."""

    gauges: PodGauges | None
    at: float
    text: bytes = b""
    error: str = ""  # why the last query failed ("" when it answered)


class PodView:
    """The snapshot task and the three routes; ``guard`` checks the API keys of ``/metrics``."""

    def __init__(self, spec: GatewaySpec, client: AsyncClient, guard: Guard):
        self.spec, self.client, self.guard = spec, client, guard
        self.snap = Snapshot(None, time.monotonic())
        self.full, self.full_at, self.scraped_at = b"", float("-inf"), float("-inf")
        self._full: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]), Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"])]

    def start(self) -> None:
        """Start refreshing the snapshot (in the running event loop)."""
        self._task = asyncio.create_task(self._refresh())

    async def stop(self) -> None:
        for task in (self._task, self._full):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _refresh(self) -> None:
        """Every REFRESH seconds (on a fixed schedule), one ``status`` query to the router."""
        due = time.monotonic()
        while True:
            try:
                st = await self.client.status(timeout=QUERY_TIMEOUT)
            except LlamapoolError as e:
                self.snap = Snapshot(self.snap.gauges, self.snap.at, self.snap.text, e.message)
            except Exception as e:  # a bug here must not stop the snapshot: the probes show it
                self.snap = Snapshot(self.snap.gauges, self.snap.at, self.snap.text, f"{type(e).__name__}: {e}")
            else:
                g = PodGauges.from_status(st)
                self.snap = Snapshot(g, time.monotonic(), g.render(self.spec.vllm_metric_names))
            due = max(due + REFRESH, time.monotonic())
            await asyncio.sleep(due - time.monotonic())

    def _silence(self) -> float:
        """Seconds since the router last answered."""
        return time.monotonic() - self.snap.at

    async def health(self, request: Request) -> Response:
        """Liveness: 200 while the router answers, draining included."""
        g, silent = self.snap.gauges, self._silence()
        if silent > LIVENESS_AFTER:
            return JSONResponse({"status": "unavailable", "error": f"the router has not answered for {silent:.1f}s"
                                 f" ({self.snap.error or 'no answer yet'})"}, status_code=503)
        body: dict[str, Any] = {"status": "draining" if g is not None and g.draining else "ok"}
        if g is not None:
            body.update(workers_ready=g.ready, queued=g.waiting, running=g.running)
        return JSONResponse(body)

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 only with ``min_ready_workers`` workers serving and no drain under way."""
        g, silent, need = self.snap.gauges, self._silence(), self.spec.min_ready_workers
        if g is None and silent <= STALE_AFTER:  # the gateway has just started
            return JSONResponse({"status": "loading", "error": "no answer from the router yet"}, status_code=503)
        if g is None or silent > STALE_AFTER:
            why = f"the router has not answered for {silent:.1f}s ({self.snap.error or 'no answer yet'})"
            return JSONResponse({"status": "unavailable", "error": why}, status_code=503)
        body = {"workers_ready": g.ready, "workers": g.workers, "min_ready_workers": need,
                "states": g.states, "queued": g.waiting, "running": g.running}
        if g.draining:
            return JSONResponse({"status": "draining", **body}, status_code=503)
        if g.ready < need:
            # no worker known yet (the supervisor has not published them, or no node has joined) or one
            # on its way: loading; every worker failed, stopped or lost: unavailable
            loading = not g.workers or any(g.states.get(s) for s in ("starting", "joining", "backoff"))
            return JSONResponse({"status": "loading" if loading else "unavailable", **body}, status_code=503)
        return JSONResponse({"status": "ready", **body})

    async def metrics(self, request: Request) -> Response:
        """The router's exposition (at most FULL_EVERY old while scraped often) and the pod's gauges
        (at most REFRESH old). 503 when the router has not answered for STALE_AFTER seconds."""
        denied = self.guard(request)
        if denied is not None:
            return denied
        now, snap = time.monotonic(), self.snap
        if snap.gauges is None or now - snap.at > STALE_AFTER:
            return Response(f"# llamapool unavailable: {snap.error or 'the router has not answered'}\n",
                            status_code=503, media_type="text/plain")
        slow_scraper = now - self.scraped_at > FULL_EVERY
        self.scraped_at = now
        if now - self.full_at > FULL_EVERY:
            if self._full is None or self._full.done():
                self._full = asyncio.create_task(self._fetch_full())
            if slow_scraper or not self.full:  # nobody scrapes often: this one waits for fresh counters
                await asyncio.shield(self._full)
        if not self.full:
            return Response("# llamapool unavailable: the router's metrics did not come\n", status_code=503,
                            media_type="text/plain")
        return Response(self.full + snap.text, media_type=CONTENT_TYPE)

    async def _fetch_full(self) -> None:
        with contextlib.suppress(LlamapoolError):
            text = (await self.client.metrics(timeout=5.0)).encode()
            self.full, self.full_at = text, time.monotonic()
