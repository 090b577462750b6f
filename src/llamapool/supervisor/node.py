"""``llamapool node``: this host's workers, serving a router on another host.

A node is the supervisor without its router, gateway and metrics listener: the same worker
lifecycle (spawn, reap, restart with backoff, flap limit, start timeout, SIGTERM drain, SIGHUP
reload, sd_notify), but its workers connect to the remote router's backend (``[node] join``) with
the node's CURVE key, under the names ``<node>/<slot>``. The router treats them as its own:
heartbeats, re-dispatch of unstarted requests, ``worker_lost`` for streams in flight.

The node never talks to the router itself; it reads its workers' lines. A worker is ``starting``
while it loads its model (``workers.start_timeout`` applies), ``joining`` once loaded (it logs
``joining the router at``) until the router accepts it, and ``ready`` once it has (it logs ``joined
the router at`` on the router's first heartbeat): the node's ``ready`` line and sd_notify READY=1
mean joined. A ``joining`` worker waits for its router as long as it takes (a router not up yet, a
key not yet in its allow-list: the worker dials again every few seconds, and the node says what to
do, every 30 s). From then on a worker keeps its model and its connection through router restarts
and network partitions: ZeroMQ reconnects (over CURVE, with the same keys) and the worker says hello
again on every new connection; it stays ``ready`` meanwhile. A worker that exits 78 (a name clash)
is ``failed``; when every worker has failed for good the node exits 78 with the reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

from llamapool import log as logmod
from llamapool import security
from llamapool.config import Config, ConfigError
from llamapool.protocol import control
from llamapool.protocol.control import ReadyCount, RetireWorker, WorkerInfo
from llamapool.supervisor.arbiter import Supervisor, WorkerSlot
from llamapool.supervisor.children import kill, stop
from llamapool.supervisor.lifecycle import State
from llamapool.worker.server import WorkerSpec

LOG = logmod.Logger("supervisor")
REFUSED_HINT_EVERY = 30.0  # seconds between two "what to do" lines about a refused node key


class NodeSupervisor(Supervisor):
    """The :class:`Supervisor`'s worker lifecycle for workers that join a remote router."""

    exit_when_all_failed = True  # a name clash, a missing model, flapping: even after workers had joined
    serves_http = False  # the router's host runs the gateways

    def __init__(self, config: Config, nvml: Any | None = None, use_nvml: bool = True):
        if config.node is None:
            raise ConfigError("node: the config has no [node] table (join, name, server_public_key, key): "
                              "`llamapool node` runs workers for a router on another host")
        super().__init__(config, nvml, use_nvml)
        self.node = config.node
        self.router_key = b""
        self._hinted_at = -1e9
        self._check_keys(config)

    def _check_keys(self, cfg: Config) -> None:
        """Read both key files now: a bad one is an error naming it (exit 2), not a worker that flaps."""
        assert cfg.node is not None
        if cfg.node.server_public_key:
            self.router_key = security.load_key_file(cfg.node.server_public_key, secret=False).public
            security.load_key_file(cfg.node.key, secret=True)

    # ------------------------------------------------------------ no router here

    def _start_router(self) -> bool:
        node, cfg = self.node, self.state.cfg
        if cfg.http is not None or cfg.metrics is not None:
            LOG.info("WARNING: [http] and [metrics] are ignored by `llamapool node`: the router's host serves them")
        how = (f"CURVE, node key {security.load_key_file(node.key, secret=False).fingerprint}, router key "
               f"{security.fingerprint(self.router_key)}" if self.router_key else "no CURVE")
        LOG.info(f"node {node.name}: workers join the router at {node.join} ({how}); model {cfg.model.path}")
        self.state.spawn(self._watch_workers())
        return True

    async def _stop_router(self) -> None:
        return None

    def _loop_alive(self, now: float, wd: float) -> bool:
        return True

    async def _watch_workers(self) -> None:
        """What the router does for its own workers, which it cannot do for a node's: kill a worker
        whose liveness lines stopped (frozen: SIGSTOP, a wedged process) or whose engine step runs
        past ``workers.step_timeout`` (a hung GPU call); the supervisor then restarts it."""
        w = self.state.cfg.workers
        silent_after = w.heartbeat_interval * w.heartbeat_liveness
        while not self._stop.is_set():
            now = time.monotonic()
            for slot in self.slots:
                proc = slot.proc
                if proc is None or slot.state in (State.STARTING, State.STOPPED, State.FAILED) or slot.kill_reason \
                        or not slot.live_at:
                    continue
                since = now - slot.live_at
                if since > silent_after:
                    self.state.spawn(kill(slot, proc.pid, f"no liveness line for {since:.1f}s (workers."
                                          f"heartbeat_interval x heartbeat_liveness = {silent_after:g}s)"))
                elif slot.busy_for > w.step_timeout:
                    self.state.spawn(kill(slot, proc.pid, f"engine step running for {slot.busy_for:.1f}s "
                                          f"> workers.step_timeout={w.step_timeout:g}s"))
            await asyncio.sleep(min(0.5, w.heartbeat_interval / 2))

    # ------------------------------------------------------------ workers named and connected for the node

    def _plan(self, cfg: Config) -> list[WorkerSlot]:
        assert cfg.node is not None
        slots = super()._plan(cfg)
        for slot in slots:
            slot.name = f"{cfg.node.name}/{slot.name}"
        return slots

    def _spec(self, slot: WorkerSlot) -> WorkerSpec:
        node = self.node
        spec = dataclasses.replace(super()._spec(slot), backend=node.join, node=node.name)
        if self.router_key:
            spec = dataclasses.replace(spec, server_key=self.router_key.decode(), key_file=node.key)
        return spec

    def _worker_log_env(self) -> dict[str, str]:
        # the workers log at info at least: their "joining"/"joined" lines are how the node follows them
        # (their lines are filtered again at the node's own level when it re-emits them)
        log = self.state.cfg.log
        return logmod.child_env(log.format, log.level if log.level == "debug" else "info")

    def _on_report(self, slot: WorkerSlot, report: control.ChildReport) -> None:
        """A node's worker's reports: liveness, loaded (joining), accepted by the router (ready), and a
        refused key."""
        if report.event == "live":
            slot.live_at, slot.busy_for = time.monotonic(), report.busy_for
        elif slot.proc is None:
            return
        elif report.event == "joined" and slot.state in (State.STARTING, State.JOINING):
            self._ready(slot)
        elif report.event == "joining" and slot.state == State.STARTING:
            slot.state = State.JOINING  # loaded: no start_timeout now, it waits for the router to accept it
            self.state.publish(slot)
        elif report.event == "key_refused":
            self._refused_hint()

    def _refused_hint(self) -> None:
        """What to do about a node key the router refuses: once, then every 30 s."""
        now = time.monotonic()
        if now - self._hinted_at < REFUSED_HINT_EVERY:
            return
        self._hinted_at = now
        node = self.node
        key = Path(node.key)
        pub = key.with_suffix(".pub")
        what = (str(pub) if pub.is_file() else
                f"{key.stem}.pub (the .pub that `llamapool keygen {key.stem}` wrote next to {key})")
        try:
            fp = " " + security.load_key_file(key, secret=False).fingerprint
        except security.KeyFileError:  # changed on disk since it was checked: the workers use the old one
            fp = ""
        LOG.error(f"node {node.name}: the router at {node.join} refuses this node's key{fp}: to let this node "
                  f"in, copy {what} into the router's [security] authorized_keys directory and send the router "
                  f"SIGHUP (`systemctl reload llamapool`); the workers keep dialling and join without a "
                  f"restart")

    # ------------------------------------------------------------ what the router's control socket did

    def _command(self, cmd: control.Command) -> None:
        """The base class's commands to its router thread, done here: readiness for systemd, and
        a retired worker (reload) gets SIGTERM, which makes it finish its requests and leave."""
        if isinstance(cmd, WorkerInfo):
            ready = sum(1 for s in self.slots if s.state == State.READY)
            if ready != self.readiness.workers or not self.readiness.announced:
                self._on_router(ReadyCount(ready, 0))
        elif isinstance(cmd, RetireWorker):
            slot = self.state.slot(cmd.name)
            if slot is not None and slot.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.terminate()

    async def drain(self) -> None:
        """Each worker tells the router to route nothing more to it, finishes what it runs (within
        ``server.drain_timeout``) and leaves; then the node exits 0."""
        if not self._begin_drain():
            return
        await stop([s for s in self.slots if s.proc is not None], self.state.cfg.server.drain_timeout)
        self._stop.set()

    async def reload(self) -> None:
        """SIGHUP: as the supervisor's (the workers replaced one at a time), with the new [node] keys checked."""
        if self.state.stopping or not self.state.cfg.source:
            return
        from llamapool.config import load_config

        try:
            new = load_config(self.state.cfg.source)
            if new.node is None:
                raise ConfigError("node: the new config has no [node] table")
            self._check_keys(new)
        except ConfigError as e:
            LOG.error(f"reload refused, keeping the running config: {e}")
            return
        self.node = new.node
        await super().reload()


def serve_node(config: Config) -> int:
    """Run ``llamapool node`` in the foreground on uvloop until a signal stops it."""
    import uvloop

    return uvloop.run(NodeSupervisor(config).run())


__all__ = ["NodeSupervisor", "serve_node"]
