"""A trivial engine for router benchmarks and scheduler tests: no model, no time.

It has the engine's interface and runs the same step plans (worker/scheduler.py): a prompt of ``n``
tokens is "computed" in the chunks the planner gives it, and a sequence whose prompt is done emits
one token ``x`` per step. So the whole service path (sockets, router, worker loop, protocol) is
measured with no inference cost, and the planner's order is observable without a model. Never used
for real serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from llamapool.protocol.messages import Delta, Done, KVPart, Run, Step
from llamapool.worker.handover import Received
from llamapool.worker.scheduler import PromptWork, plan_step


@dataclass(eq=False)
class _Seq:
    rid: int
    stream: bool
    max_tokens: int
    prompt_tokens: int
    arrived: int
    done: int = 0  # prompt tokens computed
    generated: int = 0


class EchoEngine:
    desc = "echo (router benchmark engine)"
    n_vocab = 32000

    def __init__(self, slots: int, max_batch_tokens: int = 4096):
        self.slots, self.max_batch_tokens = slots, max_batch_tokens
        self.waiting: list[_Seq] = []
        self.active: dict[int, _Seq] = {}  # slot -> sequence
        self.steps = 0
        self.decode_s = self.step_s = 0.0
        self.reused_tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    @property
    def stalled(self) -> bool:
        return False  # nothing waits for a compile

    def kv_cells(self) -> tuple[int, int]:
        return 0, 0  # no KV cache

    def submit(self, run: Run, out: Step) -> None:
        n = len(run.prompt) if isinstance(run.prompt, list) else max(1, len(run.prompt) // 4)
        self.waiting.append(_Seq(run.rid, run.stream, run.params.max_tokens, n, self.steps))

    def abort(self, rid: int, out: Step) -> None:
        for seq in list(self.waiting):
            if seq.rid == rid:
                self.waiting.remove(seq)
                out.done.append(Done(rid, "cancelled", "", 0, 0))
        for slot, seq in list(self.active.items()):
            if seq.rid == rid:
                del self.active[slot]
                out.done.append(Done(rid, "cancelled", "x" * seq.generated, seq.prompt_tokens, seq.generated))

    def step(self, flush: object = None) -> Step:
        out = Step()
        prompts = [PromptWork(slot, s.prompt_tokens - s.done, s.arrived)
                   for slot, s in self.active.items() if s.done < s.prompt_tokens]
        prompts += [PromptWork(i, s.prompt_tokens, s.arrived, running=False) for i, s in enumerate(self.waiting)]
        free = [i for i in range(self.slots) if i not in self.active]
        decoding = [slot for slot, s in self.active.items() if s.done == s.prompt_tokens]
        plan = plan_step(self.max_batch_tokens, decoding, prompts, len(free), self.steps)
        for (key, n), slot in zip(plan.admit, free, strict=False):
            self.active[slot] = self.waiting[key]
            plan.tokens[slot] = n
        admitted = {id(self.active[slot]) for slot in free if slot in self.active}
        self.waiting = [s for s in self.waiting if id(s) not in admitted]
        self.steps += 1
        for slot, n in sorted(plan.tokens.items()):
            seq = self.active[slot]
            if seq.done < seq.prompt_tokens:
                seq.done += n
                if seq.done < seq.prompt_tokens:
                    continue
            self._token(slot, seq, out)
        out.active = len(self.active)
        return out

    def _token(self, slot: int, seq: _Seq, out: Step) -> None:
        seq.generated += 1
        if seq.stream:
            out.deltas.append(Delta(seq.rid, "x", seq.generated))
        if seq.generated >= seq.max_tokens:
            del self.active[slot]
            out.done.append(Done(seq.rid, "length", "x" * seq.generated, seq.prompt_tokens, seq.generated))

    def kv_host(self) -> dict[str, float]:
        return {}

    def hand_out(self) -> Iterator[KVPart]:
        return iter(())

    def take_in(self, got: Received) -> None:
        pass

    def speculation(self) -> list[int]:
        return []  # nothing drafted: nothing is computed

    def scheduling(self) -> tuple[str, int, list[float]]:
        return "off", self.max_batch_tokens, []  # no step costs: nothing is computed

    def close(self) -> None:
        self.active.clear()
