"""The router: a ZeroMQ broker between clients (frontend) and workers (backend).

One thread, one poll loop (:meth:`Router.run`). Clients send requests; each prompt becomes a job
(``tables.py``) that waits in its model's queue (by priority class, then the tenants' fair share:
``tenants.py``) until the worker of that model with the most free slots takes it (``backend.py``).
Workers stream step reports back; the router forwards chunks and exactly one final reply per prompt.
The client side is ``intake.py``. The supervisor talks to the router over an inproc PAIR socket
(``control``) with the typed commands of ``protocol/control.py``, and hears its events (workers
joined or to kill, readiness, demand for the placement policy).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from llamapool import security
from llamapool.config import ipc_path, needs_curve
from llamapool.keys import KeysFile
from llamapool.protocol import codec, control
from llamapool.protocol.control import (
    CancelAll,
    Demand,
    Drained,
    ForgetWorker,
    GpuRows,
    KillWorker,
    ModelDemand,
    ModelLoaded,
    ModelReply,
    ModelRows,
    PoolModels,
    ReadyCount,
    RetireWorker,
    StartDrain,
    StopRouter,
    StoreFailed,
    TenantTable,
    WorkerExited,
    WorkerInfo,
)
from llamapool.protocol.messages import (
    Error,
    ErrorCode,
    Heartbeat,
    ModelActionReply,
    Shutdown,
)
from llamapool.router.adapters import AdapterTable
from llamapool.router.backend import Backend
from llamapool.router.handover import Parked
from llamapool.router.intake import Intake
from llamapool.router.metrics import RouterMetrics
from llamapool.router.tables import LOG, Job, RequestStatus, RouterConfig, WorkerState
from llamapool.router.tenants import FLEX_RANK, FairQueue, Tenancy

TICK = 0.1  # seconds between housekeeping passes
DEMAND_EVERY = 1.0  # the placement policy hears the demand at least this often (and at once when it changes)
DEMAND_SOON = 0.05  # ... and within this when a queue empties (not on every dispatch: the GIL is shared)

__all__ = ["Router", "RouterConfig"]


class Router(Intake, Backend):
    """Owns the frontend, backend and control sockets; ``run`` is the loop."""

    def __init__(self, cfg: RouterConfig, zctx: zmq.Context, control_addr: str,
                 on_event: Callable[[control.Event], None] = lambda e: None):
        self.cfg = cfg
        self.zctx = zctx
        self.on_event = on_event  # called from the router thread: keep it thread-safe
        self.front = zctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.MAXMSGSIZE, max(codec.TRANSPORT_MAX_FRAME, cfg.max_message_bytes * 4))
        self.front.setsockopt(zmq.SNDHWM, 0)
        self.front.setsockopt(zmq.RCVHWM, 0)
        self.back = zctx.socket(zmq.ROUTER)
        self.back.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.setsockopt(zmq.SNDHWM, 0)
        self.back.setsockopt(zmq.RCVHWM, 0)
        self.back.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a node worker reconnecting after a partition keeps its id
        self.control = zctx.socket(zmq.PAIR)
        self.control.connect(control_addr)
        self.monitors: list[zmq.Socket[Any]] = []  # handshake events of the CURVE sockets, for the log
        self.handshakes = security.HandshakeLog()
        if cfg.curve is not None:
            for sock, endpoint in ((self.front, cfg.frontend), (self.back, cfg.backend)):
                if needs_curve(endpoint):
                    security.set_server_keys(sock, cfg.curve)
                    self.monitors.append(sock.get_monitor_socket(security.HANDSHAKE_EVENTS))
        self.models: list[str] = list(cfg.models) or [""]  # the first is the default model
        self.adapters = AdapterTable(cfg.adapters, self.models)  # the config's, and those loaded at run time
        self.tenancy = Tenancy(cfg.tenants, cfg.rate_window, cfg.tenant_idle)
        self.queues: dict[str, FairQueue[Job]] = {m: FairQueue(self.tenancy.weight) for m in self.models}
        self.jobs: dict[int, Job] = {}
        self.light: deque[Job] = deque()  # tokenize/detokenize jobs waiting for a worker (any model's)
        self.by_request: dict[tuple[bytes, str], list[Job]] = {}
        self.workers: dict[str, WorkerState] = {}
        self.parked = Parked()
        self.remote_lost: dict[str, dict[str, Any]] = {}  # status rows of nodes' workers that left or were lost
        self._back_keys = cfg.curve is not None and needs_curve(cfg.backend)  # peers' keys (User-Id) readable
        self._peer: Any = None  # the last backend frame (its User-Id is the peer's key)
        self._refused_at: dict[tuple[str, str], float] = {}
        self.supervisor_view: dict[str, dict[str, Any]] = {}  # the supervisor's view of each worker
        self.model_rows: dict[str, dict[str, Any]] = {}  # the supervisor's view of each model (ModelRows)
        self.last_used: dict[str, float] = {}  # when a request for each model last arrived or ended
        self._demand: Demand | None = None  # the last demand sent to the supervisor, and when
        self._demand_at = 0.0
        self._demand_now = False  # a request waits for a model with no worker: tell the supervisor now
        self._demand_soon = False  # a model's queue emptied: tell the supervisor within DEMAND_SOON
        self.gpus: list[dict[str, Any]] = []
        self.draining = False
        self.running = True
        # rids are unique per router process: a node worker still running a previous router's rids never
        # mixes them up with ours (those get aborted)
        self.next_rid = (int.from_bytes(os.urandom(4), "big") << 16) + 1
        self.loop_progress = time.monotonic()  # read by the supervisor's watchdog
        self._last_ready = -1
        self.metrics = RouterMetrics(self.models[0])
        self.metrics.extra = lambda: self.tenancy.collect(self.queues)

    def bind(self) -> None:
        self.front.bind(self.cfg.frontend)
        self.back.bind(self.cfg.backend)

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.front, self.back, self.control, *self.monitors):
            poller.register(s, zmq.POLLIN)
        next_tick = 0.0
        while self.running:
            for sock, _ in poller.poll(timeout=int(TICK * 1000)):
                if sock is self.back:
                    self._read_backend()
                elif sock is self.front:
                    self._read_burst(self.front, self._on_client)
                elif sock in self.monitors:
                    while sock.poll(0):
                        self.handshakes.event(recv_monitor_message(sock))
                else:
                    while self.control.poll(0):
                        self._on_control(codec.decode([self.control.recv()], codec.COMMAND_TYPES))
            now = time.monotonic()
            self.loop_progress = now
            if now >= next_tick:
                self._housekeeping(now)
                next_tick = now + TICK
            self._dispatch()
            self._report_ready()
            if self._demand_now or (self._demand_soon and now - self._demand_at >= DEMAND_SOON):
                self._report_demand(now)
        self._close()

    def _read_burst(self, sock: zmq.Socket, handle: Callable[[bytes, list[bytes]], None]) -> None:
        for _ in range(1000):  # bounded so one busy side cannot starve the other
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames[0], frames[1:])

    def _read_backend(self) -> None:
        if not self._back_keys:
            self._read_burst(self.back, self._on_worker)
            return
        for _ in range(1000):  # with CURVE: frames, to read the peer's key on a hello
            try:
                frames = self.back.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._peer = frames[-1]
            self._on_worker(frames[0].bytes, [f.bytes for f in frames[1:]])

    def _housekeeping(self, now: float) -> None:
        dead_after = self.cfg.heartbeat_interval * self.cfg.heartbeat_liveness
        for w in list(self.workers.values()):
            if now - w.last_seen > dead_after:
                why = f"missed {self.cfg.heartbeat_liveness} heartbeats"
                self._lose_worker(w, why)
                self.on_event(KillWorker(w.name, w.hello.pid, why))
            elif w.busy_for > self.cfg.step_timeout:
                why = f"engine step ran {w.busy_for:.1f}s > workers.step_timeout"
                self._lose_worker(w, why)
                self.on_event(KillWorker(w.name, w.hello.pid, why))
            elif now - w.last_sent >= self.cfg.heartbeat_interval:
                w.last_sent = now
                self._send_worker(w, Heartbeat())
        unservable = {m: self._unservable(m) for m, q in self.queues.items() if q}
        unservable.update({j.model: self._unservable(j.model) for j in self.light})
        for job in list(self.jobs.values()):
            waiting = job.status is RequestStatus.WAITING
            if waiting and unservable.get(job.model):
                self._end(job, RequestStatus.UNAVAILABLE, message=unservable[job.model])
            elif waiting and now - job.queued_at > self._queue_timeout(job):
                ready = sum(1 for w in self.workers.values() if w.model == job.model and w.routable)
                local = any(i.get("model", self.models[0]) == job.model for i in self.supervisor_view.values())
                row = self.model_rows.get(job.model, {})
                if ready or local:
                    why = ""
                elif row.get("managed"):  # a model the pool loads on demand
                    why = f": model {job.model!r} is {row['state']}" + (f" ({row['reason']})" if row.get("reason")
                                                                         else "")
                else:
                    why = (f": model {job.model!r} has no local worker and no node's worker has joined "
                           f"(devices = \"remote\": is a `llamapool node` running and is its key in "
                           f"authorized_keys?)")
                setting = "server.flex_queue_timeout" if job.rank == FLEX_RANK else "server.queue_timeout"
                self._end(job, RequestStatus.UNAVAILABLE, message=(
                    f"no worker slot of model {job.model!r} became free within {setting}="
                    f"{self._queue_timeout(job):g}s ({ready} workers ready){why}"))
            elif job.deadline is not None and now > job.deadline:
                self._cancel_job(job, RequestStatus.TIMED_OUT)
        for w in list(self.workers.values()):
            if w.closing and not self.queues.get(w.model):
                self._retire(w)
        if self.adapters.leaving:
            self._adapter_tick()
        for model in [m for m, q in self.queues.items() if not q and m not in self.models
                      and not any(w.model == m for w in self.workers.values())]:
            del self.queues[model]
        if self.draining and not self.jobs:
            self.on_event(Drained())
        self._report_demand(now)

    def _on_control(self, cmd: control.Command) -> None:
        """One command of the supervisor (protocol/control.py)."""
        if isinstance(cmd, WorkerInfo):
            self.supervisor_view[cmd.name] = cmd.info
        elif isinstance(cmd, ForgetWorker):
            self.supervisor_view.pop(cmd.name, None)
        elif isinstance(cmd, GpuRows):
            self.gpus = cmd.rows
        elif isinstance(cmd, WorkerExited):
            w = self.workers.get(cmd.name)
            if w is not None and w.hello.pid == cmd.pid:
                self._lose_worker(w, cmd.how)
        elif isinstance(cmd, RetireWorker):
            w = self.workers.get(cmd.name)
            if w is not None and w.model not in self.models and self.queues.get(w.model):
                w.closing = True  # its model left the pool: it serves what waits for it first
            elif w is not None:
                self._retire(w)
        elif isinstance(cmd, PoolModels):
            self.models = list(cmd.names) or [""]
            for gone in self.adapters.declare(cmd.adapters, self.models):  # run-time ones the reload ends
                LOG.warning(f"LoRA adapter {gone.name!r} (loaded at run time) unloaded: the reloaded config "
                            f"{'has no model ' + repr(gone.model) if gone.model not in self.models else 'names it'}")
                self._leave(gone)
            self.metrics.model = self.models[0]
            for model in self.models:
                self._queue(model)
        elif isinstance(cmd, StartDrain):
            self.draining = True
        elif isinstance(cmd, CancelAll):
            for job in list(self.jobs.values()):
                self._cancel_job(job, RequestStatus.ABORTED)
        elif isinstance(cmd, StopRouter):
            self.running = False
        elif isinstance(cmd, TenantTable):
            self.tenancy.replace(KeysFile.from_rows(cmd.tenants, cmd.defaults))
        elif isinstance(cmd, ModelRows):
            self.model_rows = cmd.rows
        elif isinstance(cmd, ModelLoaded):
            self.metrics.model_loaded(cmd.model, cmd.seconds)
        elif isinstance(cmd, StoreFailed):
            self.metrics.store_failures[cmd.reason] += 1
        elif isinstance(cmd, ModelReply):
            self._reply(cmd.client, ModelActionReply(cmd.id, cmd.model, cmd.action, cmd.state, cmd.message)
                        if cmd.ok else Error(cmd.id, ErrorCode.INVALID_REQUEST, cmd.message, field="model"))

    def _report_demand(self, now: float) -> None:
        """Each model's waiting prompts, its oldest one's wait and its last use, and each worker's running
        prompts, to the supervisor's placement policy: when they change, and every DEMAND_EVERY seconds."""
        models = {}
        for model in self.models:
            queue = self.queues.get(model)
            first = queue.oldest() if queue is not None else None
            oldest = now - first if first is not None else 0.0
            models[model] = ModelDemand(len(queue or ()), round(oldest, 1), self.last_used.get(model, float("-inf")))
        demand = Demand(models, {w.name: len(w.jobs) for w in self.workers.values()})
        if self._demand_now or demand != self._demand or now - self._demand_at >= DEMAND_EVERY:
            self.on_event(demand)
            self._demand_at = now
        self._demand, self._demand_now, self._demand_soon = demand, False, False

    def _report_ready(self) -> None:
        n = sum(1 for w in self.workers.values() if w.routable)
        if n != self._last_ready:
            self._last_ready = n
            self.on_event(ReadyCount(n, self.queued))

    def _close(self) -> None:
        for queue in self.queues.values():
            queue.clear()
        for job in list(self.jobs.values()):
            self._end(job, RequestStatus.UNAVAILABLE, message="llamapool stopped")
        for w in self.workers.values():
            if w.hello.node:  # a node's workers outlive this router: they reconnect to the next one
                continue
            try:
                self.back.send_multipart([w.ident, codec.encode(Shutdown())], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for sock in (self.front, self.back):
            if sock.get(zmq.CURVE_SERVER):
                sock.disable_monitor()
        for mon in self.monitors:
            mon.close(linger=0)
        self.front.close(linger=500)
        self.back.close(linger=500)
        self.control.close(linger=0)
        for endpoint in (self.cfg.frontend, self.cfg.backend):  # leave no stale socket file behind
            path = ipc_path(endpoint)
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)

