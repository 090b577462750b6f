"""What a step reports for its sequences: detokenised text (stop strings, streaming deltas), logprob
entries, and a finished sequence's result (tool calls parsed from its text)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.protocol.messages import Delta, Done, Step, TokenLogprob, TopLogprob
from llamapool.worker.engine.sequence import Sequence
from llamapool.worker.sampling import Sampling
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
            out.deltas.append(Delta(seq.rid, delta, seq.generated, sent_logprobs(seq), len(seq.tokens), seq.reused))
        return None

    def described(self, tok: int) -> tuple[str, list[int]]:
        """A token's text and bytes as logprob records carry them (cached as tokens are seen)."""
        d = self._described.get(tok)
        if d is None:
            piece = self.piece(tok)
            d = self._described[tok] = (piece.decode(errors="replace"), list(piece))
        return d

    def logprob_records(self, wants: list[tuple[int, int, int]]) -> list[TokenLogprob]:
        """The records of tokens ``(output row, token, top_logprobs)`` of the step just decoded, their
        numbers computed for all of them in one pass (``Sampling.logprobs``)."""
        if not wants:
            return []
        rows, toks, tops = zip(*wants, strict=True)
        chosen, ids, vals = self.sampling.logprobs(list(rows), list(toks), max(tops))
        chosen_l, ids_l, vals_l = np.round(chosen, 6).tolist(), ids.tolist(), np.round(vals, 6).tolist()
        records = []
        for k, (tok, top) in enumerate(zip(toks, tops, strict=True)):
            text, raw = self.described(tok)
            alts = []
            for t, v in zip(ids_l[k][:top], vals_l[k][:top], strict=True):
                t_text, t_raw = self.described(t)
                alts.append(TopLogprob(t_text, v, t_raw))
            records.append(TokenLogprob(text, chosen_l[k], raw, alts))
        return records

    def done(self, seq: Sequence, reason: str, out: Step, delta: str = "") -> None:
        """The sequence's last text and its result (tool calls parsed out of the text) into ``out``."""
        delta += seq.text.finish()
        if delta and seq.stream:
            out.deltas.append(Delta(seq.rid, delta, seq.generated, sent_logprobs(seq), len(seq.tokens), seq.reused))
        text, calls = seq.text.text, None
        if seq.params.tools and seq.params.tool_choice != "none" and reason != "cancelled":
            content, found = self.tool_format.parse(text, seq.params.tools)
            if found:
                text, calls, reason = content, found, ("tool_calls" if reason == "stop" else reason)
        out.done.append(Done(seq.rid, reason, text, len(seq.tokens), seq.generated, calls, seq.reused,
                             sent_logprobs(seq), stop=seq.text.stop))


def sent_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
    """The entries not sent yet (None without logprobs), now taken."""
    if not seq.logprobs:
        return None
    sent, seq.logprobs = seq.logprobs, []
    return sent
