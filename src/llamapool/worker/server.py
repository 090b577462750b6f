"""Worker process: one device, one engine thread, one I/O thread.

The I/O thread (this process's main thread) owns the DEALER socket to the router: it forwards
router messages to the engine through a queue, sends the engine's step reports, and sends
heartbeats carrying the engine's progress, so a long step never silences the worker. The engine
thread makes every llama.cpp call.
"""

from __future__ import annotations

import contextlib
import cProfile
import faulthandler
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import zmq

from llamapool import lifeline
from llamapool import log as logmod
from llamapool.protocol import codec
from llamapool.protocol.messages import (
    LIGHT_TASKS,
    Abort,
    AdapterDone,
    Heartbeat,
    Hello,
    KVPart,
    LoadAdapter,
    Message,
    Run,
    Shutdown,
    Step,
    UnloadAdapter,
)
from llamapool.worker.contract import Engine
from llamapool.worker.faults import FaultInjector
from llamapool.worker.handover import Assembler, Received
from llamapool.worker.settings import EngineSettings

EXIT_PERMANENT = 78  # EX_CONFIG: the supervisor must not restart this worker in a loop
# A node's worker logs these for people; its supervisor follows it by its reports (lifeline.report)
JOINING = "joining the router at"  # its model is loaded
STALLED_WAIT = 0.002  # s between two steps while every waiting run waits for its grammar (Engine.stalled)
JOINED = "joined the router at"  # the router accepted it
EXIT_ENGINE = 70  # EX_SOFTWARE: the engine thread failed; the supervisor restarts the worker
REDIAL_MAX = 5.0  # seconds between re-dials after a refused handshake (libzmq does not retry it)
LINK_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)


@dataclass(frozen=True)
class WorkerSpec(EngineSettings):
    """Everything a worker process needs, passed by the supervisor as JSON in argv: its model's
    :class:`EngineSettings` (``threads`` and ``max_batch_tokens`` resolved for this worker) and these."""

    name: str
    backend: str
    device: str  # "cpu", "GPU-<uuid>", or a group's UUIDs joined by "," (= CUDA_VISIBLE_DEVICES)
    model_path: str
    heartbeat_interval: float
    heartbeat_liveness: int
    engine: str = "llama"  # "echo": the router-benchmark engine, no model
    server_key: str = ""  # the router's public key (Z85): connect with CURVE (a tcp:// backend)
    key_file: str = ""  # with server_key: this worker's secret key file (llamapool keygen format)
    node: str = ""  # the node it belongs to (`llamapool node`): its name is "<node>/<slot>"
    model_name: str = ""  # the model's name in the pool (its Hello says it; "" -> the pool's first model)
    boot_id: str = ""  # its daemon's incarnation, said in its Hello (the router refuses other daemons' workers)
    embedding: bool = False  # an embedding model (model.embedding): worker/embedder.py, not the generation engine
    pooling: str = ""  # model.pooling: "mean" | "cls" | "last"; "" -> the GGUF's own; "rank": a reranker
    # (task = "rerank": the embedding engine with llama.cpp's rank pooling)
    kv_events: str = ""  # [kv_events]: the supervisor's publisher inbox (ipc://) its KV-cache events go to; "": off
    kv_events_block: int = 16  # [kv_events] block_size

    @property
    def n_gpus(self) -> int:
        """The GPUs this worker must see: those of its device (0 for a CPU worker)."""
        return 0 if self.device == "cpu" else len(self.device.split(","))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


TERMINATED = "sigterm"  # an engine loop's Shutdown from the worker's own SIGTERM: the daemon (or an operator)
# stops it; the router's Shutdown is a retirement (a reload, a replica scaled down, a model evicted)


class EngineLoop(threading.Thread):
    """The one thread that calls llama.cpp: admits, steps, aborts, reports."""

    def __init__(self, engine: Engine, zctx: zmq.Context, out_addr: str, name: str = "worker",
                 events: tuple[str, str] | None = None):
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.events = KVEventsLink(zctx, *events, f"{name}:{os.getpid()}") if events else None
        self.inbox: queue.SimpleQueue[Message | Received] = queue.SimpleQueue()
        self._zctx, self._out_addr = zctx, out_addr
        self.step_started = 0.0  # monotonic start of the running step, 0 when idle
        self.steps = 0
        self.draining = False
        self.hand_over = False  # a drain the router asked for: the host KV tier goes to a sibling (not on SIGTERM)
        self.log = logmod.Logger(name, prefix=f"llamapool worker {name}")
        self.reqs: dict[int, str] = {}  # rid -> request id, for this worker's log lines
        self.adapter_done: list[AdapterDone] = []  # run-time LoRA loads and unloads to answer (_adapters)
        # LLAMAPOOL_PROFILE=PREFIX (diagnostics): the thread runs under cProfile, its stats written to
        # PREFIX.<pid> when it drains
        self.profile: cProfile.Profile | None = cProfile.Profile() if os.environ.get("LLAMAPOOL_PROFILE") else None

    def _send(self, sock: zmq.Socket, report: Step) -> None:
        """Send a step report; log its finishes (debug) and failures (warning) with request ids."""
        for rid, reason, _text, n_prompt, n_gen, *_ in report.done:
            req = self.reqs.pop(rid, "")
            if self.log.enabled("debug"):
                self.log.debug("finished", id=req, rid=rid, finish=reason, prompt_tokens=n_prompt,
                               generated_tokens=n_gen)
        for rid, code, message, _fld in report.failed:
            self.log.warning(f"request failed: {message}", id=self.reqs.pop(rid, ""), rid=rid, code=code)
        sock.send(codec.encode(report))

    def run(self) -> None:
        """Fail-stop: an error that escapes the engine ends the worker process (exit 70), so that the
        supervisor restarts it and the router answers its requests, rather than a dead engine thread
        behind a worker that still says it is ready."""
        try:
            if self.profile is not None:
                self.profile.runcall(self._run)
            else:
                self._run()
        except BaseException:
            import traceback

            self.log.error("FATAL: the engine thread failed: " + traceback.format_exc().replace("\n", " | "))
            os._exit(EXIT_ENGINE)

    def _run(self) -> None:
        out_sock = self._zctx.socket(zmq.PUSH)
        out_sock.connect(self._out_addr)
        eng = self.engine
        while True:
            report = Step()
            try:
                msg = self.inbox.get(timeout=None if not eng.busy and not self.draining
                                     else STALLED_WAIT if eng.stalled else 0)
                self._handle(msg, report)
                while True:
                    self._handle(self.inbox.get_nowait(), report)
            except queue.Empty:
                pass
            if self.draining and not eng.busy:
                self._send(out_sock, report)
                for sent, part in enumerate(eng.hand_out() if self.hand_over else (), 1):  # the tier, to a sibling
                    out_sock.send(codec.encode(part))  # (bounded: handover.parts)
                    if (faults := getattr(eng, "faults", None)) is not None:  # tests only: killed midway
                        faults.in_handover(sent)
                if self.events is not None:  # its KV is let go: every block removed
                    self.events.send(eng, final=True)
                if self.profile is not None:  # before the goodbye: the process ends soon after it
                    self.profile.disable()
                    self.profile.dump_stats(f"{os.environ['LLAMAPOOL_PROFILE']}.{os.getpid()}")
                out_sock.send(codec.encode(Shutdown()))
                break
            if eng.busy:
                def flush(part: Step, report: Step = report) -> None:
                    """Send what is ready before a step that blocks (see Engine.step)."""
                    self._merge(report, part)
                    report.active = len(eng.active) + len(eng.waiting)
                    self._send(out_sock, report)
                    report.deltas, report.done, report.failed = [], [], []

                self.step_started = time.monotonic()
                self._merge(report, eng.step(flush))
                self.step_started = 0.0
                self.steps += 1
            report.active = len(eng.active) + len(eng.waiting)
            if report.deltas or report.done or report.failed:
                self._send(out_sock, report)
            self._adapters(out_sock)  # before the loop may wait for a message: one the step let go is freed now
            if self.events is not None:
                self.events.send(eng)
        out_sock.close(linger=1000)
        if self.events is not None:
            self.events.close()

    def _adapters(self, sock: zmq.Socket) -> None:
        """Answer the run-time LoRA loads and unloads handled, and those whose adapter is freed now (no
        sequence uses it any more: after the step that finished the last)."""
        free = getattr(self.engine, "free_adapters", None)
        for name in free() if free is not None else ():
            self.log.info(f"LoRA adapter {name!r} unloaded (freed)")
            self.adapter_done.append(AdapterDone(name, "unload"))
        for done in self.adapter_done:
            sock.send(codec.encode(done))
        self.adapter_done = []

    def _adapter(self, msg: LoadAdapter | UnloadAdapter) -> None:
        """A run-time LoRA load (answered now) or unload (answered now if refused, else once freed)."""
        action = "load" if isinstance(msg, LoadAdapter) else "unload"
        call = getattr(self.engine, f"{action}_adapter", None)
        param = "path" if call is not None else "model"
        if call is None:
            why = "'model': this model takes no LoRA adapters (they apply to generative llama models)"
        else:
            why = call(msg.name, msg.path, msg.scale) if isinstance(msg, LoadAdapter) else call(msg.name)
        if why:
            self.log.warning(f"LoRA adapter {msg.name!r}: {action} refused: {why}")
        elif isinstance(msg, LoadAdapter):
            self.log.info(f"LoRA adapter {msg.name!r} loaded from {msg.path} (scale {msg.scale:g})")
        if why or isinstance(msg, LoadAdapter):
            self.adapter_done.append(AdapterDone(msg.name, action, why, param))

    @staticmethod
    def _merge(report: Step, part: Step) -> None:
        report.deltas += part.deltas
        report.done += part.done
        report.failed += part.failed

    def _handle(self, msg: Message | Received, report: Step) -> None:
        if isinstance(msg, Run):
            self.reqs[msg.rid] = msg.req
            if self.log.enabled("debug"):
                self.log.debug("started", id=msg.req, rid=msg.rid, stream=msg.stream,
                               max_tokens=msg.params.max_tokens)
            self.engine.submit(msg, report)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.rid, report)
        elif isinstance(msg, Shutdown):  # the router retires it (its KV to a sibling) or a SIGTERM came
            self.draining = True
            self.hand_over = self.hand_over or msg.reason != TERMINATED
        elif isinstance(msg, Received):
            self.engine.take_in(msg)
        elif isinstance(msg, (LoadAdapter, UnloadAdapter)):
            self._adapter(msg)


class KVEventsLink:
    """The engine thread's PUSH socket to the pod's KV-event publisher (supervisor/kvevents.py): each step's
    events as one batch ``[worker, model, payload, dropped]``. It never blocks: past its high-water mark a batch
    is dropped and counted (``dropped``, which the publisher exports), and once the socket takes batches again
    a snapshot of what the KV holds goes first (the publisher replaces what it knew of this worker)."""

    HWM = 10_000

    def __init__(self, zctx: zmq.Context, addr: str, model: str, worker: str):
        self.sock = zctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, self.HWM)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(addr)
        self.head = [worker.encode(), model.encode()]
        self.dropped = 0
        self.lost = False

    def send(self, eng: Engine, final: bool = False) -> None:
        kv_events = getattr(eng, "kv_events", None)
        if kv_events is None:
            return
        events = kv_events(final)
        if self.lost:
            events = eng.kv_snapshot()  # type: ignore[attr-defined]
        if not events:
            return
        from llamapool.protocol.kvevents import encode_batch

        try:
            self.sock.send_multipart([*self.head, encode_batch(events), self.dropped.to_bytes(8, "big")],
                                     zmq.NOBLOCK)
            self.lost = False
        except zmq.Again:
            self.dropped += 1
            self.lost = True

    def close(self) -> None:
        self.sock.close()


def serve(spec: WorkerSpec) -> int:
    """Load the model, say hello, and serve until told to shut down."""
    gpu = spec.device != "cpu"
    if spec.engine == "echo":
        from llamapool.worker.echo import EchoEngine

        return _serve(spec, EchoEngine(spec.slots, spec.max_batch_tokens), [])
    from llamapool.worker.engine import Engine as LlamaEngine
    from llamapool.worker.engine import EngineConfig, EngineError, visible_gpus

    # deterministic CPU workers do not speculate: a draft's rows are computed as a prompt's, not one at a time
    speculative = "off" if spec.deterministic and not gpu else spec.speculative
    cfg = EngineConfig(spec.model_path, gpu=gpu, n_gpus=max(1, spec.n_gpus),
                       kv_events_block=spec.kv_events_block if spec.kv_events and not spec.embedding else 0,
                       **spec.engine_settings(speculative=speculative))
    faults = FaultInjector.from_env()
    if faults is not None and faults.load_marker:  # tests only: a slow load
        time.sleep(float(faults.load_marker))
    try:
        if spec.embedding:
            from llamapool.worker.embedder import Embedder

            engine: LlamaEngine | Embedder = Embedder(cfg, spec.pooling, _logger(spec).info)
        else:
            engine = LlamaEngine(cfg)
    except EngineError as e:
        _logger(spec).error(f"FATAL: {e}")
        return EXIT_PERMANENT if e.permanent else 1
    seen = visible_gpus()
    wrong = gpu_mismatch(spec, seen)
    if wrong:
        _logger(spec).error(f"FATAL: {wrong}")
        return EXIT_PERMANENT
    if gpu:
        missing = _unpatched(spec)
        if missing:
            _logger(spec).error(f"FATAL: {missing}")
            return EXIT_PERMANENT
    return _serve(spec, engine, seen, engine.vocab)


def _unpatched(spec: WorkerSpec) -> str:
    """Once, at start: a GPU worker whose llama.cpp lacks a patch its model's settings need says so: a
    warning for a speed setting (it then does nothing: llama.cpp's own choice), and what to return as
    fatal for ``deterministic`` (whose promise could not hold)."""
    from pathlib import Path

    import llama_cpp.llama_cpp as raw

    from llamapool import llama_patches

    lib_dir = Path(getattr(raw._lib, "_name", "") or raw.__file__).parent  # type: ignore[attr-defined]
    note = llama_patches.cublas_rows_ignored(os.environ, lib_dir)
    if note:
        _logger(spec).warning(note)
    return llama_patches.deterministic_unsupported(os.environ, lib_dir)


def gpu_mismatch(spec: WorkerSpec, seen: list[str]) -> str:
    """Why the GPUs llama.cpp sees in this process are not exactly the worker's ("" when they are)."""
    if len(seen) == spec.n_gpus:
        return ""
    want = {0: "none", 1: "exactly one"}.get(spec.n_gpus, f"exactly {spec.n_gpus}")
    return (f"llama.cpp sees GPUs {seen} in this process; expected {want} (device {spec.device}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def _logger(spec: WorkerSpec) -> logmod.Logger:
    return logmod.Logger(spec.name, prefix=f"llamapool worker {spec.name}")


def _serve(spec: WorkerSpec, engine: Engine, seen: list[str], vocab: Any = None) -> int:
    """The I/O loop: hello, then forward router messages in and step reports out. ``vocab``: the model's
    llama.cpp vocabulary, for the runs the I/O thread answers itself (worker/tasks.py)."""
    io = WorkerIO(spec, engine, seen, vocab)
    if io.exit_code:
        return io.exit_code
    return io.run()


class WorkerIO:
    """The worker's I/O thread: one poll loop over the router's socket, the engine's reports and (on
    tcp://) the connection monitor, with a method per event: heartbeat, router message, engine
    report, link event, SIGTERM; then ``close``."""

    def __init__(self, spec: WorkerSpec, engine: Engine, seen: list[str], vocab: Any = None):
        self.spec, self.engine, self.vocab = spec, engine, vocab
        self.log = _logger(spec)
        self.exit_code = 0
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt_string(zmq.ROUTING_ID, f"{spec.name}:{os.getpid()}")
        public = b""
        if spec.server_key:
            from llamapool import security

            try:
                public, secret = security.client_pair_of(spec.key_file)
            except security.KeyFileError as e:
                print(f"llamapool worker {spec.name}: FATAL: {e}", file=sys.stderr, flush=True)
                self.exit_code = EXIT_PERMANENT
                return
            security.set_client_keys(self.sock, spec.server_key.encode(), public, secret)
        self.link = _network_link(spec, self.sock, public)
        self.sock.connect(spec.backend)
        self.pull = self.zctx.socket(zmq.PULL)
        out_addr = f"inproc://engine-out-{os.getpid()}"
        self.pull.bind(out_addr)
        events = (spec.kv_events, spec.model_name) if spec.kv_events and not spec.embedding else None
        self.loop = EngineLoop(engine, self.zctx, out_addr, spec.name, events)
        self.hello = codec.encode(Hello(
            worker=spec.name, pid=os.getpid(), device=spec.device, model=engine.desc,
            slots=spec.slots, ctx_per_slot=spec.ctx_per_slot, n_vocab=engine.n_vocab,
            visible_devices=seen, node=spec.node, model_name=spec.model_name, boot=spec.boot_id,
        ))
        self.bye = codec.encode(Shutdown())
        self.assembler = Assembler()
        self.stop = False
        self.draining = False
        self.next_beat = 0.0
        self.joined = self.ever_joined = False  # the router accepted our hello (it sent no refusal)
        self.parent = os.getppid()
        self.router_seen = time.monotonic()

    def send(self, frame: bytes) -> None:
        """To the router. A network worker never blocks here: a refused handshake drops the socket's
        only pipe (and the frame could reach no router anyway), so the frame is dropped; while the
        connection is merely down (a partition) the pipe stays and queues (no high-water mark)."""
        if self.link is None:
            self.sock.send(frame)
        else:
            with contextlib.suppress(zmq.Again):
                self.sock.send(frame, zmq.NOBLOCK)

    def introduce(self) -> None:
        """Say hello (again): the router accepts us anew."""
        self.send(self.hello)
        self.router_seen, self.joined = time.monotonic(), False

    def run(self) -> int:
        self.send(self.hello)
        if self.spec.node:  # `llamapool node` reads these lines (its workers log at info at least)
            self.log.info(f"model loaded; {JOINING} {self.spec.backend}")
            lifeline.report("joining")
        self.loop.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        if self.link is not None:
            poller.register(self.link.monitor, zmq.POLLIN)
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; Ctrl-C goes to it
        while not self.stop:
            now = time.monotonic()
            link = self.link
            if link is not None and link.redial_at and now >= link.redial_at:  # after a refused handshake
                link.redial(self.sock)
                self.introduce()
            if now >= self.next_beat:
                self.on_beat(now)
            wake = min(self.next_beat, link.redial_at or self.next_beat) if link is not None else self.next_beat
            for s, _ in poller.poll(timeout=max(1, int((wake - now) * 1000))):
                if link is not None and s is link.monitor:
                    if link.events():  # a new connection (the router restarted, or a partition healed)
                        self.introduce()  # at once rather than after the silence
                elif s is self.pull:
                    self.on_engine_reports()
                else:
                    self.on_router_messages()
        return self.close()

    def on_term(self, *_: Any) -> None:
        """SIGTERM: tell the router now (it routes nothing more here), finish what runs, leave."""
        self.draining, self.next_beat = True, 0.0
        self.loop.inbox.put(Shutdown(TERMINATED))

    def on_beat(self, now: float) -> None:
        """Every heartbeat interval: check the supervisor and the router, send a heartbeat."""
        spec, engine = self.spec, self.engine
        if os.getppid() != self.parent:  # the supervisor died: do not linger as an orphan
            self.log.warning("supervisor gone, exiting")
            os._exit(1)
        if now - self.router_seen > spec.heartbeat_interval * spec.heartbeat_liveness:
            self.introduce()  # the router lost us (or restarted)
        self.assembler.expire(now)  # a sibling that died in its handover: its parts go
        started = self.loop.step_started
        kv_used, kv_total = engine.kv_cells()
        target, budget, cost = engine.scheduling()
        self.send(codec.encode(Heartbeat(
            active=len(engine.active) + len(engine.waiting), steps=self.loop.steps,
            busy_for=(now - started) if started else 0.0,
            decode_s=engine.decode_s, step_s=engine.step_s, reused_tokens=engine.reused_tokens,
            kv_used=kv_used, kv_total=kv_total, step_target=target, step_budget=budget, step_cost=cost,
            draining=self.draining, speculation=engine.speculation(), kv_host=engine.kv_host(),
        )))
        if spec.node:  # the node's supervisor watches these (no router of its own to do it)
            lifeline.report("live", (now - started) if started else 0.0)
        self.next_beat = now + spec.heartbeat_interval

    def on_engine_reports(self) -> None:
        """The engine thread's step reports, to the router; its goodbye ends the loop."""
        for frames in _waiting(self.pull):
            if frames[0] == self.bye:
                self.stop = True
            self.send(frames[0])

    def on_router_messages(self) -> None:
        """The router's messages: a refusal ends the worker for good; the rest go to the engine."""
        for frames in _waiting(self.sock):
            self.router_seen = time.monotonic()
            try:
                msg = codec.decode(frames, codec.ROUTER_TYPES, codec.TRANSPORT_MAX_FRAME)
            except codec.ProtocolError as e:
                self.log.warning(f"bad router message: {e}")
                continue
            if isinstance(msg, Shutdown) and msg.reason:
                self.log.error(f"FATAL: the router refused this worker: {msg.reason}")
                self.exit_code = EXIT_PERMANENT
            elif not self.joined:  # the first word from the router after our hello (a heartbeat)
                self.joined = True
                if self.spec.node:
                    self.log.info(f"{JOINED} {self.spec.backend}" + (" again" if self.ever_joined else ""))
                    lifeline.report("joined")
                self.ever_joined = True
            if isinstance(msg, Run) and self.answer(msg):
                continue
            if isinstance(msg, KVPart):  # a draining sibling's host KV tier: joined and checked here
                got = self.assembler.add(msg)
                if got is not None:
                    self.loop.inbox.put(got)
                continue
            if not isinstance(msg, Heartbeat):
                self.loop.inbox.put(msg)

    def answer(self, run: Run) -> bool:
        """Answer ``run`` here if it is a tokenize, a detokenize, or a task the model does not do
        (worker/tasks.py): it never waits behind the engine's step. False: the engine runs it."""
        kind = ("rerank" if self.spec.pooling == "rank" else "embed") if self.spec.embedding else ""
        if run.task not in LIGHT_TASKS and run.task == kind:
            return False  # the common case, without importing llama.cpp's tokenizer here
        from llamapool.worker.tasks import io_answer

        controls = getattr(getattr(self.engine, "chat", None), "controls", None)
        report = io_answer(run, self.vocab, self.engine.n_vocab, self.spec.model_name, kind, controls,
                           getattr(self.engine, "prompts", None))
        if report is None:
            return False
        for _rid, _code, message, _fld in report.failed:
            self.log.warning(f"request failed: {message}", id=run.req, rid=run.rid)
        self.send(codec.encode(report))
        return True

    def close(self) -> int:
        self.loop.join(timeout=5)
        link = self.link
        if link is not None:
            link.events()
            if not link.up:  # no router to tell we left, and nothing queued is worth waiting for
                self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.disable_monitor()
            link.monitor.close(linger=0)
        self.sock.close()
        self.pull.close()
        self.zctx.term()
        self.engine.close()
        return self.exit_code


def _waiting(sock: zmq.Socket) -> Iterator[list[bytes]]:
    """Every message already waiting on ``sock``, without blocking."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


class _Link:
    """A network (tcp://) worker's view of its connection: logs connects, drops and refusals."""

    def __init__(self, spec: WorkerSpec, monitor: zmq.Socket, public: bytes):
        self.spec, self.monitor, self.public = spec, monitor, public
        self.connects = 0
        self.up = False  # a connection whose handshake succeeded is open
        self.refused_at = 0.0
        self.refusals = 0
        self.redial_at = 0.0  # when to dial again after a refused handshake (0: no re-dial due)
        self.redial_delay = 1.0
        self.log = _logger(spec)

    def events(self) -> bool:
        """Handle the monitor's events; True when a new connection to the router is up (not the first)."""
        from zmq.utils.monitor import recv_monitor_message

        reconnected = False
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)
            kind, value = int(ev["event"]), int(ev["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connects += 1
                self.up, self.redial_at, self.redial_delay = True, 0.0, 1.0
                self.log.info(f"connected to the router at {self.spec.backend}" +
                              (" again" if self.connects > 1 else ""))
                reconnected = reconnected or self.connects > 1
            elif kind == zmq.EVENT_DISCONNECTED:
                if self.up:  # (not after a refused handshake: that was logged as such)
                    self.log.warning(f"lost the connection to the router at {self.spec.backend}; reconnecting")
                self.up = False
            else:
                self.up = False
                self._refused(kind, value)
                # libzmq closes a connection whose handshake failed for good and does not dial again:
                # we do, so that a key added to the router's allow-list (and a reload) lets us in
                # a refused key backs off (1 s, doubling to REDIAL_MAX); a hang-up during the handshake
                # may be a network that just came back (a half-open connection): dial again soon
                if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.redial_at = time.monotonic() + self.redial_delay
                    self.redial_delay = min(REDIAL_MAX, self.redial_delay * 2)
                else:
                    self.redial_at = time.monotonic() + 0.2
        return reconnected

    def redial(self, sock: zmq.Socket) -> None:
        """Dial the router again (a new connection, a new pipe) after a refused handshake."""
        self.redial_at = 0.0
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(self.spec.backend)
        sock.connect(self.spec.backend)

    def _refused(self, kind: int, value: int) -> None:
        """A failed handshake (rate-limited: once, then once every 30 s with the count)."""
        now = time.monotonic()
        self.refusals += 1
        if self.refused_at and now - self.refused_at < 30:
            return
        self.refused_at = now
        from llamapool.security import fingerprint

        key = f"key {fingerprint(self.public)}" if self.public else "no key"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"the router refused this worker's {key} (ZAP status {value}): its .pub is not in the "
                   f"router's authorized_keys")
            lifeline.report("key_refused")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = f"handshake failed, ZMTP error {value:#x} (a wrong server public key, or the router uses no CURVE)"
        else:
            why = f"the router hung up during the handshake ({value}): a refused {key} or a wrong server key"
        more = f" ({self.refusals} attempts so far)" if self.refusals > 1 else ""
        self.log.error(f"cannot join {self.spec.backend}: {why}{more}; dialling again (every {REDIAL_MAX:g}s at most)")


def _network_link(spec: WorkerSpec, sock: zmq.Socket, public: bytes) -> _Link | None:
    """A worker on a network backend (a node's, on another host): ZeroMQ heartbeats drop a dead TCP
    connection within ``heartbeat_interval * heartbeat_liveness`` and reconnect at once (a partition
    can leave it open for minutes); a monitor logs its connects, drops and refusals. None for ipc://."""
    if spec.backend.startswith(("ipc://", "inproc://")):
        return None
    ivl = max(100, int(spec.heartbeat_interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl * spec.heartbeat_liveness)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ivl * spec.heartbeat_liveness)  # the router drops us as fast
    sock.setsockopt(zmq.CONNECT_TIMEOUT, ivl)  # retry a SYN lost in a partition without TCP's backoff
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, ivl)
    sock.setsockopt(zmq.SNDHWM, 0)  # a long partition must not block the I/O loop on a full pipe
    return _Link(spec, sock.get_monitor_socket(LINK_EVENTS), public)


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()  # a crash in native code leaves its Python stack in the worker's log
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m llamapool.worker SPEC_JSON", file=sys.stderr)
        return 2
    return serve(WorkerSpec.from_json(args[0]))


__all__ = ["EXIT_PERMANENT", "JOINED", "JOINING", "WorkerSpec", "main", "serve"]
