"""The embedding engine: a worker of a model with ``embedding = true``.

One llama context with ``embeddings = true``, the model's pooling (or ``model.pooling``) and one
sequence id per slot. Each step takes the inputs waiting (up to the slots and the batch), puts each
in its own sequence of ONE ``llama_batch``, decodes it once and reads every sequence's pooled vector
(``llama_get_embeddings_seq``), L2-normalised as llama-server's default gives it. An input finishes
in the step that computes it: a ``Done`` carrying its vector as float32 bytes. It implements the
``Engine`` protocol of worker/contract.py; the worker's I/O thread refuses generation for it
(worker/tasks.py).

A reranker (``task = "rerank"``: pooling "rank") is the same engine with llama.cpp's rank pooling: each
input is a query-document pair (worker/rerank.py), the pairs of every request waiting share the step's
decode, and a pair's result is its score, the first float of the classification head's output (as
llama-server's ``send_rerank`` reads it), not normalised.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.protocol.messages import Done, ErrorCode, Failed, KVPart, Run, Step
from llamapool.worker.engine import EngineConfig, EngineError, load_model
from llamapool.worker.handover import Received
from llamapool.worker.rerank import PairError, PairFormat
from llamapool.worker.vocab import tokenize

POOLING = {"mean": L.LLAMA_POOLING_TYPE_MEAN, "cls": L.LLAMA_POOLING_TYPE_CLS, "last": L.LLAMA_POOLING_TYPE_LAST,
           "rank": L.LLAMA_POOLING_TYPE_RANK}
POOLING_NAMES = {v: k for k, v in POOLING.items()}


@dataclass(eq=False)
class Input:
    rid: int
    tokens: list[int]


class Embedder:
    """Owns the model and its embedding context; only the engine thread calls ``submit``/``step``."""

    def __init__(self, cfg: EngineConfig, pooling: str = "", log: Callable[[str], None] = print):
        self.cfg = cfg
        self.model, self._tensor_split = load_model(cfg)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_embd = L.llama_model_n_embd(self.model)
        # a pooled sequence cannot be split across micro-batches: a whole input fits one
        self.n_batch = max(cfg.max_batch_tokens, cfg.ctx_per_slot)
        self.ctx = self._context(POOLING.get(pooling, L.LLAMA_POOLING_TYPE_UNSPECIFIED))
        self.pairs = PairFormat(self.model, self.vocab) if pooling == "rank" else None
        # a pair fits a slot and the trained context (a BERT's positions end there)
        self.pair_ctx = min(cfg.ctx_per_slot, L.llama_model_n_ctx_train(self.model))
        if self.pairs is None and L.llama_pooling_type(self.ctx) == L.LLAMA_POOLING_TYPE_RANK:
            L.llama_free(self.ctx)  # a reranker's GGUF listed as an embedding model: its vectors, mean pooled
            self.ctx = self._context(L.LLAMA_POOLING_TYPE_MEAN)
        if L.llama_pooling_type(self.ctx) not in POOLING_NAMES:  # the GGUF has none: mean
            L.llama_free(self.ctx)
            self.ctx = self._context(L.LLAMA_POOLING_TYPE_MEAN)
            log("the GGUF gives no pooling for embeddings: mean pooling (set model.pooling to choose)")
        self.pooling = POOLING_NAMES[L.llama_pooling_type(self.ctx)]
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.waiting: deque[Input] = deque()
        self.active: list[Input] = []  # the inputs of the step running (for heartbeats)
        self.decode_s = self.step_s = 0.0
        self.reused_tokens = 0

    def _context(self, pooling: int) -> Any:
        cfg = self.cfg
        cp = L.llama_context_default_params()
        cp.embeddings = True
        cp.pooling_type = pooling
        cp.n_seq_max = cfg.slots
        # One KV stream for all sequences, as large as one decode: the cache is cleared before each
        # step. (With a stream per sequence, llama.cpp's pooled vectors of a batch of several sequences
        # came out wrong from the fourth on: tests/test_embeddings.py compares them with llama-cpp-python.)
        cp.kv_unified = True
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_batch
        cp.no_perf = True
        # flash attention on GPUs only, as the generation engine (engine/model.py): CPU's rounds K and V to
        # f16, and a reranker's scores then differed from llama.cpp's default by 1e-3
        fa = cfg.flash_attn and cfg.gpu
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_AUTO if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if cfg.threads > 0:
            cp.n_threads = cp.n_threads_batch = cfg.threads
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise EngineError(f"llama.cpp could not create an embedding context of {cp.n_ctx} tokens "
                              f"({cfg.slots} sequences); out of memory?")
        return ctx

    @property
    def desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, buf, 256)
        what = "rerank" if self.pairs is not None else "embeddings"
        return f"{buf.value.decode(errors='replace')} ({what}, {self.pooling} pooling)"

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    @property
    def stalled(self) -> bool:
        return False  # nothing waits for a compile

    def kv_cells(self) -> tuple[int, int]:
        return 0, 0  # nothing is kept between steps

    def kv_host(self) -> dict[str, float]:
        return {}

    def hand_out(self) -> Iterator[KVPart]:
        return iter(())

    def take_in(self, got: Received) -> None:
        pass

    def speculation(self) -> list[int]:
        return []  # no generation

    def scheduling(self) -> tuple[str, int, list[float]]:
        return "off", self.n_batch, []

    def submit(self, run: Run, out: Step) -> None:
        """Queue one input (text or token ids; a reranker's: a document and its query); a bad one fails
        into ``out``."""
        p = run.prompt
        if self.pairs is not None:
            opts = run.options or {}
            try:
                tokens = self.pairs.tokens(str(opts.get("query", "")), p if isinstance(p, str) else "",
                                           int(opts.get("max_tokens_per_doc") or 0), self.pair_ctx)
            except PairError as e:
                out.failed.append(Failed(run.rid, ErrorCode.CONTEXT_LENGTH_EXCEEDED, str(e), e.field))
                return
        elif isinstance(p, str):
            tokens = tokenize(self.vocab, p, add_special=True, parse_special=False)
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            tokens = list(p)  # type: ignore[arg-type]
            bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                out.failed.append(Failed(run.rid, ErrorCode.INVALID_REQUEST,
                                         f"input token id {bad} is out of range (vocab has {self.n_vocab})", "input"))
                return
        else:
            out.failed.append(Failed(run.rid, ErrorCode.INVALID_REQUEST, "an input must be a text or token ids",
                                     "input"))
            return
        if not tokens:
            out.failed.append(Failed(run.rid, ErrorCode.INVALID_REQUEST, "the input has no tokens", "input"))
        elif len(tokens) > self.cfg.ctx_per_slot:
            out.failed.append(Failed(run.rid, ErrorCode.CONTEXT_LENGTH_EXCEEDED, f"input has {len(tokens)} tokens; "
                                     f"the limit is {self.cfg.ctx_per_slot} (model.ctx_per_slot)", "input"))
        else:
            self.waiting.append(Input(run.rid, tokens))

    def abort(self, rid: int, out: Step) -> None:
        for item in [i for i in self.waiting if i.rid == rid]:
            self.waiting.remove(item)
            out.done.append(Done(rid, "cancelled", "", 0, 0))

    def step(self, flush: Callable[[Step], None] | None = None) -> Step:
        """Embed what waits, up to the slots and the batch, with one ``llama_decode``."""
        out = Step()
        start = time.perf_counter()
        take: list[Input] = []
        n = 0
        while self.waiting and len(take) < self.cfg.slots and n + len(self.waiting[0].tokens) <= self.n_batch:
            item = self.waiting.popleft()
            take.append(item)
            n += len(item.tokens)
        if not take:
            return out
        self.active = take
        b = self.batch
        i = 0
        for seq, item in enumerate(take):
            for pos, tok in enumerate(item.tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, 1
                b.seq_id[i][0] = seq
                i += 1
        b.n_tokens = i
        if self.mem:
            L.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        rc = L.llama_decode(self.ctx, b)
        self.decode_s += time.perf_counter() - t0
        for seq, item in enumerate(take):
            ptr = L.llama_get_embeddings_seq(self.ctx, seq) if rc == 0 else None
            if not ptr:
                out.failed.append(Failed(item.rid, ErrorCode.INTERNAL, f"llama_decode failed ({rc}) embedding "
                                         f"{len(take)} inputs of {n} tokens", None))
                continue
            if self.pairs is not None:  # a score (llama-server's embd[0])
                vec = np.array([ptr[0]], dtype=np.float32)
            else:
                vec = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float32)
                norm = float(np.linalg.norm(vec))
                if norm > 0:
                    vec /= norm
            out.done.append(Done(item.rid, "stop", "", len(item.tokens), 0, embedding=vec.astype("<f4").tobytes()))
        self.active = []
        self.step_s += time.perf_counter() - start
        return out

    def close(self) -> None:
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
