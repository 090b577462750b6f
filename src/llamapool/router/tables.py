"""The router's tables: its config, the jobs (a client's prompts from arrival to their final reply) and
the connected workers, and the one way a job ends (:meth:`JobTable._end`, by :data:`ENDINGS`)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import zmq

from llamapool import log as logmod
from llamapool import security
from llamapool.keys import DEFAULT_TENANT, KeysFile
from llamapool.protocol import codec, control
from llamapool.protocol.messages import (
    LIGHT_TASKS,
    Abort,
    DetokenizeReply,
    Done,
    Embedding,
    Error,
    ErrorCode,
    Failed,
    Hello,
    Message,
    Prompt,
    Result,
    SamplingParams,
    StatusReply,
    TokenizeReply,
)
from llamapool.router.fleet import Fleet, LiveWorker
from llamapool.router.handover import Parked
from llamapool.router.metrics import RouterMetrics
from llamapool.router.tenants import DEFAULT_RANK, FLEX_RANK, FairQueue, Tenancy

LOG = logmod.Logger("router", prefix="llamapool: router")


class RequestStatus(StrEnum):
    """A prompt's life in the router (vLLM v1's ``RequestStatus``): ``waiting`` in its model's queue,
    ``running`` on a worker, then one finished status. A finished status set while the prompt runs
    (an abort) waits for the worker to confirm it; :data:`ENDINGS` says what each one answers."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # the worker's Done: a Result
    CANCELLED = "cancelled"  # the client's Cancel: a Result whose finish_reason is "cancelled"
    DISCONNECTED = "disconnected"  # the client left: no reply
    TIMED_OUT = "timed_out"  # the request's own timeout passed
    ABORTED = "aborted"  # the drain timed out (CancelAll)
    UNAVAILABLE = "unavailable"  # no worker can take it, none became free in time, or the router stops
    WORKER_LOST = "worker_lost"  # its worker was lost after it had streamed tokens, or a second time
    FAILED = "failed"  # the worker's Failed: an error with the worker's code

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Reply(Enum):
    """The final reply a finished status sends the client."""

    RESULT = "result"
    ERROR = "error"
    NONE = "none"


# each finished status: its reply, and its outcome (``llamapool_requests_total{outcome}``; an error's code,
# "" for the worker's own)
Reply_ = Embedding | TokenizeReply | DetokenizeReply  # the final replies of the other tasks

ENDINGS: dict[RequestStatus, tuple[Reply, str]] = {
    RequestStatus.FINISHED: (Reply.RESULT, "ok"),
    RequestStatus.CANCELLED: (Reply.RESULT, "cancelled"),
    RequestStatus.DISCONNECTED: (Reply.NONE, "disconnected"),
    RequestStatus.TIMED_OUT: (Reply.ERROR, ErrorCode.TIMEOUT),
    RequestStatus.ABORTED: (Reply.ERROR, ErrorCode.UNAVAILABLE),
    RequestStatus.UNAVAILABLE: (Reply.ERROR, ErrorCode.UNAVAILABLE),
    RequestStatus.WORKER_LOST: (Reply.ERROR, ErrorCode.WORKER_LOST),
    RequestStatus.FAILED: (Reply.ERROR, ""),
}


@dataclass(frozen=True)
class RouterConfig:
    frontend: str
    backend: str
    max_queue: int = 4096
    queue_timeout: float = 60.0
    max_message_bytes: int = codec.DEFAULT_MAX_FRAME
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 3
    step_timeout: float = 60.0
    affinity_slack: int = 4  # a worker holding the prompt's prefix may have this many fewer free slots
    models: tuple[str, ...] = ("",)  # the pool's model names; the first is the default model
    # the models' LoRA adapters, each named as a model is (vLLM's way): (adapter, its model, its scale)
    adapters: tuple[tuple[str, str, float], ...] = ()
    curve: security.KeyPair | None = None  # the router's key: CURVE on its tcp:// sockets (ZAP checks clients)
    local_key: bytes = b""  # the supervisor's internal public key (Z85): its own workers use it
    boot_id: str = ""  # this daemon's incarnation: its own workers' hellos carry it ("" = not checked)
    tenants: KeysFile | None = None  # the keys file's tenants (None: every request is the default tenant's)
    rate_window: float = 60.0  # seconds of a rate-limit window (rpm and tpm are scaled to it)
    flex_queue_timeout: float = 240.0  # queue_timeout of the flex class
    tenant_idle: float = 5.0  # seconds a tenant keeps its share of a model's slots after its last request


@dataclass(eq=False)
class Job:
    """One prompt of one client request, from arrival to its final reply."""

    rid: int  # the router's id of this prompt's run on a worker (Run.rid)
    client: bytes
    id: str  # the client's request id (every reply to the client carries it)
    index: int  # the prompt's place in a micro-batch
    prompt: Prompt
    params: SamplingParams
    stream: bool
    queued_at: float
    deadline: float | None
    worker: str | None = None
    keys: tuple[int, ...] = ()  # prompt prefix hashes, for KV-cache affinity
    delivered: int = 0  # tokens already streamed to the client
    status: RequestStatus = RequestStatus.WAITING  # finished while running: the abort's answer, once confirmed
    started: float = 0.0  # when a worker first took it (metrics: queue wait)
    last_token: float = 0.0  # when its last chunk came (metrics: inter-token latency)
    log_id: str = ""  # the request id in logs: the client's id (+ "/index" in a micro-batch)
    dispatched_at: float = 0.0  # when it was last sent to a worker
    model: str = ""  # the model that runs it (a name in the pool)
    first_at: float = 0.0  # when its first chunk went to the client
    last_worker: str = ""  # the worker that ran it last (for the access log)
    task: str = ""  # "" (generate), "embed", "rerank", "tokenize", "detokenize" (messages.Run.task)
    options: dict[str, Any] | None = None  # a tokenize's flags
    siblings: list[Job] = field(default_factory=list)  # the other choices of its prompt (``n``): they go with it
    losses: int = 0  # workers lost (not shut down) while it ran on them
    tenant: str = DEFAULT_TENANT  # who asked (router/tenants.py)
    counted: bool = False  # its tenant counts it (in flight, slot, tokens) until it ends
    rank: int = DEFAULT_RANK  # its priority class's place in keys.CLASSES
    reserved: int = 0  # tokens it reserved of its tenant's tpm until it ends
    on_slot: bool = False  # it holds a slot (its tenant's share counts it)
    prompt_tokens: int = 0  # its prompt's tokens, once its first chunk told them
    named: str = ""  # the adapter the request named as its model (its replies name it): ``model`` is its base


@dataclass(eq=False)
class WorkerState:
    name: str
    ident: bytes
    hello: Hello
    last_seen: float
    model: str = ""  # its model's name in the pool
    state: str = "ready"  # ready | retiring
    closing: bool = False  # its model left the pool: retire it once that model's queue is empty
    jobs: dict[int, Job] = field(default_factory=dict)
    light: dict[int, Job] = field(default_factory=dict)  # its tokenize/detokenize jobs: they take no slot
    steps: int = 0
    busy_for: float = 0.0
    decode_s: float = 0.0
    step_s: float = 0.0
    reused_tokens: int = 0
    kv_used: int = 0
    kv_total: int = 0
    schedule: tuple[str, int, list[float]] = ("", 0, [])  # its step target, last budget, fitted cost
    speculation: list[int] = field(default_factory=list)  # drafted, accepted, sampled, sampling steps
    kv_host: dict[str, float] = field(default_factory=dict)  # its host KV tier's counters (Heartbeat.kv_host)
    handover_to: str = ""  # the sibling its host KV tier goes to as it drains (Backend._hand_over)
    last_sent: float = 0.0
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    key: str = ""  # its CURVE public key (Z85) on a CURVE backend
    orphans: set[int] = field(default_factory=set)  # rids it runs that this router never gave it (aborted)

    @property
    def free(self) -> int:
        return self.hello.slots - len(self.jobs)

    @property
    def routable(self) -> bool:
        return self.state == "ready"

    def live(self) -> LiveWorker:
        """Its row in the fleet view (router/fleet.py)."""
        h = self.hello
        return LiveWorker(self.name, h.pid, h.device, self.state, h.slots, len(self.jobs), self.model, h.model,
                          h.visible_devices, h.n_vocab, h.ctx_per_slot, h.node, self.steps, self.decode_s, self.step_s,
                          self.reused_tokens, self.kv_used, self.kv_total, self.schedule, self.speculation,
                          self.kv_host)


class JobTable:
    """The router's tables and how a job ends: the state that the client side (:mod:`intake`), the
    worker side (:mod:`backend`) and the loop (:mod:`broker`) share. Only the router thread touches it."""

    cfg: RouterConfig
    front: zmq.Socket[Any]  # clients (ROUTER)
    back: zmq.Socket[Any]  # workers (ROUTER)
    on_event: Callable[[control.Event], None]  # to the supervisor (thread-safe)
    models: list[str]  # the pool's model names; the first is the default
    queues: dict[str, FairQueue[Job]]  # waiting prompts per model, by class and fair share (router/tenants.py)
    tenancy: Tenancy  # each tenant's settings and counts
    jobs: dict[int, Job]  # every prompt not answered yet, by rid
    light: deque[Job]  # tokenize/detokenize jobs waiting for a worker (any model's)
    by_request: dict[tuple[bytes, str], list[Job]]  # a client request's prompts
    workers: dict[str, WorkerState]  # the connected workers
    remote_lost: dict[str, dict[str, Any]]  # status rows of nodes' workers that left or were lost
    supervisor_view: dict[str, dict[str, Any]]  # the supervisor's view of each worker
    model_rows: dict[str, dict[str, Any]]  # the supervisor's view of each model (ModelRows)
    last_used: dict[str, float]  # when a request for each model last arrived or ended
    gpus: list[dict[str, Any]]
    draining: bool
    next_rid: int
    metrics: RouterMetrics
    parked: Parked  # KV handover parts kept for a model's next worker (router/handover.py)
    _demand: control.Demand | None  # the demand the supervisor last heard
    _demand_now: bool  # a request waits for a model with no worker: tell the supervisor now
    _demand_soon: bool  # a model's queue emptied: tell the supervisor within DEMAND_SOON
    _back_keys: bool  # peers' keys (User-Id) readable on the backend
    _peer: Any  # the last backend frame
    _refused_at: dict[tuple[str, str], float]

    def _reply(self, client: bytes, msg: Message) -> None:
        """Send ``msg`` to a client (:class:`~llamapool.router.intake.Intake`)."""
        raise NotImplementedError

    def _send_worker(self, w: WorkerState, msg: Message) -> None:
        """Send ``msg`` to a worker (:class:`~llamapool.router.backend.Backend`)."""
        raise NotImplementedError

    @property
    def queued(self) -> int:
        """Prompts waiting, all models together."""
        return sum(len(q) for q in self.queues.values())

    def _queue(self, model: str) -> FairQueue[Job]:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = FairQueue(self.tenancy.weight)
        return q

    def _queue_timeout(self, job: Job) -> float:
        return self.cfg.flex_queue_timeout if job.rank == FLEX_RANK else self.cfg.queue_timeout

    def _end(self, job: Job, status: RequestStatus, reply: Result | Reply_ | Error | None = None,
             message: str = "") -> None:
        """Finish ``job`` with ``status`` and forget it. :data:`ENDINGS` decides the rest: its final reply
        (``reply``, else an empty cancelled Result or an error saying ``message``), its outcome count, and,
        with a reply, its latency and its access line."""
        kind, outcome = ENDINGS[status]
        self.last_used[job.model] = time.monotonic()
        if job.status is RequestStatus.WAITING:
            queue = self.light if job.task in LIGHT_TASKS else self.queues.get(job.model)
            if queue is not None and job in queue:
                queue.remove(job)
        job.status = status
        self._forget(job)
        counted = job.counted
        if isinstance(reply, (Result, Embedding)):
            self.tenancy.ended(job, outcome, reply.prompt_tokens,
                               reply.completion_tokens if isinstance(reply, Result) else 0)
        else:
            self.tenancy.ended(job, reply.code if isinstance(reply, Error) and reply.code else outcome,
                               job.prompt_tokens, job.delivered)
        if kind is Reply.NONE:
            self.metrics.outcome(outcome, 1, job.model)
            return
        if reply is None and kind is Reply.RESULT:
            reply = Result(job.id, job.index, "", "cancelled", 0, job.delivered, job.worker or "")
        elif reply is None:
            reply = self._error(job, outcome, message or f"request {outcome}")
        if isinstance(reply, (Result, Error)):
            reply.ratelimit = self.tenancy.limits(job.tenant, time.monotonic()) if counted else None
        if not isinstance(reply, Error):
            reply.model = job.named or job.model
        self.metrics.outcome(reply.code if isinstance(reply, Error) else outcome, 1, job.model)
        self.metrics.of(job.model).e2e.observe(time.monotonic() - job.queued_at)
        self._reply(job.client, reply)
        self._access(job, reply)

    @staticmethod
    def _result(job: Job, done: Done, worker: str) -> Result | Reply_:
        """The client's Result of a worker's Done entry (an Embedding, TokenizeReply or DetokenizeReply
        for those tasks): the one place that converts them."""
        if job.task and done.reason != "cancelled":
            if job.task in ("embed", "rerank"):
                return Embedding(job.id, job.index, done.embedding or b"", done.prompt_tokens, worker)
            if job.task == "tokenize":
                return TokenizeReply(job.id, done.tokens or [], worker)
            return DetokenizeReply(job.id, done.text, worker)
        return Result(job.id, job.index, done.text, done.reason, done.prompt_tokens, done.completion_tokens, worker,
                      tool_calls=done.tool_calls, cached_tokens=done.cached_tokens, logprobs=done.logprobs,
                      stop=done.stop)

    def _failure(self, job: Job, failed: Failed) -> Error:
        """The client's Error of a worker's Failed entry: the one place that converts them."""
        err = self._error(job, failed.code, failed.message)
        err.field = failed.field
        return err

    def _access(self, job: Job, msg: Result | Reply_ | Error) -> None:
        """``access``: id, model, worker, tokens, queue wait, TTFT, duration, outcome (info level)."""
        if not LOG.enabled("info"):
            return
        now = time.monotonic()
        ms = lambda t: round((t - job.queued_at) * 1000, 1) if t else None  # noqa: E731
        n_prompt: int | None
        if isinstance(msg, Result):
            outcome, finish, n_prompt, n_gen = "ok", msg.finish_reason, msg.prompt_tokens, msg.completion_tokens
        elif not isinstance(msg, Error):  # an embedding, tokenize or detokenize
            n_prompt = msg.prompt_tokens if isinstance(msg, Embedding) else None
            outcome, finish, n_gen = "ok", job.task, 0
        else:
            outcome, finish, n_prompt, n_gen = msg.code, None, None, job.delivered
        LOG.info("access", id=job.log_id, model=job.model or None, worker=job.last_worker or None,
                 outcome=outcome, finish=finish, tenant=job.tenant, prompt_tokens=n_prompt,
                 generated_tokens=n_gen, stream=job.stream, queue_ms=ms(job.dispatched_at), ttft_ms=ms(job.first_at),
                 duration_ms=ms(now))

    def _error(self, job: Job, code: str, message: str) -> Error:
        return Error(job.id, code, message, index=job.index,
                     tokens_delivered=job.delivered if job.stream else None)

    def _cancel_job(self, job: Job, status: RequestStatus) -> None:
        """Stop a job with a finished ``status``: at once if it waits; if it runs, its worker is told to
        abort it, and ``status`` answers once the worker confirms (the first abort wins)."""
        if job.status is RequestStatus.WAITING:
            self._end(job, status)
        elif job.status is RequestStatus.RUNNING:
            job.status = status
            w = self.workers.get(job.worker or "")
            if w is not None:
                self._send_worker(w, Abort(job.rid))

    def _forget(self, job: Job) -> None:
        """Drop ``job`` without a reply (its client is gone, or the reply was sent)."""
        self.jobs.pop(job.rid, None)
        key = (job.client, job.id)
        rest = [j for j in self.by_request.get(key, ()) if j is not job]
        if rest:
            self.by_request[key] = rest
        else:
            self.by_request.pop(key, None)

    def _unservable(self, model: str) -> str:
        """Why no worker of ``model`` can ever take its work (it left the pool, or every worker of it
        failed for good), or "" if one may."""
        if any(w.model == model for w in self.workers.values()):
            return ""
        if model not in self.models:
            return f"model {model!r} was removed from the pool"
        row = self.model_rows.get(model)
        if row is not None and row.get("state") == "failed":
            return str(row.get("reason") or f"model {model!r} failed to load")
        rows = [i for i in self.supervisor_view.values() if i.get("model", self.models[0]) == model]
        if rows and all(i.get("state") == "failed" for i in rows):
            reasons = sorted({str(i.get("reason")) for i in rows})
            return f"no worker can serve: every worker failed ({'; '.join(reasons)}); see llamapool status"
        return ""

    def fleet(self) -> Fleet:
        """Every worker as ``status`` and ``/metrics`` show it (router/fleet.py)."""
        return Fleet.build(self.models, self.supervisor_view, [w.live() for w in self.workers.values()],
                           self.remote_lost, {m: len(q) for m, q in self.queues.items()}, self.draining, self.gpus,
                           self.model_rows)

    def _status(self, rid: str) -> StatusReply:
        """The fleet's status (router/adapters.py adds each model's LoRA adapters)."""
        return self.fleet().status(rid)

