"""SIGHUP: re-read the config file and apply it while the pool serves (a rolling reload).

New models' workers start, removed models' workers finish what they have (and what waits for them)
and exit, and the workers of models that stay are replaced one device at a time with the model's new
settings: the successor starts beside the old worker where the device has room for both, which then retires
(``surge.py``), else the old one finishes what it runs and exits first
(:class:`~llamapool.supervisor.drain.Drainer`); a new worker whose GPU a leaving one holds starts once that
one has exited. The tenants, the CURVE allow-list and the gateways (``gateways.py``) follow;
a managed model's workers stay as they are while it stays managed (the placement policy retires them).
A config that does not load is refused whole: the running one stays.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from llamapool import log as logmod
from llamapool.config import Config, ConfigError, load_config, tenants_of
from llamapool.keys import KeysFile, KeysFileError
from llamapool.protocol.control import PoolModels, TenantTable
from llamapool.supervisor import surge
from llamapool.supervisor.children import WorkerSlot
from llamapool.supervisor.curve import Curve
from llamapool.supervisor.drain import Drainer
from llamapool.supervisor.gateways import Gateways
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.placer import Placer
from llamapool.supervisor.processes import Processes
from llamapool.supervisor.runstate import RunState
from llamapool.supervisor.sdnotify import Notifier

LOG = logmod.Logger("supervisor")


class Reloader:
    def __init__(self, state: RunState, plan: Callable[[Config], list[WorkerSlot]], curve: Curve,
                 notify: Notifier, processes: Processes, drain: Drainer, placer: Placer, gateways: Gateways,
                 nvml: Any | None = None) -> None:
        self.state = state
        self.nvml = nvml  # the free memory a successor needs beside its predecessor (surge.py)
        self.plan = plan  # a config's fixed workers (the arbiter's plan)
        self.curve = curve
        self.notify = notify
        self.processes = processes
        self.drain = drain
        self.placer = placer
        self.gateways = gateways
        self._lock = asyncio.Lock()  # one SIGHUP at a time: a second one waits for the first

    async def __call__(self) -> None:
        async with self._lock:
            await self._reload()

    async def _reload(self) -> None:
        state = self.state
        if state.stopping or not state.cfg.source:
            return
        try:
            new = load_config(state.cfg.source)
            tenants = tenants_of(new)
            plan = self.plan(new)
            allowed = self.curve.read_allowed(new)
        except (ConfigError, KeysFileError) as e:
            LOG.error(f"reload refused, keeping the running config: {e}")
            return
        self.curve.apply_allowed(new, allowed)  # the allow-list applies to new connections now
        self.notify.reloading()
        # a managed model's workers stay as they are while it stays managed (the policy retires them); the
        # fixed plan's workers are replaced, retired or started as before
        managed = {m.name for m in new.models if m.managed}
        old = {surge.plan_name(s.name): s for s in state.slots if s.model is None or s.model.name not in managed
               or not s.model.managed}
        self.placer.configure(new)
        planned = {s.name: s for s in plan}
        staying = [(old[n], planned[n]) for n in planned if n in old]
        added = [s for n, s in planned.items() if n not in old]
        removed = [s for n, s in old.items() if n not in planned]
        before = set(state.cfg.model_names)
        LOG.info(f"reloading: models {', '.join(new.model_names)}"
                 f" (added: {', '.join(m for m in new.model_names if m not in before) or 'none'}; removed: "
                 f"{', '.join(m for m in before if m not in new.model_names) or 'none'}); "
                 f"{len(added)} worker(s) to start, {len(removed)} to retire, {len(staying)} to replace")
        state.cfg = new
        logmod.configure(new.log.format, new.log.level)
        state.command(PoolModels(list(new.model_names), new.adapters))
        table = tenants or KeysFile()
        state.command(TenantTable([t.to_row() for t in table.tenants.values()], table.defaults.to_row()))
        state.spawn(self.gateways.reload())
        await self._workers(added, staying, removed)

    async def _workers(self, added: list[WorkerSlot], staying: list[tuple[WorkerSlot, WorkerSlot]],
                       removed: list[WorkerSlot]) -> None:
        """Start the added workers, replace the staying ones one at a time, retire the removed ones; then
        start those whose GPU a removed one held."""
        held = {g.uuid for s in removed for g in s.gpus}
        blocked = [s for s in added if any(g.uuid in held for g in s.gpus)]
        for slot in added:
            if slot not in blocked:
                self.state.slots.append(slot)
                self.processes.start(slot)
        new = self.state.cfg
        for slot, want in staying:
            if self.state.stopping:
                return
            # each replacement may drain for drain_timeout and load for start_timeout
            self.notify.extend_timeout(new.server.drain_timeout + new.workers.start_timeout)
            if new.server.reload_surge and await self._surge(slot, want):
                continue
            slot.model, slot.gpus = want.model, want.gpus
            await self.drain.replace(slot)
        await self._wait_ready([s for s in added if s not in blocked])
        await asyncio.gather(*(self.drain.retire(slot) for slot in removed))
        for slot in blocked:
            self.state.slots.append(slot)
            self.processes.start(slot)
        await self._wait_ready(blocked)
        LOG.info("reload done")
        self.notify.ready()

    async def _surge(self, slot: WorkerSlot, want: WorkerSlot) -> bool:
        """Replace ``slot`` by a successor started beside it (supervisor/surge.py) when its device has room:
        once the successor is ready the old worker retires; False (nothing changed: replace it in place)
        without room, or when the successor does not get ready."""
        assert want.model is not None
        fits, why = surge.room(self.nvml, slot, want.model)
        if not fits:
            LOG.info(f"{slot.name}: replaced in place, its successor does not fit beside it ({why})")
            return False
        twin = WorkerSlot(surge.successor(slot.name, {s.name for s in self.state.slots}), want.gpus, want.model)
        LOG.info(f"{slot.name}: its successor {twin.name} starts beside it ({why})")
        self.state.slots.append(twin)
        self.processes.start(twin)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(twin.ready_event.wait(), self.state.cfg.workers.start_timeout)
        if twin.state != State.READY:
            LOG.warning(f"{twin.name}: not ready within workers.start_timeout; {slot.name} is replaced in place")
            await self.drain.retire(twin)
            return False
        await self.drain.retire(slot)
        return True

    async def _wait_ready(self, slots: list[WorkerSlot]) -> None:
        for slot in slots:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.ready_event.wait(), self.state.cfg.workers.start_timeout)
