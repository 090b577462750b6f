"""The supervisor: the daemon's main process, as gunicorn's arbiter: one class whose lifecycle reads
top to bottom.

It plans one worker per device (a GPU, a group of GPUs, or a CPU share) of each model of the pool,
runs the router in a thread, spawns its workers and HTTP gateways (one way for both: spawn, read
reports, reap, restart with backoff), and turns signals into drain (TERM/INT), fast stop (QUIT) and
rolling reload (HUP). It never imports llama_cpp, so it never creates a CUDA context. CURVE set-up
(``curve.py``), NVML polling (``gpuwatch.py``) and the child processes (``children.py``) are modules of
their own; every change of a child's state is checked against ``lifecycle.py``'s table.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import zmq

from llamapool import lifeline
from llamapool import log as logmod
from llamapool.config import Config, ConfigError, load_config, step_budget, tenants_of
from llamapool.keys import KeysFile, KeysFileError
from llamapool.protocol import codec, control
from llamapool.protocol.control import (
    CancelAll,
    Demand,
    Drained,
    ForgetWorker,
    GpuRows,
    KillWorker,
    ModelCommand,
    ModelLoaded,
    ModelReply,
    ModelRows,
    PoolModels,
    ReadyCount,
    RetireWorker,
    StartDrain,
    StopRouter,
    TenantTable,
    WorkerExited,
    WorkerInfo,
    WorkerJoined,
)
from llamapool.rlimits import raise_fd_limit
from llamapool.router import Router, RouterConfig
from llamapool.supervisor import gpus as gpumod
from llamapool.supervisor import lifecycle, placement
from llamapool.supervisor.children import (
    KILL_GRACE,
    Launch,
    WorkerSlot,
    exit_text,
    kill,
    read_line,
    signal_all,
    spawn,
    stop,
    until_reaped,
)
from llamapool.supervisor.curve import Curve
from llamapool.supervisor.env import cpu_threads, worker_env
from llamapool.supervisor.gpuwatch import GpuWatch
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.listener import Listener
from llamapool.supervisor.memory import fmt_bytes
from llamapool.supervisor.pool import CPU, Pool, host_kv_share
from llamapool.supervisor.runlock import RunLock
from llamapool.supervisor.sdnotify import Notifier, scrub_env
from llamapool.worker.server import EXIT_PERMANENT, WorkerSpec

EXIT_ALL_FAILED = EXIT_PERMANENT  # 78 (EX_CONFIG): every worker failed for good before any was ready
LOG = logmod.Logger("supervisor")

__all__ = ["KILL_GRACE", "Supervisor", "WorkerSlot", "serve"]


class Supervisor:
    # Exit 78 when every worker has failed for good even after some served (llamapool node: no
    # status to show and nothing else to do); the daemon does so only at start-up.
    exit_when_all_failed = False

    def __init__(self, config: Config, nvml: Any | None = None, use_nvml: bool = True):
        self.cfg = config
        nvml = nvml if nvml is not None else (gpumod.load_nvml() if use_nvml else None)
        self.gpus = gpumod.discover(nvml)
        self.gpu_watch = GpuWatch(nvml, self.gpus)
        self.curve = Curve(config)  # a bad key file is a start-up error (exit 2) naming it
        self.metrics_server: Any = None  # the [metrics] listener (read at start; a reload keeps it)
        self.notify = Notifier.from_env()
        self.slots: list[WorkerSlot] = []  # the workers
        self.gateways: list[WorkerSlot] = []  # the HTTP gateway processes ([http])
        self.pool: Pool | None = None  # the models the placement policy loads and unloads (supervisor/pool.py)
        self._model_rows: dict[str, dict[str, Any]] = {}  # the last ModelRows sent to the router
        self.listener: Listener | None = None  # the socket that [http] listen names; new gateways accept on it
        self.listeners: list[Listener] = []  # it, and an old one that gateways a reload retires still accept on
        self.zctx = zmq.Context()
        self.stopping = False
        self.draining = False  # a SIGTERM/SIGINT drain is under way (a second signal stops at once)
        self.fast = False  # a fast stop: requests in flight end with an error now
        self._router_stopping = False
        self.exit_code = 0
        self.boot_id = uuid.uuid4().hex[:16]  # this incarnation: the router takes only workers that carry it
        self._drained = asyncio.Event()
        self._stop = asyncio.Event()
        self._announced_ready = False
        self._ever_ready = False  # a worker said hello at least once since start
        self._ready_workers = 0
        self._queued = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reload_lock = asyncio.Lock()  # one SIGHUP at a time: a second one waits for the first
        self.kv_events: Any = None  # [kv_events]: the pod's KV-cache event publisher (supervisor/kvevents.py)

    # ------------------------------------------------------------ the lifecycle

    async def run(self) -> int:
        """Plan, start the router, spawn the children, serve until a signal, then stop in order."""
        self.loop = asyncio.get_running_loop()
        logmod.configure(self.cfg.log.format, self.cfg.log.level)
        self.slots = self._plan(self.cfg)  # a GPU given to two models is a ConfigError (exit 2)
        self.pool = self._make_pool(self.cfg)
        self._prepare_runtime_dir()
        if not self._start_router():
            return 1
        handlers: dict[signal.Signals, Callable[[], Coroutine[Any, Any, None]]] = {
            signal.SIGTERM: self.stop_signal, signal.SIGINT: self.stop_signal,
            signal.SIGQUIT: self.fast_stop, signal.SIGHUP: self.reload,
        }
        for sig, handler in handlers.items():
            self.loop.add_signal_handler(sig, self._spawn_task_of, handler)
        for slot in self.slots:  # the fixed plan's workers
            self._start(slot)
        self._place()  # the managed models' first workers (their floors), through the same spawn path
        self._start_gateways()
        self._spawn_task(self._timers())
        await self._stop.wait()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.shutdown)
        if self.fast:  # the router answers every request first, so that the gateways can pass it on
            await self._stop_router()
            await self._stop_gateways(grace=3.0)
            await self._shutdown_workers()
        else:
            await self._stop_gateways(self.cfg.server.drain_timeout + 5)
            await self._shutdown_workers()
            await self._stop_router()
        if self.kv_events is not None:
            self.kv_events.stop()
        self.zctx.term()
        self.gpu_watch.shutdown()
        self._log("stopped")
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
            if m.managed:  # the placement policy starts its workers (_place)
                continue
            prefix = f"{m.name}-" if cfg.models_table else ""
            if groups[m.name]:
                slots += [WorkerSlot(f"{prefix}gpu{'+'.join(str(g.index) for g in group)}", group, m)
                          for group in groups[m.name]]
                continue
            if m.devices == "remote":
                self._log(f"{m.name}: devices = \"remote\": no local worker; `llamapool node` hosts serve it")
                continue
            if m.devices != "cpu":
                self._log(f"{m.name}: no GPU found through NVML; starting CPU workers")
            slots += [WorkerSlot(f"{prefix}cpu{i}", (), m) for i in range(m.cpu_workers)]
        return slots

    def _make_pool(self, cfg: Config, old: Pool | None = None) -> Pool:
        """The placement policy's view of ``cfg``'s models (a reload keeps each model's pin and counters);
        a model that can never fit on the devices it may use is failed now, with both numbers."""
        keys = [f"models[{i}]" for i in range(len(cfg.models))] if cfg.models_table else ["model"]
        pool = Pool(cfg, self.gpus, gpumod.plan_groups(self.gpus, cfg.models, keys))
        for name, rec in pool.models.items():
            kept = old.models.get(name) if old is not None else None
            if kept is not None:
                rec.pinned, rec.loads, rec.evictions = kept.pinned, kept.loads, kept.evictions
                rec.unloads, rec.load_failures = kept.unloads, kept.load_failures
            if rec.need:
                largest = max(d.total for d in pool.devices(self.slots) if d.id in rec.allowed)
                if rec.need > largest:
                    where = "the CPU workers' RAM budget (pool.ram_budget)" if rec.allowed == (CPU,) else \
                        "the largest GPU it may use"
                    why = (f"model {name!r} can never be loaded: it needs {rec.need_text}, more than "
                           f"{where} holds ({fmt_bytes(largest)})")
                    pool.refuse(name, why)
                    self._log(why, "error", model=name)
        return pool

    def _prepare_runtime_dir(self) -> None:
        d = self.cfg.runtime_dir
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)

    def _start_router(self) -> bool:
        """The ``[http]`` listening socket, CURVE, the ``[metrics]`` listener and the router thread
        (``llamapool node`` has none of them)."""
        if self.cfg.http is not None:
            try:
                self._listen(self._listener_for(self.cfg.http.listen))
            except OSError as e:
                self._log(f"FATAL: http.listen: cannot listen on {self.cfg.http.listen}: {e}", "error")
                return False
        self.curve.start(self.zctx, self.cfg)
        if self.cfg.metrics is not None and self.cfg.metrics.listen:
            from llamapool.supervisor.metrics_http import serve_metrics

            try:
                curve = self.curve.child_fields(self.cfg.frontend)  # its client uses the internal key on tcp://
                keys = {"server_public_key": curve["server_key"].encode(), "client_key": curve["key_file"]} \
                    if curve else None
                self.metrics_server = serve_metrics(self.cfg.metrics.host_port, self.cfg.frontend, keys,
                                                    self.cfg.metrics.vllm_compatible_names)
            except OSError as e:
                self._log(f"FATAL: metrics.listen: cannot listen on {self.cfg.metrics.listen}: {e}", "error")
                return False
            self._log(f"metrics: http://{self.cfg.metrics.listen}/metrics")
        self.control = self.zctx.socket(zmq.PAIR)
        self.control.bind("inproc://llamapool-control")
        self.router = Router(dataclasses.replace(self._router_config(self.cfg), curve=self.curve.key,
                                                 local_key=self.curve.local_public(), boot_id=self.boot_id),
                             self.zctx, "inproc://llamapool-control", on_event=self._from_router_thread)
        self.router.bind()
        if not self._start_kv_events():
            return False
        self.router_thread = threading.Thread(target=self.router.run, name="router", daemon=True)
        self.router_thread.start()
        self._log(f"frontend {self.cfg.frontend}; models " + ", ".join(
            f"{m.name} ({m.path})" for m in self.cfg.models))
        return True

    def _start_kv_events(self) -> bool:
        """``[kv_events]``: the pod's KV-cache event publisher, its series in the router's metrics."""
        kv = self.cfg.kv_events
        if kv is None:
            return True
        from llamapool.supervisor import kvevents

        port = self.cfg.http.host_port[1] if self.cfg.http is not None else None
        self.kv_events = kvevents.start(self.zctx, kv, str(self.cfg.runtime_dir), port, self.cfg.model_names)
        if self.kv_events.error:
            self._log(f"FATAL: {self.kv_events.error}", "error")
            return False
        before, pub = self.router.metrics.extra, self.kv_events
        self.router.metrics.extra = lambda: itertools.chain(before(), pub.metrics())
        self._log(f"kv_events: publishing on {kv.endpoint}" + (f", replay on {kv.replay_endpoint}"
                                                              if kv.replay_endpoint else "") + f" (topic {pub.topic})")
        return True

    @staticmethod
    def _router_config(cfg: Config) -> RouterConfig:
        s, w = cfg.server, cfg.workers
        return RouterConfig(
            frontend=cfg.frontend, backend=cfg.backend, max_queue=s.max_queue,
            queue_timeout=s.queue_timeout, max_message_bytes=s.max_message_bytes,
            heartbeat_interval=w.heartbeat_interval, heartbeat_liveness=w.heartbeat_liveness,
            step_timeout=w.step_timeout, affinity_slack=s.affinity_slack, models=tuple(cfg.model_names),
            tenants=tenants_of(cfg), rate_window=s.rate_window, flex_queue_timeout=s.flex_queue_timeout,
            tenant_idle=s.tenant_idle,
        )

    def _listener_for(self, listen: str) -> Listener:
        """The socket that ``listen`` names: the current one when it names its address, else one bound
        now (OSError if that fails). It may resolve a host name: a reload calls it in a thread."""
        if self.listener is not None and self.listener.serves(listen):
            return self.listener
        return Listener.bind(listen)

    def _listen(self, listener: Listener) -> None:
        """Make ``listener`` the socket new gateways accept on."""
        if listener not in self.listeners:
            self.listeners.append(listener)
        self.listener = listener

    def _release_listeners(self) -> list[Listener]:
        """Close the supervisor's copy of each socket that [http] no longer names and that no gateway
        is to accept on any more (the socket itself closes with the last gateway that holds it)."""
        keep = {id(gw.listener) for gw in self.gateways if gw.state not in (State.STOPPED, State.FAILED)} | \
            {id(self.listener)}
        closed = [s for s in self.listeners if id(s) not in keep]
        for old in closed:
            self.listeners.remove(old)
            old.close()
        return closed

    def _start_gateways(self) -> None:
        if self.cfg.http is None or self.listener is None:
            return
        self._log(f"HTTP gateway: http://{self.listener.listen} ({self.cfg.http.processes} process(es))")
        self.gateways = [WorkerSlot(f"http{i}", listener=self.listener) for i in range(self.cfg.http.processes)]
        for gw in self.gateways:
            self._start(gw)

    # ------------------------------------------------------------ children: spawn, read, reap

    def _start(self, slot: WorkerSlot) -> None:
        """Spawn a process for ``slot``, a worker or a gateway: the one way a child starts."""
        if not slot.is_worker and self.cfg.http is None:  # a reload removed [http]
            return
        slot.state, slot.kill_reason = State.STARTING, None
        slot.live_at = slot.busy_for = 0.0
        slot.ready_event.clear()
        self._spawn_task(self._run_child(slot))

    async def _run_child(self, slot: WorkerSlot) -> None:
        """One child process from spawn to reap: its output line by line (reports handled, log lines
        relayed), then its exit."""
        proc = await spawn(self._launch(slot))
        slot.proc, slot.started_at = proc, time.monotonic()
        self._publish(slot)
        self._log(f"{slot.name}: started pid {proc.pid}" + (f" on {slot.device}" if slot.is_worker else ""))
        assert proc.stdout is not None
        async for raw in proc.stdout:
            self._child_line(slot, raw)
        self._reap(slot, proc, await proc.wait())

    def _launch(self, slot: WorkerSlot) -> Launch:
        """What a worker (``llamapool.worker``) or a gateway (``llamapool.gateway``) process runs."""
        log_env = self._worker_log_env() if slot.is_worker else logmod.child_env(self.cfg.log.format,
                                                                                 self.cfg.log.level)
        if slot.is_worker:
            spec = self._spec(slot)
            model = slot.model or self.cfg.model
            env = worker_env(os.environ, slot.gpus, self.cfg.workers.env, spec.threads,
                             model.prefill_cublas_min_rows, model.deterministic)
            return Launch("llamapool.worker", spec.to_json(), {**env, **log_env, **lifeline.parent_env()})
        from llamapool.gateway import GatewaySpec

        http, listener = self.cfg.http, slot.listener
        assert http is not None and listener is not None
        spec_gw = GatewaySpec(name=slot.name, frontend=self.cfg.frontend, host=listener.host, port=listener.port,
                              listen_fd=listener.fd,
                              model=self.cfg.model_name, api_keys_file=http.api_keys_file,
                              tenant_header=http.tenant_header,
                              drain_timeout=self.cfg.server.drain_timeout, request_timeout=http.request_timeout,
                              max_message_bytes=self.cfg.server.max_message_bytes,
                              allowed_hosts=list(http.allowed_hosts), cors_origins=list(http.cors_origins),
                              min_ready_workers=max(1, self._ready_needed),
                              vllm_metric_names=self.cfg.metrics is not None and self.cfg.metrics.vllm_compatible_names,
                              models=[{"name": m.name, "path": m.path, "embedding": m.embedding,
                                       "ctx_per_slot": m.ctx_per_slot, "chat_template": m.chat_template}
                                      for m in self.cfg.models],
                              idle_timeout=http.idle_timeout, read_timeout=http.read_timeout,
                              max_connections=http.max_connections, send_timeout=http.send_timeout,
                              send_buffer_bytes=http.send_buffer_bytes,
                              responses_store=self.cfg.responses_path, responses_ttl=http.responses_ttl,
                              responses_max_bytes=int(http.responses_max_mb * (1 << 20)),
                              **self.curve.child_fields(self.cfg.frontend))
        return Launch("llamapool.gateway", spec_gw.to_json(),
                      {**scrub_env(os.environ), **log_env, **lifeline.parent_env()}, pass_fds=(listener.fd,))

    def _spec(self, slot: WorkerSlot) -> WorkerSpec:
        m, w = slot.model or self.cfg.model, self.cfg.workers
        live = [s for s in self.slots if s.state not in (State.STOPPED, State.RETIRING)] or [slot]
        # the cores are split between every CPU worker of every model (a model's threads overrides)
        n_cpu = sum(1 for s in live if not s.gpus) or 1
        threads = cpu_threads(n_cpu, m.threads) if not slot.gpus else min(8, cpu_threads(len(live), m.threads))
        budget = step_budget(m.max_batch_tokens, m.slots, bool(slot.gpus))
        curve: dict[str, Any] = self.curve.child_fields(self.cfg.backend)
        return WorkerSpec(
            name=slot.name, backend=self.cfg.backend, device=slot.device, model_path=m.path,
            heartbeat_interval=w.heartbeat_interval, heartbeat_liveness=w.heartbeat_liveness,
            engine=m.engine, model_name=m.name, boot_id=self.boot_id, embedding=m.embedding, pooling=m.pooling,
            kv_events=self.kv_events.inbox if self.kv_events is not None else "",
            kv_events_block=self.cfg.kv_events.block_size if self.cfg.kv_events is not None else 16,
            **m.engine_settings(threads=threads, max_batch_tokens=budget, kv_host=str(host_kv_share(m, len(live)))),
            **curve,
        )

    def _worker_log_env(self) -> dict[str, str]:
        return logmod.child_env(self.cfg.log.format, self.cfg.log.level)

    def _child_line(self, slot: WorkerSlot, raw: bytes) -> str:
        """One line of a child's output: a report is handled (never logged), a log line re-emitted at
        its level; returns the line's message ("" for a report)."""
        line = read_line(slot, raw, self.cfg.log.format == "json")
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

    def _reap(self, slot: WorkerSlot, proc: asyncio.subprocess.Process, code: int) -> None:
        """A child exited: the router hears of a worker's exit; a child that was to stop is stopped,
        any other goes through :meth:`_after_death`."""
        how = exit_text(code, slot.kill_reason)
        slot.last_exit, slot.proc = how, None
        if slot.is_worker:
            self._command(WorkerExited(slot.name, proc.pid, how))
            if self.kv_events is not None:  # its KV is gone: its blocks are removed
                self.kv_events.worker_gone(f"{slot.name}:{proc.pid}")
        if slot.state in (State.RETIRING, State.STOPPED) or self.stopping:
            self._log(f"{slot.name}: pid {proc.pid} exited ({how})")
            if slot.state == State.RETIRING:
                slot.state = State.STOPPED
            self._publish(slot)
            return
        if slot.model is not None and self.pool is not None and slot.model.name in self.pool.models:
            self._replica_died(slot, proc.pid, code, how)
            return
        self._after_death(slot, proc.pid, code, how)
        self._publish(slot)
        self._check_all_failed()

    def _after_death(self, slot: WorkerSlot, pid: int, code: int, how: str) -> None:
        """An unexpected exit of a worker or a gateway: FAILED for good (a permanent error, or flapping),
        else BACKOFF and a restart after a delay that doubles with each death in a row."""
        now = time.monotonic()
        reason = lifecycle.restart_reason(code, slot.kill_reason)
        slot.exits[reason] = slot.exits.get(reason, 0) + 1
        slot.deaths.append(now)
        w = self.cfg.workers
        if code == EXIT_PERMANENT:
            fatal = [ln for ln in slot.log if "FATAL" in ln]
            slot.state, slot.reason = State.FAILED, (fatal[-1] if fatal else how)
        elif sum(1 for t in slot.deaths if now - t < w.flap_window) > w.flap_limit:
            slot.state = State.FAILED
            slot.reason = f"flapping: died more than {w.flap_limit} times in {w.flap_window:g}s; last: {how}"
        else:
            if slot.ready_at and now - slot.ready_at > w.restart_backoff_max:
                slot.streak = 0
            delay = min(w.restart_backoff * 2**slot.streak, w.restart_backoff_max)
            slot.streak += 1
            slot.state = State.BACKOFF
            self._log(f"{slot.name}: pid {pid} died ({how}); restarting in {delay:g}s", "warning")
            self._spawn_task(self._restart_later(slot, delay))
            return
        self._log(f"{slot.name}: FAILED, not restarting: {slot.reason}", "error")
        serving = [gw for gw in self.gateways if gw.listener is self.listener and gw.state != State.STOPPED]
        if not slot.is_worker and self.listener is not None and all(gw.state == State.FAILED for gw in serving):
            # nothing accepts on the socket any more: close it, so that a client is refused at once
            # rather than wait in its queue for ever (a reload binds it again)
            self._log(f"HTTP gateway: every gateway process failed: no longer listening on {self.listener.listen} "
                      f"until a reload", "error")
            self.listener = None
            self._release_listeners()

    def _replica_died(self, slot: WorkerSlot, pid: int, code: int, how: str) -> None:
        """A worker of a managed model died. While loading, its model has failed: the requests waiting for
        it end with the cause, and no new load is tried for a back-off; once serving, the slot is dropped
        and the policy starts another if the model still has demand."""
        assert slot.model is not None and self.pool is not None
        model, now = slot.model.name, time.monotonic()
        loading = slot.state == State.STARTING
        fatal = [ln for ln in slot.log if "FATAL" in ln]
        cause = fatal[-1] if fatal else f"{how}" + (f"; its last line: {slot.log[-1]}" if slot.log else "")
        slot.state, slot.reason = State.FAILED, cause
        if slot in self.slots:
            self.slots.remove(slot)
        self._command(ForgetWorker(slot.name))
        if loading:
            backoff = self.pool.load_failed(model, cause, now)
            self._log(f"placement: model {model} failed to load on {slot.name} ({slot.device}): {cause}; "
                      f"the requests waiting for it fail; next try in {backoff:g}s", "error", model=model)
        else:
            self._log(f"{slot.name}: pid {pid} died ({how}); its model {model} gets a new worker when it has "
                      f"demand", "warning", model=model)
        self._publish_models()
        self._place()

    # ------------------------------------------------------------ the pool: placement (supervisor/placement.py)

    def _place(self) -> None:
        """Ask the placement policy, carry out its actions (the one spawn path, the one retire path) and
        tell the router each model's state."""
        if self.pool is None or self.stopping:
            return
        now = time.monotonic()
        for action in self.pool.plan(self.slots, now):
            if isinstance(action, placement.Start):
                self._start_replica(action)
            elif isinstance(action, placement.Drain):
                self._drain_replica(action)
            elif isinstance(action, placement.Refuse) and not self.pool.models[action.model].never:
                self.pool.refuse(action.model, action.why)
                self._log(f"placement: {action.why}", "error", model=action.model)
        self._publish_models()

    def _start_replica(self, action: placement.Start) -> None:
        assert self.pool is not None
        m = self.pool.models[action.model].cfg
        gpu = next((g for g in self.gpus if g.uuid == action.device), None)
        base = f"{m.name}-gpu{gpu.index}" if gpu is not None else f"{m.name}-cpu"
        taken = {s.name for s in self.slots}
        name = next(n for n in (f"{base}{k}" if gpu is None else base if k == 0 else f"{base}.{k}"
                                for k in range(len(taken) + 1)) if n not in taken)
        slot = WorkerSlot(name, (gpu,) if gpu is not None else (), m)
        self.slots.append(slot)
        self.pool.started(m.name)
        self._log(f"placement: start {name}: {action.why}", model=m.name, worker=name, device=action.device)
        self._start(slot)

    def _drain_replica(self, action: placement.Drain) -> None:
        assert self.pool is not None
        slot = self._slot(action.worker)
        if slot is None or slot.state not in (State.STARTING, State.READY):
            return
        self.pool.drained(action.model, action.evict)
        self._log(f"placement: {'evict' if action.evict else 'retire'} {slot.name}: {action.why}",
                  model=action.model, worker=slot.name)
        self._spawn_task(self._retire(slot))

    def _model_command(self, cmd: ModelCommand) -> None:
        """An operator's load, unload, pin or unpin (SDK, CLI, HTTP), answered through the router."""
        assert self.pool is not None
        ok, message = self.pool.command(cmd.action, cmd.model, self.slots)
        if ok and cmd.action == "unload":
            for slot in [s for s in self.slots if s.model is not None and s.model.name == cmd.model
                         and s.state in (State.STARTING, State.READY)]:
                self._drain_replica(placement.Drain(slot.name, cmd.model, "unloaded by an operator", evict=False))
        if ok:
            self._log(f"placement: {cmd.action} {cmd.model} (operator): {message}", model=cmd.model)
        self._place()
        state = str(self._model_rows.get(cmd.model, {}).get("state", ""))
        self._command(ModelReply(cmd.client, cmd.id, cmd.model, cmd.action, ok, state, message))

    def _publish_models(self) -> None:
        """Each model's row to the router, when it changed."""
        if self.pool is None:
            return
        rows = self.pool.rows(self.cfg, self.slots, time.monotonic())
        if rows != self._model_rows:
            self._model_rows = rows
            self._command(ModelRows(rows))

    async def _restart_later(self, slot: WorkerSlot, delay: float) -> None:
        await asyncio.sleep(delay)
        if slot.state == State.BACKOFF and not self.stopping:
            slot.restarts += 1
            self._start(slot)

    def _check_all_failed(self) -> None:
        """Every worker failed for good before any became ready: exit EX_CONFIG (78), do not idle.

        Only at start-up: once a worker has served, a pool that loses every worker (GPUs lost, a
        model file removed) keeps running and answers ``unavailable``, so that ``llamapool status``
        can say why; a restart by systemd would not bring a lost GPU back.
        """
        if (self._ever_ready and not self.exit_when_all_failed) or self.stopping or not self.slots or \
                not all(s.state == State.FAILED for s in self.slots):
            return
        reasons = "; ".join(sorted({str(s.reason) for s in self.slots}))
        when = "after joining" if self._ever_ready else "at start-up"
        why = f"every worker failed {when}, exiting with status {EXIT_ALL_FAILED}: {reasons}"
        self._log(why, "error")
        self.notify.status(why)
        self.stopping = True
        self.exit_code = EXIT_ALL_FAILED
        self._stop.set()

    # ------------------------------------------------------------ the router's events: readiness

    def _from_router_thread(self, event: control.Event) -> None:
        self.loop.call_soon_threadsafe(self._on_router, event)

    def _on_router(self, event: control.Event) -> None:
        """One event of the router thread (protocol/control.py), in the event loop."""
        if isinstance(event, WorkerJoined):
            slot = self._slot(event.name)
            if slot is not None and slot.state == State.STARTING:
                self._ready(slot)
        elif isinstance(event, KillWorker):
            slot = self._slot(event.name)
            if slot is not None:
                self._spawn_task(kill(slot, event.pid, event.why))
        elif isinstance(event, ReadyCount):
            self._ready_workers, self._queued = event.ready, event.queued
            if not self._announced_ready and self._ready_workers >= self._ready_needed:
                self._announced_ready = True
                self._log(f"ready (READY=1): {self._ready_workers} of {len(self.slots)} local worker(s) ready "
                          f"(server.min_ready_workers = {self.cfg.server.min_ready_workers})")
                self.notify.ready()  # after the line: in the journal it comes before systemd's "Started"
            self.notify.status(f"{self._ready_workers} workers ready, {self._queued} queued")
        elif isinstance(event, Drained):
            self._drained.set()
        elif isinstance(event, Demand) and self.pool is not None:
            self.pool.on_demand(event, time.monotonic())
            self._place()
        elif isinstance(event, ModelCommand):
            self._model_command(event)

    @property
    def _ready_needed(self) -> int:
        """Ready workers for READY=1 (``server.min_ready_workers``, at most all of them)."""
        return min(self.cfg.server.min_ready_workers, len(self.slots))

    def _ready(self, slot: WorkerSlot) -> None:
        """A worker is ready (the router accepted its hello; a node's worker joined): said in the log as
        it comes, except the one that the READY=1 line is about to announce."""
        self._ever_ready = True
        slot.state, slot.ready_at, slot.reason = State.READY, time.monotonic(), None
        slot.ready_event.set()
        if slot.model is not None and self.pool is not None and slot.model.name in self.pool.models:
            self.pool.loaded(slot.model.name)
            seconds = slot.ready_at - slot.started_at
            self._command(ModelLoaded(slot.model.name, seconds))
            self._log(f"placement: {slot.model.name} loaded on {slot.name} ({slot.device}) in {seconds:.2f}s",
                      model=slot.model.name, worker=slot.name, load_seconds=round(seconds, 3))
        self._publish_models()
        n = sum(1 for s in self.slots if s.state == State.READY)
        if self._announced_ready or n < self._ready_needed:
            self._log(f"ready: {n} of {len(self.slots)} local workers")
        self._publish(slot)

    def _slot(self, name: str) -> WorkerSlot | None:
        return next((s for s in self.slots if s.name == name), None)

    # ------------------------------------------------------------ timers

    async def _timers(self) -> None:
        """Start timeouts, EXTEND_TIMEOUT while loading, the watchdog and GPU health."""
        wd = self.notify.watchdog_interval
        while not self._stop.is_set():
            now = time.monotonic()
            for slot in self.slots:
                if slot.state == State.STARTING and slot.proc is not None and \
                        now - slot.started_at > self.cfg.workers.start_timeout:
                    self._spawn_task(kill(slot, slot.proc.pid, "no hello within "
                                          f"workers.start_timeout={self.cfg.workers.start_timeout:g}s"))
            if self.slots and all(slot.state == State.FAILED for slot in self.slots):
                self.notify.status("every worker failed: " + "; ".join(sorted({str(s.reason) for s in self.slots})))
            elif not self._announced_ready:
                self.notify.extend_timeout(10)
            if wd is not None and self._loop_alive(now, wd):
                self.notify.watchdog()
            if self.gpu_watch.due(now):
                self._on_gpus(self.gpu_watch.poll())
            self._place()
            await asyncio.sleep(min(1.0, wd) if wd else 1.0)

    def _loop_alive(self, now: float, wd: float) -> bool:
        """Whether the watchdog may be fed: the router's loop made progress lately."""
        return now - self.router.loop_progress < max(1.0, wd)

    def _on_gpus(self, rows: list[dict[str, Any]]) -> None:
        """NVML's reading, to the router; a worker whose GPU NVML lost is failed for good and killed."""
        self._command(GpuRows(rows))
        if self.pool is not None:
            self.pool.on_gpu_rows(rows)
        for row in rows:
            lost = next((s for s in self.slots if any(g.uuid == row["uuid"] for g in s.gpus)), None)
            if row.get("lost") and lost is not None and lost.state != State.FAILED:
                lost.state, lost.reason = State.FAILED, f"GPU lost: {row.get('error')}"
                if lost.proc is not None:
                    self._spawn_task(kill(lost, lost.proc.pid, lost.reason))
                self._publish(lost)

    # ------------------------------------------------------------ signals: drain and fast stop

    def _spawn_task_of(self, handler: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._spawn_task(handler())

    async def stop_signal(self) -> None:
        """SIGTERM/SIGINT: the first drains; a second one during the drain stops at once (as gunicorn
        and uvicorn do)."""
        await (self.fast_stop() if self.draining else self.drain())

    def _begin_drain(self) -> bool:
        """Start a graceful stop once (False when one is under way): tell systemd, log it."""
        if self.stopping:
            return False
        self.stopping = self.draining = True
        self.notify.stopping()
        self.notify.extend_timeout(self.cfg.server.drain_timeout + 15)
        self._log(f"draining: new requests are refused; those in flight get up to "
                  f"{self.cfg.server.drain_timeout:g}s (server.drain_timeout) to finish. To stop at once, "
                  f"press Ctrl-C again (or send SIGINT, SIGTERM or SIGQUIT): what is in flight then ends "
                  f"with an error")
        return True

    async def drain(self) -> None:
        """Refuse new work, let in-flight finish within drain_timeout, exit 0."""
        if not self._begin_drain():
            return
        # the gateways keep listening: their /ready says 503 at once, /health 200, and a new request gets
        # the router's refusal; once the router has drained they stop (their streams finish)
        self._command(StartDrain())
        try:
            await asyncio.wait_for(self._drained.wait(), self.cfg.server.drain_timeout)
        except TimeoutError:
            self._log("drain timeout: cancelling what is left", "warning")
            self._command(CancelAll())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), 5)
        self._stop.set()

    async def fast_stop(self) -> None:
        """SIGQUIT (or a second SIGTERM/SIGINT): stop now. The workers are killed; the router then
        answers every request in flight with an error (``unavailable``, with ``tokens_delivered``) as
        it closes, and the gateways get a moment to end their HTTP streams with an error event."""
        if self.fast:
            return
        self.stopping = self.fast = True
        self.notify.stopping()
        self._log("stopping now: requests in flight end with an error")
        signal_all(self.slots, signal.SIGKILL)
        self._stop.set()

    # ------------------------------------------------------------ SIGHUP: reload

    async def reload(self) -> None:
        """SIGHUP: re-read the config and apply its models list: new models' workers start, removed
        models' workers finish what they have (and what waits for them) and exit, and the workers of
        models that stay are replaced one device at a time (with the model's new settings)."""
        async with self._reload_lock:
            await self._reload()

    async def _reload(self) -> None:
        if self.stopping or not self.cfg.source:
            return
        try:
            new = load_config(self.cfg.source)
            tenants = tenants_of(new)
            plan = self._plan(new)
            allowed = self.curve.read_allowed(new)
        except (ConfigError, KeysFileError) as e:
            self._log(f"reload refused, keeping the running config: {e}", "error")
            return
        self.curve.apply_allowed(new, allowed)  # the allow-list applies to new connections now
        self.notify.reloading()
        # a managed model's workers stay as they are while it stays managed (the policy retires them); the
        # fixed plan's workers are replaced, retired or started as before
        managed = {m.name for m in new.models if m.managed}
        old = {s.name: s for s in self.slots if s.model is None or s.model.name not in managed
               or not s.model.managed}
        self.pool = self._make_pool(new, self.pool)
        planned = {s.name: s for s in plan}
        staying = [(old[n], planned[n]) for n in planned if n in old]
        added = [s for n, s in planned.items() if n not in old]
        removed = [s for n, s in old.items() if n not in planned]
        before = set(self.cfg.model_names)
        self._log(f"reloading: models {', '.join(new.model_names)}"
                  f" (added: {', '.join(m for m in new.model_names if m not in before) or 'none'}; removed: "
                  f"{', '.join(m for m in before if m not in new.model_names) or 'none'}); "
                  f"{len(added)} worker(s) to start, {len(removed)} to retire, {len(staying)} to replace")
        self.cfg = new
        logmod.configure(new.log.format, new.log.level)
        self._command(PoolModels(list(new.model_names)))
        table = tenants or KeysFile()
        self._command(TenantTable([t.to_row() for t in table.tenants.values()], table.defaults.to_row()))
        self._spawn_task(self._reload_gateways())
        # a new worker whose GPU a leaving worker holds starts once that one has exited
        held = {g.uuid for s in removed for g in s.gpus}
        blocked = [s for s in added if any(g.uuid in held for g in s.gpus)]
        for slot in added:
            if slot not in blocked:
                self.slots.append(slot)
                self._start(slot)
        for slot, want in staying:
            if self.stopping:
                return
            # each replacement may drain for drain_timeout and load for start_timeout
            self.notify.extend_timeout(new.server.drain_timeout + new.workers.start_timeout)
            slot.model, slot.gpus = want.model, want.gpus
            await self._replace(slot)
        await self._wait_ready([s for s in added if s not in blocked])
        await asyncio.gather(*(self._retire(slot) for slot in removed))
        for slot in blocked:
            self.slots.append(slot)
            self._start(slot)
        await self._wait_ready(blocked)
        self._log("reload done")
        self.notify.ready()

    async def _wait_ready(self, slots: list[WorkerSlot]) -> None:
        for slot in slots:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.ready_event.wait(), self.cfg.workers.start_timeout)

    async def _let_go(self, slot: WorkerSlot, grace: float) -> None:
        """End the slot's process: a ready worker is told to finish what it runs (RetireWorker) and has
        ``grace`` seconds before SIGKILL; one not ready yet is killed now. Returns once it is reaped."""
        proc = slot.proc
        if proc is None:
            return
        if slot.state == State.READY:
            slot.state = State.RETIRING
            self._publish(slot)
            self._command(RetireWorker(slot.name))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        else:
            slot.state = State.STOPPED
        with contextlib.suppress(ProcessLookupError):
            if proc.returncode is None:
                proc.kill()
        await proc.wait()
        await until_reaped(slot)

    async def _retire(self, slot: WorkerSlot) -> None:
        """A worker that leaves the pool: it finishes its requests (and, when its model left, what is
        queued for that model), then exits; then it is forgotten."""
        await self._let_go(slot, self.cfg.server.drain_timeout + self.cfg.server.queue_timeout)
        slot.state = State.STOPPED
        if slot in self.slots:
            self.slots.remove(slot)
        self._command(ForgetWorker(slot.name))
        self._log(f"{slot.name}: retired")

    async def _replace(self, slot: WorkerSlot) -> None:
        """A worker of a model that stays: its process finishes what it runs and exits, then a new
        one starts on the same device with the model's new settings."""
        await self._let_go(slot, self.cfg.server.drain_timeout)
        slot.streak, slot.reason = 0, None
        slot.deaths.clear()
        self._start(slot)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(slot.ready_event.wait(), self.cfg.workers.start_timeout)

    async def _reload_gateways(self) -> None:
        """SIGHUP: start gateway processes with the new ``[http]`` next to the old ones, accepting on
        the same listening socket (a new one if ``[http] listen`` names another address), then let the
        old ones stop accepting and finish what they have: a connection the kernel has queued is
        accepted by a new one, never reset. If the new ones do not start, the old ones keep serving."""
        was = self.listener
        if self.cfg.http is None:  # [http] removed: the old gateways stop, and the socket with them
            self.listener = None
        else:
            try:
                listener = await asyncio.to_thread(self._listener_for, self.cfg.http.listen)
            except OSError as e:
                kept = f"the HTTP gateways keep serving on http://{was.listen} as they are" if was else \
                    "no HTTP gateway starts"
                self._log(f"reload: http.listen: cannot listen on {self.cfg.http.listen}: {e}; {kept}", "error")
                return
            if self.stopping:  # a stop came meanwhile: it stops the gateways there are
                if listener is not was:
                    listener.close()
                return
            self._listen(listener)
        before = self.gateways
        old = [gw for gw in before if gw.state != State.STOPPED]  # not those an earlier reload stops
        self._start_gateways()
        new = [gw for gw in self.gateways if gw not in before]
        self.gateways = new + before  # a stop during the switch reaches them all
        end = time.monotonic() + 15
        while time.monotonic() < end and not self.stopping and any(gw.state != State.READY for gw in new) \
                and not any(gw.state == State.FAILED for gw in new):
            await asyncio.sleep(0.05)
        if self.stopping:
            return
        ok = all(gw.state == State.READY for gw in new)
        if not ok:
            self._log("reload: the new HTTP gateway processes did not start listening; the old ones keep serving")
            self.listener = was
        retired = old if ok else new
        for gw in retired:
            gw.state = State.STOPPED
        for closed in self._release_listeners():  # an old address: it closes as its last gateway stops accepting
            self._log(f"HTTP gateway: {closed.listen} closes as its old gateways stop accepting (they finish "
                      f"their requests)")
        await stop(retired, self.cfg.server.drain_timeout + 5)
        self.gateways = [gw for gw in self.gateways if gw not in retired]

    # ------------------------------------------------------------ stopping

    async def _stop_gateways(self, grace: float) -> None:
        """SIGTERM: stop accepting, finish what is in flight (within ``grace`` seconds); then SIGKILL.
        The listening socket closes as the last gateway stops accepting: new connections are refused."""
        self.listener = None
        for gw in self.gateways:
            gw.state = State.STOPPED
        self._release_listeners()
        await stop(self.gateways, grace)

    async def _shutdown_workers(self) -> None:
        await stop([s for s in self.slots if s.proc is not None], 10)  # they finish what they have: nothing now
        for task in list(self._tasks):
            if not task.done():
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 2)

    async def _stop_router(self) -> None:
        self._command(StopRouter())
        self._router_stopping = True  # nothing reads the control socket any more: send nothing
        await asyncio.to_thread(self.router_thread.join, 10)
        self.control.close(linger=0)
        self.curve.stop()

    # ------------------------------------------------------------ helpers

    def _command(self, cmd: control.Command) -> None:
        if self._router_stopping:  # a fast stop closes the router before the last workers are reaped
            return
        self.control.send(codec.encode(cmd))

    def _publish(self, slot: WorkerSlot) -> None:
        """A worker's row to the router's ``status`` (a gateway has none)."""
        if slot.is_worker:
            self._command(WorkerInfo(slot.name, slot.info()))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _log(msg: str, level: str = "info", **fields: Any) -> None:
        LOG.log(logmod.LEVELS[level], msg, **fields)


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
