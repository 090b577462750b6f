"""A trivial engine for router benchmarks only: no model, one token per sequence per step.

It has the engine's interface, so the whole service path (sockets, router, worker loop,
protocol) is measured with no inference cost. Never used for real serving.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from llamapool.protocol.messages import Delta, Done, Run, Step


@dataclass(eq=False)
class _Seq:
    rid: int
    stream: bool
    max_tokens: int
    prompt_tokens: int
    generated: int = 0


class EchoEngine:
    desc = "echo (router benchmark engine)"
    n_vocab = 32000

    def __init__(self, slots: int):
        self.slots = slots
        self.waiting: deque[Run] = deque()
        self.active: dict[int, _Seq] = {}
        self.steps = 0
        self.decode_s = self.step_s = 0.0
        self.reused_tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def kv_cells(self) -> tuple[int, int]:
        return 0, 0  # no KV cache

    def submit(self, run: Run, out: Step) -> None:
        self.waiting.append(run)

    def abort(self, rid: int, out: Step) -> None:
        for run in list(self.waiting):
            if run.rid == rid:
                self.waiting.remove(run)
                out.done.append(Done(rid, "cancelled", "", 0, 0))
        if rid in self.active:
            seq = self.active.pop(rid)
            out.done.append(Done(rid, "cancelled", "x" * seq.generated, seq.prompt_tokens, seq.generated))

    def step(self, flush: Any = None) -> Step:
        out = Step()
        while self.waiting and len(self.active) < self.slots:
            run = self.waiting.popleft()
            n = len(run.prompt) if isinstance(run.prompt, list) else max(1, len(run.prompt) // 4)
            self.active[run.rid] = _Seq(run.rid, run.stream, run.params.max_tokens, n)
        self.steps += 1
        for seq in list(self.active.values()):
            seq.generated += 1
            if seq.stream:
                out.deltas.append(Delta(seq.rid, "x", seq.generated))
            if seq.generated >= seq.max_tokens:
                del self.active[seq.rid]
                out.done.append(Done(seq.rid, "length", "x" * seq.generated, seq.prompt_tokens, seq.generated))
        out.active = len(self.active)
        return out

    def close(self) -> None:
        self.active.clear()
