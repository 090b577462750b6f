"""A request's state in the engine: waiting for a slot (:class:`Waiting`), then running (:class:`Sequence`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llamapool.protocol.messages import ErrorCode, Run, SamplingParams, TokenLogprob
from llamapool.worker.engine.adapters import BASE, Key
from llamapool.worker.engine.media import MediaSpan
from llamapool.worker.engine.spec import Drafting
from llamapool.worker.sampling import SeqSampling
from llamapool.worker.text import TextStream


@dataclass(eq=False)
class Sequence:
    """One request occupying one llama sequence id (a slot)."""

    rid: int
    seq_id: int
    tokens: np.ndarray  # the prompt, int32
    params: SamplingParams
    stream: bool
    sampling: SeqSampling
    text: TextStream
    n_past: int = 0  # tokens already in the KV cache
    generated: int = 0
    last: int = -1  # last sampled token, fed at the next step
    rows: list[int] = field(default_factory=list)  # batch rows of this sequence's logits in the current step
    arrived: int = 0  # the engine step its request arrived at (prompt chunks: scheduler.priority)
    reused: int = 0  # prompt tokens its KV had from the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # records not yet sent (with ``logprobs``)
    echo_rows: list[tuple[int, int]] = field(default_factory=list)  # echo: (batch row, prompt position) in flight
    fault: str = ""  # tests only: the fault injected into its emit path (worker/faults.py)
    history: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # prompt + output so far, then room
    n_history: int = 0  # tokens in ``history``
    ahead: int = 0  # tokens taken this step and not emitted yet (a stop string may end it before them)
    drafting: Drafting | None = None  # its speculation (None: it does not speculate)
    tail: int = 0  # filler positions written after the step's tokens (a step with drafts: batch.fill)
    adapters: Key = BASE  # its LoRA adapter set (worker/engine/adapters.py): decoded in steps of that set only
    skipped: bool = False  # a step of another adapter set left it out (a padding token may follow its KV)
    media: list[MediaSpan] = field(default_factory=list)  # its prompt's images (media.py), in order

    def generated_token(self, tok: int) -> None:
        """``tok`` is its next output token (the token its next step feeds)."""
        self.generated += 1
        self.last = tok
        if self.n_history < len(self.history):
            self.history[self.n_history] = tok
            self.n_history += 1

    @property
    def draft(self) -> list[int]:
        """The draft tokens of the step in flight (after ``last``)."""
        return self.drafting.draft if self.drafting is not None else []

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.tokens)

    @property
    def out_idx(self) -> int:
        """The batch row of the logits its next token is sampled from (-1: none this step)."""
        return self.rows[0] if self.rows else -1


class ContextLengthExceeded(ValueError):
    """A prompt longer than a slot's context (the message gives the count and the limit)."""

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


@dataclass(eq=False)
class Waiting:
    """A run waiting for a slot, its prompt tokenized on arrival."""

    run: Run
    tokens: np.ndarray
    arrived: int
    grammar: Future[Any] | None = None  # the compiled constraint (a matcher to copy), compiling meanwhile
    checked: bool = False  # its compiled grammar was checked against its budget (Engine._refuse_bad_grammars)
    adapters: Key = BASE  # its LoRA adapter set, resolved on arrival
    media: list[MediaSpan] = field(default_factory=list)  # its prompt's images (media.py)

    @property
    def rid(self) -> int:
        return self.run.rid

    @property
    def ready(self) -> bool:
        """Its constraint (if any) is compiled and was checked: it may take a slot."""
        return self.grammar is None or self.checked
