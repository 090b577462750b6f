"""The supervisor: the daemon's main process, as gunicorn's arbiter: the event loop, the wiring of its
parts, and a lifecycle that reads top to bottom.

It plans one worker per device (a GPU, a group of GPUs, or a CPU share) of each model of the pool,
runs the router in a thread, spawns its workers and HTTP gateways, turns the router's events into the
parts' actions and signals into drain (TERM/INT), fast stop (QUIT) and rolling reload (HUP). It never
imports llama_cpp, so it never creates a CUDA context. Each concern is a module of its own, given what
it acts on (the shared :class:`~llamapool.supervisor.runstate.RunState`, and each other), never the
arbiter:

- ``processes.py``: spawn, read, reap, restart with back-off (``children.py``: the slot and the process
  primitives; ``lifecycle.py``: the state table every change is checked against; ``launch.py``: what a
  child runs);
- ``placer.py``: the placement policy's actions (``placement.py`` decides, ``pool.py`` keeps its inputs);
- ``drain.py``: a worker's drain (retire, replace) and the pool's at SIGTERM;
- ``reload.py``: SIGHUP; ``gateways.py``: the HTTP gateways and their socket; ``readiness.py``: READY=1;
- ``curve.py`` (keys), ``gpuwatch.py`` (NVML), ``sdnotify.py`` (systemd).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import zmq

from llamapool import log as logmod
from llamapool.config import Config
from llamapool.protocol import codec, control
from llamapool.protocol.control import (
    Demand,
    Drained,
    GpuRows,
    KillWorker,
    ModelCommand,
    ReadyCount,
    StopRouter,
    WorkerJoined,
)
from llamapool.rlimits import raise_fd_limit
from llamapool.router import Router
from llamapool.supervisor import gpus as gpumod
from llamapool.supervisor import launch
from llamapool.supervisor.children import KILL_GRACE, Launch, WorkerSlot, kill, read_line, signal_all, stop
from llamapool.supervisor.curve import Curve
from llamapool.supervisor.drain import Drainer
from llamapool.supervisor.gateways import Gateways
from llamapool.supervisor.gpuwatch import GpuWatch
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.placer import Placer
from llamapool.supervisor.processes import Processes
from llamapool.supervisor.readiness import Readiness
from llamapool.supervisor.reload import Reloader
from llamapool.supervisor.runlock import RunLock
from llamapool.supervisor.runstate import RunState
from llamapool.supervisor.sdnotify import Notifier
from llamapool.worker.server import EXIT_PERMANENT, WorkerSpec

EXIT_ALL_FAILED = EXIT_PERMANENT  # 78 (EX_CONFIG): every worker failed for good before any was ready
LOG = logmod.Logger("supervisor")

__all__ = ["KILL_GRACE", "Supervisor", "WorkerSlot", "serve"]


class Supervisor:
    # Exit 78 when every worker has failed for good even after some served (llamapool node: no
    # status to show and nothing else to do); the daemon does so only at start-up.
    exit_when_all_failed = False
    serves_http = True  # llamapool node: no gateways (the router's host serves HTTP)

    def __init__(self, config: Config, nvml: Any | None = None, use_nvml: bool = True):
        nvml = nvml if nvml is not None else (gpumod.load_nvml() if use_nvml else None)
        self.gpus = gpumod.discover(nvml)
        self.gpu_watch = GpuWatch(nvml, self.gpus)
        self.curve = Curve(config)  # a bad key file is a start-up error (exit 2) naming it
        self.metrics_server: Any = None  # the [metrics] listener (read at start; a reload keeps it)
        self.notify = Notifier.from_env()
        self.zctx = zmq.Context()
        self.draining = False  # a SIGTERM/SIGINT drain is under way (a second signal stops at once)
        self.fast = False  # a fast stop: requests in flight end with an error now
        self._router_stopping = False
        self.exit_code = 0
        self.boot_id = uuid.uuid4().hex[:16]  # this incarnation: the router takes only workers that carry it
        self._stop = asyncio.Event()
        # the parts: each is given what it acts on, none holds the arbiter
        self.state = RunState(config, self._command)
        self.processes = Processes(self.state, self._launch, self._child_line, self._on_death)
        self.gateways = Gateways(self.state, self.processes, enabled=self.serves_http)
        self.drainer = Drainer(self.state, self.processes)
        self.placer = Placer(self.state, self.gpus, self.processes, self.drainer)
        self.readiness = Readiness(self.state, self.notify)
        self.reloader = Reloader(self.state, self._plan, self.curve, self.notify, self.processes, self.drainer,
                                 self.placer, self.gateways, nvml)

    @property
    def slots(self) -> list[WorkerSlot]:
        """The workers (``RunState.slots``)."""
        return self.state.slots

    @slots.setter
    def slots(self, slots: list[WorkerSlot]) -> None:
        self.state.slots = slots

    # ------------------------------------------------------------ the lifecycle

    async def run(self) -> int:
        """Plan, start the router, spawn the children, serve until a signal, then stop in order."""
        cfg = self.state.cfg
        self.loop = asyncio.get_running_loop()
        logmod.configure(cfg.log.format, cfg.log.level)
        self.slots = self._plan(cfg)  # a GPU given to two models is a ConfigError (exit 2)
        self.placer.configure(cfg)
        cfg.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(cfg.runtime_dir, 0o700)
        if not self._start_router():
            return 1
        handlers: dict[signal.Signals, Callable[[], Coroutine[Any, Any, None]]] = {
            signal.SIGTERM: self.stop_signal, signal.SIGINT: self.stop_signal,
            signal.SIGQUIT: self.fast_stop, signal.SIGHUP: self.reload,
        }
        for sig, handler in handlers.items():
            self.loop.add_signal_handler(sig, lambda h: self.state.spawn(h()), handler)
        for slot in self.slots:  # the fixed plan's workers
            self.processes.start(slot)
        self.placer.place()  # the managed models' first workers (their floors), through the same spawn path
        self.gateways.start()
        self.state.spawn(self._timers())
        await self._stop.wait()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.shutdown)
        if self.fast:  # the router answers every request first, so that the gateways can pass it on
            await self._stop_router()
            await self.gateways.stop(grace=3.0)
            await self._shutdown_workers()
        else:
            await self.gateways.stop(self.state.cfg.server.drain_timeout + 5)
            await self._shutdown_workers()
            await self._stop_router()
        if self.state.kv_events is not None:
            self.state.kv_events.stop()
        self.zctx.term()
        self.gpu_watch.shutdown()
        LOG.info("stopped")
        return self.exit_code

    # ------------------------------------------------------------ start-up: the plan and the router

    def _plan(self, cfg: Config) -> list[WorkerSlot]:
        """Each model's slots: one per GPU or group of GPUs, or ``cpu_workers`` CPU slots when it has
        none. Worker names are ``gpu0``, ``gpu0+1`` (a group), ``cpu0``; with ``[[models]]`` tables
        the model's name comes first (``chat-gpu0``), so names are unique across models."""
        keys = [f"models[{i}]" for i in range(len(cfg.models))] if cfg.models_table else ["model"]
        groups = gpumod.plan_groups(self.gpus, cfg.models, keys)
        slots = []
        for m in cfg.models:
            if m.managed:  # the placement policy starts its workers (placer.py)
                continue
            prefix = f"{m.name}-" if cfg.models_table else ""
            if groups[m.name]:
                slots += [WorkerSlot(f"{prefix}gpu{'+'.join(str(g.index) for g in group)}", group, m)
                          for group in groups[m.name]]
                continue
            if m.devices == "remote":
                LOG.info(f"{m.name}: devices = \"remote\": no local worker; `llamapool node` hosts serve it")
                continue
            if m.devices != "cpu":
                LOG.info(f"{m.name}: no GPU found through NVML; starting CPU workers")
            slots += [WorkerSlot(f"{prefix}cpu{i}", (), m) for i in range(m.cpu_workers)]
        return slots

    def _start_router(self) -> bool:
        """The ``[http]`` listening socket, CURVE, the ``[metrics]`` listener and the router thread
        (``llamapool node`` has none of them)."""
        cfg = self.state.cfg
        if not self.gateways.bind():
            return False
        self.curve.start(self.zctx, cfg)
        if cfg.metrics is not None and cfg.metrics.listen:
            from llamapool.supervisor.metrics_http import serve_metrics

            try:
                self.metrics_server = serve_metrics(cfg.metrics.host_port, cfg.frontend,
                                                    self.curve.client_keys(cfg.frontend),
                                                    cfg.metrics.vllm_compatible_names)
            except OSError as e:
                LOG.error(f"FATAL: metrics.listen: cannot listen on {cfg.metrics.listen}: {e}")
                return False
            LOG.info(f"metrics: http://{cfg.metrics.listen}/metrics")
        self.control = self.zctx.socket(zmq.PAIR)
        self.control.bind("inproc://llamapool-control")

        def from_router_thread(event: control.Event) -> None:
            self.loop.call_soon_threadsafe(self._on_router, event)

        self.router = Router(dataclasses.replace(launch.router_config(cfg), curve=self.curve.key,
                                                 local_key=self.curve.local_public(), boot_id=self.boot_id),
                             self.zctx, "inproc://llamapool-control", on_event=from_router_thread)
        self.router.bind()
        if cfg.kv_events is not None:  # the pod's KV-cache event publisher, its series in the router's metrics
            from llamapool.supervisor import kvevents

            self.state.kv_events = kvevents.attach(self.zctx, cfg, self.router.metrics)
            if self.state.kv_events.error:
                LOG.error(f"FATAL: {self.state.kv_events.error}")
                return False
        self.router_thread = threading.Thread(target=self.router.run, name="router", daemon=True)
        self.router_thread.start()
        LOG.info(f"frontend {cfg.frontend}; models " + ", ".join(f"{m.name} ({m.path})" for m in cfg.models))
        return True

    async def _stop_router(self) -> None:
        self._command(StopRouter())
        self._router_stopping = True  # nothing reads the control socket any more: send nothing
        await asyncio.to_thread(self.router_thread.join, 10)
        self.control.close(linger=0)
        self.curve.stop()

    def _loop_alive(self, now: float, wd: float) -> bool:
        """Whether the watchdog may be fed: the router's loop made progress lately."""
        return now - self.router.loop_progress < max(1.0, wd)

    def _command(self, cmd: control.Command) -> None:
        """A command to the router thread (the one channel: ``RunState.command``)."""
        if self._router_stopping:  # a fast stop closes the router before the last workers are reaped
            return
        self.control.send(codec.encode(cmd))

    # ------------------------------------------------------------ children: what they run, what they say

    def _spec(self, slot: WorkerSlot) -> WorkerSpec:
        kv = self.state.kv_events
        return launch.worker_spec(self.state.cfg, slot, self.slots, self.curve, self.boot_id,
                                  kv.inbox if kv is not None else "")

    def _worker_log_env(self) -> dict[str, str]:
        return logmod.child_env(self.state.cfg.log.format, self.state.cfg.log.level)

    def _launch(self, slot: WorkerSlot) -> Launch:
        """What a worker (``llamapool.worker``) or a gateway (``llamapool.gateway``) process runs."""
        cfg = self.state.cfg
        if slot.is_worker:
            return launch.worker(cfg, slot, self._spec(slot), self._worker_log_env())
        return launch.gateway(cfg, slot, self.curve, self.readiness.needed,
                              logmod.child_env(cfg.log.format, cfg.log.level))

    def _child_line(self, slot: WorkerSlot, raw: bytes) -> str:
        """One line of a child's output: a report is handled (never logged), a log line re-emitted at
        its level; returns the line's message ("" for a report)."""
        line = read_line(slot, raw, self.state.cfg.log.format == "json")
        if isinstance(line, str):
            return line
        self._on_report(slot, line)
        return ""

    def _on_report(self, slot: WorkerSlot, report: control.ChildReport) -> None:
        """A child's report: a gateway that listens is ready (a worker is ready at its hello); a gateway's
        failure to store a response is counted by the router."""
        if report.event == "listening" and slot.state == State.STARTING:
            slot.state, slot.ready_at = State.READY, time.monotonic()
        elif report.event == "store_failed" and report.detail in control.STORE_FAILURES:
            self._command(control.StoreFailed(report.detail))

    def _on_death(self, slot: WorkerSlot, pid: int, code: int, how: str) -> None:
        """An exit nobody asked for: a managed model's worker is the placer's; any other child restarts
        after a back-off or has failed for good (a gateway's socket may then close)."""
        if self.placer.manages(slot):
            self.placer.replica_died(slot, pid, how)
            return
        if self.processes.after_death(slot, pid, code, how) and not slot.is_worker:
            self.gateways.failed()
        self.state.publish(slot)
        self._check_all_failed()

    def _check_all_failed(self) -> None:
        """Every worker failed for good before any became ready: exit EX_CONFIG (78), do not idle.

        Only at start-up: once a worker has served, a pool that loses every worker (GPUs lost, a
        model file removed) keeps running and answers ``unavailable``, so that ``llamapool status``
        can say why; a restart by systemd would not bring a lost GPU back.
        """
        reasons = self.readiness.all_failed(even_after_ready=self.exit_when_all_failed)
        if reasons is None or self.state.stopping:
            return
        when = "after joining" if self.readiness.ever else "at start-up"
        why = f"every worker failed {when}, exiting with status {EXIT_ALL_FAILED}: {reasons}"
        LOG.error(why)
        self.notify.status(why)
        self.state.stopping = True
        self.exit_code = EXIT_ALL_FAILED
        self._stop.set()

    # ------------------------------------------------------------ the router's events

    def _on_router(self, event: control.Event) -> None:
        """One event of the router thread (protocol/control.py), in the event loop."""
        if isinstance(event, WorkerJoined):
            slot = self.state.slot(event.name)
            if slot is not None and slot.state == State.STARTING:
                self._ready(slot)
        elif isinstance(event, KillWorker):
            slot = self.state.slot(event.name)
            if slot is not None:
                self.state.spawn(kill(slot, event.pid, event.why))
        elif isinstance(event, ReadyCount):
            self.readiness.counted(event.ready, event.queued)
        elif isinstance(event, Drained):
            self.drainer.drained.set()
        elif isinstance(event, Demand):
            self.placer.on_demand(event)
        elif isinstance(event, ModelCommand):
            self.placer.command(event)

    def _ready(self, slot: WorkerSlot) -> None:
        """A worker is ready (the router accepted its hello; a node's worker joined)."""
        slot.state, slot.ready_at, slot.reason = State.READY, time.monotonic(), None
        slot.ready_event.set()
        self.placer.loaded(slot)
        self.placer.publish()
        self.readiness.worker_ready()
        self.state.publish(slot)

    # ------------------------------------------------------------ timers

    async def _timers(self) -> None:
        """Start timeouts, EXTEND_TIMEOUT while loading, the watchdog and GPU health."""
        wd = self.notify.watchdog_interval
        while not self._stop.is_set():
            now = time.monotonic()
            start_timeout = self.state.cfg.workers.start_timeout
            for slot in self.slots:
                if slot.state == State.STARTING and slot.proc is not None and now - slot.started_at > start_timeout:
                    self.state.spawn(kill(slot, slot.proc.pid, f"no hello within workers.start_timeout="
                                          f"{start_timeout:g}s"))
            self.readiness.tick()
            if wd is not None and self._loop_alive(now, wd):
                self.notify.watchdog()
            if self.gpu_watch.due(now):
                self._on_gpus(self.gpu_watch.poll())
            self.placer.place()
            await asyncio.sleep(min(1.0, wd) if wd else 1.0)

    def _on_gpus(self, rows: list[dict[str, Any]]) -> None:
        """NVML's reading, to the router; a worker whose GPU NVML lost is failed for good and killed."""
        self._command(GpuRows(rows))
        self.placer.on_gpu_rows(rows)
        for row in rows:
            lost = next((s for s in self.slots if any(g.uuid == row["uuid"] for g in s.gpus)), None)
            if row.get("lost") and lost is not None and lost.state != State.FAILED:
                lost.state, lost.reason = State.FAILED, f"GPU lost: {row.get('error')}"
                if lost.proc is not None:
                    self.state.spawn(kill(lost, lost.proc.pid, lost.reason))
                self.state.publish(lost)

    # ------------------------------------------------------------ signals: drain, fast stop, reload

    async def stop_signal(self) -> None:
        """SIGTERM/SIGINT: the first drains; a second one during the drain stops at once (as gunicorn
        and uvicorn do)."""
        await (self.fast_stop() if self.draining else self.drain())

    def _begin_drain(self) -> bool:
        """Start a graceful stop once (False when one is under way): tell systemd, log it."""
        if self.state.stopping:
            return False
        self.state.stopping = self.draining = True
        timeout = self.state.cfg.server.drain_timeout
        self.notify.stopping()
        self.notify.extend_timeout(timeout + 15)
        LOG.info(f"draining: new requests are refused; those in flight get up to {timeout:g}s "
                 f"(server.drain_timeout) to finish. To stop at once, press Ctrl-C again (or send SIGINT, "
                 f"SIGTERM or SIGQUIT): what is in flight then ends with an error")
        return True

    async def drain(self) -> None:
        """Refuse new work, let in-flight finish within drain_timeout (``drain.py``), exit 0; the gateways
        stop once the router has drained (their streams finish)."""
        if not self._begin_drain():
            return
        await self.drainer.pool()
        self._stop.set()

    async def fast_stop(self) -> None:
        """SIGQUIT (or a second SIGTERM/SIGINT): stop now. The workers are killed; the router then
        answers every request in flight with an error (``unavailable``, with ``tokens_delivered``) as
        it closes, and the gateways get a moment to end their HTTP streams with an error event."""
        if self.fast:
            return
        self.state.stopping = self.fast = True
        self.notify.stopping()
        LOG.info("stopping now: requests in flight end with an error")
        signal_all(self.slots, signal.SIGKILL)
        self._stop.set()

    async def reload(self) -> None:
        """SIGHUP: re-read the config and apply its models list (``reload.py``)."""
        await self.reloader()

    async def _shutdown_workers(self) -> None:
        await stop([s for s in self.slots if s.proc is not None], 10)  # they finish what they have: nothing now
        await self.state.settle(2)


def serve(config: Config) -> int:
    """Run the daemon in the foreground on uvloop until a signal stops it; one daemon per runtime dir
    (a second one gets ``AlreadyRunning`` before it binds anything)."""
    import uvloop

    raise_fd_limit()  # the router's sockets: ZeroMQ aborts the process on EMFILE
    lock = RunLock(config.runtime_dir)
    lock.acquire()
    try:
        return uvloop.run(Supervisor(config).run())
    finally:
        lock.release()
