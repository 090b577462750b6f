"""What a step reports for its sequences: detokenised text (stop strings, streaming deltas), logprob
entries, and a finished sequence's result (tool calls parsed from its text)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.protocol.messages import Delta, Done, Step, TokenLogprob, TopLogprob
from llamapool.worker.engine.sequence import Sequence
from llamapool.worker.sampling import Sampling, log_softmax_top
from llamapool.worker.tools import ToolFormat


class Output:
    """Token pieces (cached as tokens are seen), logprob entries and the reports of a step."""

    def __init__(self, vocab: Any, sampling: Sampling, tool_format: ToolFormat):
        self.vocab = vocab
        self.sampling = sampling
        self.tool_format = tool_format
        self._piece = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # token -> its bytes, filled as tokens are seen
        self._described: dict[int, tuple[str, list[int]]] = {}  # token -> (text, bytes) of its logprob records

    def piece(self, tok: int) -> bytes:
        piece = self._pieces.get(tok)
        if piece is None:
            n = L.llama_token_to_piece(self.vocab, tok, self._piece, 256, 0, False)
            piece = self._pieces[tok] = self._piece.raw[: max(n, 0)]
        return piece

    def emit(self, seq: Sequence, tok: int, out: Step) -> str | None:
        """Detokenise the token into the sequence's text and stream it; when a stop string ends the
        sequence, the text still to send is returned (for :meth:`done`), else None."""
        delta = seq.text.push(self.piece(tok))
        if seq.text.stopped:
            return delta
        if delta and seq.stream:
            _stream(out, Delta(seq.rid, delta, seq.generated, sent_logprobs(seq), len(seq.tokens), seq.reused))
        return None

    def described(self, tok: int) -> tuple[str, list[int]]:
        """A token's text and bytes as logprob records carry them (cached as tokens are seen)."""
        d = self._described.get(tok)
        if d is None:
            piece = self.piece(tok)
            d = self._described[tok] = (piece.decode(errors="replace"), list(piece))
        return d

    def logprob_records(self, wants: list[tuple[int, int, int]], block: np.ndarray | None = None,
                        numbers: Numbers | None = None) -> list[TokenLogprob]:
        """The records of tokens ``(output row, token, top_logprobs)`` of the step just decoded, their
        numbers computed for all of them in one pass (``Sampling.logprobs``); from ``block`` (the rows'
        logits, copied) when given; or the ``numbers`` themselves (``(chosen, ids, values)``: those the
        decode graph computed, ``Sampling.graph_logprobs``)."""
        if not wants:
            return []
        rows, toks, tops = zip(*wants, strict=True)
        if numbers is not None:
            chosen, ids, vals = numbers
        else:
            chosen, ids, vals = (self.sampling.logprobs(list(rows), list(toks), max(tops)) if block is None
                                 else log_softmax_top(block, list(toks), max(tops)))
        chosen_l, ids_l, vals_l = np.round(chosen, 6).tolist(), ids.tolist(), np.round(vals, 6).tolist()
        seen, described, new = self._described.get, self.described, tuple.__new__  # tuple.__new__: a fifth of
        records = []  # a named tuple's own time
        for k, (tok, top) in enumerate(zip(toks, tops, strict=True)):
            text, raw = seen(tok) or described(tok)
            alts = []
            for t, v in zip(ids_l[k][:top], vals_l[k][:top], strict=True):
                d = seen(t) or described(t)
                alts.append(new(TopLogprob, (d[0], v, d[1])))
            records.append(new(TokenLogprob, (text, chosen_l[k], raw, alts)))
        return records

    def done(self, seq: Sequence, reason: str, out: Step, delta: str = "") -> None:
        """The sequence's last text and its result (tool calls parsed out of the text) into ``out``."""
        delta += seq.text.finish()
        if delta and seq.stream:
            _stream(out, Delta(seq.rid, delta, seq.generated, sent_logprobs(seq), len(seq.tokens), seq.reused))
        text, calls = seq.text.text, None
        if seq.params.tools and seq.params.tool_choice != "none" and reason != "cancelled":
            content, found = self.tool_format.parse(text, seq.params.tools)
            if found:
                text, calls, reason = content, found, ("tool_calls" if reason == "stop" else reason)
        out.done.append(Done(seq.rid, reason, text, len(seq.tokens), seq.generated, calls, seq.reused,
                             sent_logprobs(seq), stop=seq.text.stop))


PENDING = TokenLogprob("", None, [], [])  # a record to be computed after the next launch (Deferred)
Numbers = tuple[np.ndarray, np.ndarray, np.ndarray]  # rows' logprobs: (chosen, ids, values), as log_softmax_top


@dataclass(eq=False)
class Deferred:
    """A pipelined step's logprob rows, taken off the step's outputs before the next batch is launched
    (the numbers the graph computed for its first rows, then the other rows' logits): their records are
    made after the launch, while the GPU computes (:meth:`resolve`), and put in the places the sequences
    kept for them (a :data:`PENDING` record each, never sent: a sequence that ends first has them
    resolved before its result is made)."""

    rows: np.ndarray | None  # the host rows' logits, (n, n_vocab)
    wants: list[tuple[int, int, int]]  # (output row, token, top_logprobs) of each: the graph's rows first
    seqs: list[Sequence]
    numbers: Numbers | None = None  # the graph's rows' numbers
    places: list[tuple[int, list[TokenLogprob], int]] = field(default_factory=list)  # (k, records, index)
    records: list[TokenLogprob] | None = None
    index: dict[int, int] = field(default_factory=dict)  # sequence id -> its row's place in ``wants``

    def __post_init__(self) -> None:
        self.index = {seq.seq_id: k for k, seq in enumerate(self.seqs)}

    def waits(self, seq: Sequence) -> bool:
        return self.records is None and any(lst is seq.logprobs for _, lst, _ in self.places)

    def place(self, seq: Sequence) -> None:
        """``seq`` took its token: its record goes where its last (pending) one is."""
        k = self.index[seq.seq_id]
        if self.records is not None:
            seq.logprobs[-1] = self.records[k]
        else:
            self.places.append((k, seq.logprobs, len(seq.logprobs) - 1))

    def resolve(self, output: Output) -> None:
        if self.records is None:
            ng = 0 if self.numbers is None else len(self.numbers[0])
            self.records = [*output.logprob_records(self.wants[:ng], numbers=self.numbers),
                            *output.logprob_records(self.wants[ng:], self.rows)]
            for k, lst, i in self.places:
                lst[i] = self.records[k]
            self.places = []


def _stream(out: Step, d: Delta) -> None:
    """Add ``d`` to the step's deltas, joined to the sequence's delta before it (a verified draft's tokens
    are sent as one delta)."""
    last = out.deltas[-1] if out.deltas else None
    if last is None or last.rid != d.rid:
        out.deltas.append(d)
        return
    lps = None if last.logprobs is None and d.logprobs is None else [*(last.logprobs or ()), *(d.logprobs or ())]
    out.deltas[-1] = d._replace(text=last.text + d.text, logprobs=lps)


def sent_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
    """The entries not sent yet (None without logprobs), now taken."""
    if not seq.logprobs:
        return None
    sent, seq.logprobs = seq.logprobs, []
    return sent
