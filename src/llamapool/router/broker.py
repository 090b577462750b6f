"""The router: a ZeroMQ broker between clients (frontend) and workers (backend).

One thread, one poll loop. Clients send requests; each prompt becomes a :class:`Job` that waits
in its model's FIFO queue until the worker of that model with the most free slots takes it. Workers stream step reports
back; the router forwards chunks and exactly one final reply per prompt. The supervisor sends the router
the typed commands of protocol/control.py over an inproc PAIR socket (``control``); events go back typed too.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from llamapool import log as logmod
from llamapool import security
from llamapool.config import ipc_path, needs_curve
from llamapool.protocol import codec, control, params
from llamapool.protocol.control import (
    CancelAll,
    Drained,
    ForgetWorker,
    GpuRows,
    KillWorker,
    PoolModels,
    ReadyCount,
    RetireWorker,
    StartDrain,
    StopRouter,
    WorkerExited,
    WorkerInfo,
    WorkerJoined,
)
from llamapool.protocol.messages import (
    LIGHT_TASKS,
    Abort,
    Cancel,
    Chunk,
    Detokenize,
    DetokenizeReply,
    Done,
    Embed,
    Embedding,
    Error,
    ErrorCode,
    Failed,
    Generate,
    Heartbeat,
    Hello,
    Message,
    MetricsReply,
    MetricsRequest,
    Prompt,
    Result,
    Run,
    SamplingParams,
    Shutdown,
    StatusReply,
    StatusRequest,
    Step,
    Tokenize,
    TokenizeReply,
)
from llamapool.router.fleet import SPECULATION, Fleet, LiveWorker
from llamapool.router.metrics import RouterMetrics
from llamapool.router.policy import pick_worker, prefix_keys, remember

TICK = 0.1  # seconds between housekeeping passes
# A request whose worker was lost before it streamed a token is sent to another worker this many times
# at most: a request that kills every worker it runs on (a poison pill) must not take its model down.
RETRIES_AFTER_LOSS = 1
SHUT_DOWN = "it shut down"  # a worker that left in good order (drained): its requests are not to blame
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
    curve: security.KeyPair | None = None  # the router's key: CURVE on its tcp:// sockets (ZAP checks clients)
    local_key: bytes = b""  # the supervisor's internal public key (Z85): its own workers use it
    boot_id: str = ""  # this daemon's incarnation: its own workers' hellos carry it ("" = not checked)


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
    task: str = ""  # "" (generate), "embed", "tokenize", "detokenize" (messages.Run.task)
    options: dict[str, Any] | None = None  # a tokenize's flags
    siblings: list[Job] = field(default_factory=list)  # the other choices of its prompt (``n``): they go with it
    losses: int = 0  # workers lost (not shut down) while it ran on them


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
                          self.reused_tokens, self.kv_used, self.kv_total, self.schedule, self.speculation)


class Router:
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
        self.queues: dict[str, deque[Job]] = {m: deque() for m in self.models}  # FIFO per model
        self.jobs: dict[int, Job] = {}
        self.light: deque[Job] = deque()  # tokenize/detokenize jobs waiting for a worker (any model's)
        self.by_request: dict[tuple[bytes, str], list[Job]] = {}
        self.workers: dict[str, WorkerState] = {}
        self.remote_lost: dict[str, dict[str, Any]] = {}  # status rows of nodes' workers that left or were lost
        self._back_keys = cfg.curve is not None and needs_curve(cfg.backend)  # peers' keys (User-Id) readable
        self._peer: Any = None  # the last backend frame (its User-Id is the peer's key)
        self._refused_at: dict[tuple[str, str], float] = {}
        self.supervisor_view: dict[str, dict[str, Any]] = {}  # the supervisor's view of each worker
        self.gpus: list[dict[str, Any]] = []
        self.draining = False
        self.running = True
        # rids are unique per router process: a node worker still running a previous router's rids never
        # mixes them up with ours (those get aborted)
        self.next_rid = (int.from_bytes(os.urandom(4), "big") << 16) + 1
        self.loop_progress = time.monotonic()  # read by the supervisor's watchdog
        self._last_ready = -1
        self.metrics = RouterMetrics(self.models[0])

    @property
    def queued(self) -> int:
        """Prompts waiting, all models together."""
        return sum(len(q) for q in self.queues.values())

    def _queue(self, model: str) -> deque[Job]:
        return self.queues.setdefault(model, deque())

    def bind(self) -> None:
        self.front.bind(self.cfg.frontend)
        self.back.bind(self.cfg.backend)

    # ------------------------------------------------------------ the loop

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

    def _peer_key(self) -> str:
        try:
            return str(self._peer.get("User-Id")) if self._peer is not None else ""
        except zmq.ZMQError:
            return ""

    # ------------------------------------------------------------ clients

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
        elif isinstance(msg, (Embed, Tokenize, Detokenize)):
            self._on_task(client, msg)
        elif isinstance(msg, Cancel):
            for job in list(self.by_request.get((client, msg.id), ())):
                self._cancel_job(job, RequestStatus.CANCELLED)
        elif isinstance(msg, StatusRequest):
            self._reply(client, self._status(msg.id))
        elif isinstance(msg, MetricsRequest):
            self._reply(client, MetricsReply(msg.id, self.metrics.render(self.fleet()).decode()))

    def _on_generate(self, client: bytes, msg: Generate) -> None:
        key = (client, msg.id)
        if key in self.by_request:
            self._refuse_request(client, msg, None, ErrorCode.DUPLICATE_ID,
                                 f"request id {msg.id!r} is already in flight", "id")
            return
        model = self.models[0] if msg.model is None else msg.model
        if model not in self.models:
            self._refuse_request(client, msg, None, ErrorCode.UNKNOWN_MODEL, f"model {model!r} is not in this pool "
                                 f"(models: {', '.join(repr(m) for m in self.models)})", "model")
            return
        if self.draining:
            self._refuse_request(client, msg, model, ErrorCode.UNAVAILABLE, "llamapool is shutting down")
            return
        unservable = self._unservable(model)
        if unservable:
            self._refuse_request(client, msg, model, ErrorCode.UNAVAILABLE, unservable)
            return
        queue = self._queue(model)
        n = msg.params.n
        if len(queue) + len(msg.prompts) * n > self.cfg.max_queue:
            self._refuse_request(client, msg, model, ErrorCode.OVERLOADED, f"queue of model {model!r} is full "
                                 f"({len(queue)} waiting, server.max_queue={self.cfg.max_queue})")
            return
        now = time.monotonic()
        deadline = now + msg.timeout if msg.timeout else None
        jobs = []
        for i, prompt in enumerate(msg.prompts):
            keys = prefix_keys(prompt)
            for j in range(n):  # choice j of prompt i is the reply with index i * n + j
                job = Job(self.next_rid, client, msg.id, i * n + j, prompt, params.choice(msg.params, j), msg.stream,
                          now, deadline, keys=keys, log_id=f"{msg.id}/{i * n + j}" if msg.batch or n > 1 else msg.id,
                          model=model)
                self.next_rid += 1
                self.jobs[job.rid] = job
                if j == 0:
                    first = job
                    queue.append(job)
                else:
                    first.siblings.append(job)
                jobs.append(job)
        self.by_request[key] = jobs

    def _on_task(self, client: bytes, msg: Embed | Tokenize | Detokenize) -> None:
        """An embed (a job per input, each taking a slot of an embedding model's worker), or a tokenize
        or detokenize (one job that takes no slot: the first worker of the model answers it at once)."""
        if isinstance(msg, Embed):
            task, inputs, options = "embed", list(msg.inputs), None
        elif isinstance(msg, Tokenize):
            task, inputs = "tokenize", [msg.content]
            options = {"add_special": msg.add_special, "parse_special": msg.parse_special,
                       "with_pieces": msg.with_pieces}
        else:
            task, inputs, options = "detokenize", [msg.tokens], None
        model = self.models[0] if msg.model is None else msg.model
        why = self._refusal(client, msg.id, model, len(inputs) if task == "embed" else 0)
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

    def _refusal(self, client: bytes, rid: str, model: str, queued: int) -> tuple[str, str, str | None] | None:
        """Why a task request cannot be queued (code, message, field), or None."""
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
        if queued and len(queue) + queued > self.cfg.max_queue:
            return (ErrorCode.OVERLOADED, f"queue of model {model!r} is full ({len(queue)} waiting, "
                    f"server.max_queue={self.cfg.max_queue})", None)
        return None

    def _refuse_request(self, client: bytes, msg: Generate, model: str | None, code: str, message: str,
                        fld: str | None = None) -> None:
        """Answer a request refused before it was queued: count it (under the pool's first model when
        its own is unknown), reply, and write its access line."""
        self.metrics.outcome(code, len(msg.prompts), model or self.models[0])
        self._reply(client, Error(msg.id, code, message, field=fld))
        if LOG.enabled("info"):
            LOG.info("access", id=msg.id, model=model or (msg.model if isinstance(msg.model, str) else None),
                     outcome=code, prompts=len(msg.prompts), stream=msg.stream, duration_ms=0.0)

    def _end(self, job: Job, status: RequestStatus, reply: Result | Reply_ | Error | None = None,
             message: str = "") -> None:
        """Finish ``job`` with ``status`` and forget it. :data:`ENDINGS` decides the rest: its final reply
        (``reply``, else an empty cancelled Result or an error saying ``message``), its outcome count, and,
        with a reply, its latency and its access line."""
        kind, outcome = ENDINGS[status]
        if job.status is RequestStatus.WAITING:
            queue = self.light if job.task in LIGHT_TASKS else self.queues.get(job.model)
            if queue is not None and job in queue:
                queue.remove(job)
        job.status = status
        self._forget(job)
        if kind is Reply.NONE:
            self.metrics.outcome(outcome, 1, job.model)
            return
        if reply is None and kind is Reply.RESULT:
            reply = Result(job.id, job.index, "", "cancelled", 0, job.delivered, job.worker or "")
        elif reply is None:
            reply = self._error(job, outcome, message or f"request {outcome}")
        if not isinstance(reply, Error):
            reply.model = job.model
        self.metrics.outcome(reply.code if isinstance(reply, Error) else outcome, 1, job.model)
        self.metrics.of(job.model).e2e.observe(time.monotonic() - job.queued_at)
        self._reply(job.client, reply)
        self._access(job, reply)

    @staticmethod
    def _result(job: Job, done: Done, worker: str) -> Result | Reply_:
        """The client's Result of a worker's Done entry (an Embedding, TokenizeReply or DetokenizeReply
        for those tasks): the one place that converts them."""
        if job.task and done.reason != "cancelled":
            if job.task == "embed":
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
                 outcome=outcome, finish=finish, prompt_tokens=n_prompt, generated_tokens=n_gen,
                 stream=job.stream, queue_ms=ms(job.dispatched_at), ttft_ms=ms(job.first_at),
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

    # ------------------------------------------------------------ workers

    def _send_worker(self, w: WorkerState, msg: Message) -> None:
        try:
            self.back.send_multipart([w.ident, codec.encode(msg)])
        except zmq.ZMQError:
            self._lose_worker(w, "its socket disconnected")

    def _on_worker(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            msg = codec.decode(frames, codec.WORKER_TYPES, 1 << 30)
        except codec.ProtocolError:
            return
        name = ident.decode(errors="replace").split(":")[0]
        w = self.workers.get(name)
        now = time.monotonic()
        if isinstance(msg, Hello):
            if w is not None and w.ident == ident:  # it lost track of us and says hello again
                w.last_seen = now
                return
            key = self._peer_key() if self._back_keys else ""
            why = self._why_refused(name, msg, key)
            if why:
                self._refuse_worker(ident, name, msg, key, why)
                return
            if w is not None:
                self._lose_worker(w, "replaced by a new process")
            model = msg.model_name if isinstance(msg.model_name, str) and msg.model_name else self.models[0]
            if model not in self.models:
                LOG.warning(f"worker {name} serves model {model!r}, which is not in the pool "
                            f"({', '.join(self.models)}): no request can reach it", worker=name)
            self.workers[name] = WorkerState(name, ident, msg, now, model, key=key)
            if msg.node:
                self.remote_lost.pop(name, None)
                LOG.info(f"worker {name} of node {msg.node} joined (pid {msg.pid}, {msg.device}, {msg.slots} slots)",
                         worker=name, node=msg.node, key=security.fingerprint(key.encode()) if key else None)
            self._queue(model)
            self.on_event(WorkerJoined(name, msg.pid))
            return
        if w is None or w.ident != ident:
            return  # a worker we dropped; it will be killed by the supervisor
        w.last_seen = now
        if isinstance(msg, Step):
            self._on_step(w, msg)
        elif isinstance(msg, Heartbeat):
            w.steps, w.busy_for, w.decode_s, w.step_s = msg.steps, msg.busy_for, msg.decode_s, msg.step_s
            w.reused_tokens, w.kv_used, w.kv_total = msg.reused_tokens, msg.kv_used, msg.kv_total
            w.schedule = (msg.step_target, msg.step_budget, msg.step_cost)
            w.speculation = msg.speculation
            if msg.draining and w.state == "ready":  # SIGTERM on its node: it finishes what it has
                w.state = "retiring"
        elif isinstance(msg, Shutdown):  # drained and leaving
            self._lose_worker(w, SHUT_DOWN)

    def _on_step(self, w: WorkerState, step: Step) -> None:
        now = time.monotonic()
        for d in step.deltas:
            rid, text, ntok = d.rid, d.text, d.tokens
            job = w.jobs.get(rid)
            if job is None and rid not in w.orphans:  # a request of a previous router, or one we lost it
                w.orphans.add(rid)  # with (a partition): its client had its final reply; free the slot
                self._send_worker(w, Abort(rid))
            if job is not None and job.status is RequestStatus.RUNNING:
                first = job.delivered == 0
                if first:
                    self.metrics.of(job.model).ttft.observe(now - job.queued_at)
                elif ntok > job.delivered:
                    n = ntok - job.delivered
                    self.metrics.of(job.model).itl.observe((now - job.last_token) / n, n)
                job.delivered, job.last_token = ntok, now
                if not job.first_at:
                    job.first_at = now
                self._reply(job.client, Chunk(job.id, job.index, text, ntok, d.logprobs,
                                              *((d.prompt_tokens, d.cached_tokens) if first else (None, None))))
        for entry in step.done:
            done = Done(*entry)  # a named tuple from the codec (a plain list from a test)
            self.metrics.tokens(w.name, done.prompt_tokens, done.completion_tokens, w.model)
            w.orphans.discard(done.rid)
            job = w.jobs.pop(done.rid, None) or w.light.pop(done.rid, None)
            if job is None:
                continue
            if job.status in (RequestStatus.RUNNING, RequestStatus.CANCELLED):
                status = RequestStatus.CANCELLED if done.reason == "cancelled" else RequestStatus.FINISHED
                self._end(job, status, self._result(job, done, w.name))
            else:  # aborted by the router: its answer, with what the worker had done
                self._end(job, job.status, message=f"request {ENDINGS[job.status][1]}: stopped after "
                                                   f"{done.completion_tokens} tokens")
        for item in step.failed:
            failed = Failed(*item)
            job = w.jobs.pop(failed.rid, None) or w.light.pop(failed.rid, None)
            if job is not None:
                self._end(job, RequestStatus.FAILED, self._failure(job, failed))

    def _lose_worker(self, w: WorkerState, why: str) -> None:
        """Take ``w`` out of routing; retry its unstarted jobs (once, unless it shut down in good order),
        fail its streaming ones and those it was the second lost worker of."""
        if self.workers.get(w.name) is w:
            del self.workers[w.name]
            self.metrics.worker_gone(w.name, {"reused_tokens": w.reused_tokens, "decode_s": w.decode_s,
                                              "step_s": w.step_s, "steps": w.steps,
                                              **dict(zip(SPECULATION, w.speculation, strict=False))})
        if w.jobs:
            LOG.warning(f"worker {w.name} lost ({why}) with {len(w.jobs)} request(s)", worker=w.name,
                        requests=",".join(sorted(j.log_id for j in w.jobs.values())))
        for job in sorted([*w.jobs.values(), *w.light.values()], key=lambda j: j.rid, reverse=True):
            job.losses += why != SHUT_DOWN
            if job.status.finished:  # aborted: the worker will never confirm it
                self._end(job, job.status)
            elif job.delivered == 0 and job.losses > RETRIES_AFTER_LOSS:
                message = (f"request {job.log_id} was running on {job.losses} workers that were lost (the last, "
                           f"{w.name}: {why}); it is not sent to another one, in case it is what kills them")
                LOG.warning(message, id=job.log_id, worker=w.name)
                self._end(job, RequestStatus.WORKER_LOST, message=message)
            elif job.delivered == 0:
                job.worker, job.status = None, RequestStatus.WAITING
                # invisible retry on another worker
                (self.light if job.task in LIGHT_TASKS else self._queue(job.model)).appendleft(job)
            else:
                self._end(job, RequestStatus.WORKER_LOST, message=f"worker {w.name} was lost ({why}) after "
                                                                  f"{job.delivered} tokens were delivered")
        w.jobs.clear()
        w.light.clear()
        if w.hello.node and w.name not in self.workers:
            if why != SHUT_DOWN:
                LOG.warning(f"worker {w.name} of node {w.hello.node} lost: {why}", worker=w.name, node=w.hello.node)
            self.remote_lost[w.name] = {
                "id": w.name, "node": w.hello.node, "pid": w.hello.pid, "device": w.hello.device, "slots": 0,
                "active": 0, "state": "stopped" if why == SHUT_DOWN else "lost", "reason": why,
                "model": w.model}

    def _why_refused(self, name: str, hello: Hello, key: str) -> str:
        """Why a worker's hello cannot be accepted ("" if it can): its name must be unique, and the
        name of a node's worker is "<node>/..."; a node's name belongs to the key that holds it."""
        node = hello.node
        if node and not name.startswith(f"{node}/"):
            return f"the worker name {name!r} does not start with its node's name {node!r} and '/'"
        if not node and "/" in name:
            return f"the worker name {name!r} has a '/' but names no node"
        if not key or (self.cfg.local_key and key == self.cfg.local_key.decode()):
            # one of this router's own workers (or no CURVE: no key tells them apart), so it must carry
            # this daemon's boot id: a worker left over from an earlier daemon on the same socket may not join
            if not node and self.cfg.boot_id and hello.boot != self.cfg.boot_id:
                return (f"a worker of another daemon (boot id {hello.boot or '-'}; this daemon's is "
                        f"{self.cfg.boot_id}): only this daemon's own workers may join")
            return ""
        if name in self.supervisor_view:
            return f"name clash: {name!r} is one of the router's own workers"
        for other in self.workers.values():
            if other.key != key and (other.name == name or (node and other.hello.node == node)):
                return (f"name clash: node {other.hello.node or other.name!r} is connected with another key "
                        f"({security.fingerprint(other.key.encode()) if other.key else 'none'})")
        return ""

    def _refuse_worker(self, ident: bytes, name: str, hello: Hello, key: str, why: str) -> None:
        """Tell the worker (it logs it and exits for good) and log it here, once per 10 s per worker."""
        with contextlib.suppress(zmq.ZMQError):
            self.back.send_multipart([ident, codec.encode(Shutdown(reason=why))], zmq.NOBLOCK)
        now = time.monotonic()
        if now - self._refused_at.get((name, why), -1e9) >= 10.0:
            self._refused_at[(name, why)] = now
            LOG.warning(f"refused worker {name} (node {hello.node or '-'}, pid {hello.pid}): {why}", worker=name,
                        node=hello.node or None, key=security.fingerprint(key.encode()) if key else None)

    def _dispatch(self) -> None:
        """Each model's queue, oldest first, to that model's workers (prefix affinity among them)."""
        if self.light:
            self._dispatch_light()
        for model, queue in list(self.queues.items()):  # a lost worker may requeue (and add a queue)
            if queue:
                self._dispatch_model(queue, [w for w in self.workers.values() if w.model == model])

    def _dispatch_model(self, queue: deque[Job], pool: list[WorkerState]) -> None:
        while queue:
            job = queue[0]
            w = pick_worker(pool, job.keys, self.cfg.affinity_slack)
            if w is None:
                return
            queue.popleft()
            remember(w, job.keys)
            self._start_on(w, job)
            for sib in job.siblings:  # the prompt's other choices: on the same worker, after the first
                self._start_on(w, sib, after=job.rid)
            job.siblings = []
            if self.workers.get(w.name) is not w:  # its socket was gone: lost, and the job is queued again
                pool.remove(w)

    def _start_on(self, w: WorkerState, job: Job, after: int = -1) -> None:
        """Send ``job`` to ``w`` (``after``: the rid of the first choice whose computed prompt it copies)."""
        if not job.started:
            job.started = time.monotonic()
            self.metrics.of(job.model).queue_wait.observe(job.started - job.queued_at)
        job.worker = job.last_worker = w.name
        job.status, job.dispatched_at = RequestStatus.RUNNING, time.monotonic()
        w.jobs[job.rid] = job
        if LOG.enabled("debug"):
            LOG.debug("dispatch", id=job.log_id, worker=w.name, rid=job.rid)
        self._send_worker(w, Run(job.rid, job.prompt, job.params, job.stream, job.log_id, task=job.task,
                                 after=after))

    def _dispatch_light(self) -> None:
        """Tokenize and detokenize jobs: each to the ready worker of its model with the most free slots,
        full or not (its I/O thread answers them at once: worker/tasks.py)."""
        for job in list(self.light):
            pool = [w for w in self.workers.values() if w.model == job.model and w.routable]
            if not pool:
                continue
            w = max(pool, key=lambda w: (w.free, w.name))
            self.light.remove(job)
            job.started = job.started or time.monotonic()
            job.worker = job.last_worker = w.name
            job.status, job.dispatched_at = RequestStatus.RUNNING, time.monotonic()
            w.light[job.rid] = job
            self._send_worker(w, Run(job.rid, job.prompt, job.params, False, job.log_id, task=job.task,
                                     options=job.options))

    def _unservable(self, model: str) -> str:
        """Why no worker of ``model`` can ever take its work (it left the pool, or every worker of it
        failed for good), or "" if one may."""
        if any(w.model == model for w in self.workers.values()):
            return ""
        if model not in self.models:
            return f"model {model!r} was removed from the pool"
        rows = [i for i in self.supervisor_view.values() if i.get("model", self.models[0]) == model]
        if rows and all(i.get("state") == "failed" for i in rows):
            reasons = sorted({str(i.get("reason")) for i in rows})
            return f"no worker can serve: every worker failed ({'; '.join(reasons)}); see llamapool status"
        return ""

    # ------------------------------------------------------------ time

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
            elif waiting and now - job.queued_at > self.cfg.queue_timeout:
                ready = sum(1 for w in self.workers.values() if w.model == job.model and w.routable)
                local = any(i.get("model", self.models[0]) == job.model for i in self.supervisor_view.values())
                why = "" if ready or local else (
                    f": model {job.model!r} has no local worker and no node's worker has joined "
                    f"(devices = \"remote\": is a `llamapool node` running and is its key in authorized_keys?)")
                self._end(job, RequestStatus.UNAVAILABLE, message=(
                    f"no worker slot of model {job.model!r} became free within server.queue_timeout="
                    f"{self.cfg.queue_timeout:g}s ({ready} workers ready){why}"))
            elif job.deadline is not None and now > job.deadline:
                self._cancel_job(job, RequestStatus.TIMED_OUT)
        for w in list(self.workers.values()):
            if w.closing and not self.queues.get(w.model):
                self._retire(w)
        for model in [m for m, q in self.queues.items() if not q and m not in self.models
                      and not any(w.model == m for w in self.workers.values())]:
            del self.queues[model]
        if self.draining and not self.jobs:
            self.on_event(Drained())

    # ------------------------------------------------------------ supervisor

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

    def _retire(self, w: WorkerState) -> None:
        w.state, w.closing = "retiring", False
        self._send_worker(w, Shutdown())

    def _report_ready(self) -> None:
        n = sum(1 for w in self.workers.values() if w.routable)
        if n != self._last_ready:
            self._last_ready = n
            self.on_event(ReadyCount(n, self.queued))

    def fleet(self) -> Fleet:
        """Every worker as ``status`` and ``/metrics`` show it (router/fleet.py)."""
        return Fleet.build(self.models, self.supervisor_view, [w.live() for w in self.workers.values()],
                           self.remote_lost, {m: len(q) for m, q in self.queues.items()}, self.draining, self.gpus)

    def _status(self, rid: str) -> StatusReply:
        return self.fleet().status(rid)

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
