"""The router's LoRA adapters: those of the config and those loaded at run time (``llamapool load NAME --lora
PATH``), each named as a model is; a request's ``lora`` entries resolved against them; and the run-time loads
and unloads, which the model's workers carry out.

A load goes to every ready worker of its model (:class:`LoadAdapter`); each answers (:class:`AdapterDone`).
Once all have answered, the client hears that it is loaded, or the first refusal (the workers that had loaded
it free it again). A worker of the model that joins later (a restart, a replica, a reload's) is sent every
run-time adapter of its model after its hello, before any request. An unload takes the adapter out of routing
at once (a request naming it is refused); once no request for it waits in the router's queue, the model's
workers are told (:class:`UnloadAdapter`), and each frees it when the sequences using it have finished. The
table lives as long as the daemon: run-time adapters are not in the config, and a restart forgets them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llamapool.config import MODEL_NAME
from llamapool.protocol.messages import (
    AdapterDone,
    Error,
    ErrorCode,
    LoadAdapter,
    ModelActionReply,
    StatusReply,
    UnloadAdapter,
)
from llamapool.protocol.params import resolve_lora
from llamapool.router.tables import LOG, Job, JobTable, RequestStatus, WorkerState


@dataclass(eq=False)
class Adapter:
    """One adapter of a model, and the load or unload of it under way."""

    name: str
    model: str
    scale: float
    path: str = ""  # a run-time adapter's file ("": the config's; its workers load it as they start)
    state: str = "loaded"  # "loading" (its workers are loading it), "loaded", "unloading"
    waiting: set[str] = field(default_factory=set)  # the workers yet to answer the load or unload under way
    loaded_on: set[str] = field(default_factory=set)  # the workers that loaded it (a load under way)
    errors: list[tuple[str, str]] = field(default_factory=list)  # the workers' refusals, and the parameter each
    # names (a load under way)
    client: bytes = b""  # who waits for the load's answer, and the request's id
    rid: str = ""
    told: bool = False  # an unload: its workers were told

    @property
    def runtime(self) -> bool:
        return bool(self.path)


class AdapterTable:
    """The adapters requests may name (config ones first, then run-time ones in load order: a request's
    ``lora[i].id`` is a place among its model's), and those leaving (unloading, out of routing)."""

    def __init__(self, declared: Iterable[tuple[str, str, float]] = (), models: Iterable[str] = ()):
        self.table: dict[str, Adapter] = {}
        self.leaving: list[Adapter] = []
        self.declare(declared, models)

    def declare(self, declared: Iterable[tuple[str, str, float]], models: Iterable[str]) -> list[Adapter]:
        """The config's adapters ((adapter, model, scale) each) at the start or after a reload. The run-time
        ones stay, but those whose model left the pool or whose name the config now takes: returned (to
        unload)."""
        kept, pool = [a for a in self.table.values() if a.runtime], set(models)
        self.table = {n: Adapter(n, m, s) for n, m, s in declared}
        gone = []
        for a in kept:
            if a.model in pool and a.name not in self.table and a.name not in pool:
                self.table[a.name] = a
            else:
                gone.append(a)
        return gone

    def named(self, name: str) -> Adapter | None:
        """The loaded adapter of that name (None: no such adapter, or one loading or unloading)."""
        a = self.table.get(name)
        return a if a is not None and a.state == "loaded" else None

    def of(self, model: str) -> list[Adapter]:
        """``model``'s loaded adapters, in id order."""
        return [a for a in self.table.values() if a.model == model and a.state == "loaded"]

    def resolve(self, model: str, lora: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        """A request's ``lora`` entries as ``{"name", "scale"}`` of ``model``'s loaded adapters (what its workers
        take); a ParamError names a wrong entry (an unknown id or name, or one unloading)."""
        mine = self.of(model)
        chosen = resolve_lora(lora, [a.name for a in mine], [a.scale for a in mine])
        return tuple({"name": mine[i].name, "scale": s} for i, s in chosen.items())

    def rows(self, model: str) -> list[dict[str, Any]]:
        """``model``'s adapters as ``status`` lists them (``/v1/models`` too): id, name, scale, and whether it
        was loaded at run time."""
        return [{"id": i, "name": a.name, "scale": a.scale, **({"runtime": True} if a.runtime else {})}
                for i, a in enumerate(self.of(model))]

    def listed(self) -> str:
        return ", ".join(repr(n) for n in self.table) or "none"


class AdapterOps(JobTable):
    """The run-time loads and unloads: the client's commands, the workers' answers, the workers that come
    and go meanwhile."""

    adapters: AdapterTable

    # ------------------------------------------------------------ load

    def _on_load_adapter(self, client: bytes, msg: LoadAdapter) -> None:
        """An operator's load: checked (each refusal names its parameter), then sent to the model's workers."""
        model = self.models[0] if msg.model is None else msg.model
        why = self._load_refusal(msg, model)
        if why is not None:
            code, message, param = why
            self._reply(client, Error(msg.id, code, message, field=param))
            return
        ready = [w for w in self.workers.values() if w.model == model and w.routable]
        a = Adapter(msg.name, model, msg.scale, msg.path, "loading", {w.name for w in ready}, client=client,
                    rid=msg.id)
        self.adapters.table[a.name] = a
        LOG.info(f"LoRA adapter {a.name!r}: loading {a.path} into model {model!r} on {len(ready)} worker(s)",
                 model=model)
        for w in ready:
            self._send_worker(w, LoadAdapter("", a.name, a.path, model, a.scale))

    def _load_refusal(self, msg: LoadAdapter, model: str) -> tuple[str, str, str | None] | None:
        """Why a load cannot start (code, message, parameter), or None."""
        name, path = msg.name, msg.path
        if self.draining:
            return ErrorCode.UNAVAILABLE, "llamapool is shutting down", None
        if model not in self.models:
            return (ErrorCode.UNKNOWN_MODEL, f"'model': {model!r} is not a model of this pool (models: "
                    f"{', '.join(repr(m) for m in self.models)}); an adapter's base is a model", "model")
        if not MODEL_NAME.fullmatch(name):
            return (ErrorCode.INVALID_REQUEST, f"'name' must be 1 to 64 letters, digits, '.', '_', '-' or '/', "
                    f"starting with a letter or digit (requests name the adapter by it), got {name!r}", "name")
        other = self.adapters.table.get(name)
        if name in self.models or other is not None:
            what = "a model of the pool" if other is None else f"an adapter of model {other.model!r}"
            return ErrorCode.INVALID_REQUEST, f"'name': {name!r} is already the name of {what}", "name"
        if any(a.name == name for a in self.adapters.leaving):
            return (ErrorCode.INVALID_REQUEST, f"'name': the adapter {name!r} is still being unloaded (requests "
                    f"using it are finishing); load it again once it is gone", "name")
        if path.startswith("hf:") or not os.path.isabs(path):
            return (ErrorCode.INVALID_REQUEST, f"'path' must be an absolute path to the adapter GGUF on the workers' "
                    f"host (`llamapool fetch-model hf:...` downloads a Hugging Face file and prints its path), "
                    f"got {path!r}", "path")
        if not any(w.model == model and w.routable for w in self.workers.values()):
            return (ErrorCode.UNAVAILABLE, f"model {model!r} has no running worker to load the adapter into: load "
                    f"the model first (llamapool load {model})", "model")
        return None

    def _settle_load(self, a: Adapter) -> None:
        """Every worker answered the load: the client hears it loaded, or the first refusal (the workers that
        loaded it then free it)."""
        if a.waiting or a.state != "loading":
            return
        if a.errors or not a.loaded_on:
            del self.adapters.table[a.name]
            why, param = a.errors[0] if a.errors else \
                (f"every worker of model {a.model!r} left while it loaded the adapter", None)
            self._reply(a.client, Error(a.rid, ErrorCode.INVALID_REQUEST if a.errors else ErrorCode.UNAVAILABLE, why,
                                        field=param))
            LOG.warning(f"LoRA adapter {a.name!r}: not loaded: {why}", model=a.model)
            if a.loaded_on:
                self._leave(a, a.loaded_on)
            return
        a.state = "loaded"
        n = len(a.loaded_on)
        self._reply(a.client, ModelActionReply(a.rid, a.name, "load", "loaded", f"adapter {a.name!r} of model "
                                               f"{a.model!r} loaded from {a.path} on {n} worker(s)"))
        LOG.info(f"LoRA adapter {a.name!r}: loaded into model {a.model!r} on {n} worker(s)", model=a.model)

    def _adapters_for(self, w: WorkerState) -> None:
        """A worker that joined: its model's run-time adapters, before any request (those unloading too, while
        requests for them still wait: the worker is told with the others)."""
        for a in [*self.adapters.table.values(), *(x for x in self.adapters.leaving if not x.told)]:
            if a.runtime and a.model == w.model:
                if a.state == "loading":
                    a.waiting.add(w.name)
                self._send_worker(w, LoadAdapter("", a.name, a.path, a.model, a.scale))

    # ------------------------------------------------------------ unload

    def _unload_adapter(self, client: bytes, rid: str, name: str) -> None:
        """An operator's unload of an adapter: out of routing now, freed by its workers once unused."""
        a = self.adapters.table.get(name)
        if a is None and any(x.name == name for x in self.adapters.leaving):
            self._reply(client, ModelActionReply(rid, name, "unload", "unloading", f"adapter {name!r} is "
                                                 f"already unloading"))
            return
        why = "" if a is None else (
            f"'model': adapter {name!r} is declared in the config ([[models.lora]] of model {a.model!r}): remove "
            f"it there and reload (SIGHUP)" if not a.runtime else
            f"'model': adapter {name!r} is still loading; unload it once its load has answered"
            if a.state == "loading" else "")
        if a is None or why:
            self._reply(client, Error(rid, ErrorCode.INVALID_REQUEST, why, field="model"))
            return
        del self.adapters.table[name]
        self._leave(a)
        self._reply(client, ModelActionReply(rid, name, "unload", "unloading", f"adapter {name!r} of model "
                                             f"{a.model!r} unloading: the requests using it finish, then its "
                                             f"workers free it"))
        LOG.info(f"LoRA adapter {name!r}: unloading (no new request takes it)", model=a.model)

    def _leave(self, a: Adapter, workers: Iterable[str] | None = None) -> None:
        """``a`` out of routing, unloading: told to its workers now (``workers``: a failed load's), or once no
        request for it waits (:meth:`_adapter_tick`)."""
        a.state, a.waiting, a.errors = "unloading", set(), []
        self.adapters.leaving.append(a)
        if workers is not None:
            self._tell_unload(a, set(workers))

    def _tell_unload(self, a: Adapter, names: set[str]) -> None:
        a.told = True
        a.waiting = {n for n in names if n in self.workers}
        for n in list(a.waiting):  # a send to a worker that is gone drops it from ``waiting``
            if n in self.workers:
                self._send_worker(self.workers[n], UnloadAdapter(a.name))
        self._settle_unload(a)

    def _settle_unload(self, a: Adapter) -> None:
        if a.told and not a.waiting and a in self.adapters.leaving:
            self.adapters.leaving.remove(a)
            LOG.info(f"LoRA adapter {a.name!r}: unloaded (freed by the workers of model {a.model!r})", model=a.model)

    def _adapter_tick(self) -> None:
        """The leaving adapters that no waiting request names any more: their workers are told."""
        for a in [x for x in self.adapters.leaving if not x.told]:
            if not any(j.status is RequestStatus.WAITING and j.model == a.model and _uses(j, a.name)
                       for j in self.jobs.values()):
                self._tell_unload(a, {w.name for w in self.workers.values() if w.model == a.model})

    # ------------------------------------------------------------ the workers

    def _adapter_done(self, w: WorkerState, msg: AdapterDone) -> None:
        """A worker's answer to a load or an unload."""
        if msg.action == "unload":
            a = next((x for x in self.adapters.leaving if x.name == msg.name and w.name in x.waiting), None)
            if msg.error:
                LOG.warning(f"worker {w.name}: LoRA adapter {msg.name!r} not unloaded: {msg.error}", worker=w.name)
            if a is not None:
                a.waiting.discard(w.name)
                self._settle_unload(a)
            return
        a = self.adapters.table.get(msg.name)
        if a is None or w.name not in a.waiting:  # a worker that joined later: its copy
            if msg.error:
                LOG.warning(f"worker {w.name}: LoRA adapter {msg.name!r} not loaded ({msg.error}): requests for it "
                            f"that reach this worker fail", worker=w.name)
            return
        a.waiting.discard(w.name)
        if msg.error:
            a.errors.append((msg.error, msg.field))
        else:
            a.loaded_on.add(w.name)
        self._settle_load(a)

    def _adapter_worker_gone(self, w: WorkerState) -> None:
        """A worker left or was lost: no answer of it is waited for."""
        for a in [*self.adapters.table.values(), *self.adapters.leaving]:
            if w.name in a.waiting:
                a.waiting.discard(w.name)
                a.loaded_on.discard(w.name)
                if a.state == "loading":
                    self._settle_load(a)
                else:
                    self._settle_unload(a)

    def _status(self, rid: str) -> StatusReply:
        """The fleet's status; each model's row lists its LoRA adapters (``lora``: /v1/models lists them)."""
        reply = super()._status(rid)
        for row in reply.models:
            lora = self.adapters.rows(row["name"])
            if lora:
                row["lora"] = lora
        return reply


def _uses(job: Job, name: str) -> bool:
    return job.named == name or any(e.get("name") == name for e in job.params.lora)


__all__ = ["Adapter", "AdapterOps", "AdapterTable"]
