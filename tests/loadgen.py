"""A raw-socket load generator for fault tests: counts every reply, so duplicates would show."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq


@dataclass
class Outcome:
    chunks: int = 0
    tokens: int = 0
    finals: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Load:
    """``n`` streamed requests sent at once on one DEALER socket; replies recorded per id."""

    endpoint: str
    n: int
    max_tokens: int = 40
    timeout: float = 120.0
    model: str | None = None  # the pool's model to ask (None: the first)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    first_chunk: threading.Event = field(default_factory=threading.Event)
    chunks_seen: int = 0
    curve: tuple[bytes, bytes, bytes] | None = None  # (router public, client public, client secret), Z85
    prefix: str = "load"  # request ids: "<prefix>-<i>"

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        return t

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.curve
        sock.connect(self.endpoint)
        for i in range(self.n):
            rid = f"{self.prefix}-{i}"
            self.outcomes[rid] = Outcome()
            req = {"v": 1, "type": "generate", "id": rid, "prompt": f"request number {i}", "stream": True,
                   "params": {"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}}
            if self.model is not None:
                req["model"] = self.model
            sock.send(msgpack.packb(req))
        end = time.monotonic() + self.timeout
        grace_end: float | None = None
        while time.monotonic() < end:
            if grace_end is None and all(o.finals for o in self.outcomes.values()):
                grace_end = time.monotonic() + 1.0  # linger: a second final reply would show up here
            if grace_end is not None and time.monotonic() > grace_end:
                break
            if not sock.poll(100):
                continue
            msg = msgpack.unpackb(sock.recv())
            o = self.outcomes[msg["id"]]
            if msg["type"] == "chunk":
                o.chunks += 1
                o.tokens = msg["tokens"]
                self.chunks_seen += 1
                self.first_chunk.set()
            else:
                o.finals.append(msg)
        ctx.destroy(linger=0)

    def wait_chunks(self, k: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while self.chunks_seen < k and time.monotonic() < end:
            time.sleep(0.005)

    # ------------------------------------------------------------ judging

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for o in self.outcomes.values():
            for f in o.finals:
                k = f["type"] if f["type"] == "result" else f"error:{f['code']}"
                kinds[k] = kinds.get(k, 0) + 1
        return {"sent": self.n, "finals": sum(len(o.finals) for o in self.outcomes.values()), **kinds}

    def check_every_request_answered_once(self) -> None:
        for rid, o in self.outcomes.items():
            assert len(o.finals) == 1, f"{rid}: {len(o.finals)} final replies: {o.finals}"

    def failed(self, pred: Callable[[dict[str, Any]], bool] = lambda f: f["type"] == "error"
               ) -> dict[str, Outcome]:
        return {rid: o for rid, o in self.outcomes.items() if o.finals and pred(o.finals[0])}
