"""A draft model, a :class:`~llamapool.worker.engine.spec.Proposer` (``speculative = "draft:<path>"``): a
small model with its model's vocabulary, in the same worker and on the same device, proposes each
sequence's draft by greedy decoding; the step verifies it as any draft (``speculator.py``'s policy
decides how many of its tokens a step carries).

The draft model has its own context, one KV sequence per slot (the model's slot ids): before a proposal
the sequence's tokens since the last one are decoded into it (a draft's tokens that were kept stay, the
others leave its cache), then one token at a time, each the argmax of the last one's logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.worker.engine.batch import Batch
from llamapool.worker.engine.model import EngineConfig, EngineError, context_params, load_model
from llamapool.worker.engine.ngram import MATCH_MAX
from llamapool.worker.engine.spec import Speculating

PREFIX = "draft:"


def draft_path(setting: str) -> str:
    """The draft model's path in a ``speculative`` setting ("" when it names none)."""
    return setting[len(PREFIX):] if setting.startswith(PREFIX) else ""


def vocabulary(model: Any) -> tuple[int, list[bytes]]:
    """A model's vocabulary size and every token's piece (control tokens' text included)."""
    vocab = L.llama_model_get_vocab(model)
    n = int(L.llama_vocab_n_tokens(vocab))
    buf = ctypes_buffer(256)
    pieces = []
    for t in range(n):
        k = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        pieces.append(bytes(buf[: max(k, 0)]))
    return n, pieces


def ctypes_buffer(n: int) -> Any:
    import ctypes

    return (ctypes.c_char * n)()


class DraftModel:
    """The draft model's proposer: its model, context and batch, and what each slot's KV holds."""

    def __init__(self, cfg: EngineConfig, model: Any):
        path = draft_path(cfg.speculative)
        dcfg = dataclasses.replace(cfg, model_path=path)
        self.model, self._keep = load_model(dcfg)
        mine, theirs = vocabulary(self.model), vocabulary(model)
        if mine != theirs:
            L.llama_model_free(self.model)
            what = f"{mine[0]} tokens against {theirs[0]}" if mine[0] != theirs[0] else \
                f"token {next(i for i, (a, b) in enumerate(zip(mine[1], theirs[1], strict=True)) if a != b)} differs"
            raise EngineError(f"speculative: the draft model {path} does not share the vocabulary of the model "
                              f"{cfg.model_path} ({what}); a draft model must have its model's vocabulary")
        cp = context_params(dcfg)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create the draft model's context ({path}); out of memory?")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = mine[0]
        self.batch = Batch(cp.n_batch)
        self.held: dict[int, tuple[int, np.ndarray]] = {}  # slot -> (rid, the tokens its KV holds)

    def propose(self, seq: Speculating, k: int) -> tuple[list[int], int]:
        sid = seq.seq_id
        toks = seq.history[: seq.n_history]
        rid, held = self.held.get(sid, (-1, np.zeros(0, np.int32)))
        keep = 0
        if rid == seq.rid:  # what it holds of this sequence: the common prefix
            n = min(len(held), len(toks))
            diff = np.flatnonzero(held[:n] != toks[:n])
            keep = int(diff[0]) if diff.size else n
        keep = min(keep, len(toks) - 1)  # the last token is decoded again: its logits give the first draft
        L.llama_memory_seq_rm(self.mem, sid, keep, -1)
        draft: list[int] = []
        tok = self._decode(sid, toks[keep:], keep)
        pos = len(toks)
        while tok >= 0 and len(draft) < k:
            draft.append(tok)
            if len(draft) == k:
                break
            tok = self._decode(sid, np.array([tok], np.int32), pos)
            pos += 1
        self.held[sid] = (seq.rid, np.concatenate([toks, np.array(draft[:-1], np.int32)]))
        return draft, MATCH_MAX

    def _decode(self, sid: int, toks: np.ndarray, pos: int) -> int:
        """``toks`` decoded at ``pos`` in slot ``sid`` (a batch at a time); the argmax of the last one's
        logits (-1: failed)."""
        b, cap = self.batch, len(self.batch.token)
        for at in range(0, len(toks), cap):
            part = toks[at : at + cap]
            n = len(part)
            b.token[:n] = part
            b.pos[:n] = np.arange(pos + at, pos + at + n, dtype=np.int32)
            b.seq[:n] = sid
            b.logits[:n] = 0
            b.logits[n - 1] = 1
            b.raw.n_tokens = n
            if L.llama_decode(self.ctx, b.raw) != 0:
                return -1
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, n - 1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def prepare(self, seq: Speculating) -> None:
        pass

    def close(self) -> None:
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
