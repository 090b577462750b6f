"""KV-cache events for llm-d's precise prefix-cache scorer (issue 53), and the render endpoints.

The tracker and the pod's merge alone; the publisher on real (inproc) sockets: a stalled subscriber past
the high-water mark costs dropped batches (counted, kept for replay), never a blocked worker; then a daemon on
the tiny model, read by a subscriber written with msgpack and pyzmq alone (the format's independent reading):
every full block of every prompt is announced, with the render endpoint's tokens and a linked parent chain,
once; a slot's reuse, the host tier and the model's unload publish what leaves and arrives; replay returns
what was published; and a subscriber stalled over TCP while prompts run costs the daemon counted drops,
never a request (the throughput figure is ``llamapool bench --kv-stall``'s, docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from llamapool.protocol.kvevents import CPU, GPU, Cleared, Removed, Stored, decode_batch, encode_batch
from llamapool.supervisor.kvevents import PodBlocks, Publisher
from llamapool.worker.engine.kvevents import BlockTracker, chain
from tests.conftest import Daemon, free_port

B = 16


def _toks(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_a_prefix_two_slots_hold_is_announced_once_and_removed_with_its_last_holder() -> None:
    t = BlockTracker(b"model-a", B)
    assert isinstance(t.take()[0], Cleared)  # a new worker holds nothing
    a = _toks(*range(100, 100 + 3 * B + 5))
    t.hold(0, a)
    (ev,) = t.take()
    assert isinstance(ev, Stored) and ev.parent is None and ev.medium == GPU and ev.block == B
    assert list(ev.tokens) == list(a[: 3 * B]) and list(ev.hashes) == chain(None, b"model-a", a, B)
    t.hold(1, a[: 2 * B + 3])  # a prefix another slot holds: nothing new
    assert t.take() == []
    t.clear(0)  # block 3 had one holder; blocks 1-2 still have slot 1
    (gone,) = t.take()
    assert isinstance(gone, Removed) and gone.hashes == (ev.hashes[2],)
    grown = np.concatenate([a[: 2 * B], _toks(*range(7, 7 + 2 * B))])
    t.hold(1, grown, extends=True)  # slot 1's sequence grew two blocks: their parent is its block 2
    (more,) = t.take()
    assert isinstance(more, Stored) and more.parent == ev.hashes[1] and len(more.hashes) == 2
    t.hold(1, _toks(*range(900, 900 + B)))  # reused by another prompt: the old chain goes, the new one comes
    removed, stored = t.take()
    assert isinstance(removed, Removed) and set(removed.hashes) == {*ev.hashes[:2], *more.hashes}
    assert isinstance(stored, Stored) and stored.parent is None
    t.stored(7, a)  # the host tier: CPU, counted apart from the slots
    (cpu,) = t.take()
    assert isinstance(cpu, Stored) and cpu.medium == CPU and cpu.hashes == ev.hashes
    snap = t.snapshot()
    assert isinstance(snap[0], Cleared) and {e.medium for e in snap[1:] if isinstance(e, Stored)} == {GPU, CPU}
    t.clear_all()
    assert {e.medium for e in t.take() if isinstance(e, Removed)} == {GPU, CPU} and not t.count
    assert set(chain(None, b"model-b", a, B)).isdisjoint(ev.hashes), "another model's blocks never collide"


def test_the_pod_announces_a_block_of_two_workers_once_and_removes_a_dead_workers_blocks() -> None:
    t = BlockTracker(b"m", B)
    t.take()
    t.hold(0, _toks(*range(3 * B)))
    (ev,) = t.take()
    assert isinstance(ev, Stored)
    pod = PodBlocks()
    assert pod.apply("w0:1", "m", [ev]) == [ev]
    longer = Stored((*ev.hashes, 12345), None, ev.tokens + tuple(range(B)), B, GPU)
    (run,) = pod.apply("w1:2", "m", [longer])  # only the block the pod lacked, its parent the last held
    assert isinstance(run, Stored) and run.hashes == (12345,) and run.parent == ev.hashes[-1]
    assert run.tokens == tuple(range(B))
    assert pod.apply("w0:1", "m", [Removed(ev.hashes, GPU)]) == []  # w1 still holds them
    (gone,) = pod.gone("w1:2")  # w1 died
    assert isinstance(gone, Removed) and set(gone.hashes) == {*ev.hashes, 12345} and not pod.count
    assert pod.blocks() == {GPU: 0}


def _publisher(ctx: zmq.Context, name: str, hwm: int = 100_000) -> Publisher:
    pub = Publisher(ctx, f"inproc://{name}-in", f"inproc://{name}-pub", f"inproc://{name}-replay",
                    "kv@pod-1:8000@{model}", ["m"], buffer_steps=1000, hwm=hwm)
    assert pub.start_and_wait() == ""
    return pub


def _replay(ctx: zmq.Context, addr: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(addr)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while dealer.poll(5000):
        frames = dealer.recv_multipart()[1:]
        if frames[2] == b"":
            assert int.from_bytes(frames[1], "big", signed=True) == -1
            break
        got.append(frames)
    dealer.close(linger=0)
    return got


def test_a_stalled_subscriber_costs_dropped_batches_never_a_blocked_worker_and_replay_has_them() -> None:
    ctx = zmq.Context()
    pub = _publisher(ctx, "stall", hwm=4)
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.connect("inproc://stall-pub")
    stalled.setsockopt(zmq.SUBSCRIBE, b"kv@")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://stall-in")
    time.sleep(0.2)
    t0 = time.monotonic()
    for i in range(300):  # a worker's reports: each a new block
        ev = Stored((1000 + i,), None if i == 0 else 999 + i, tuple(range(B)), B, GPU)
        push.send_multipart([b"w:1", b"m", encode_batch([ev]), (0).to_bytes(8, "big")], zmq.NOBLOCK)
    assert time.monotonic() - t0 < 1.0, "the worker's side never waits"
    deadline = time.monotonic() + 10
    while pub.seq < 301 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pub.seq == 301 and pub.counters.dropped > 250, pub.counters  # seq 0 was AllBlocksCleared
    stalled.close(linger=0)
    got = _replay(ctx, "inproc://stall-replay", 0)
    assert [int.from_bytes(f[1], "big") for f in got] == list(range(301)), "replay has the dropped ones too"
    assert all(f[0] == b"kv@pod-1:8000@m" for f in got)
    assert isinstance(decode_batch(got[0][2])[1][0], Cleared)
    bad = ctx.socket(zmq.DEALER)  # a malformed replay request gets nothing and breaks nothing
    bad.connect("inproc://stall-replay")
    bad.send_multipart([b"", b"x"])
    assert not bad.poll(300)
    bad.close(linger=0)
    assert len(_replay(ctx, "inproc://stall-replay", 299)) == 2 and pub.counters.bad_replays == 1
    push.close(linger=0)
    pub.stop()
    ctx.term()


# ---------------------------------------------------------------- the daemon, read by an independent subscriber


class Subscriber:
    """KV events read with pyzmq and msgpack alone (no llamapool code): the pod's view per (medium, hash),
    replayed from 0 at the start, every store checked against it (parent held, no block stored twice)."""

    def __init__(self, pub: str, replay: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.replay_addr = replay
        self.view: dict[tuple[str, int], tuple[int | None, list[int]]] = {}
        self.stores: list[tuple[str, int]] = []
        self.lora: dict[tuple[str, int], str | None] = {}  # each stored block's lora_name
        self.removes: list[tuple[str, int]] = []
        self.problems: list[str] = []
        self.topics: set[bytes] = set()
        self.last = -1
        self.lock = threading.Lock()
        self.stop = False
        time.sleep(0.3)
        for topic, seq, payload in self._replayed(0):
            self._batch(topic, seq, payload)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _replayed(self, start: int) -> list[tuple[bytes, int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_addr)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(5000):
            _, topic, seq, payload = dealer.recv_multipart()
            if not payload:
                break
            out.append((topic, int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
        return out

    def _run(self) -> None:
        while not self.stop:
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                n = int.from_bytes(seq, "big")
                if n > self.last + 1:  # a gap: what was missed comes from the replay socket
                    for t, s, p in self._replayed(self.last + 1):
                        if s < n:
                            self._batch(t, s, p)
                self._batch(topic, n, payload)

    def _batch(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq <= self.last:
            return
        with self.lock:
            self.last = seq
            self.topics.add(topic)
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and rank == 0
            for e in events:
                self._event(e)

    def _event(self, e: list[Any]) -> None:
        if e[0] == "AllBlocksCleared":
            self.view.clear()
        elif e[0] == "BlockStored":
            hashes, parent, tokens, size, _lora_id, medium, lora_name = e[1:8]
            assert len(tokens) == size * len(hashes) and size == B
            if parent is not None and (medium, parent) not in self.view:
                self.problems.append(f"parent {parent} of {hashes[0]} not held")
            for i, h in enumerate(hashes):
                if (medium, h) in self.view:
                    self.problems.append(f"{medium} block {h} stored twice")
                self.view[(medium, h)] = (parent if i == 0 else hashes[i - 1], tokens[i * size:(i + 1) * size])
                self.stores.append((medium, h))
                self.lora[(medium, h)] = lora_name
        elif e[0] == "BlockRemoved":
            for h in e[1]:
                if self.view.pop((e[2], h), None) is None:
                    self.problems.append(f"{e[2]} block {h} removed, never stored")
                self.removes.append((e[2], h))

    def chain_of(self, tokens: list[int], medium: str = GPU) -> list[int]:
        """The held blocks of ``tokens``' full blocks, following the parent links from the first."""
        with self.lock:
            found, parent = [], None
            for i in range(len(tokens) // B):
                want = tokens[i * B:(i + 1) * B]
                match = [h for (m, h), (p, t) in self.view.items() if m == medium and p == parent and t == want]
                if not match:
                    return found
                parent = match[0]
                found.append(parent)
            return found

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.sub.close(linger=0)
        self.ctx.term()


def _post(port: int, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _until(what: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(0.05)
    return what()


PROMPT_1 = "The quick brown fox jumps over the lazy dog, " * 6
PROMPT_2 = "Pack my box with five dozen liquor jugs, then sail away to sea. " * 8
PROMPT_3 = "How vexingly quick daft zebras jump in the morning light, " * 7


def test_a_daemon_announces_every_prompt_block_once_and_what_leaves(start_daemon: Callable[..., Daemon]) -> None:
    port, ev_port, replay_port = free_port(), free_port(), free_port()
    d = start_daemon(wait_workers=None, http={"listen": f"127.0.0.1:{port}"},
                     model={"slots": 2, "kv_host": "64MiB", "load": "on_demand"},
                     workers={"cpu_workers": 1, "slots": 2},
                     kv_events={"enable": True, "endpoint": f"tcp://*:{ev_port}",
                                "replay_endpoint": f"tcp://*:{replay_port}", "pod": "10.0.0.7:8000"})
    d.wait_log("kv_events: publishing")
    sub = Subscriber(f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        with d.client() as c:
            c.load_model("tiny", wait=True, timeout=60)
        gen = {"model": "tiny", "max_tokens": 3, "temperature": 0}
        _post(port, "/v1/completions", {**gen, "prompt": PROMPT_1})
        (rendered,) = _post(port, "/v1/completions/render", {"model": "tiny", "prompt": PROMPT_1})
        t1 = rendered["token_ids"]
        assert rendered["request_id"].startswith("cmpl-") and rendered["model"] == "tiny" and len(t1) > 3 * B
        assert _until(lambda: len(sub.chain_of(t1)) == len(t1) // B), (len(sub.chain_of(t1)), len(t1) // B)
        assert sub.topics == {b"kv@10.0.0.7:8000@tiny"}
        h1 = sub.chain_of(t1)
        stores = len(sub.stores)
        _post(port, "/v1/completions", {**gen, "prompt": PROMPT_1})  # its prefix reused: no store again
        time.sleep(0.5)
        assert not {(GPU, h) for h in h1} & set(sub.stores[stores:])
        # two longer prompts take both slots: the first prompt's slot is reused, its KV moves to the host tier
        _post(port, "/v1/completions", {**gen, "prompt": PROMPT_2})
        _post(port, "/v1/completions", {**gen, "prompt": PROMPT_3})
        assert _until(lambda: not {(GPU, h) for h in h1} & set(sub.view)), "its GPU blocks were removed"
        assert {(GPU, h) for h in h1} <= set(sub.removes)
        assert _until(lambda: len(sub.chain_of(t1, CPU)) == len(h1)), "and stored in the CPU tier"
        chat = _post(port, "/v1/chat/completions/render", {
            "model": "tiny", "messages": [{"role": "user", "content": PROMPT_2}]})
        assert isinstance(chat, dict) and chat["request_id"].startswith("chatcmpl-") and chat["token_ids"]
        with d.client() as c:
            c.unload_model("tiny")
        assert _until(lambda: not sub.view, timeout=30), f"the model's unload removed every block: {len(sub.view)}"
        assert not sub.problems, sub.problems[:5]
    finally:
        sub.close()


def test_kv_of_a_lora_adapter_is_announced_apart_with_its_name(start_daemon: Callable[..., Daemon],
                                                                 model_path: str, tmp_path: Any) -> None:
    """The same prompt under the base model and under an adapter: two chains of blocks of the same tokens, of
    different hashes (other content: KV computed under another adapter set), the adapter's carrying its name
    in ``lora_name`` (the base's none)."""
    from llamapool.modelgen import make_lora

    port, ev_port, replay_port = free_port(), free_port(), free_port()
    lora = str(make_lora(tmp_path / "a.gguf", model_path, seed=1))
    d = start_daemon(wait_workers=1, http={"listen": f"127.0.0.1:{port}"}, workers={"cpu_workers": 1, "slots": 2},
                     model={"lora": [{"name": "tiny-a", "path": lora}]},
                     kv_events={"enable": True, "endpoint": f"tcp://*:{ev_port}",
                                "replay_endpoint": f"tcp://*:{replay_port}"})
    d.wait_log("kv_events: publishing")
    sub = Subscriber(f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        (rendered,) = _post(port, "/v1/completions/render", {"model": "tiny", "prompt": PROMPT_1})
        full = len(rendered["token_ids"]) // B
        for model in ("tiny", "tiny-a"):
            _post(port, "/v1/completions", {"model": model, "prompt": PROMPT_1, "max_tokens": 2, "temperature": 0})

        def named(name: str | None) -> set[int]:
            with sub.lock:
                return {h for (m, h), n in sub.lora.items() if m == GPU and n == name}
        assert _until(lambda: len(named("tiny-a")) >= full and len(named(None)) >= full), (full, sub.lora)
        assert not named("tiny-a") & named(None)
        assert not sub.problems, sub.problems[:5]
    finally:
        sub.close()


@pytest.mark.parametrize("path", ["/v1/completions/render", "/v1/chat/completions/render"])
def test_render_refuses_what_the_generation_would(start_daemon: Callable[..., Daemon], path: str) -> None:
    port = free_port()
    start_daemon(wait_workers=1, http={"listen": f"127.0.0.1:{port}"}, workers={"cpu_workers": 1})
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(port, path, {"prompt": 7} if "chat" not in path else {"messages": []})
    assert e.value.code == 400
    if "chat" not in path:
        ids = _post(port, path, {"prompt": [[1, 2, 3], [4, 5]]})
        assert [r["token_ids"] for r in ids] == [[1, 2, 3], [4, 5]]
        texts = _post(port, path, {"prompt": ["hello", "hello <s> world"], "max_tokens": 5})
        for text, r in zip(["hello", "hello <s> world"], texts, strict=True):  # BOS added, special text as text
            tok = _post(port, "/tokenize", {"content": text, "add_special": True, "parse_special": False})
            assert r["token_ids"] == tok["tokens"] and r["sampling_params"]["max_tokens"] == 5


def _kv_dropped(d: Daemon) -> float:
    with d.client() as c:
        text = c.metrics()
    found = re.search(r'^llamapool_kv_events_dropped_total\{where="publisher"\} (\S+)$', text, re.MULTILINE)
    assert found, "the publisher's drop counter is in the metrics"
    return float(found.group(1))


def _kv_seq(d: Daemon) -> float:
    """The batches the publisher has numbered: sent and dropped."""
    with d.client() as c:
        text = c.metrics()
    sent = re.search(r"^llamapool_kv_events_batches_total (\S+)$", text, re.MULTILINE)
    assert sent, "the publisher's batch counter is in the metrics"
    return float(sent.group(1)) + _kv_dropped(d)


async def _prompts_until_dropped(d: Daemon, n_vocab: int, start: float,
                                 let_go: Callable[[], bool] = lambda: False) -> tuple[int, int]:
    """Prompts of 400 distinct tokens, 4 in flight, until the publisher has dropped (and a wave more), or
    ``let_go()`` (the stalled subscriber was disconnected): each must complete within a generous timeout,
    else publishing blocked the engine. Returns (sent, tokens received)."""
    from llamapool import AsyncClient

    rng = np.random.default_rng(5)
    sent = got = 0
    dropped_waves = 0
    sem = asyncio.Semaphore(4)
    async with AsyncClient(d.endpoint, timeout=120) as client:

        async def one(prompt: list[int]) -> int:
            async with sem:
                c = await asyncio.wait_for(client.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True), 60)
                return int(c.usage.completion_tokens)

        while dropped_waves < 2 and sent < STALL_MAX_PROMPTS:
            wave = [rng.integers(3, n_vocab, 400).tolist() for _ in range(32)]
            got += sum(await asyncio.gather(*(one(p) for p in wave)))
            sent += len(wave)
            dropped_waves += await asyncio.to_thread(_kv_dropped, d) > start
            if let_go():
                break
    return sent, got


STALL_MAX_PROMPTS = 2000  # a bound on the test: with 1-token blocks a few hundred fill the kernel's buffers


def test_a_stalled_tcp_subscriber_costs_counted_drops_never_a_request(start_daemon: Callable[..., Daemon]) -> None:
    """A subscriber that connects over TCP, subscribes and never reads (a receive mark of 1, a 4 KiB kernel
    buffer) while prompts run until its queue is past the publisher's mark or the publisher's heartbeat lets it
    go: every request completes, the drops are counted in the metrics, the daemon stays healthy, a live
    subscriber beside it gets batches numbered after the stall, and then a fresh subscriber gets events and replay
    still returns the buffered batches, the dropped ones included. (1-token blocks: more bytes of events a
    prompt, so that the kernel's TCP buffers, megabytes, fill in a few hundred prompts.)"""
    ev_port, replay_port = free_port(), free_port()
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1, "slots": 4},
                     kv_events={"enable": True, "endpoint": f"tcp://*:{ev_port}",
                                "replay_endpoint": f"tcp://*:{replay_port}", "hwm": 8, "buffer_steps": 200_000,
                                "block_size": 1})
    d.wait_log("kv_events: publishing")
    (worker,) = d.status()["workers"]
    ctx = zmq.Context()
    try:
        _stall_beside_fresh_and_replay(d, ctx, worker, ev_port, replay_port)
    finally:
        ctx.destroy(linger=0)  # every socket closed, even after a failed assert (a context left open blocks)


def _stall_beside_fresh_and_replay(d: Daemon, ctx: zmq.Context, worker: dict[str, Any], ev_port: int,
                                   replay_port: int) -> None:
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.connect(f"tcp://127.0.0.1:{ev_port}")
    stalled.setsockopt(zmq.SUBSCRIBE, b"kv@")
    beside = ctx.socket(zmq.SUB)  # a live subscriber beside it: it must not be cut off for long
    beside.connect(f"tcp://127.0.0.1:{ev_port}")
    beside.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.5)
    start = _kv_dropped(d)
    # prompts until the publisher drops, or for 10 s (its heartbeat lets a stalled subscriber go after 3 s
    # without an answer: on a loaded machine, before the megabytes of the kernel's buffers fill)
    until = time.monotonic() + 10
    sent, got = asyncio.run(_prompts_until_dropped(d, worker["n_vocab"], start, lambda: time.monotonic() > until))
    assert got == 4 * sent, "every request completed"
    # the publisher's heartbeat lets the stalled one go (it may reconnect and stall again): the live one gets
    # a batch numbered after the drops began, within a few heartbeat timeouts
    mark, newest, deadline = _kv_seq(d), -1, time.monotonic() + 30
    with d.client() as c:
        while newest < mark and time.monotonic() < deadline:
            c.generate(list(range(3, 40)), max_tokens=2, temperature=0)
            while beside.poll(200):
                newest = max(newest, int.from_bytes(beside.recv_multipart()[1], "big"))
    assert newest >= mark, (newest, mark, "the live subscriber was cut off by the stalled one")
    beside.close(linger=0)
    (after,) = d.status()["workers"]
    assert d.proc.poll() is None and (after["state"], after["pid"]) == ("ready", worker["pid"]), after
    stalled.close(linger=0)
    fresh = ctx.socket(zmq.SUB)
    fresh.connect(f"tcp://127.0.0.1:{ev_port}")
    fresh.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.5)
    with d.client() as c:
        c.generate(list(range(3, 60)), max_tokens=2, temperature=0)
    assert fresh.poll(10_000), "a fresh subscriber gets events"
    topic, seq, payload = fresh.recv_multipart()
    _ts, events, _rank = msgpack.unpackb(payload)
    assert topic.startswith(b"kv@") and events and events[0][0] in ("BlockStored", "BlockRemoved")
    last = int.from_bytes(seq, "big")
    got_back = _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
    seqs = [int.from_bytes(f[1], "big") for f in got_back]
    assert seqs[: last + 1] == list(range(last + 1)), "replay has every batch, the dropped ones too"
    assert msgpack.unpackb(got_back[last][2]) == msgpack.unpackb(payload)
