"""The router's client side: a client's messages read, checked and queued as jobs, or refused with a
reason (:meth:`Intake._refusal`, one place); status, metrics and an operator's model commands."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import zmq

from llamapool.keys import CLASSES, DEFAULT_TENANT
from llamapool.protocol import codec, params
from llamapool.protocol.control import (
    ModelCommand,
)
from llamapool.protocol.messages import (
    LIGHT_TASKS,
    Cancel,
    Detokenize,
    Embed,
    Error,
    ErrorCode,
    Generate,
    LoadAdapter,
    Message,
    MetricsReply,
    MetricsRequest,
    ModelAction,
    Prompt,
    Rerank,
    SamplingParams,
    StatusRequest,
    Tokenize,
)
from llamapool.router.adapters import AdapterOps
from llamapool.router.policy import prefix_keys
from llamapool.router.tables import LOG, Job, RequestStatus


@dataclass(frozen=True)
class Ask:
    """What a generation asks for, beyond its model: its tenant's limits and class cap are checked."""

    tenant: str
    rank: int  # its class's place in keys.CLASSES
    prompts: list[Prompt]
    max_tokens: int  # per prompt, within a slot's context (its tokens reservation)


class Intake(AdapterOps):
    """The frontend: clients' requests in, replies out."""

    def _reply(self, client: bytes, msg: Message) -> None:
        try:
            self.front.send_multipart([client, codec.encode(msg)])
        except zmq.ZMQError:  # EHOSTUNREACH: the client is gone; stop its work
            for job in [j for j in self.jobs.values() if j.client == client]:
                self._cancel_job(job, RequestStatus.DISCONNECTED)

    def _on_client(self, client: bytes, frames: list[bytes]) -> None:
        try:
            msg = codec.decode(frames, codec.CLIENT_TYPES, self.cfg.max_message_bytes)
        except codec.ProtocolError as e:
            self.metrics.outcome(e.code)
            self._reply(client, e.to_error())
            return
        if isinstance(msg, Generate):
            self._on_generate(client, msg)
        elif isinstance(msg, (Embed, Rerank, Tokenize, Detokenize)):
            self._on_task(client, msg)
        elif isinstance(msg, Cancel):
            for job in list(self.by_request.get((client, msg.id), ())):
                self._cancel_job(job, RequestStatus.CANCELLED)
        elif isinstance(msg, StatusRequest):
            self._reply(client, self._status(msg.id))
        elif isinstance(msg, MetricsRequest):
            self._reply(client, MetricsReply(msg.id, self.metrics.render(self.fleet()).decode()))
        elif isinstance(msg, ModelAction):
            self._on_model_action(client, msg)
        elif isinstance(msg, LoadAdapter):
            self._on_load_adapter(client, msg)

    def _on_generate(self, client: bytes, msg: Generate) -> None:
        model = self.models[0] if msg.model is None else msg.model
        named = ""
        adapter = self.adapters.named(model)
        if adapter is not None:  # an adapter named as the model (vLLM's way): its model, with it applied
            named, model = adapter.name, adapter.model
            msg.params = dataclasses.replace(msg.params, lora=({"name": named, "scale": adapter.scale},
                                                               *msg.params.lora))
        n = msg.params.n
        tenant, rank = msg.tenant or DEFAULT_TENANT, CLASSES.index(msg.priority or "default")
        max_tokens = self._max_tokens(model, msg.params.max_tokens)
        why = self._lora_refusal(model, msg) or \
            self._refusal(client, msg.id, model, len(msg.prompts) * n, Ask(tenant, rank, msg.prompts, max_tokens))
        if why:
            code, message, fld = why
            self._refuse_request(client, msg, model if model in self.models else None, code, message, fld, tenant)
            return
        queue = self._queue(model)
        now = time.monotonic()
        deadline = now + msg.timeout if msg.timeout else None
        jobs = []
        for i, prompt in enumerate(msg.prompts):
            keys = prefix_keys(prompt)
            for j in range(n):  # choice j of prompt i is the reply with index i * n + j
                job = Job(self.next_rid, client, msg.id, i * n + j, prompt, params.choice(msg.params, j), msg.stream,
                          now, deadline, keys=keys, log_id=f"{msg.id}/{i * n + j}" if msg.batch or n > 1 else msg.id,
                          model=model, tenant=tenant, rank=rank, named=named)
                self.next_rid += 1
                self.jobs[job.rid] = job
                if j == 0:
                    first = job
                    queue.append(job)
                else:
                    first.siblings.append(job)
                jobs.append(job)
        self.by_request[(client, msg.id)] = jobs
        self.tenancy.admitted(tenant, model, jobs, max_tokens, now)
        self._used(model, now)

    def _lora_refusal(self, model: str, msg: Generate) -> tuple[str, str, str | None] | None:
        """A request's ``lora`` entries resolved against ``model``'s adapters now (each to its name: an adapter
        unloaded later still names the one it meant), or why they cannot be (the entry named)."""
        if not msg.params.lora or model not in self.models:
            return None
        try:
            msg.params = dataclasses.replace(msg.params, lora=self.adapters.resolve(model, msg.params.lora))
        except params.ParamError as e:
            return ErrorCode.INVALID_REQUEST, e.message, e.field
        return None

    def _max_tokens(self, model: str, asked: int) -> int:
        """The most tokens a prompt of ``model`` can generate: ``asked``, within a slot's context."""
        ctx = max((w.hello.ctx_per_slot for w in self.workers.values() if w.model == model), default=0)
        return min(asked, ctx) if ctx else asked

    def _on_task(self, client: bytes, msg: Embed | Rerank | Tokenize | Detokenize) -> None:
        """An embed or a rerank (a job per input or document, each taking a slot of an embedding or rerank
        model's worker, which computes those it holds together), or a tokenize or detokenize (one job
        that takes no slot: the first worker of the model answers it at once)."""
        inputs: list[Any]
        options: dict[str, Any] | None
        if isinstance(msg, Embed):
            task, inputs, options = "embed", list(msg.inputs), None
        elif isinstance(msg, Rerank):
            task, inputs = "rerank", list(msg.documents)
            options = {"query": msg.query, "max_tokens_per_doc": msg.max_tokens_per_doc}
        elif isinstance(msg, Tokenize):
            task, inputs = "tokenize", [msg.messages if msg.messages else msg.content]
            options = {"add_special": msg.add_special, "parse_special": msg.parse_special,
                       "with_pieces": msg.with_pieces}
            if msg.render:  # the tokens a generation of the prompt puts in KV (worker/tasks.py)
                options = {"render": True, "tools": msg.tools}
            if msg.infill is not None:  # a fill-in-the-middle prompt's tokens (worker/infill.py)
                options = {"infill": msg.infill}
        else:
            task, inputs, options = "detokenize", [msg.tokens], None
        model = self.models[0] if msg.model is None else msg.model
        adapter = self.adapters.named(model)
        if adapter is not None and task in ("tokenize", "detokenize"):  # an adapter's vocab is its model's
            model = adapter.model
        why = self._refusal(client, msg.id, model, len(inputs) if task in ("embed", "rerank") else 0)
        if why:
            code, message, fld = why
            self.metrics.outcome(code, len(inputs), model if model in self.models else self.models[0])
            self._reply(client, Error(msg.id, code, message, field=fld))
            return
        now = time.monotonic()
        deadline = now + msg.timeout if msg.timeout else None
        jobs = []
        for i, prompt in enumerate(inputs):
            job = Job(self.next_rid, client, msg.id, i, prompt, SamplingParams(), False, now, deadline,
                      log_id=f"{msg.id}/{i}" if len(inputs) > 1 else msg.id, model=model, task=task, options=options)
            self.next_rid += 1
            self.jobs[job.rid] = job
            (self.light if task in LIGHT_TASKS else self._queue(model)).append(job)
            jobs.append(job)
        self.by_request[(client, msg.id)] = jobs
        self._used(model, now)

    def _refusal(self, client: bytes, rid: str, model: str, queued: int,
                 ask: Ask | None = None) -> tuple[str, str, str | None] | None:
        """Why a request cannot be queued (code, message, field), or None: the one place that says it.
        ``ask``: a generation's tenant and class, whose limits and cap are checked (router/tenants.py)."""
        if (client, rid) in self.by_request:
            return ErrorCode.DUPLICATE_ID, f"request id {rid!r} is already in flight", "id"
        if model not in self.models:
            return (ErrorCode.UNKNOWN_MODEL, f"model {model!r} is not in this pool "
                    f"(models: {', '.join(repr(m) for m in self.models)})", "model")
        if self.draining:
            return ErrorCode.UNAVAILABLE, "llamapool is shutting down", None
        unservable = self._unservable(model)
        if unservable:
            return ErrorCode.UNAVAILABLE, unservable, None
        queue = self._queue(model)
        now = time.monotonic()
        if queued and len(queue) + queued > self.cfg.max_queue:
            if ask is not None:
                self.tenancy.refused(ask.tenant, "queue_full", now)
            return (ErrorCode.OVERLOADED, f"queue of model {model!r} is full ({len(queue)} waiting, "
                    f"server.max_queue={self.cfg.max_queue})", None)
        if ask is not None:
            limited = self.tenancy.refusal(ask.tenant, ask.rank, model, ask.prompts, queued, ask.max_tokens, queue,
                                           self.cfg.max_queue, now)
            if limited:
                self.tenancy.refused(ask.tenant, limited[3], now)
                return limited[:3]
        return None

    def _refuse_request(self, client: bytes, msg: Generate, model: str | None, code: str, message: str,
                        fld: str | None = None, tenant: str = DEFAULT_TENANT) -> None:
        """Answer a request refused before it was queued: count it (under the pool's first model when
        its own is unknown), reply (with its tenant's limit state), and write its access line."""
        self.metrics.outcome(code, len(msg.prompts), model or self.models[0])
        limits = self.tenancy.limits(tenant, time.monotonic(), retry=code == ErrorCode.RATE_LIMITED)
        self._reply(client, Error(msg.id, code, message, field=fld, ratelimit=limits))
        if LOG.enabled("info"):
            LOG.info("access", id=msg.id, model=model or (msg.model if isinstance(msg.model, str) else None),
                     outcome=code, tenant=tenant, prompts=len(msg.prompts), stream=msg.stream, duration_ms=0.0)

    def _used(self, model: str, now: float) -> None:
        """A request for ``model`` arrived: a model with no worker to take it makes the supervisor hear
        of it now (it may start one), not at the next tick."""
        self.last_used[model] = now
        if not any(w.model == model and w.routable for w in self.workers.values()):
            self._demand_now = True

    def _on_model_action(self, client: bytes, msg: ModelAction) -> None:
        """An operator's load, unload, pin or unpin: checked here, carried out by the supervisor, which
        answers (ModelReply); the unload of a LoRA adapter is the router's own (router/adapters.py)."""
        known = msg.model in self.adapters.table or any(a.name == msg.model for a in self.adapters.leaving)
        if msg.model not in self.models and msg.action == "unload" and known:
            self._unload_adapter(client, msg.id, msg.model)
        elif msg.model in self.adapters.table:
            self._reply(client, Error(msg.id, ErrorCode.INVALID_REQUEST, f"'model': {msg.model!r} is a LoRA adapter "
                                      f"of model {self.adapters.table[msg.model].model!r}: {msg.action} its model "
                                      f"(an adapter is loaded with its path: llamapool load NAME --lora PATH)",
                                      field="model"))
        elif msg.model not in self.models:
            self._reply(client, Error(msg.id, ErrorCode.UNKNOWN_MODEL, f"model {msg.model!r} is not in this pool "
                                      f"(models: {', '.join(repr(m) for m in self.models)}; LoRA adapters: "
                                      f"{self.adapters.listed()})", field="model"))
        elif self.draining:
            self._reply(client, Error(msg.id, ErrorCode.UNAVAILABLE, "llamapool is shutting down"))
        else:
            if msg.action in ("load", "pin"):
                self.last_used[msg.model] = time.monotonic()
            self.on_event(ModelCommand(client, msg.id, msg.action, msg.model))

