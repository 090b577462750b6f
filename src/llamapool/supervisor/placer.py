"""The placement policy's decisions carried out: ``placement.py`` decides (a pure function), ``pool.py``
keeps its inputs (demand, memory, the operator's commands), and :class:`Placer` acts: a new replica
goes through the one spawn path (:class:`~llamapool.supervisor.processes.Processes`), one to evict or
retire through the one drain path (:class:`~llamapool.supervisor.drain.Drainer`), and each model's state
goes to the router. The arbiter hands it the router's demand, the operator's model commands, NVML's
readings, and the loads and deaths of the managed models' workers.
"""

from __future__ import annotations

import time
from typing import Any

from llamapool import log as logmod
from llamapool.config import Config
from llamapool.protocol.control import Demand, ForgetWorker, ModelCommand, ModelLoaded, ModelReply, ModelRows
from llamapool.supervisor import gpus as gpumod
from llamapool.supervisor import placement
from llamapool.supervisor.children import WorkerSlot
from llamapool.supervisor.drain import Drainer
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.memory import fmt_bytes
from llamapool.supervisor.pool import CPU, Pool
from llamapool.supervisor.processes import Processes
from llamapool.supervisor.runstate import RunState

LOG = logmod.Logger("supervisor")


class Placer:
    def __init__(self, state: RunState, gpus: list[gpumod.Gpu], processes: Processes, drain: Drainer) -> None:
        self.state = state
        self.gpus = gpus
        self.processes = processes
        self.drain = drain
        self.pool: Pool | None = None  # the models the placement policy loads and unloads (supervisor/pool.py)
        self._rows: dict[str, dict[str, Any]] = {}  # the last ModelRows sent to the router

    def configure(self, cfg: Config) -> None:
        """The policy's view of ``cfg``'s models (a reload keeps each model's pin and counters); a model
        that can never fit on the devices it may use is failed now, with both numbers."""
        keys = [f"models[{i}]" for i in range(len(cfg.models))] if cfg.models_table else ["model"]
        pool, old = Pool(cfg, self.gpus, gpumod.plan_groups(self.gpus, cfg.models, keys)), self.pool
        for name, rec in pool.models.items():
            kept = old.models.get(name) if old is not None else None
            if kept is not None:
                rec.pinned, rec.loads, rec.evictions = kept.pinned, kept.loads, kept.evictions
                rec.unloads, rec.load_failures = kept.unloads, kept.load_failures
                rec.evicted_at, rec.rebounds = kept.evicted_at, kept.rebounds
            if rec.need:
                largest = max(d.total for d in pool.devices(self.state.slots) if d.id in rec.allowed)
                if rec.need > largest:
                    where = "the CPU workers' RAM budget (pool.ram_budget)" if rec.allowed == (CPU,) else \
                        "the largest GPU it may use"
                    why = (f"model {name!r} can never be loaded: it needs {rec.need_text}, more than "
                           f"{where} holds ({fmt_bytes(largest)})")
                    pool.refuse(name, why)
                    LOG.error(why, model=name)
        self.pool = pool

    def manages(self, slot: WorkerSlot) -> bool:
        """Whether ``slot`` is a worker of a model the policy places (not of the fixed plan)."""
        return slot.model is not None and self.pool is not None and slot.model.name in self.pool.models

    # ------------------------------------------------------------ deciding and acting

    def place(self) -> None:
        """Ask the placement policy, carry out its actions (the one spawn path, the one retire path) and
        tell the router each model's state."""
        if self.pool is None or self.state.stopping:
            return
        for action in self.pool.plan(self.state.slots, time.monotonic()):
            if isinstance(action, placement.Start):
                self._start_replica(action)
            elif isinstance(action, placement.Drain):
                self._drain_replica(action)
            elif isinstance(action, placement.Refuse) and not self.pool.models[action.model].never:
                self.pool.refuse(action.model, action.why)
                LOG.error(f"placement: {action.why}", model=action.model)
        self.publish()

    def _start_replica(self, action: placement.Start) -> None:
        assert self.pool is not None
        m = self.pool.models[action.model].cfg
        gpu = next((g for g in self.gpus if g.uuid == action.device), None)
        base = f"{m.name}-gpu{gpu.index}" if gpu is not None else f"{m.name}-cpu"
        taken = {s.name for s in self.state.slots}
        name = next(n for n in (f"{base}{k}" if gpu is None else base if k == 0 else f"{base}.{k}"
                                for k in range(len(taken) + 1)) if n not in taken)
        slot = WorkerSlot(name, (gpu,) if gpu is not None else (), m)
        self.state.slots.append(slot)
        self.pool.started(m.name, time.monotonic())
        LOG.info(f"placement: start {name}: {action.why}", model=m.name, worker=name, device=action.device)
        self.processes.start(slot)

    def _drain_replica(self, action: placement.Drain) -> None:
        assert self.pool is not None
        slot = self.state.slot(action.worker)
        if slot is None or slot.state not in (State.STARTING, State.READY):
            return
        self.pool.drained(action.model, action.evict, time.monotonic())
        LOG.info(f"placement: {'evict' if action.evict else 'retire'} {slot.name}: {action.why}",
                 model=action.model, worker=slot.name)
        self.state.spawn(self.drain.retire(slot))

    def publish(self) -> None:
        """Each model's row to the router, when it changed."""
        if self.pool is None:
            return
        rows = self.pool.rows(self.state.cfg, self.state.slots, time.monotonic())
        if rows != self._rows:
            self._rows = rows
            self.state.command(ModelRows(rows))

    # ------------------------------------------------------------ what the policy hears

    def command(self, cmd: ModelCommand) -> None:
        """An operator's load, unload, pin or unpin (SDK, CLI, HTTP), answered through the router."""
        assert self.pool is not None
        ok, message = self.pool.command(cmd.action, cmd.model, self.state.slots)
        if ok and cmd.action == "unload":
            for slot in [s for s in self.state.slots if s.model is not None and s.model.name == cmd.model
                         and s.state in (State.STARTING, State.READY)]:
                self._drain_replica(placement.Drain(slot.name, cmd.model, "unloaded by an operator", evict=False))
        if ok:
            LOG.info(f"placement: {cmd.action} {cmd.model} (operator): {message}", model=cmd.model)
        self.place()
        state = str(self._rows.get(cmd.model, {}).get("state", ""))
        self.state.command(ModelReply(cmd.client, cmd.id, cmd.model, cmd.action, ok, state, message))

    def on_demand(self, demand: Demand) -> None:
        if self.pool is not None:
            self.pool.on_demand(demand, time.monotonic())
            self.place()

    def on_gpu_rows(self, rows: list[dict[str, Any]]) -> None:
        if self.pool is not None:
            self.pool.on_gpu_rows(rows)

    def loaded(self, slot: WorkerSlot) -> None:
        """A worker said hello: when it is a managed model's, the model is loaded (the router hears how fast)."""
        if not self.manages(slot):
            return
        assert slot.model is not None and self.pool is not None
        self.pool.loaded(slot.model.name)
        seconds = slot.ready_at - slot.started_at
        self.state.command(ModelLoaded(slot.model.name, seconds))
        LOG.info(f"placement: {slot.model.name} loaded on {slot.name} ({slot.device}) in {seconds:.2f}s",
                 model=slot.model.name, worker=slot.name, load_seconds=round(seconds, 3))

    def replica_died(self, slot: WorkerSlot, pid: int, how: str) -> None:
        """A worker of a managed model died. While loading, its model has failed: the requests waiting for
        it end with the cause, and no new load is tried for a back-off; once serving, the slot is dropped
        and the policy starts another if the model still has demand."""
        assert slot.model is not None and self.pool is not None
        model, now = slot.model.name, time.monotonic()
        loading = slot.state == State.STARTING
        fatal = [ln for ln in slot.log if "FATAL" in ln]
        cause = fatal[-1] if fatal else f"{how}" + (f"; its last line: {slot.log[-1]}" if slot.log else "")
        slot.state, slot.reason = State.FAILED, cause
        if slot in self.state.slots:
            self.state.slots.remove(slot)
        self.state.command(ForgetWorker(slot.name))
        if loading:
            backoff = self.pool.load_failed(model, cause, now)
            LOG.error(f"placement: model {model} failed to load on {slot.name} ({slot.device}): {cause}; "
                      f"the requests waiting for it fail; next try in {backoff:g}s", model=model)
        else:
            LOG.warning(f"{slot.name}: pid {pid} died ({how}); its model {model} gets a new worker when it has "
                        f"demand", model=model)
        self.publish()
        self.place()
