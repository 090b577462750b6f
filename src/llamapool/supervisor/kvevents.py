"""The pod's KV-cache event publisher (``[kv_events]``, issue 53): one ZeroMQ PUB endpoint per pod, as llm-d's
precise prefix-cache scorer subscribes to (it dials ``tcp://<pod IP>:<socketPort>`` and follows one sequence
number per endpoint), fed by the pod's workers.

Each worker reports what its own KV holds (worker/engine/kvevents.py) over a PUSH socket to this thread's PULL
socket (``ipc://`` in the runtime directory). :class:`PodBlocks` merges the workers: a block (per model, medium
and hash) is announced when the first worker holds it and removed when the last lets it go, so two workers
holding one prefix publish it once, and a worker that dies (or restarts: its first report clears it) has its
blocks removed at once. The merged batches are published as ``[topic, seq, payload]`` (protocol/kvevents.py),
``seq`` counting up from 0 at the publisher's start, whose first batch is ``AllBlocksCleared``; the last
``buffer_steps`` batches are kept for the replay ROUTER socket.

A slow or absent subscriber never slows a worker: the PUB socket (XPUB with ``XPUB_NODROP``) refuses a batch
past its high-water mark rather than queue it, and the batch is dropped (still kept for replay: the subscriber
sees the gap in ``seq`` and asks for it) and counted. ``XPUB_NODROP`` refuses a batch for every subscriber
at once, so a subscriber that stops reading would cut off the others: ZMTP heartbeats (``HEARTBEAT_IVL``,
``HEARTBEAT_TIMEOUT``) disconnect it once it has not answered a ping for ``HEARTBEAT_TIMEOUT`` (a stalled
peer's full TCP window holds the ping), and the others receive again (a reconnecting subscriber replays
its gap). A worker never waits on this thread either: its PUSH socket drops past its own mark, counts,
and sends a snapshot of what it holds once it can again.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llamapool import log as logmod
from llamapool.protocol.kvevents import END_SEQ, Cleared, Event, Removed, Stored, decode_batch, encode_batch

LOG = logmod.Logger("supervisor")
POLL_MS = 50  # the thread's poll: how soon a worker's exit is acted on when nothing else arrives
HEARTBEAT_IVL_MS = 1000  # the PUB socket pings each subscriber this often (ZMTP PING)
HEARTBEAT_TIMEOUT_MS = 3000  # ... and drops one whose answer has not come by then (a stalled one)
Key = tuple[str, str, int]  # (model, medium, block hash)


@dataclass
class PodBlocks:
    """The pod's blocks as the union of its workers' (a count of workers per block)."""

    count: dict[Key, int] = field(default_factory=dict)
    of: dict[str, set[Key]] = field(default_factory=dict)  # worker ("name:pid") -> the blocks it holds
    held: dict[str, int] = field(default_factory=dict)  # blocks the pod holds, by medium (kept as they change)

    def apply(self, worker: str, model: str, events: list[Event]) -> list[Event]:
        """A worker's events as the pod's: the blocks the pod newly holds, the ones it no longer holds."""
        out: list[Event] = []
        mine = self.of.setdefault(worker, set())
        for e in events:
            if isinstance(e, Cleared):  # a worker's start (or a snapshot after lost reports)
                out += self.gone(worker, keep=True)
            elif isinstance(e, Stored):
                out += self._stored(mine, model, e)
            else:
                gone = []
                for h in e.hashes:
                    key = (model, e.medium, h)
                    if key in mine:
                        mine.discard(key)
                        gone += [h] if self._down(key) else []
                out += [Removed(tuple(gone), e.medium)] if gone else []
        return out

    def _stored(self, mine: set[Key], model: str, e: Stored) -> list[Event]:
        """The runs of ``e``'s blocks no worker held before (each run's parent: the block before it)."""
        out: list[Event] = []
        run, b = -1, e.block
        for i in range(len(e.hashes) + 1):
            fresh = False
            if i < len(e.hashes):
                key = (model, e.medium, e.hashes[i])
                if key not in mine:
                    mine.add(key)
                    fresh = self.count.get(key, 0) == 0
                    self.count[key] = self.count.get(key, 0) + 1
                    self.held[e.medium] = self.held.get(e.medium, 0) + fresh
            if fresh and run < 0:
                run = i
            elif not fresh and run >= 0:
                parent = e.hashes[run - 1] if run else e.parent
                out.append(Stored(e.hashes[run:i], parent, e.tokens[run * b:i * b], b, e.medium, e.lora_name))
                run = -1
        return out

    def _down(self, key: Key) -> bool:
        """One worker fewer holds ``key``; True when none does any more."""
        left = self.count.get(key, 0) - 1
        if left > 0:
            self.count[key] = left
            return False
        self.count.pop(key, None)
        self.held[key[1]] = self.held.get(key[1], 1) - 1
        return True

    def gone(self, worker: str, keep: bool = False) -> list[Event]:
        """Worker ``worker`` holds nothing any more (it died, or restarted): the blocks only it held, removed."""
        keys = self.of.get(worker, set()) if keep else self.of.pop(worker, set())
        by: dict[str, list[int]] = {}
        for key in keys:
            if self._down(key):
                by.setdefault(key[1], []).append(key[2])
        keys.clear()
        return [Removed(tuple(hs), medium) for medium, hs in by.items()]

    def models_of(self, worker: str) -> set[str]:
        return {k[0] for k in self.of.get(worker, ())}

    def blocks(self) -> dict[str, int]:
        """Blocks the pod holds, by medium (read from another thread: a copy of a small dict)."""
        return dict(self.held)


def pod_name(pod: str, http_port: int | None) -> str:
    """The pod in the topic: ``pod`` as configured, else ``$POD_IP`` (the chart sets it), else this host's name,
    with the HTTP port: the ``<address>:<port>`` the endpoint picker knows the pod by."""
    if pod:
        return pod
    host = os.environ.get("POD_IP") or socket.gethostname()
    return f"{host}:{http_port}" if http_port else host


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an endpoint with a wildcard (``*``, ``::``) or an ipc/inproc one, connect to others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass
class Counters:
    batches: int = 0  # published
    events: int = 0
    dropped: int = 0  # batches the PUB socket refused (a subscriber past its high-water mark)
    worker_dropped: dict[str, int] = field(default_factory=dict)  # reports a worker's socket dropped, by worker
    replays: int = 0
    bad_replays: int = 0  # malformed replay requests (ignored)
    bad_reports: int = 0  # worker reports that were not a batch (ignored)


class Publisher(threading.Thread):
    """The publisher thread: the workers' reports in, the pod's batches out, replays answered."""

    def __init__(self, zctx: zmq.Context, inbox: str, endpoint: str, replay: str, topic: str, models: list[str],
                 buffer_steps: int = 10_000, hwm: int = 100_000):
        super().__init__(name="kv-events", daemon=True)
        self.zctx, self.inbox, self.endpoint, self.replay_endpoint = zctx, inbox, endpoint, replay
        self.topic, self.models, self.hwm = topic, models, hwm
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=max(1, buffer_steps))
        self.pod = PodBlocks()
        self.counters = Counters()
        self.seq = 0
        self._gone: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self.error: str = ""

    def topic_of(self, model: str) -> bytes:
        return self.topic.replace("{model}", model).encode()

    def start_and_wait(self) -> str:
        """Start the thread; "" once its sockets are bound, else why they are not."""
        self.start()
        self._ready.wait(10)
        return self.error

    def worker_gone(self, worker: str) -> None:
        """Worker ``worker`` ("name:pid") exited (any thread)."""
        self._gone.put(worker)

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)

    def run(self) -> None:
        try:
            socks = self._sockets()
        except zmq.ZMQError as e:
            self.error = f"kv_events: cannot open {self.endpoint} / {self.replay_endpoint or '-'}: {e}"
            self._ready.set()
            return
        self._ready.set()
        pull, pub, router = socks
        for model in self.models:
            self._publish(pub, model, [Cleared()])
        poller = zmq.Poller()
        for s in socks:
            if s is not None:
                poller.register(s, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                for s, _ in poller.poll(POLL_MS):
                    if s is pull:
                        self._reports(pull, pub)
                    elif s is router:
                        self._replay(router)
                    else:
                        _drain(pub)  # XPUB: the subscriptions, read so they do not pile up
                self._reap(pub)
        finally:
            for s in socks:
                if s is not None:
                    s.close(linger=0)

    def _sockets(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket | None]:
        pull = self.zctx.socket(zmq.PULL)
        pull.bind(self.inbox)
        pub = self.zctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.XPUB_NODROP, 1)  # past the mark: EAGAIN (counted) rather than a silent drop
        pub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)  # ... and a stalled subscriber is let go
        pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.endpoint) if binds(self.endpoint) else pub.connect(self.endpoint)
        router = None
        if self.replay_endpoint:
            router = self.zctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
        return pull, pub, router

    def _reports(self, pull: zmq.Socket, pub: zmq.Socket) -> None:
        """The workers' waiting reports: ``[worker, model, payload, dropped]`` each."""
        for _ in range(1000):
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                worker, model = frames[0].decode(), frames[1].decode()
                _, events = decode_batch(frames[2])
                self.counters.worker_dropped[worker.split(":")[0]] = int.from_bytes(frames[3], "big")
            except (ValueError, IndexError, UnicodeDecodeError):
                self.counters.bad_reports += 1
                continue
            self._publish(pub, model, self.pod.apply(worker, model, events))

    def _reap(self, pub: zmq.Socket) -> None:
        while True:
            try:
                worker = self._gone.get_nowait()
            except queue.Empty:
                return
            models = self.pod.models_of(worker)
            removed = self.pod.gone(worker)
            if removed:  # a worker serves one model
                self._publish(pub, next(iter(models)) if models else self.models[0], removed)

    def _publish(self, pub: zmq.Socket, model: str, events: list[Event]) -> None:
        if not events:
            return
        topic, seq = self.topic_of(model), self.seq
        payload = encode_batch(events)
        self.seq += 1
        self.buffer.append((seq, topic, payload))
        try:
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.counters.dropped += 1
            return
        self.counters.batches += 1
        self.counters.events += len(events)

    def _replay(self, router: zmq.Socket) -> None:
        """A replay request ``[identity, "", start seq (8 bytes)]``: every buffered batch from it, as
        ``[topic, seq, payload]``, then ``[topic, -1, ""]``. A malformed one gets nothing."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.counters.bad_replays += 1
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        self.counters.replays += 1
        with contextlib.suppress(zmq.ZMQError):  # a client gone meanwhile: its answer goes nowhere
            for seq, topic, payload in list(self.buffer):
                if seq >= start:
                    router.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", self.topic_of(self.models[0]), END_SEQ, b""])

    def metrics(self) -> Iterator[Metric]:
        """The publisher's series (read from the router thread: plain counters, racy but safe)."""
        c = self.counters
        yield CounterMetricFamily("llamapool_kv_events_batches", "KV-cache event batches published ([kv_events])",
                                  value=c.batches)
        yield CounterMetricFamily("llamapool_kv_events_events", "KV-cache events published", value=c.events)
        fam = CounterMetricFamily("llamapool_kv_events_dropped", "KV-cache event batches dropped: by the pod's PUB "
                                  "socket past its high-water mark (a stalled subscriber; kept for replay), or by "
                                  "a worker's socket to the publisher (then resent as a snapshot)", labels=["where"])
        fam.add_metric(["publisher"], c.dropped)
        fam.add_metric(["worker"], sum(list(c.worker_dropped.values())))
        yield fam
        yield CounterMetricFamily("llamapool_kv_events_replays", "Replay requests answered", value=c.replays)
        gauge = GaugeMetricFamily("llamapool_kv_events_blocks", "Blocks the pod announces, by medium",
                                  labels=["medium"])
        for medium, n in sorted(self.pod.blocks().items()):  # GPU, CPU: two keys, never resized mid-copy
            gauge.add_metric([medium], n)
        yield gauge


def _drain(sock: zmq.Socket) -> None:
    with contextlib.suppress(zmq.Again):
        for _ in range(1000):
            sock.recv(zmq.NOBLOCK)


def start(zctx: zmq.Context, cfg: Any, runtime_dir: str, http_port: int | None, models: list[str]) -> Publisher:
    """The publisher of ``cfg`` (a ``KVEventsConfig``), started; ``Publisher.error`` says why it could not bind."""
    topic = cfg.topic.replace("{pod}", pod_name(cfg.pod, http_port))
    pub = Publisher(zctx, f"ipc://{runtime_dir}/kv-events.sock", cfg.endpoint, cfg.replay_endpoint, topic, models,
                    cfg.buffer_steps, cfg.hwm)
    pub.start_and_wait()
    return pub


def attach(zctx: zmq.Context, cfg: Any, metrics: Any) -> Publisher:
    """The daemon's publisher (``cfg``: the daemon's Config, with ``[kv_events]``), started, its series added to
    the router's ``metrics`` (``Publisher.error`` says why it could not bind)."""
    import itertools

    from llamapool import log as logmod

    kv = cfg.kv_events
    port = cfg.http.host_port[1] if cfg.http is not None else None
    pub = start(zctx, kv, str(cfg.runtime_dir), port, cfg.model_names)
    if not pub.error:
        before = metrics.extra
        metrics.extra = lambda: itertools.chain(before(), pub.metrics())
        replay = f", replay on {kv.replay_endpoint}" if kv.replay_endpoint else ""
        logmod.Logger("supervisor").info(f"kv_events: publishing on {kv.endpoint}{replay} (topic {pub.topic})")
    return pub


__all__ = ["Counters", "PodBlocks", "Publisher", "attach", "binds", "pod_name", "start"]
