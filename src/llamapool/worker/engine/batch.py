"""The step's ``llama_batch``: numpy-owned arrays, filled in sequence-id order from the step's plan."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.worker.engine.sequence import Sequence


class Batch:
    """A ``llama_batch`` whose arrays are numpy-owned, so filling it is vectorised (``n``: tokens in it)."""

    def __init__(self, capacity: int):
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        raw: Any = L.llama_batch()  # ctypes pointers; llama-cpp-python's stubs type them as arrays
        raw.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        raw.embd = None
        raw.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        raw.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        raw.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        raw.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.raw = raw
        self.n = 0


@dataclass
class Filled:
    """What :func:`fill` put in the batch."""

    outputs: list[Sequence] = field(default_factory=list)  # sequences with output rows, in batch order
    echoing: list[Sequence] = field(default_factory=list)  # sequences with prompt rows (echo's logprobs)
    split: bool = False  # it runs as several micro-batches (``llama_decode`` blocks until the last)
    shape: tuple[int, int, int] = (0, 0, 0)  # (rows, prompt tokens, draft and filler
    # tokens): the cost model's measure
    drafts: int = 0  # draft tokens in it


def fill(b: Batch, chunk: dict[int, int], active: dict[int, Sequence], cached: dict[int, np.ndarray],
         mem: Any, n_ubatch: int, wide: int = 1, pad: int = -1) -> Filled:
    """Fill the batch with the step's tokens (``chunk``: prompt tokens per prefilling sequence id; a
    decoding sequence's entry is its next token, and its draft's tokens after it, each with logits).
    ``wide``: the step's tokens a decoding sequence (spec.width): every decoding sequence and padding
    slot gets as many (llama.cpp splits per-sequence KV streams into micro-batches of equally many
    tokens a sequence), the draft's and filler tokens after its own, the fillers computed and dropped
    (``Sequence.tail``). A fixed few widths keep the batch's shapes few: llama.cpp reuses its graphs.
    Per-sequence KV streams split a batch into micro-batches of consecutive sequence ids, so the batch is
    filled in sequence-id order and a free slot between busy ones gets one padding token (past its cached
    prefix, no output): the step's decode tokens then form one micro-batch. ``pad``: a slot beside a lone
    decoding sequence padded too, its row with logits (deterministic mode: two rows or more a decode step).
    """
    b.n, done = 0, Filled()
    if not chunk:
        return done
    lo, hi = min(chunk), max(chunk)
    if wide == 1 and pad < 0 and hi - lo + 1 == len(chunk) and _decode_only(b, chunk, active, lo, hi, n_ubatch, done):
        return done
    if pad >= 0:
        lo, hi = min(lo, pad), max(hi, pad)
    lens = np.full(hi - lo + 1, wide, dtype=np.int64)
    one_at: list[int] = []  # entries of one token (decode or padding): filled vectorised
    one_tok: list[int] = []
    one_pos: list[int] = []
    chunks: list[tuple[int, Sequence]] = []
    drafting: list[tuple[int, Sequence]] = []  # decoding sequences of a step with drafts: ``wide`` tokens each
    padding: list[tuple[int, int, int]] = []  # (entry, token, position) of a padding slot ``wide`` tokens long
    outputs: list[tuple[int, Sequence]] = []
    for k, sid in enumerate(range(lo, hi + 1)):
        running = active.get(sid)
        if running is None or sid not in chunk:  # a free slot between busy ones: pad it past its cached prefix;
            # or one that waits out the step (deterministic prompts, other adapter sets): past its computed part
            keep = cached.get(sid) if running is None else running.history[: running.n_past]
            n = len(keep) if keep is not None else 0
            L.llama_memory_seq_rm(mem, sid, n, -1)
            if wide > 1:
                padding.append((k, int(keep[-1]) if keep is not None and n else 0, n))
                continue
            one_at.append(k)
            one_tok.append(int(keep[-1]) if keep is not None and n else 0)
            one_pos.append(n)
        elif wide > 1 and not running.prefilling:
            drafting.append((k, running))
            outputs.append((k, running))
        elif not running.prefilling:
            one_at.append(k)
            one_tok.append(running.last)
            one_pos.append(running.n_past)
            running.n_past += 1
            outputs.append((k, running))
        else:  # (deterministic mode computes prompts in fill_apart, which drops such a padding token first)
            lens[k] = chunk[sid]
            chunks.append((k, running))
    start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=start[1:])
    total = int(start[-1])
    b.seq[:total] = np.repeat(np.arange(lo, hi + 1, dtype=np.int32), lens)
    b.logits[:total] = 0
    at = start[one_at]
    b.token[at] = one_tok
    b.pos[at] = one_pos
    for k, seq in chunks:
        if _fill_chunk(b, seq, int(start[k]), int(lens[k]), done):
            outputs.append((k, seq))
    _fill_wide(b, start, wide, padding, drafting)
    outputs.sort(key=lambda e: e[0])
    _mark_outputs(b, start, wide, outputs, {k for k, _ in drafting})
    if pad >= 0:
        b.logits[start[pad - lo]] = 1
    b.n = total
    done.outputs = [seq for _, seq in outputs]
    done.drafts = int(sum(len(seq.draft) for _, seq in drafting))
    wide_rows = len(drafting) + len(padding)
    done.shape = (len(one_at) + len(chunks) + wide_rows, int(sum(lens[k] for k, _ in chunks)),
                  (wide - 1) * wide_rows)
    # more than one micro-batch: a prompt chunk (per-sequence KV splits into equal shares per
    # sequence), or more tokens than one micro-batch holds
    done.split = bool(chunks) or total > n_ubatch
    return done


def _decode_only(b: Batch, chunk: dict[int, int], active: dict[int, Sequence], lo: int, hi: int, n_ubatch: int,
                 done: Filled) -> bool:
    """:func:`fill`'s common step, without numpy's per-call overheads (~40 µs a step, the GPU idle meanwhile):
    a decode token for each of the consecutive slots ``lo..hi``, no prompt, padding or draft. False (nothing
    written) when the step is not that."""
    seqs = []
    for sid in range(lo, hi + 1):
        seq = active.get(sid)
        if seq is None or seq.n_past < len(seq.tokens):
            return False
        seqs.append(seq)
    n = len(seqs)
    if n == 1:
        seq = seqs[0]
        b.token[0], b.pos[0], b.seq[0], b.logits[0] = seq.last, seq.n_past, lo, 1
        seq.n_past += 1
        seq.rows = [0]
    else:
        b.token[:n] = [seq.last for seq in seqs]
        b.pos[:n] = [seq.n_past for seq in seqs]
        b.seq[:n] = range(lo, hi + 1)
        b.logits[:n] = 1
        for k, seq in enumerate(seqs):
            seq.n_past += 1
            seq.rows = [k]
    b.n = n
    done.outputs = seqs
    done.shape = (n, 0, 0)
    done.split = n > n_ubatch
    return True


def fill_apart(b: Batch, chunk: dict[int, int], active: dict[int, Sequence], mem: Any, n_ubatch: int) -> Filled:
    """A prompt step of deterministic mode (``chunk``: prompt tokens per sequence id, no decoding sequence):
    each prompt's chunk a micro-batch of its own. llama.cpp joins consecutive sequence ids, in batch
    order, into a micro-batch of equally many tokens each (``fill``), which would leave the longer
    chunk's rest, perhaps one token, to a micro-batch of its own; in descending id order none joins."""
    b.n = 0
    done = Filled()
    o = 0
    for sid in sorted(chunk, reverse=True):
        seq, n = active[sid], chunk[sid]
        L.llama_memory_seq_rm(mem, sid, seq.n_past, -1)  # a padding token it had (fill)
        b.seq[o : o + n] = sid
        b.logits[o : o + n] = 0
        if _fill_chunk(b, seq, o, n, done):
            seq.rows = [o + n - 1]
            b.logits[o + n - 1] = 1
            done.outputs.append(seq)
        o += n
    b.n = o
    done.shape = (len(chunk), o, 0)
    done.split = len(chunk) > 1 or o > n_ubatch
    return done


def _fill_wide(b: Batch, start: np.ndarray, wide: int, padding: list[tuple[int, int, int]],
               drafting: list[tuple[int, Sequence]]) -> None:
    """The ``wide`` tokens of each padding slot (``(entry, token, position)``) and decoding sequence of a
    step with drafts: a sequence's token, its draft, and filler tokens (``Sequence.tail``) after it."""
    for k, tok, n in padding:
        o = int(start[k])
        b.token[o : o + wide] = tok
        b.pos[o : o + wide] = np.arange(n, n + wide, dtype=np.int32)
    for k, seq in drafting:
        o, p, d = int(start[k]), seq.n_past, seq.draft
        b.token[o] = seq.last
        b.token[o + 1 : o + 1 + len(d)] = d
        b.token[o + 1 + len(d) : o + wide] = seq.last  # filler
        b.pos[o : o + wide] = np.arange(p, p + wide, dtype=np.int32)
        seq.n_past = p + 1 + len(d)
        seq.tail = wide - 1 - len(d)


def _mark_outputs(b: Batch, start: np.ndarray, wide: int, outputs: list[tuple[int, Sequence]],
                  wide_at: set[int]) -> None:
    """Each output sequence's logits rows (``seq.rows``): a prompt's or a one-token entry's last row; a
    wide entry's token and draft, all ``wide`` rows if verified in the graph (one output shape a step)."""
    for k, seq in outputs:
        o = int(start[k])
        if k not in wide_at:
            first, end = int(start[k + 1]) - 1, int(start[k + 1])
        else:
            first, end = o, o + (wide if seq.sampling.in_graph and seq.drafting is not None else 1 + len(seq.draft))
        seq.rows = list(range(first, end))
        b.logits[first:end] = 1


def _fill_chunk(b: Batch, seq: Sequence, o: int, n: int, done: Filled) -> bool:
    """A prompt chunk of ``n`` tokens at batch row ``o``; True when it completes the prompt (an output)."""
    p = seq.n_past
    b.token[o : o + n] = seq.tokens[p : p + n]
    b.pos[o : o + n] = np.arange(p, p + n, dtype=np.int32)
    seq.n_past = p + n
    seq.rows = []
    if seq.params.echo and seq.params.logprobs:  # the prompt's own logprobs: every row an output
        b.logits[o : o + n] = 1
        seq.echo_rows = [(o + i, p + i) for i in range(n) if p + i + 1 < len(seq.tokens)]
        done.echoing.append(seq)
    return seq.n_past == len(seq.tokens)
