"""The engine: one llama context, continuous batching, one ``llama_decode`` per step.

Only the engine thread may call into this module's :class:`Engine` (llama.cpp contexts are not
thread-safe). Each :meth:`Engine.step` puts every decoding sequence's next token and the pending
prompt chunks of prefilling sequences into ONE ``llama_batch`` and decodes it once.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.protocol.messages import Delta, Done, ErrorCode, Failed, Prompt, Run, SamplingParams, Step
from llamapool.protocol.params import ParamError
from llamapool.worker.chat import ChatFormatter, TemplateFileError
from llamapool.worker.constraints import Grammars, spec_of
from llamapool.worker.faults import FaultInjector, request_failure
from llamapool.worker.sampling import Sampling, SeqSampling
from llamapool.worker.scheduler import ArrivalRate, CostModel, PromptWork, StepTarget, plan_step, priority
from llamapool.worker.text import TextStream
from llamapool.worker.vocab import tokenize


class EngineError(Exception):
    """The model or context could not be created; ``permanent`` when retrying cannot help."""

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    slots: int = 8
    ctx_per_slot: int = 2048
    max_batch_tokens: int = 2048  # the per-step token budget: decode tokens + prompt chunks
    target_step: str = "auto"  # how large a step's prompt work is, below the budget (scheduler.StepTarget)
    n_ubatch: int = 512
    prefix_cache: bool = True  # reuse KV of a shared prompt prefix instead of recomputing it
    gpu: bool = False
    threads: int = 0
    flash_attn: bool = True
    gpu_sampling: bool = True  # on a GPU: sample on the device (llama.cpp backend sampling)
    backend_sampling: bool | None = None  # None: as gpu_sampling on a GPU; True forces it (tests)
    kv_unified: bool = False  # one KV stream for all sequences (benchmarks only: slower, see below)
    chat_template: str = ""  # a Jinja2 chat template file, used instead of the GGUF's
    n_gpus: int = 1  # GPUs this process sees (with gpu): more than one splits the layers between them
    tensor_split: tuple[float, ...] = ()  # each GPU's share of the layers; () -> llama.cpp's (by free memory)


def model_params(cfg: EngineConfig) -> tuple[Any, Any]:
    """llama.cpp's model parameters: every layer on the GPU(s), none on CPU workers. Over several GPUs
    (a worker of a GPU group) the layers are split between them (split mode layer, ``tensor_split``
    shares if given). Returns the parameters and the ctypes array they point to (keep it alive)."""
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = -1 if cfg.gpu else 0
    mp.main_gpu = 0
    # On the CPU, llama.cpp's repacked weight layouts (e.g. Q4_K for AVX2) compute a batch of rows with
    # other kernels than one row, so a prompt's greedy text would depend on what runs beside it (seen on
    # an AMD EPYC without AVX-512). Plain layouts keep every row's arithmetic the same, batched or not.
    mp.use_extra_bufts = cfg.gpu
    keep = None
    if cfg.gpu and cfg.n_gpus > 1:
        mp.split_mode = L.LLAMA_SPLIT_MODE_LAYER
        if cfg.tensor_split:
            keep = (ctypes.c_float * max(L.llama_max_devices(), len(cfg.tensor_split)))(*cfg.tensor_split)
            mp.tensor_split = ctypes.cast(keep, ctypes.POINTER(ctypes.c_float))
    else:
        mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
    return mp, keep


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
    out_idx: int = -1  # batch index of this sequence's logits in the current step
    arrived: int = 0  # the engine step its request arrived at (prompt chunks: scheduler.priority)
    reused: int = 0  # prompt tokens its KV had from the prefix cache
    logprobs: list[list[Any]] = field(default_factory=list)  # entries not yet sent (with ``logprobs``)
    echo_rows: list[tuple[int, int]] = field(default_factory=list)  # echo: (batch row, prompt position) in flight
    fault: str = ""  # tests only: the fault injected into its emit path (worker/faults.py)

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.tokens)


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

    @property
    def rid(self) -> int:
        return self.run.rid

    @property
    def ready(self) -> bool:
        """Its constraint (if any) is compiled: it may take a slot."""
        return self.grammar is None or (self.grammar.done() and self.grammar.exception() is None)


class _Batch:
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


def visible_gpus() -> list[str]:
    """The GPU devices llama.cpp sees in this process, as ``name (PCI bus id)`` strings."""

    class Props(ctypes.Structure):
        _fields_ = [
            ("name", ctypes.c_char_p),
            ("description", ctypes.c_char_p),
            ("memory_free", ctypes.c_size_t),
            ("memory_total", ctypes.c_size_t),
            ("type", ctypes.c_int),
            ("device_id", ctypes.c_char_p),
            ("_caps", ctypes.c_byte * 64),
        ]

    lib = L.llama_cpp._lib  # type: ignore[attr-defined]
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get_props.argtypes = [ctypes.c_void_p, ctypes.POINTER(Props)]
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        props = Props()
        lib.ggml_backend_dev_get_props(lib.ggml_backend_dev_get(i), ctypes.byref(props))
        if props.type in (1, 2):  # GGML_BACKEND_DEVICE_TYPE_GPU / IGPU
            desc = (props.description or b"").decode(errors="replace")
            bus = (props.device_id or b"?").decode(errors="replace")
            found.append(f"{desc} ({bus})")
    return found


def quiet_llama_logs() -> None:
    """Keep llama.cpp's warnings and errors (the evidence after a crash), drop its info chatter."""
    from llama_cpp import _logger

    _logger.set_verbose(False)


def load_model(cfg: EngineConfig) -> tuple[Any, Any]:
    """llama.cpp set up (its log through llamapool's logger) and the model loaded, with the ctypes array its
    parameters point to (keep it alive); :class:`EngineError` when the file is missing or unusable."""
    if not os.path.isfile(cfg.model_path):
        raise EngineError(f"model file {cfg.model_path} does not exist")
    from llamapool.worker.llamalog import route_llama_logs

    route_llama_logs()
    L.llama_backend_init()
    mp, keep = model_params(cfg)
    model = L.llama_model_load_from_file(cfg.model_path.encode(), mp)
    if not model:
        raise EngineError(f"llama.cpp could not load model {cfg.model_path} (corrupt or unsupported)")
    return model, keep


class Engine:
    """Owns the model, the context, its KV cache and all sequences."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model, self._tensor_split = load_model(cfg)
        cp = L.llama_context_default_params()
        cp.n_ctx = cfg.slots * cfg.ctx_per_slot
        # A step holds at most the budget plus one padding token per free slot (see _build).
        cp.n_batch = cfg.max_batch_tokens + cfg.slots
        cp.n_ubatch = min(cfg.n_ubatch, cp.n_batch)
        cp.n_seq_max = cfg.slots
        # One KV stream per sequence: attention for a token reads only its own sequence's cells.
        # A unified cache makes every token attend over (masked) cells of all sequences, so a
        # step costs B x total context: 2.8x slower at 64 sequences of 1,024 tokens on an H200.
        cp.kv_unified = cfg.kv_unified
        # A sliding-window model (Gemma 3: llama.cpp's iSWA cache) keeps every position of the window
        # layers too, so a prefix trimmed with seq_rm or copied with seq_cp is exact; a window-sized
        # cache drops positions that a reused prefix still needs (tests/test_real_model.py).
        cp.swa_full = True
        cp.no_perf = True
        # Flash attention on GPUs only: llama.cpp's CPU flash attention computes a sequence's row otherwise
        # when other sequences share the batch, so a prompt's greedy text would depend on its neighbours.
        cp.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_AUTO if cfg.flash_attn and cfg.gpu else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        if cfg.threads > 0:
            cp.n_threads = cp.n_threads_batch = cfg.threads
        # Backend sampling: each sequence id carries a sampler chain that runs inside the decode
        # graph on the GPU, so the host picks no token for those rows (worker/sampling.py).
        self.gpu_sampling = (cfg.gpu and cfg.gpu_sampling) if cfg.backend_sampling is None \
            else cfg.backend_sampling
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.sampling = Sampling(cfg.slots, self.n_vocab, self.gpu_sampling, cfg.ctx_per_slot)
        self.sampling.context_params(cp)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise EngineError(
                f"llama.cpp could not create a context of {cp.n_ctx} tokens "
                f"({cfg.slots} slots x {cfg.ctx_per_slot}); out of memory?"
            )
        self.sampling.bind(self.ctx)
        self.max_piece = self._max_piece_bytes()
        try:
            self.chat = ChatFormatter.load(self.model, self.vocab, cfg.chat_template)
        except TemplateFileError as e:
            raise EngineError(str(e)) from None
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = _Batch(cp.n_batch)
        self.free_ids: deque[int] = deque(range(cfg.slots))
        self.waiting: list[Waiting] = []  # runs beyond the free slots, in arrival order
        self.active: dict[int, Sequence] = {}
        self._piece = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # token -> its bytes, filled as tokens are seen
        self._eog = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        self.grammars = Grammars(self.vocab, self.n_vocab, self._eog)
        self.inflight: list[Sequence] = []  # sequences with an output in the batch in flight
        self._echoing: list[Sequence] = []  # sequences with prompt rows (echo's logprobs) in the batch in flight
        self.cached: dict[int, np.ndarray] = {}  # free seq id -> prompt tokens its KV still holds
        self.reused_tokens = 0
        self.copied_streams = 0  # prefix shares that copied a KV stream buffer
        self._split = False  # the batch being built runs as several micro-batches
        self.steps = 0
        self.target = StepTarget.parse(cfg.target_step)
        self.budget = cfg.max_batch_tokens  # the last step's token budget
        self.arrivals = ArrivalRate()  # prompt tokens a second, lately (a step-time target uses it)
        self.cost = CostModel()  # fitted from the steps' times (a step-time target uses it)
        self._measure: tuple[int, int, float] | None = None  # (rows, prompt tokens, start) of the last batch
        self._shape = (0, 0)  # (rows, prompt tokens) of the batch being built
        # LLAMAPOOL_STEP_TRACE=PREFIX: each step's rows, prompt tokens, seconds and budget to PREFIX.<pid>
        trace = os.environ.get("LLAMAPOOL_STEP_TRACE")
        self._trace = open(f"{trace}.{os.getpid()}", "w", buffering=1) if trace else None  # line by line
        self.decode_s = 0.0  # time inside llama_decode (+ sampling on the GPU)
        self.faults = FaultInjector.from_env()  # tests only (LLAMAPOOL_INJECT_FAULT); None otherwise
        self.step_s = 0.0  # whole steps, Python work included

    @property
    def desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, buf, 256)
        return buf.value.decode(errors="replace")

    def kv_cells(self) -> tuple[int, int]:
        """(used, total) KV cells: running sequences' computed tokens and kept prefixes. Read from the
        I/O thread for heartbeats, so it copies the engine thread's dicts first (a racy but safe read)."""
        try:
            used = sum(s.n_past for s in list(self.active.values()))
            used += sum(len(t) for t in list(self.cached.values()))
        except RuntimeError:  # a dict changed size while copied: report next time
            used = 0
        return used, self.cfg.slots * self.cfg.ctx_per_slot

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def scheduling(self) -> tuple[str, int, list[float]]:
        return str(self.target), self.budget, list(self.cost.coef or ())

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
        L.llama_synchronize(self.ctx)
        for seq in list(self.active.values()):
            self._release(seq)
        self.grammars.close()
        self.sampling.close()
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    # ------------------------------------------------------------ requests in and out

    def _max_piece_bytes(self) -> int:
        """An upper bound on the bytes one token stands for (its vocabulary text is at least as long),
        so that a prompt far over the context is refused without tokenizing it (megabytes take
        seconds, on the engine thread)."""
        longest = 1
        for t in range(self.n_vocab):
            text = L.llama_vocab_get_text(self.vocab, t)
            if text and len(text) > longest:
                longest = len(text)
        return longest

    def _surely_too_long(self, n_bytes: int) -> bool:
        """``n_bytes`` of text make at least ``n_bytes / max_piece`` tokens: over the limit?"""
        return n_bytes // self.max_piece >= self.cfg.ctx_per_slot

    def tokenize(self, text: str) -> list[int]:
        """A text prompt's tokens: BOS added as the model wants, special-token text read as text."""
        return tokenize(self.vocab, text, add_special=True, parse_special=False)

    def submit(self, run: Run, out: Step) -> None:
        """Queue a run (it takes a slot at a coming step); a prompt that cannot run fails into ``out``,
        the report being built (the interface is shared with the echo engine)."""
        chat = isinstance(run.prompt, list) and bool(run.prompt) and isinstance(run.prompt[0], dict)
        try:
            if run.params.tools and not chat:
                raise ParamError("tools", "'tools' need a chat prompt (messages), not a text or token prompt")
            if run.params.n > self.cfg.slots:
                raise ParamError("n", f"'n' is {run.params.n}; a worker of this model has {self.cfg.slots} slots "
                                      f"(workers.slots), and a prompt's choices run on one worker")
            spec = spec_of(run.params, self.chat.tool_format)
            self.sampling.check(run.params)
            tokens = self._prompt_tokens(run.prompt, run.params.tools)
        except ParamError as e:
            out.failed.append(Failed(run.rid, ErrorCode.INVALID_REQUEST, e.message, e.field))
            return
        except ValueError as e:  # a ChatError carries its own code (no_chat_template)
            out.failed.append(Failed(run.rid, getattr(e, "code", ErrorCode.INVALID_REQUEST), str(e),
                                     "messages" if chat else "prompt"))
            return
        except Exception as e:  # a bug meeting this request: it fails, not the worker
            out.failed.append(request_failure(run.rid, e))
            return
        # converted once: planning, admission, prefill, cache; a grammar compiles meanwhile
        grammar = None if spec is None else self.grammars.compile(spec)
        self.waiting.append(Waiting(run, np.asarray(tokens, dtype=np.int32), self.steps, grammar))
        self.arrivals.add(len(tokens))

    def abort(self, rid: int, out: Step) -> None:
        for w in self.waiting:
            if w.rid == rid:
                self.waiting.remove(w)
                out.done.append(Done(rid, "cancelled", "", 0, 0))
                return
        seq = self._find(rid)
        if seq is not None:
            self._finish(seq, "cancelled", out)

    def abort_all(self, out: Step) -> None:
        for w in list(self.waiting):
            self.abort(w.rid, out)
        for seq in list(self.active.values()):
            self._finish(seq, "cancelled", out)

    def _find(self, rid: int) -> Sequence | None:
        for seq in self.active.values():
            if seq.rid == rid:
                return seq
        return None

    def _admit(self, w: Waiting, out: Step) -> Sequence | None:
        """Give the waiting run a slot (None when llama.cpp will not build its sampler: it fails into ``out``)."""
        run, prompt = w.run, w.tokens
        p = run.params
        prompt_logprobs = p.echo and p.logprobs
        seq_id, reused = self._take_slot(prompt, reuse=not prompt_logprobs)  # a prompt's logprobs: all computed
        try:
            matcher = None if w.grammar is None else w.grammar.result().deep_copy()
            sampling = self.sampling.admit(seq_id, p, matcher)
        except Exception as e:  # a sampler llama.cpp will not build: this request fails, not the worker
            self.free_ids.appendleft(seq_id)
            self.cached.pop(seq_id, None)
            L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
            out.failed.append(Failed(run.rid, ErrorCode.INTERNAL, f"cannot build the sampler: {e!r}", None))
            return None
        seq = self.active[seq_id] = Sequence(
            rid=run.rid, seq_id=seq_id, tokens=prompt, params=p, stream=run.stream,
            sampling=sampling, text=self._text_stream(p), n_past=reused, arrived=w.arrived, reused=reused,
            fault=self.faults.kind(run.prompt) if self.faults is not None else "",
        )
        self.reused_tokens += reused
        if p.echo:  # a text prompt as it was given; token ids (and a rendered chat) as their pieces
            seq.text.preface(run.prompt if isinstance(run.prompt, str) else
                             b"".join(self._piece_of(int(t)) for t in prompt).decode(errors="replace"))
        if prompt_logprobs:  # the first prompt token has no logprob
            piece = self._piece_of(int(prompt[0]))
            seq.logprobs.append([piece.decode(errors="replace"), None, list(piece), []])
        return seq

    def _take_slot(self, want: np.ndarray, reuse: bool = True) -> tuple[int, int]:
        """A free sequence id for the prompt ``want`` and how many of its leading tokens are already in KV.

        The KV of every active sequence's computed prompt, and of recently finished sequences
        kept in free slots, is searched for the longest common prefix. A prefix kept in a free
        slot is used in place; one held by an active sequence (in another KV stream) is shared
        by copying that stream into the new slot's (``llama_memory_seq_cp`` copies the whole
        stream buffer at the next decode, on the device) and trimming the copy to the prefix.
        At least the last prompt token is always computed, for its logits.
        """
        src, best = -1, 0
        if self.cfg.prefix_cache and reuse:
            in_kv = list(self.cached.items())
            in_kv += [(s.seq_id, s.tokens[: s.n_past]) for s in self.active.values() if s.n_past]
            for sid, have in in_kv:
                n = min(len(have), len(want) - 1)
                if n <= best:
                    continue
                diff = np.flatnonzero(have[:n] != want[:n])
                common = int(diff[0]) if diff.size else n
                if common > best:
                    src, best = sid, common
        if best and src in self.free_ids:
            seq_id = src
            self.free_ids.remove(seq_id)
        else:
            # the free slot whose cached prefix is least worth keeping, lowest id first
            seq_id = min(self.free_ids, key=lambda i: (len(self.cached.get(i, ())), i))
            self.free_ids.remove(seq_id)
            L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
            if best:
                L.llama_memory_seq_cp(self.mem, src, seq_id, -1, -1)
                self.copied_streams += 1
        if best:
            L.llama_memory_seq_rm(self.mem, seq_id, best, -1)
        self.cached.pop(seq_id, None)
        return seq_id, best

    def _prompt_tokens(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]:
        text_bytes = 0
        for part in [prompt] if isinstance(prompt, str) else prompt:
            content = part.get("content") if isinstance(part, dict) else part
            if isinstance(content, str):
                text_bytes += len(content.encode())
        if self._surely_too_long(text_bytes):
            raise ContextLengthExceeded(
                f"prompt is {text_bytes} bytes of text, at least {text_bytes // self.max_piece} tokens; the limit is "
                f"{self.cfg.ctx_per_slot - 1} (model.ctx_per_slot)"
            )
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt)
        elif prompt and isinstance(prompt[0], dict):  # chat messages
            tokens = self.chat.tokens(prompt, tools)  # type: ignore[arg-type]
        else:
            tokens = list(prompt)  # type: ignore[arg-type]
        if not tokens:
            raise ValueError("prompt tokenizes to nothing")
        bad = next((t for t in tokens if t >= self.n_vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range (vocab has {self.n_vocab})")
        if len(tokens) >= self.cfg.ctx_per_slot:
            raise ContextLengthExceeded(
                f"prompt has {len(tokens)} tokens; the limit is {self.cfg.ctx_per_slot - 1} "
                f"(model.ctx_per_slot)"
            )
        return tokens

    def _text_stream(self, p: SamplingParams) -> TextStream:
        """The sequence's text: stop strings held back, and a tool call's opening (``auto``: prose
        streams until it; ``required`` or a named function: the whole reply is calls)."""
        if not p.tools or p.tool_choice == "none":
            return TextStream(p.stop)
        text = TextStream(p.stop, self.chat.tool_format.trigger)
        if p.tool_choice not in (None, "auto"):
            text.mark_here()
        return text

    # ------------------------------------------------------------ one step

    def step(self, flush: Callable[[Step], None] | None = None) -> Step:
        """Admit waiting runs, decode one batch, sample, and report what happened.

        With GPU sampling the step is pipelined: the tokens of the batch in flight are read, the
        next batch is launched at once (``llama_decode`` returns before the GPU is done), and
        only then is the text of the tokens just read worked out, while the GPU computes. A
        sequence that a stop string ends meanwhile has one token computed in vain, never sent.

        A batch with prompt chunks is several micro-batches, and ``llama_decode`` returns only
        when all but the last have run (each waits for the one before to copy its inputs). So
        before launching such a batch, the text of the tokens just read is worked out and handed
        to ``flush`` (the worker sends it at once): otherwise every client would wait a whole
        prefill step longer for tokens that are ready.
        """
        out = Step()
        t_step = time.perf_counter()
        if self.gpu_sampling:
            ready = self._collect(out)
            order = self._build(out)
            blocking = flush is not None and self._split  # several micro-batches: decode blocks
            if blocking:
                self._emit_ready(ready, out)
                out.active = len(self.active)
                assert flush is not None
                flush(out)
                out = Step()
            if self.batch.n:
                self._launch(order, out)
            if not blocking:
                self._emit_ready(ready, out)
        else:
            order = self._build(out)
            if self.batch.n and self._launch(order, out):
                self._echo_logprobs(out)
                self._emit_ready(self._take_all(order, out), out)
        out.active = len(self.active)
        self.step_s += time.perf_counter() - t_step
        return out

    def _emit_ready(self, ready: list[tuple[Sequence, int]], out: Step) -> None:
        for seq, tok in ready:
            if self.active.get(seq.seq_id) is seq:
                try:
                    self._emit(seq, tok, out)
                except Exception as e:
                    self._drop(seq, e, out)

    def _drop(self, seq: Sequence, e: Exception, out: Step) -> None:
        """The sequence's own work raised ``e``: it alone ends (``internal``); the engine and the other
        sequences go on (worker/faults.py)."""
        out.failed.append(request_failure(seq.rid, e))
        if self.active.get(seq.seq_id) is seq:
            self._release(seq)

    def _plan(self, out: Step) -> dict[int, int]:
        """This step's tokens per sequence id (``scheduler.plan_step``), waiting runs admitted as planned."""
        now = self.steps
        self._refuse_bad_grammars(out)
        prompts = [PromptWork(s.seq_id, len(s.tokens) - s.n_past, s.arrived)
                   for s in self.active.values() if s.prefilling]
        prompts += [PromptWork(i, len(w.tokens), w.arrived, running=False)
                    for i, w in enumerate(self.waiting) if self._may_start(w)]
        ahead, free = [], len(self.free_ids)  # what could run this step, first in line first
        for p in sorted(prompts, key=lambda p: priority(p, now)):
            if p.running or free > 0:
                ahead.append(p)
                free -= not p.running
        budget = self.cost.step_budget(self.target, len(self.active), self.cfg.max_batch_tokens,
                                       [p.remaining for p in ahead], self.arrivals.rate())
        plan = plan_step(budget, (s.seq_id for s in self.active.values() if not s.prefilling), prompts,
                         len(self.free_ids), now)
        chunk = plan.tokens
        admitted = [(self.waiting[key], n) for key, n in plan.admit]
        for w, n in admitted:
            self.waiting.remove(w)
            seq = self._admit(w, out)
            if seq is not None:
                chunk[seq.seq_id] = min(n, len(seq.tokens) - seq.n_past)
        self.budget = budget
        return chunk

    def _may_start(self, w: Waiting) -> bool:
        """Its grammar is compiled; and a prompt's second and later choices (``n``) wait until the first
        one's prompt is computed, so that they copy its KV (``_take_slot``) rather than compute it again."""
        if not w.ready:
            return False
        if w.run.after < 0:
            return True
        if any(x.rid == w.run.after for x in self.waiting):
            return False
        first = self._find(w.run.after)
        return first is None or not first.prefilling

    def _refuse_bad_grammars(self, out: Step) -> None:
        """Waiting runs whose grammar did not compile fail (before they take a slot), naming the parameter."""
        for w in [w for w in self.waiting if w.grammar is not None and w.grammar.done()
                  and w.grammar.exception() is not None]:
            self.waiting.remove(w)
            e = w.grammar.exception() if w.grammar is not None else None
            field = e.field if isinstance(e, ParamError) else None
            out.failed.append(Failed(w.rid, ErrorCode.INVALID_REQUEST, str(e), field))

    def _build(self, out: Step) -> list[Sequence]:
        """Schedule this step's tokens and fill the batch; return the sequences with an output.

        The step's tokens are planned by ``scheduler.plan_step`` (see ``_plan``). With
        per-sequence KV streams llama.cpp splits a batch
        into micro-batches of consecutive sequence ids, so the batch is filled in sequence-id
        order and a free slot between busy ones gets one padding token (written past its
        cached prefix, no output): the decode tokens of the step then form one micro-batch.
        """
        chunk = self._plan(out)
        b = self.batch
        b.n = 0
        self._echoing = []
        self._split = False
        if not chunk:
            return []
        lo, hi = min(chunk), max(chunk)
        lens = np.ones(hi - lo + 1, dtype=np.int64)
        one_at: list[int] = []  # entries of one token (decode or padding): filled vectorised
        one_tok: list[int] = []
        one_pos: list[int] = []
        chunks: list[tuple[int, Sequence]] = []
        outputs: list[tuple[int, Sequence]] = []
        for k, sid in enumerate(range(lo, hi + 1)):
            running = self.active.get(sid)
            if running is None:  # a free slot between busy ones: pad it past its cached prefix
                keep = self.cached.get(sid)
                n = len(keep) if keep is not None else 0
                L.llama_memory_seq_rm(self.mem, sid, n, -1)
                one_at.append(k)
                one_tok.append(int(keep[-1]) if keep is not None and n else 0)
                one_pos.append(n)
            elif not running.prefilling:
                one_at.append(k)
                one_tok.append(running.last)
                one_pos.append(running.n_past)
                running.n_past += 1
                outputs.append((k, running))
            else:
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
            o, n, p = int(start[k]), int(lens[k]), seq.n_past
            b.token[o : o + n] = seq.tokens[p : p + n]
            b.pos[o : o + n] = np.arange(p, p + n, dtype=np.int32)
            seq.n_past = p + n
            seq.out_idx = -1
            if seq.params.echo and seq.params.logprobs:  # the prompt's own logprobs: every row an output
                b.logits[o : o + n] = 1
                seq.echo_rows = [(o + i, p + i) for i in range(n) if p + i + 1 < len(seq.tokens)]
                self._echoing.append(seq)
            if seq.n_past == len(seq.tokens):
                outputs.append((k, seq))
        outputs.sort(key=lambda e: e[0])
        for k, seq in outputs:
            seq.out_idx = int(start[k + 1]) - 1
            b.logits[seq.out_idx] = 1
        b.n = total
        self._shape = (len(one_at) + len(chunks), int(sum(lens[k] for k, _ in chunks)))
        # more than one micro-batch: a sequence with several tokens (per-sequence KV splits
        # into equal shares per sequence), or more tokens than one micro-batch holds
        self._split = bool(chunks) or total > self.cfg.n_ubatch
        return [seq for _, seq in outputs]

    def _launch(self, order: list[Sequence], out: Step) -> bool:
        """Start decoding the batch; on failure every active sequence fails with the reason."""
        b = self.batch
        b.raw.n_tokens = b.n
        t0 = time.perf_counter()
        self._time_step(t0)
        rc = L.llama_decode(self.ctx, b.raw)
        self.decode_s += time.perf_counter() - t0
        self.steps += 1
        if rc != 0:
            self.inflight = []
            for seq in list(self.active.values()):
                out.failed.append(Failed(seq.rid, ErrorCode.INTERNAL, f"llama_decode returned {rc}", None))
                self._release(seq)
            return False
        self.inflight = order
        return True

    def _time_step(self, now: float) -> None:
        """Feed the cost model: the batch launched before this one took until now (launches follow each
        other while the engine is busy: with GPU sampling the host works while the GPU computes)."""
        last, self._measure = self._measure, (self._shape[0], self._shape[1], now)
        if last is None:
            return
        rows, tokens, start = last
        seconds = now - start
        coef = self.cost.coef
        expected = coef[0] + coef[1] * rows + coef[2] * tokens if coef else 0.5
        if seconds < 4 * expected + 0.005:  # longer: the engine was idle in between, not computing
            self.cost.observe(rows, tokens, seconds)
        if self._trace is not None:
            self._trace.write(f"{rows} {tokens} {seconds:.6f} {self.budget}\n")

    def _collect(self, out: Step) -> list[tuple[Sequence, int]]:
        """Wait for the batch in flight and take its tokens (sequences ended meanwhile are skipped)."""
        if not self.inflight:
            return []
        t0 = time.perf_counter()
        L.llama_synchronize(self.ctx)
        self.decode_s += time.perf_counter() - t0
        self._echo_logprobs(out)
        ready = self._take_all([seq for seq in self.inflight if self.active.get(seq.seq_id) is seq], out)
        self.inflight = []
        return ready

    def _echo_logprobs(self, out: Step) -> None:
        """The logprobs of the prompt tokens computed in the batch just decoded (``echo`` with ``logprobs``):
        the row of position ``i`` gives prompt token ``i + 1``'s."""
        for seq in self._echoing:
            if self.active.get(seq.seq_id) is not seq:
                continue
            try:
                for row, pos in seq.echo_rows:
                    seq.logprobs.append(self._logprob_entry(seq, int(seq.tokens[pos + 1]), row))
            except Exception as e:
                self._drop(seq, e, out)
            seq.echo_rows = []
        self._echoing = []

    def _take_all(self, order: list[Sequence], out: Step) -> list[tuple[Sequence, int]]:
        """Every output row's token (its mask ready first, if constrained); then the next masks are
        filled in the background while the engine goes on."""
        self.sampling.prepare([(seq.sampling, seq.out_idx) for seq in order])
        ready = []
        for seq in order:
            try:
                tok = self._take(seq, out)
            except Exception as e:
                self._drop(seq, e, out)
                continue
            if tok is not None:
                ready.append((seq, tok))
        self.sampling.masks_next()
        return ready

    def _take(self, seq: Sequence, out: Step) -> int | None:
        """The sequence's new token, or None when it ended (end of generation, length)."""
        tok = self.sampling.pick(seq.sampling, seq.out_idx)
        p = seq.params
        matcher = seq.sampling.matcher
        if (not p.ignore_eos or matcher is not None) and tok in self._eog:
            self._finish(seq, "stop", out)
            return None
        if p.logprobs:
            seq.logprobs.append(self._logprob_entry(seq, tok))
        seq.generated += 1
        seq.last = tok
        if tok in self.chat.tool_format.special.values() and p.tools:
            seq.text.mark_here()  # a call opens with a control token (no text)
        if matcher is not None and matcher.is_stopped():  # the grammar is complete
            self._finish(seq, "stop", out, seq.text.push(self._piece_of(tok)))
            return None
        if seq.generated >= p.max_tokens or seq.n_past + 1 >= self.cfg.ctx_per_slot:
            self._finish(seq, "length", out, seq.text.push(self._piece_of(tok)))
            return None
        return tok

    def _emit(self, seq: Sequence, tok: int, out: Step) -> None:
        """Detokenise the token into the sequence's text; a stop string ends the sequence."""
        if seq.fault:
            FaultInjector.trigger(seq.fault)
        delta = seq.text.push(self._piece_of(tok))
        if seq.text.stopped:
            self._finish(seq, "stop", out, delta)
        elif delta and seq.stream:
            out.deltas.append(Delta(seq.rid, delta, seq.generated, self._sent_logprobs(seq)))

    def _logprob_entry(self, seq: Sequence, tok: int, row: int = -1) -> list[Any]:
        """A token's logprob entry as the wire carries it: ``[text, logprob, bytes, top]``, ``top`` a list
        of ``[text, logprob, bytes]`` (protocol.md, 5.1); from output ``row`` (default: the sequence's)."""
        lp, top = self.sampling.logprobs(seq.out_idx if row < 0 else row, tok, seq.params.top_logprobs)

        def described(t: int, v: float) -> list[Any]:
            piece = self._piece_of(t)
            return [piece.decode(errors="replace"), round(v, 6), list(piece)]

        return [*described(tok, lp), [described(t, v) for t, v in top]]

    @staticmethod
    def _sent_logprobs(seq: Sequence) -> list[list[Any]] | None:
        """The entries not sent yet (None without logprobs), now taken."""
        if not seq.logprobs:
            return None
        sent, seq.logprobs = seq.logprobs, []
        return sent

    def _piece_of(self, tok: int) -> bytes:
        piece = self._pieces.get(tok)
        if piece is None:
            n = L.llama_token_to_piece(self.vocab, tok, self._piece, 256, 0, False)
            piece = self._pieces[tok] = self._piece.raw[: max(n, 0)]
        return piece

    def _finish(self, seq: Sequence, reason: str, out: Step, delta: str = "") -> None:
        delta += seq.text.finish()
        if delta and seq.stream:
            out.deltas.append(Delta(seq.rid, delta, seq.generated, self._sent_logprobs(seq)))
        text, calls = seq.text.text, None
        if seq.params.tools and seq.params.tool_choice != "none" and reason != "cancelled":
            content, found = self.chat.tool_format.parse(text, seq.params.tools)
            if found:
                text, calls, reason = content, found, ("tool_calls" if reason == "stop" else reason)
        out.done.append(Done(seq.rid, reason, text, len(seq.tokens), seq.generated, calls, seq.reused,
                             self._sent_logprobs(seq), stop=seq.text.stop))
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.sampling.release(seq.sampling)
        if self.cfg.prefix_cache and seq.n_past:  # keep its prompt's KV for a later request
            self.cached[seq.seq_id] = seq.tokens[: seq.n_past]
        else:
            L.llama_memory_seq_rm(self.mem, seq.seq_id, -1, -1)
        del self.active[seq.seq_id]
        self.free_ids.append(seq.seq_id)
