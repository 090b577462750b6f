"""A draft model, a :class:`~llamapool.worker.engine.spec.Drafter` (``speculative = "draft:<path>"``): a
small model with its model's vocabulary, in the same worker and on the same device, proposes the drafts
of the step's drafting sequences by greedy decoding, all of them together; the step verifies them as any
draft (``speculator.py``'s policy decides which sequences draft and how many tokens, its cost included).

The draft model has its own context, one KV sequence per slot (the model's slot ids). A proposal is
``1 + (n - 1)`` ``llama_decode`` calls for every drafting sequence together: the first holds each
sequence's tokens since its last proposal (catching up: a draft's tokens that were kept stay in its
cache, the others leave it; a sequence that backs off catches up only when it drafts again), the
following ones one token a sequence, the row's argmax each (the graph's greedy pick where the worker
samples in the graph: only the token leaves the device; else the argmax of the one row on the host).
Each call's seconds are measured by the tokens in it (:meth:`DraftModel.seconds` prices a proposal).
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.worker.engine.batch import Batch
from llamapool.worker.engine.model import EngineConfig, EngineError, context_params, load_model
from llamapool.worker.engine.spec import Speculating
from llamapool.worker.graph_samplers import GraphSamplers

PREFIX = "draft:"
SETTLE = 0.8  # a measured call's seconds: the old estimate's weight against the new call's
FIRST_CALLS = 3  # a band's first calls: their least is its estimate (the first builds the graph)
AMORTIZE = 256  # a reply's tokens over which a backlog's catching up is shared, at most


def draft_path(setting: str) -> str:
    """The draft model's path in a ``speculative`` setting ("" when it names none)."""
    return setting[len(PREFIX):] if setting.startswith(PREFIX) else ""


def vocabulary(model: Any) -> tuple[int, list[bytes]]:
    """A model's vocabulary size and every token's piece (control tokens' text included)."""
    vocab = L.llama_model_get_vocab(model)
    n = int(L.llama_vocab_n_tokens(vocab))
    buf = (ctypes.c_char * 256)()
    pieces = []
    for t in range(n):
        k = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        pieces.append(buf.raw[: max(k, 0)])
    return n, pieces


def band(tokens: int) -> int:
    """The band of a call's tokens (1, 2-3, 4-7, ...): its seconds are kept per band."""
    return max(tokens, 1).bit_length()


@dataclass
class _Held:
    """What a slot's KV holds: the sequence (``rid``), its first ``n`` tokens and a draft's ``tail`` after them."""

    rid: int
    n: int
    tail: list[int] = field(default_factory=list)


class DraftModel:
    """The draft model's drafter: its model, context and batch, what each slot's KV holds, and its calls'
    measured seconds."""

    def __init__(self, cfg: EngineConfig, model: Any, graph: bool = False):
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
        # graph: each slot's greedy chain in the decode graph (as the engine's: only the token comes back)
        self._graph = GraphSamplers() if graph else None
        self._chains = [self._graph.greedy() for _ in range(cfg.slots)] if self._graph else []
        if self._chains:
            self._seq_cfg = (L.llama_sampler_seq_config * len(self._chains))(
                *[L.llama_sampler_seq_config(i, ctypes.cast(ch, ctypes.c_void_p)) for i, ch in enumerate(self._chains)])
            cp.samplers = ctypes.cast(self._seq_cfg, ctypes.POINTER(L.llama_sampler_seq_config))
            cp.n_samplers = len(self._chains)
            cp.n_outputs_max_per_seq = 1
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self._free_chains()
            L.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create the draft model's context ({path}); out of memory?")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = mine[0]
        self.batch = Batch(cp.n_batch)
        self._sampled_token = ctypes.PYFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)(
            ("llama_get_sampled_token_ith", L.llama_cpp._lib))
        # before any call is measured, a call costs this share of the model's plain step (weights read)
        self.ratio = float(L.llama_model_size(self.model)) / max(float(L.llama_model_size(model)), 1.0)
        self.held: dict[int, _Held] = {}  # slot -> what its KV holds
        self.timing: dict[int, float] = {}  # band of a call's tokens -> its seconds (moving average)
        self._timed: dict[int, int] = {}  # band -> calls measured
        self.calls = 0  # llama_decode calls made
        self.tokens = 0  # tokens decoded

    # ------------------------------------------------------------ the policy's price

    def seconds(self, seqs: Sequence[Speculating], length: int, plain: float, left: Sequence[int] = ()) -> float:
        """A proposal's expected seconds: drafts of ``length`` tokens for ``seqs`` (one call catching up on
        their tokens since their last proposals, ``length - 1`` calls of a token each), each call at its
        band's measured seconds (unmeasured: the nearest band measured; none yet: ``plain``, the model's
        plain step, times the draft model's share of the weights).

        A backlog (tokens beyond what one proposal's step adds: a new sequence's prompt, a long back-off's
        tokens) is caught up once for every later proposal, so a proposal pays its share of it: ``length +
        1`` of the tokens the sequences' replies have ``left`` (at most ``AMORTIZE`` each; none given: all of
        it). Priced whole, a long prompt's catching up made a first proposal look too dear to make, and the
        sequence never drafted (an H200, 8B target, one stream, an always-right draft: in one of two rounds
        only the first of four requests drafted)."""
        if length <= 0 or not seqs:
            return 0.0
        behind = steady = 0
        for seq in seqs:
            h = self.held.get(seq.seq_id)
            n = seq.n_history - (h.n if h is not None and h.rid == seq.rid else 0) + 1
            behind += n
            steady += min(n, length + 1)
        catch_up = self._call(behind, plain)
        if behind > steady and left:
            share = min(1.0, (length + 1) * len(left) / max(sum(min(x, AMORTIZE) for x in left), 1))
            catch_up = self._call(steady, plain) + share * max(catch_up - self._call(steady, plain), 0.0)
        return catch_up + (length - 1) * self._call(len(seqs), plain)

    def _call(self, tokens: int, plain: float) -> float:
        b = band(tokens)
        s = self.timing.get(b)
        if s is None:
            if not self.timing:
                return plain * self.ratio
            s = self.timing[min(self.timing, key=lambda x: (abs(x - b), -x))]
        return s

    # ------------------------------------------------------------ drafts

    def draft(self, seqs: Sequence[Speculating], lengths: list[int]) -> list[list[int]]:
        """Each sequence's greedy continuation of ``lengths[i]`` tokens (shorter, or none, where a call
        fails): every sequence's catching up in one call, then one call a draft position."""
        drafts: list[list[int]] = [[] for _ in seqs]
        parts: list[tuple[int, np.ndarray, int]] = []
        for seq in seqs:
            size = seq.n_history
            h = self.held.get(seq.seq_id)
            keep = 0
            if h is not None and h.rid == seq.rid:  # what its KV holds of this sequence: the common prefix
                keep = min(h.n, size)
                while keep < size and keep - h.n < len(h.tail) and seq.history[keep] == h.tail[keep - h.n]:
                    keep += 1
            keep = min(keep, size - 1)  # the last token is decoded again: its logits give the first draft
            L.llama_memory_seq_rm(self.mem, seq.seq_id, keep, -1)
            self.held[seq.seq_id] = _Held(seq.rid, keep)  # until the calls succeed
            parts.append((seq.seq_id, seq.history[keep:size], keep))
        first = self._catch_up(parts)
        if first is None:
            return drafts
        going = []
        for i, tok in enumerate(first):
            drafts[i].append(tok)
            if lengths[i] > 1:
                going.append(i)
        while going:
            got = self._step([(seqs[i].seq_id, drafts[i][-1], seqs[i].n_history + len(drafts[i]) - 1) for i in going])
            if got is None:  # the tokens decoded so far may be in the KV: what it holds is unknown past n
                for i in going:
                    drafts[i] = []
                break
            for i, tok in zip(going, got, strict=True):
                drafts[i].append(tok)
            going = [i for i in going if len(drafts[i]) < lengths[i]]
        for seq, d in zip(seqs, drafts, strict=True):
            self.held[seq.seq_id] = _Held(seq.rid, seq.n_history, d[:-1])
        return drafts

    def _catch_up(self, parts: list[tuple[int, np.ndarray, int]]) -> list[int] | None:
        """Every part's tokens (slot, tokens, first position) decoded, a batch at a time; the argmax after
        each part's last one (None: a call failed)."""
        b, cap = self.batch, len(self.batch.token)
        out: list[int] = [-1] * len(parts)
        ends: list[tuple[int, int]] = []  # (part, its last token's row) in the batch being filled
        n = 0
        for i, (sid, toks, pos) in enumerate(parts):
            at = 0
            while at < len(toks):
                take = min(len(toks) - at, cap - n)
                b.token[n : n + take] = toks[at : at + take]
                b.pos[n : n + take] = np.arange(pos + at, pos + at + take, dtype=np.int32)
                b.seq[n : n + take] = sid
                b.logits[n : n + take] = 0
                at += take
                n += take
                if at == len(toks):
                    b.logits[n - 1] = 1
                    ends.append((i, n - 1))
                if n == cap and not (i == len(parts) - 1 and at == len(toks)):
                    if not self._decode(n, ends, out):
                        return None
                    n, ends = 0, []
        if n and not self._decode(n, ends, out):
            return None
        return out

    def _step(self, rows: list[tuple[int, int, int]]) -> list[int] | None:
        """One token a sequence (slot, token, position) decoded; each one's argmax (None: the call failed)."""
        b = self.batch
        n = len(rows)
        for j, (sid, tok, pos) in enumerate(rows):
            b.token[j], b.pos[j], b.seq[j] = tok, pos, sid
        b.logits[:n] = 1
        out = [-1] * n
        return out if self._decode(n, [(j, j) for j in range(n)], out) else None

    def _decode(self, n: int, ends: list[tuple[int, int]], out: list[int]) -> bool:
        """The batch's ``n`` tokens decoded, and ``out[i]`` the argmax of row ``r`` for each ``(i, r)`` in
        ``ends``; its seconds measured (by its tokens)."""
        t0 = time.perf_counter()
        self.batch.raw.n_tokens = n
        if L.llama_decode(self.ctx, self.batch.raw) != 0:
            return False
        for i, r in ends:
            out[i] = self._argmax(r)
        s = time.perf_counter() - t0
        self.calls += 1
        self.tokens += n
        b = band(n)
        was, seen = self.timing.get(b), self._timed.get(b, 0)
        self.timing[b] = s if was is None else min(was, s) if seen < FIRST_CALLS else SETTLE * was + (1 - SETTLE) * s
        self._timed[b] = seen + 1
        return True

    def _argmax(self, row: int) -> int:
        if self._graph is not None:
            return int(self._sampled_token(self.ctx, row))
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def close(self) -> None:
        L.llama_free(self.ctx)
        self._free_chains()
        L.llama_model_free(self.model)

    def _free_chains(self) -> None:
        for ch in self._chains:
            L.llama_sampler_free(ch)
        self._chains = []
        if self._graph is not None:
            self._graph.close()
