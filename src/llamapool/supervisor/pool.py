"""The pool's models as the placement policy sees them: demand from the router, workers from the
supervisor, memory from the GGUFs and NVML, and the operator's commands.

:class:`Pool` keeps what outlives one decision (each managed model's pin, failed loads and their
back-off, counters) and turns the supervisor's slots into the views of :mod:`placement`, whose
:func:`~llamapool.supervisor.placement.plan` decides. ``placer.py`` carries the actions out through the
one spawn path and the one retire path. Models with ``load = "always"`` and no ``replicas`` (a fixed
plan) are not the policy's: they only take memory on their devices.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, cast

from llamapool import log as logmod
from llamapool.config import Config, ModelConfig, ram_budget, step_budget
from llamapool.protocol.control import Demand, ModelDemand
from llamapool.supervisor import gpus as gpumod
from llamapool.supervisor import memory, placement
from llamapool.supervisor.children import WorkerSlot
from llamapool.supervisor.lifecycle import State
from llamapool.worker.settings import host_kv_bytes, machine_ram

LOG = logmod.Logger("supervisor")
CPU = "cpu"  # the device id of the CPU workers' RAM budget
MAX_BACKOFF = 600.0  # a failed model's back-off doubles up to this
def worker_need(m: ModelConfig, gpu: bool, workers: int = 1) -> tuple[int, str]:
    """What one worker of ``m`` takes, its process included (bytes, and the sum in words); (0, why) when
    the GGUF cannot be read (a Hugging Face file not downloaded yet, or not a GGUF: its load will say).
    A CPU worker's host KV tier (``kv_host``, :func:`host_kv_share`) counts in its RAM."""
    if m.engine != "llama" or not m.path:
        process = memory.GPU_PROCESS if gpu else memory.CPU_PROCESS
        return process, f"{memory.fmt_bytes(process)} process"
    need = _estimate(m, gpu)
    if isinstance(need, str):
        return 0, need
    if not gpu:
        need = dataclasses.replace(need, host=host_kv_bytes(m.kv_host, need.kv, workers))
    return need.total, need.text()


def host_kv_share(m: ModelConfig, workers: int, gpu: bool = False) -> int:
    """The bytes of host RAM a worker of ``m`` may keep KV in (``kv_host``; "auto": a share split between
    the machine's ``workers``, at most 8x its KV cache, on CPU workers; 0 on GPU workers, where the tier is
    not yet measured faster than recomputing: a size turns it on there, docs/configuration.md): what its
    spec carries."""
    if gpu and m.kv_host.strip().lower() == "auto":
        return 0
    need = _estimate(m, False) if m.engine == "llama" and m.path else "no model"
    return host_kv_bytes(m.kv_host, need.kv if not isinstance(need, str) else 0, workers)


def _estimate(m: ModelConfig, gpu: bool) -> memory.MemoryNeed | str:
    ubatch = memory.worker_ubatch(m.n_ubatch, step_budget(m.max_batch_tokens, m.slots, gpu), m.slots)
    try:
        return memory.estimate(m.path, m.slots, m.ctx_per_slot, ubatch, gpu=gpu, flash_attn=m.flash_attn,
                               mmproj=m.mmproj)
    except (OSError, ValueError, KeyError) as e:
        LOG.warning(f"{m.name}: cannot estimate its memory from {m.path}: {e}", model=m.name)
        return f"unknown ({e})"


@dataclass
class ModelRecord:
    """What the pool keeps of one managed model between decisions."""

    cfg: ModelConfig
    need: int  # bytes one worker needs (memory.estimate), 0 when unknown
    need_text: str
    allowed: tuple[str, ...]  # device ids it may run on ("cpu" or GPU UUIDs)
    pinned: bool = False
    want: bool = False  # an operator's load: start a worker even with nothing waiting
    failures: int = 0  # failed loads in a row
    retry_at: float = 0.0  # no new load before this (time.monotonic)
    never: str = ""  # why it can never be placed (its need exceeds every device)
    reason: str = ""  # the last failure's cause
    loads: int = 0
    evictions: int = 0
    evicted_at: float = float("-inf")  # its last eviction (time.monotonic)
    rebounds: int = 0  # loads within min_residency of its own eviction (thrash the hysteresis damps)
    unloads: int = 0
    load_failures: int = 0
    demand: ModelDemand = field(default_factory=lambda: ModelDemand(0, 0.0, float("-inf")))


class Pool:
    """The managed models of one config; :meth:`plan` gives the placement policy's actions."""

    def __init__(self, cfg: Config, gpus: list[gpumod.Gpu], groups: dict[str, list[tuple[gpumod.Gpu, ...]]]):
        self.cfg = cfg
        self.gpus = {g.uuid: g for g in gpus}
        self.cpu_total = ram_budget(cfg.pool.ram_budget, machine_ram())
        self.settings = placement.Settings(scale_up_wait=cfg.pool.scale_up_wait,
                                           scale_down_idle=cfg.pool.scale_down_idle,
                                           min_residency=cfg.pool.min_residency)
        self.models: dict[str, ModelRecord] = {}
        self.active: dict[str, int] = {}  # each connected worker's running prompts (Demand)
        self.idle_since: dict[str, float] = {}  # each worker's last moment of becoming idle
        self.gpu_free: dict[str, int] = {}  # NVML's free bytes per GPU (GpuRows)
        self.read_at: dict[str, float] = {}  # ... and when it was read
        # workers gone since: their memory, which that reading may still count as used (uuid -> [(when,
        # bytes)]); without it each pass before the next reading evicted another model for the same start
        self.gone: dict[str, list[tuple[float, int]]] = {}
        self._held: dict[str, str] = {}  # the workers holding memory at the last pass: name -> model
        self.needs: dict[str, int] = {}  # every model's need (fixed ones' too: they take memory)
        managed = any(m.managed for m in cfg.models)  # a fixed plan alone needs no estimate
        for m in cfg.models:
            need, text = worker_need(m, bool(groups.get(m.name))) if managed else (0, "")
            self.needs[m.name] = need
            if m.managed:
                allowed = tuple(g[0].uuid for g in groups.get(m.name, [])) or (CPU,)
                self.models[m.name] = ModelRecord(m, need, text, allowed)

    # ------------------------------------------------------------ what the router and NVML report

    def on_demand(self, demand: Demand, now: float) -> None:
        for name, d in demand.models.items():
            rec = self.models.get(name)
            if rec is not None:
                rec.demand = d
        for worker, n in demand.active.items():
            if n:
                self.idle_since.pop(worker, None)
            elif self.active.get(worker, 1) or worker not in self.idle_since:
                self.idle_since[worker] = now
        self.active = dict(demand.active)

    def on_gpu_rows(self, rows: list[dict[str, Any]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for row in rows:
            if "memory_total" in row:
                uuid = row["uuid"]
                self.gpu_free[uuid] = int(row["memory_total"]) - int(row.get("memory_used", 0))
                self.read_at[uuid] = now
                self.gone[uuid] = [(t, b) for t, b in self.gone.get(uuid, []) if t + GONE_SETTLE > now]

    # ------------------------------------------------------------ the decision

    def plan(self, slots: list[WorkerSlot], now: float) -> list[placement.Action]:
        """The policy's actions for the slots as they are now."""
        models, replicas = [], []
        for name, rec in self.models.items():
            if rec.never:
                continue
            lo, hi = rec.cfg.replica_bounds
            idle = rec.cfg.idle_unload if rec.cfg.idle_unload >= 0 else self.cfg.pool.idle_unload
            d = rec.demand
            # idle since its last request, or since it was loaded: a model loaded by an operator (or whose
            # load took longer than its idle_unload) is not unloaded before it could serve
            loaded_at = max((s.ready_at for s in slots if s.model is not None and s.model.name == name
                             and s.state == State.READY), default=float("-inf"))
            models.append(placement.ModelView(
                name, rec.need, cast(placement.Load, rec.cfg.load), lo, hi, idle, rec.pinned,
                d.queued + (1 if rec.want else 0), d.oldest_wait, max(d.last_used, loaded_at), rec.retry_at,
                rec.allowed, rec.evicted_at))
        for s in slots:
            if s.model is None or s.model.name not in self.models or s.state not in _HELD:
                continue
            state: placement.ReplicaState = "ready" if s.state == State.READY else \
                "loading" if s.state == State.STARTING else "draining"
            replicas.append(placement.ReplicaView(
                s.name, s.model.name, _device(s), state, self.active.get(s.name, 0), s.started_at,
                self.idle_since.get(s.name) if state == "ready" else None))
        self._note_gone(slots, now)
        return placement.plan(models, replicas, self.devices(slots), now, self.settings)

    def _note_gone(self, slots: list[WorkerSlot], now: float) -> None:
        """The GPU workers that held memory at the last pass and no longer do: their bytes count as free
        until an NVML reading GONE_SETTLE seconds after they went."""
        held = {s.name: s for s in slots if s.model is not None and s.state in _HELD}
        for name, model in self._held.items():
            if name not in held:
                was = next((s for s in slots if s.name == name), None)
                for uuid in (g.uuid for g in was.gpus) if was is not None else ():
                    self.gone.setdefault(uuid, []).append((now, self.needs.get(model, 0)))
        self._held = {name: s.model.name for name, s in held.items() if s.model is not None}

    def devices(self, slots: list[WorkerSlot]) -> list[placement.DeviceView]:
        """Each device's memory: what its live workers' needs leave (NVML's free bytes too, on a GPU, less
        what its loading workers have yet to take), and what its draining workers will give back."""
        held: dict[str, int] = {}
        loading: dict[str, int] = {}
        draining: dict[str, int] = {}
        for s in slots:
            if s.model is None or s.state not in _HELD:
                continue
            need = self.needs.get(s.model.name, 0)
            for dev in _devices(s):
                book = draining if s.state == State.RETIRING else held
                book[dev] = book.get(dev, 0) + need
                if s.state == State.STARTING:
                    loading[dev] = loading.get(dev, 0) + need
        out = [placement.DeviceView(CPU, max(0, self.cpu_total - held.get(CPU, 0)), self.cpu_total,
                                    draining.get(CPU, 0))]
        for uuid, g in self.gpus.items():
            free = g.memory_total - held.get(uuid, 0)
            if uuid in self.gpu_free:  # what NVML sees free (and what went since), less what loading ones take
                since = sum(b for t, b in self.gone.get(uuid, []) if t + GONE_SETTLE > self.read_at.get(uuid, 0.0))
                free = min(free, self.gpu_free[uuid] + since - loading.get(uuid, 0))
            out.append(placement.DeviceView(uuid, max(0, free), g.memory_total, draining.get(uuid, 0)))
        return out

    # ------------------------------------------------------------ what happened

    def started(self, model: str, now: float) -> None:
        rec = self.models[model]
        rec.loads += 1
        rec.rebounds += now - rec.evicted_at < self.settings.min_residency

    def loaded(self, model: str) -> None:
        rec = self.models.get(model)
        if rec is not None:
            rec.failures, rec.want, rec.reason = 0, False, ""

    def drained(self, model: str, evict: bool, now: float) -> None:
        rec = self.models[model]
        if evict:
            rec.evictions += 1
            rec.evicted_at = now
        else:
            rec.unloads += 1

    def load_failed(self, model: str, why: str, now: float) -> float:
        """A worker of ``model`` died while loading: the model is failed for a back-off that doubles with
        each failure in a row (``pool.load_backoff``, to 10 minutes); returns it."""
        rec = self.models[model]
        rec.failures += 1
        rec.load_failures += 1
        rec.want = False
        backoff = min(self.cfg.pool.load_backoff * 2 ** (rec.failures - 1), MAX_BACKOFF)
        rec.retry_at, rec.reason = now + backoff, why
        return backoff

    def refuse(self, model: str, why: str) -> None:
        """``model`` can never be placed (its need exceeds every device it may use)."""
        self.models[model].never = why

    # ------------------------------------------------------------ the operator

    def command(self, action: str, model: str, slots: list[WorkerSlot]) -> tuple[bool, str]:
        """An operator's load, unload, pin or unpin: (accepted, what it did, for a person). The placer
        drains the workers of an unloaded model."""
        rec = self.models.get(model)
        if rec is None:
            if action in ("load", "pin"):
                return True, f"model {model!r} is load = \"always\": its workers run from the start"
            return False, (f"model {model!r} is load = \"always\" (its workers run from the start and are "
                           f"never unloaded): set load = \"on_demand\" in the config and reload to {action} it")
        if rec.never:
            return False, rec.never
        if action in ("load", "pin"):
            rec.want = not self._replicas(model, slots)
            rec.retry_at = 0.0 if rec.retry_at > time.monotonic() else rec.retry_at  # an operator may retry
            rec.pinned = rec.pinned or action == "pin"
            return True, f"model {model!r} " + ("pinned: never evicted or unloaded when idle" if action == "pin"
                                                else "loading" if rec.want else "is loaded")
        rec.pinned, rec.want = False, False
        if action == "unpin":
            return True, f"model {model!r} unpinned: it may be evicted, and unloaded when idle"
        return True, f"model {model!r} unloading: its workers finish what they run, then exit"

    @staticmethod
    def _replicas(model: str, slots: list[WorkerSlot]) -> list[WorkerSlot]:
        return [s for s in slots if s.model is not None and s.model.name == model
                and s.state in (State.STARTING, State.READY)]

    # ------------------------------------------------------------ what status shows

    def rows(self, cfg: Config, slots: list[WorkerSlot], now: float) -> dict[str, dict[str, Any]]:
        """Each model's row (``status``, ``/v1/models``, metrics): its state, where it runs, its need."""
        rows = {}
        for m in cfg.models:
            mine = [s for s in slots if s.model is not None and s.model.name == m.name]
            ready = [s for s in mine if s.state == State.READY]
            loading = [s for s in mine if s.state == State.STARTING]
            rec = self.models.get(m.name)
            failed = bool(rec and (rec.never or rec.retry_at > now)) or (
                rec is None and bool(mine) and all(s.state == State.FAILED for s in mine))
            state = "loaded" if ready else "failed" if failed else "loading" if loading else "unloaded"
            row: dict[str, Any] = {
                "state": state, "load": m.load, "managed": m.managed, "pinned": bool(rec and rec.pinned),
                "replicas": len(ready) + len(loading), "replica_bounds": list(m.replica_bounds) if m.managed else
                [len(mine), len(mine)], "devices": sorted({d for s in ready + loading for d in _devices(s)}),
                "need_bytes": self.needs.get(m.name, 0),
            }
            if rec is not None:
                row.update(need=rec.need_text, loads=rec.loads, evictions=rec.evictions, unloads=rec.unloads,
                           load_failures=rec.load_failures, rebounds=rec.rebounds)
                if rec.never:
                    row["reason"] = rec.never
                elif rec.reason:
                    left = rec.retry_at - now
                    row["reason"] = (f"model {m.name!r} failed to load: {rec.reason}" +
                                     (f"; next try in {math.ceil(left)}s (pool.load_backoff)" if left > 0 else ""))
            elif state == "failed":
                row["reason"] = "; ".join(sorted({str(s.reason) for s in mine}))
            rows[m.name] = row
        return rows


GONE_SETTLE = 2.0  # seconds after a worker's exit until NVML's reading no longer counts its memory
_HELD = (State.STARTING, State.READY, State.RETIRING)  # a worker that holds (or is about to hold) memory


def _devices(slot: WorkerSlot) -> list[str]:
    return [g.uuid for g in slot.gpus] or [CPU]


def _device(slot: WorkerSlot) -> str:
    return _devices(slot)[0]
