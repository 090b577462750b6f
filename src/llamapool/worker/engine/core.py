"""The engine: one llama context, continuous batching, one ``llama_decode`` per step.

Only the engine thread may call into this module's :class:`Engine` (llama.cpp contexts are not
thread-safe). Each :meth:`Engine.step` puts every decoding sequence's next token and the pending
prompt chunks of prefilling sequences into ONE ``llama_batch`` and decodes it once. The step's
phases: collect (the batch in flight's tokens) -> plan (``scheduler.plan_step``; drafts:
``Speculator.propose``) -> build (``batch.fill``) -> launch (``Speculator.launching``) -> sample
(``worker/sampling.py``; drafts kept: ``Speculator.verified``) -> emit (``output.py``), the speculator's
own work after the launch (``Speculator.after_launch``). Speculation is ``speculator.py``'s alone.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from collections.abc import Callable, Iterator

import llama_cpp as L
import numpy as np

from llamapool.protocol.kvevents import Event
from llamapool.protocol.messages import Done, ErrorCode, Failed, KVPart, Run, Step, TokenLogprob
from llamapool.protocol.params import ParamError
from llamapool.worker.chat import ChatFormatter, TemplateFileError
from llamapool.worker.constraints import Grammars, spec_of
from llamapool.worker.engine.adapters import BASE, Adapters, Key, fair_pick
from llamapool.worker.engine.batch import Batch, fill, fill_apart
from llamapool.worker.engine.draft import DraftModel, draft_path
from llamapool.worker.engine.hostkv import HostTier, model_identity
from llamapool.worker.engine.kvcache import KVSlots
from llamapool.worker.engine.kvevents import BlockTracker
from llamapool.worker.engine.media import EmbdBatch, Projector
from llamapool.worker.engine.model import EngineConfig, EngineError, context_params, load_model
from llamapool.worker.engine.output import PENDING, Deferred, Output
from llamapool.worker.engine.prompt import Prompts
from llamapool.worker.engine.sequence import Sequence, Waiting
from llamapool.worker.engine.spec import spec_mode
from llamapool.worker.engine.speculator import Speculator, rows_per_seq
from llamapool.worker.faults import FaultInjector, request_failure
from llamapool.worker.handover import Received
from llamapool.worker.sampling import RETRY, Sampling
from llamapool.worker.scheduler import (
    ArrivalRate,
    CostModel,
    PromptWork,
    StepTarget,
    at_least_two,
    plan_step,
    priority,
)
from llamapool.worker.settings import host_kv_bytes


class Engine:
    """Owns the model, the context, its KV cache and all sequences."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model, self._tensor_split = load_model(cfg)
        self.adapters = self._adapters(cfg)  # [[models.lora]]: loaded once, applied per step
        self._lora_turn: Key = BASE  # the adapter set of the last step (round robin: fair_pick)
        cp = context_params(cfg)
        # Backend sampling: each sequence id carries a sampler chain that runs inside the decode
        # graph on the GPU, so the host picks no token for those rows (worker/sampling.py).
        self.gpu_sampling = (cfg.gpu and cfg.gpu_sampling) if cfg.backend_sampling is None \
            else cfg.backend_sampling
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        mode = spec_mode(cfg.speculative, cfg.gpu and self.gpu_sampling)  # who speculates
        self.sampling = Sampling(cfg.slots, self.n_vocab, self.gpu_sampling, cfg.ctx_per_slot,
                                 rows_per_seq=rows_per_seq(mode, cfg.speculative))
        self.sampling.context_params(cp)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise EngineError(
                f"llama.cpp could not create a context of {cp.n_ctx} tokens "
                f"({cfg.slots} slots x {cfg.ctx_per_slot}); out of memory?"
            )
        self.sampling.bind(self.ctx)
        try:
            self.chat = ChatFormatter.load(self.model, self.vocab, cfg.chat_template, cfg.parse_special_in_content)
        except TemplateFileError as e:
            raise EngineError(str(e)) from None
        self.projector = self._projector(cfg)
        self.prompts = Prompts(self.vocab, self.n_vocab, self.chat, cfg.ctx_per_slot, self.projector)
        # a step's image embeddings: a llama_decode of their own, before its token batch (_feed_media)
        self.embd_batch = EmbdBatch(cp.n_batch, self.projector.n_embd) if self.projector is not None else None
        self.output = Output(self.vocab, self.sampling, self.chat.tool_format)
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = Batch(cp.n_batch)
        # CPU: a token's numbers independent of the batch and the prefix cache (_plan: docs/http.md#determinism);
        # a GPU worker's kernels are batch-invariant themselves (GGML_CUDA_DETERMINISTIC, patch 0002): no plan
        self.deterministic = cfg.deterministic and not cfg.gpu
        self._prompt_turn = False  # deterministic mode: this step computes prompts (else decode tokens)
        self.kv = self._kv_slots(cfg)
        self.waiting: list[Waiting] = []  # runs beyond the free slots, in arrival order
        self.active: dict[int, Sequence] = {}
        self._eog = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        self.grammars = Grammars(self.vocab, self.n_vocab, self._eog, cfg.grammar_cache_mb << 20)
        self.inflight: list[Sequence] = []  # sequences with an output in the batch in flight
        self._echoing: list[Sequence] = []  # sequences with prompt rows (echo's logprobs) in the batch in flight
        self._deferred: Deferred | None = None  # the step's logprob rows, made into records after the launch
        self._split = False  # the batch being built runs as several micro-batches
        self.steps = 0
        self.target = StepTarget.parse(cfg.target_step)
        self.budget = cfg.max_batch_tokens  # the token budget last sized (a step with prompt work)
        self.arrivals = ArrivalRate()  # prompt tokens a second, lately (a step-time target uses it)
        self.cost = CostModel()  # fitted from the steps' times (a step-time target uses it)
        self.spec = Speculator(mode, cfg, self.sampling, self.cost)  # drafts, their widths, what they keep
        if draft_path(cfg.speculative):  # a draft model's drafts, not prompt lookup's
            try:
                self.spec.drafter = DraftModel(cfg, self.model, self.gpu_sampling)
            except EngineError:
                self.grammars.close()
                self.sampling.close()
                L.llama_free(self.ctx)
                L.llama_model_free(self.model)
                raise
        # the last batch: (rows, prompt tokens, drafts, draft width, a new width, start)
        self._measure: tuple[int, int, int, int, bool, float] | None = None
        self._shape = (0, 0, 0)  # (rows, prompt tokens, draft and filler tokens) of the batch being built
        # LLAMAPOOL_STEP_TRACE=PREFIX: each step's rows, prompt tokens, seconds, budget, draft and filler
        # tokens, draft width, whether its time is left out of the width's (settling) and a draft model's
        # seconds after it (not in its seconds: Speculator.aside) to PREFIX.<pid>
        trace = os.environ.get("LLAMAPOOL_STEP_TRACE")
        self._trace = open(f"{trace}.{os.getpid()}", "w", buffering=1) if trace else None  # line by line
        self.decode_s = 0.0  # time inside llama_decode (+ sampling on the GPU)
        self.faults = FaultInjector.from_env()  # tests only (LLAMAPOOL_INJECT_FAULT); None otherwise
        self.step_s = 0.0  # whole steps, Python work included
        # where a GPU step's time goes (diagnostics, graph_mask_check.py, in git history): the host's work from the
        # batch's tokens read to the next launch (the GPU idle), the llama_decode calls themselves (the
        # host's launch work), the waits for the GPU after them (decode_s = calls + waits)
        self.gap_s = self.call_s = 0.0
        self._synced = 0.0  # when the last synchronize returned (0: none since the last launch)
        self.sampled_tokens = 0  # output rows sampled: tokens generated, each step's ending ones included
        self.sampling_steps = 0  # (sequence, step) pairs with output rows: tokens a step = sampled / this

    def _adapters(self, cfg: EngineConfig) -> Adapters:
        """The model's LoRA adapters, loaded (the model freed when one cannot be)."""
        try:
            return Adapters(self.model, cfg.lora)
        except EngineError:
            L.llama_model_free(self.model)
            raise

    def load_adapter(self, name: str, path: str, scale: float) -> str:
        """A LoRA adapter loaded at run time (the router's LoadAdapter): "" once loaded, else why not."""
        L.llama_synchronize(self.ctx)  # a batch in flight (GPU sampling's pipeline) finishes first
        return self.adapters.load(name, path, scale)

    def unload_adapter(self, name: str) -> str:
        """A run-time adapter to free once no sequence uses it (:meth:`free_adapters`): "" or why not."""
        return self.adapters.unload(name)

    def free_adapters(self) -> list[str]:
        """The adapters being unloaded that no sequence uses any more, freed, and the KV computed with them
        dropped from the prefix cache and the host tier: their names."""
        if not self.adapters.closing and not self.adapters.unheld:
            return []
        # (a finished sequence's row still in flight is waited for: free_unused synchronizes first)
        in_use = [s.adapters for s in self.active.values()] + [w.adapters for w in self.waiting]
        names, tags = self.adapters.free_unused(self.ctx, in_use)
        if tags:
            self.kv.drop_tags(tags)
        return names

    def _projector(self, cfg: EngineConfig) -> Projector | None:
        """The model's mmproj (model.mmproj), loaded by libmtmd; None without one."""
        if not cfg.mmproj:
            return None
        if not os.path.isfile(cfg.mmproj):
            self._free_early()
            raise EngineError(f"the projector file {cfg.mmproj} (model.mmproj) does not exist")
        try:
            return Projector(cfg.mmproj, self.model, cfg.gpu, cfg.threads or os.cpu_count() or 1)
        except EngineError:
            self._free_early()
            raise

    def _free_early(self) -> None:
        """What __init__ made before it failed."""
        self.sampling.close()
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _kv_slots(self, cfg: EngineConfig) -> KVSlots:
        """The KV cache's slots, with the host tier and, with [kv_events], the block tracker of both."""
        events = BlockTracker(model_identity(cfg.model_path, "kv-events"), cfg.kv_events_block) \
            if cfg.kv_events_block > 0 else None  # [kv_events]: what the KV holds (worker/engine/kvevents.py)
        host = self._host_tier(cfg)
        if host is not None:
            host.store.events = events
        return KVSlots(self.mem, cfg.slots, cfg.prefix_cache, 2 if self.deterministic else 1,
                       host=host, keep_output=not self.deterministic, events=events)

    def _host_tier(self, cfg: EngineConfig) -> HostTier | None:
        """The host-RAM KV tier of ``workers.kv_host`` bytes (None: off)."""
        capacity = host_kv_bytes(cfg.kv_host)
        if capacity <= 0 or not cfg.prefix_cache:
            return None
        identity = model_identity(cfg.model_path, cfg.gpu, cfg.flash_attn and cfg.gpu, cfg.n_gpus)

        def prefill_s(n: int) -> float | None:
            return None if self.cost.coef is None else self.cost.coef[2] * n

        return HostTier(self.ctx, capacity, identity, prefill_s, gpu=cfg.gpu, max_tokens=cfg.ctx_per_slot)

    def kv_host(self) -> dict[str, float]:
        """The host tier's counters ({} without one)."""
        return self.kv.host.stats.as_dict() if self.kv.host is not None else {}

    def kv_events(self, final: bool = False) -> list[Event]:
        """The KV-cache events since the last call ([kv_events]; [] when off). ``final``: the worker leaves, its
        KV is let go (every block removed)."""
        if self.kv.events is None:
            return []
        if final:
            self.kv.events.clear_all()
        return self.kv.events.take()

    def kv_snapshot(self) -> list[Event]:
        """Every block the KV holds, after ``AllBlocksCleared`` (the events since the last call are dropped)."""
        if self.kv.events is None:
            return []
        self.kv.events.take()
        return self.kv.events.snapshot()

    def hand_out(self) -> Iterator[KVPart]:
        """A drain, once nothing runs: every free slot's KV into the host tier, then its newest entries as
        parts for a sibling worker (worker/handover.py)."""
        if self.kv.host is None:
            return iter(())
        self.kv.save_all()
        return self.kv.host.hand_out()

    def take_in(self, got: Received) -> None:
        """An entry a draining sibling handed over (checked by the I/O thread), into the host tier."""
        if self.kv.host is not None:
            self.kv.host.take_in(got)

    @property
    def free_ids(self) -> deque[int]:
        return self.kv.free_ids

    @property
    def cached(self) -> dict[int, np.ndarray]:
        return self.kv.cached

    @property
    def reused_tokens(self) -> int:
        return self.kv.reused_tokens

    @property
    def max_piece(self) -> int:
        return self.prompts.max_piece

    def tokenize(self, text: str) -> list[int]:
        """A text prompt's tokens: BOS added as the model wants, special-token text read as text."""
        return self.prompts.tokenize(text)

    @property
    def desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.model, buf, 256)
        return buf.value.decode(errors="replace")

    def kv_cells(self) -> tuple[int, int]:
        """(used, total) KV cells: running sequences' computed tokens and kept prefixes. Read from the
        I/O thread for heartbeats, so it copies the engine thread's dicts first (a racy but safe read)."""
        try:
            used = self.kv.cells(list(self.active.values()))
        except RuntimeError:  # a dict changed size while copied: report next time
            used = 0
        return used, self.cfg.slots * self.cfg.ctx_per_slot

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    @property
    def stalled(self) -> bool:
        """Busy with nothing a step can do: no sequence runs, and every waiting run waits for its grammar
        to compile (on the compile pool). The worker's loop then waits a little between steps rather than
        spin."""
        return (not self.active and not self.inflight and bool(self.waiting)
                and all(w.grammar is not None and not w.grammar.done() for w in self.waiting))

    def speculation(self) -> list[int]:
        return [self.spec.drafted_tokens, self.spec.accepted_tokens, self.sampled_tokens, self.sampling_steps]

    def scheduling(self) -> tuple[str, int, list[float]]:
        return str(self.target), self.budget, list(self.cost.coef or ())

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
        L.llama_synchronize(self.ctx)
        for seq in list(self.active.values()):
            self._release(seq)
        self.grammars.close()
        self.spec.close()
        self.sampling.close()
        if self.kv.host is not None:
            self.kv.host.close()
        if self.projector is not None:
            self.projector.close()
        L.llama_free(self.ctx)
        self.adapters.close()
        L.llama_model_free(self.model)

    # ------------------------------------------------------------ requests in and out

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
            adapters = self.adapters.resolve(run.params.lora)
            self.sampling.check(run.params)
            tokens, media = self.prompts.media_tokens(run.prompt, run.params.tools)
            room = self.embd_batch.capacity if self.embd_batch is not None else 0
            big = next((m for m in media if m.n > room), None)
            if big is not None:
                raise ParamError("messages", f"an image of the prompt is {big.n} tokens; a step holds at most "
                                             f"{room} (raise model.max_batch_tokens)")
            if media and run.params.echo and run.params.logprobs:
                raise ParamError("logprobs", "a prompt's own logprobs ('echo' with 'logprobs') are not computed "
                                             "for a prompt with images")
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
        self.waiting.append(Waiting(run, np.asarray(tokens, dtype=np.int32), self.steps, grammar, media=media,
                                    adapters=adapters))
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
        # a prompt's logprobs: all computed
        tag = self.adapters.tag(w.adapters)
        if tag and self.kv.events is not None:  # kv-events: its blocks carry the adapter set's name
            self.kv.events.names[tag] = self.adapters.name(w.adapters)
        seq_id, reused = self.kv.take(prompt, self.active.values(), reuse=not prompt_logprobs, tag=tag)
        cut = next((m.start for m in w.media if m.start < reused < m.end), -1)
        if cut >= 0:  # a prefix that ends inside an image: the image is fed again whole
            L.llama_memory_seq_rm(self.mem, seq_id, cut, -1)
            reused = cut
        try:
            closing = None if w.grammar is None else self.grammars.start(w.grammar.result(), self._budget(w))
            sampling = self.sampling.admit(seq_id, p, closing, host=self.spec.on_host(p))
        except Exception as e:  # a sampler llama.cpp will not build: this request fails, not the worker
            self.kv.undo(seq_id)
            out.failed.append(Failed(run.rid, ErrorCode.INTERNAL, f"cannot build the sampler: {e!r}", None))
            return None
        seq = self.active[seq_id] = Sequence(
            rid=run.rid, seq_id=seq_id, tokens=prompt, params=p, stream=run.stream,
            sampling=sampling, text=self.prompts.text_stream(p), n_past=reused, arrived=w.arrived, reused=reused,
            fault=self.faults.kind(run.prompt) if self.faults is not None else "",
            drafting=self.spec.start(sampling), media=w.media, adapters=w.adapters,
        )
        seq.history = np.zeros(min(len(prompt) + p.max_tokens, self.cfg.ctx_per_slot) + 1, np.int32)
        seq.history[: len(prompt)] = prompt
        seq.n_history = len(prompt)
        self.kv.reused_tokens += reused
        if p.echo:  # a text prompt as it was given; token ids (and a rendered chat) as their pieces
            seq.text.preface(run.prompt if isinstance(run.prompt, str) else
                             b"".join(self.output.piece(int(t)) for t in prompt).decode(errors="replace"))
        if prompt_logprobs:  # the first prompt token has no logprob
            text, raw = self.output.described(int(prompt[0]))
            seq.logprobs.append(TokenLogprob(text, None, raw, []))
        return seq

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
        prefill step longer for tokens that are ready. A prompt's first token goes to ``flush`` before
        the next launch too (``_send_first``): time to first token.
        """
        out = Step()
        t_step = time.perf_counter()
        if self.gpu_sampling:
            fresh = [seq for seq in self.inflight if not seq.generated and not seq.params.logprobs]
            ready = self._collect(out)
            if flush is not None and fresh:  # first tokens: sent before the next launch
                ready, out = self._send_first(ready, fresh, out, flush)
            order = self._build(out)
            blocking = flush is not None and self._split  # several micro-batches: decode blocks
            if blocking:
                self._resolve_logprobs(out)
                self._emit_ready(ready, out)
                out.active = len(self.active)
                assert flush is not None
                flush(out)
                out = Step()
            if self.batch.n:
                self._launch(order, out)
            if not blocking:
                self._resolve_logprobs(out)  # the logprobs, while the GPU computes
                self._emit_ready(ready, out)
            self.spec.after_launch(self.active, self.steps)
        else:
            order = self._build(out)
            launched = bool(self.batch.n) and self._launch(order, out)
            self.spec.after_launch(self.active, self.steps)
            if launched:
                self._echo_logprobs(out)
                self._emit_ready(self._take_all(order, out), out)
        out.active = len(self.active)
        self.kv.grown(self.active.values())  # kv-events: blocks the step completed
        self.step_s += time.perf_counter() - t_step
        return out

    def _send_first(self, ready: list[tuple[Sequence, int]], fresh: list[Sequence], out: Step,
                    flush: Callable[[Step], None]) -> tuple[list[tuple[Sequence, int]], Step]:
        """The first tokens of the sequences whose prompt just ended (``fresh``), emitted and handed to
        ``flush`` before the next batch is built and launched; the rest of ``ready`` is returned, with a new
        report. After a prompt step the next launch is a slow one (llama.cpp's CUDA graph is captured
        again for the decode shape, its kernels launched one by one meanwhile), and the first token would
        otherwise wait for it: time to first token."""
        first = {id(seq) for seq in fresh}
        early = [(seq, tok) for seq, tok in ready if id(seq) in first]
        if not early:
            return ready, out
        self._emit_ready(early, out)
        out.active = len(self.active)
        flush(out)
        return [(seq, tok) for seq, tok in ready if id(seq) not in first], Step()

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
        active = self._of_turn()  # this step's adapter set's sequences (all of them without adapters)
        if not self.waiting and not any(s.n_past < len(s.tokens) for s in active.values()):
            self._prompt_turn = False  # no prompt work: a decode token each, no budget to size (~30 µs a step)
            return dict.fromkeys(active, 1)
        self._refuse_bad_grammars(out)
        prompts = [PromptWork(s.seq_id, len(s.tokens) - s.n_past, s.arrived)
                   for s in active.values() if s.prefilling]
        prompts += [PromptWork(i, len(w.tokens), w.arrived, running=False)
                    for i, w in enumerate(self.waiting) if w.adapters == self._lora_turn and self._may_start(w)]
        ahead, free = [], len(self.free_ids)  # what could run this step, first in line first
        for p in sorted(prompts, key=lambda p: priority(p, now)):
            if p.running or free > 0:
                ahead.append(p)
                free -= not p.running
        decoding = [s.seq_id for s in active.values() if not s.prefilling]
        # a hold only while decoding sequences speculate (their replies end at different steps as drafts are
        # kept); else a prompt that arrives while others decode starts at once (its time to first token)
        if self.target.auto and not self.deterministic and ahead \
                and any(self.active[i].drafting is not None for i in decoding) \
                and not any(p.running for p in ahead) \
                and self.cost.hold([now - p.arrived for p in ahead], len(decoding), len(self.active),
                                   sum(p.remaining for p in ahead), self.cfg.max_batch_tokens, self._shape[2]):
            return dict.fromkeys(decoding, 1)  # the prompts wait for company (a decode step)
        budget = self.cost.step_budget(self.target, len(self.active), self.cfg.max_batch_tokens,
                                       [p.remaining for p in ahead], self.arrivals.rate())
        if self.deterministic:  # a step computes decode tokens or prompt chunks, in turn, never both
            self._prompt_turn = bool(ahead) and not (decoding and self._prompt_turn)
            decoding, prompts = ([], prompts) if self._prompt_turn else (decoding, [])
        plan = plan_step(budget, decoding, prompts, len(self.free_ids), now)
        chunk = plan.tokens
        admitted = [(self.waiting[key], n) for key, n in plan.admit]
        for w, n in admitted:
            self.waiting.remove(w)
            seq = self._admit(w, out)
            if seq is not None:
                chunk[seq.seq_id] = min(n, len(seq.tokens) - seq.n_past)
        if self._prompt_turn:
            for sid, n in chunk.items():
                chunk[sid] = at_least_two(n, len(self.active[sid].tokens) - self.active[sid].n_past,
                                          self.cfg.n_ubatch)
        self.budget = budget
        return chunk

    def _of_turn(self) -> dict[int, Sequence]:
        """The running sequences this step decodes: those of one adapter set, each set with work taking its
        turn (llama.cpp applies adapters to the whole context); all of them when the model has no adapters."""
        if not self.adapters.names:
            return self.active
        free = bool(self.free_ids)
        sets = {s.adapters for s in self.active.values()} | {w.adapters for w in self.waiting if free and w.ready}
        self._lora_turn = fair_pick(sets, self._lora_turn)
        return {i: s for i, s in self.active.items() if s.adapters == self._lora_turn}

    def _may_start(self, w: Waiting) -> bool:
        """Its grammar is compiled; and a prompt's second and later choices (``n``) wait until the first
        one's prompt is computed, so that they copy its KV (``KVSlots.take``) rather than compute it again."""
        if not w.ready:
            return False
        if w.run.after < 0:
            return True
        if any(x.rid == w.run.after for x in self.waiting):
            return False
        first = self._find(w.run.after)
        return first is None or not first.prefilling

    def _refuse_bad_grammars(self, out: Step) -> None:
        """Waiting runs whose grammar did not compile, or whose shortest reply takes more tokens than they
        may generate, fail (before they take a slot), naming the parameter."""
        for w, g in [(w, w.grammar) for w in self.waiting if w.grammar is not None and w.grammar.done()]:
            e = g.exception()
            need = None if e is not None else g.result().closing
            if need is not None and need > self._budget(w):
                mt, fit = w.run.params.max_tokens, self._budget(w)
                e = ParamError("max_tokens", f"'max_tokens' is {mt}" + (f" ({fit} fit the context)" if fit < mt else "")
                               + f"; the shortest reply that the request's constraint allows takes {need} tokens")
            w.checked = e is None
            if e is not None:
                self.waiting.remove(w)
                field = e.field if isinstance(e, ParamError) else None
                out.failed.append(Failed(w.rid, ErrorCode.INVALID_REQUEST, str(e), field))

    def _budget(self, w: Waiting) -> int:
        """The most tokens the run may generate: ``max_tokens``, or fewer where the context ends first."""
        return max(0, min(w.run.params.max_tokens, self.cfg.ctx_per_slot - len(w.tokens)))

    def _build(self, out: Step) -> list[Sequence]:
        """Plan this step's tokens (``_plan``) and fill the batch (``batch.fill``); return the sequences
        with an output."""
        chunk = self._plan(out)
        if self.adapters.names:
            self._rejoin(chunk)
        if self.projector is not None:
            self._feed_media(chunk, out)
        wide = 1 + self.spec.propose(chunk, self.active, self.steps)
        if self._prompt_turn:
            filled = fill_apart(self.batch, chunk, self.active, self.mem, self.cfg.n_ubatch)
        else:
            pad = -1  # deterministic mode: a lone decoding sequence gets a padding neighbour (two rows a step)
            if self.deterministic and len(chunk) == 1 and self.cfg.slots > 1:
                sid = next(iter(chunk))
                pad = sid + 1 if sid + 1 < self.cfg.slots else sid - 1
            filled = fill(self.batch, chunk, self.active, self.kv.cached, self.mem, self.cfg.n_ubatch, wide, pad)
        self._echoing = filled.echoing
        self._split = filled.split
        self._shape = filled.shape
        return filled.outputs

    def _rejoin(self, chunk: dict[int, int]) -> None:
        """Sequences a step of another adapter set left out may have had a padding token past their KV
        (``batch.fill``): it leaves before they decode again; then the context takes this step's set."""
        for sid, seq in self.active.items():
            if sid not in chunk:
                seq.skipped = True
            elif seq.skipped:
                L.llama_memory_seq_rm(self.mem, sid, seq.n_past, -1)
                seq.skipped = False
        if chunk:
            self.adapters.apply(self.ctx, self._lora_turn)

    def _feed_media(self, chunk: dict[int, int], out: Step) -> None:
        """The step's images, scheduled as prompt tokens: a prompt (of ``chunk``) at an image's first position
        has the image encoded and its embeddings decoded (a ``llama_decode`` of their own, before the step's
        token batch) out of the tokens the plan gave it (``scheduler.plan_step``: the step target's budget);
        an image larger than that goes whole, one a step (the oldest prompt's first). Then each prompt's text
        chunk is what is left of its tokens, up to where its next image starts (none left: it waits, out of
        ``chunk``)."""
        assert self.projector is not None and self.embd_batch is not None
        eb, fed = self.embd_batch, False
        for sid in sorted(chunk, key=lambda i: (self.active[i].arrived, i)):
            seq: Sequence | None = self.active[sid]
            allow = chunk[sid]
            while seq is not None and seq.media and seq.prefilling:
                span = next((m for m in seq.media if m.start == seq.n_past), None)
                if span is None or span.chunk is None or (fed and span.n > allow) or span.n > eb.capacity - eb.n:
                    break
                try:
                    rows = self.projector.encode(span)
                except Exception as e:  # this request fails, not the worker
                    self._drop(seq, e, out)
                    break
                L.llama_memory_seq_rm(self.mem, sid, seq.n_past, -1)  # a padding token it had (batch.fill)
                eb.add(sid, seq.n_past, rows)
                span.chunk = span.owner = None  # fed: libmtmd's copy of its pixels goes
                allow, fed = allow - span.n, True
                seq.n_past = span.end
                if self.projector.non_causal:  # the image attends to itself whole: a decode of its own
                    self._decode_embd([seq], out)
                seq = self.active.get(sid) if self.active.get(sid) is seq else None
            if seq is not None and seq.media and seq.prefilling:
                L.llama_memory_seq_rm(self.mem, sid, seq.n_past, -1)  # a padding token it had (batch.fill)
                nxt = next((m.start for m in seq.media if m.start >= seq.n_past), len(seq.tokens))
                chunk[sid] = min(allow, nxt - seq.n_past)
        if eb.n:
            self._decode_embd([s for s in self.active.values() if s.seq_id in chunk and s.media], out)
        for sid in list(chunk):
            seq = self.active.get(sid)
            if seq is None or chunk[sid] <= 0:
                del chunk[sid]

    def _decode_embd(self, seqs: list[Sequence], out: Step) -> None:
        """Decode the embedding batch; on failure its sequences fail (the worker goes on)."""
        assert self.embd_batch is not None
        causal = not self.projector or not self.projector.non_causal
        if not causal:
            L.llama_set_causal_attn(self.ctx, False)
        try:
            rc = self.embd_batch.decode(self.ctx)
        finally:
            if not causal:
                L.llama_set_causal_attn(self.ctx, True)
        if rc != 0:
            for seq in seqs:
                if self.active.get(seq.seq_id) is seq and seq.media:
                    out.failed.append(Failed(seq.rid, ErrorCode.INTERNAL, f"llama_decode of image embeddings "
                                                                          f"returned {rc}", None))
                    self._release(seq)

    def _launch(self, order: list[Sequence], out: Step) -> bool:
        """Start decoding the batch; on failure every active sequence fails with the reason."""
        b = self.batch
        b.raw.n_tokens = b.n
        t0 = time.perf_counter()
        last = self._measure
        self._measure = (*self._shape, *self.spec.launching(self._shape[1] > 0), t0)
        aside = self.spec.aside()  # a draft model's calls for this launch: not the last batch's time
        self.sampling.before_launch()  # the masks the graph applies are its inputs
        if self._synced:
            self.gap_s += t0 - self._synced
            self._synced = 0.0
        rc = L.llama_decode(self.ctx, b.raw)
        t1 = time.perf_counter()
        self.decode_s += t1 - t0
        self.call_s += t1 - t0
        self.sampling.after_launch()  # the masks left for later, while the GPU computes
        if last is not None:  # after the launch: the GPU does not wait for the fit
            self._time_step(last, t0, aside)
        self.steps += 1
        if rc != 0:
            self.inflight = []
            for seq in list(self.active.values()):
                out.failed.append(Failed(seq.rid, ErrorCode.INTERNAL, f"llama_decode returned {rc}", None))
                self._release(seq)
            return False
        self.inflight = order
        return True

    def _time_step(self, last: tuple[int, int, int, int, bool, float], now: float, aside: float = 0.0) -> None:
        """Feed the cost model, and the draft widths' costs for a decode step: the batch ``last`` (its shape,
        width and launch time) took until ``now``, the next launch (launches follow each other while the
        engine is busy: with GPU sampling the host works while the GPU computes), less ``aside``, a draft
        model's calls in between (``Speculator.aside``). Called right after that launch, while the GPU
        computes."""
        rows, tokens, drafts, k, changed, start = last
        seconds = now - start - aside
        expected = self.cost.predict(rows, tokens, drafts) or 0.5
        if seconds < 4 * expected + 0.005:  # longer: the engine was idle in between, not computing
            self.cost.observe(rows, tokens, seconds, drafts)
            if not tokens:
                self.spec.observe(k, rows, seconds, changed)
        if self._trace is not None:
            self._trace.write(f"{rows} {tokens} {seconds:.6f} {self.budget} {drafts} {k} {int(changed)} {aside:.6f}\n")

    def _collect(self, out: Step) -> list[tuple[Sequence, int]]:
        """Wait for the batch in flight and take its tokens (sequences ended meanwhile are skipped)."""
        if not self.inflight:
            return []
        t0 = time.perf_counter()
        L.llama_synchronize(self.ctx)
        self._synced = time.perf_counter()
        self.decode_s += self._synced - t0
        self._echo_logprobs(out)
        ready = self._take_all([seq for seq in self.inflight if self.active.get(seq.seq_id) is seq], out)
        self.inflight = []
        return ready

    def _echo_logprobs(self, out: Step) -> None:
        """The logprobs of the prompt tokens computed in the batch just decoded (``echo`` with ``logprobs``):
        the row of position ``i`` gives prompt token ``i + 1``'s; all rows' in one pass."""
        if not self._echoing:
            return
        seqs = [seq for seq in self._echoing if self.active.get(seq.seq_id) is seq]
        self._echoing = []
        wants = [(row, int(seq.tokens[pos + 1]), seq.params.top_logprobs) for seq in seqs for row, pos in seq.echo_rows]
        try:
            records = self.output.logprob_records(wants)
        except Exception as e:
            for seq in seqs:
                self._drop(seq, e, out)
            return
        for seq in seqs:
            seq.logprobs.extend(records[: len(seq.echo_rows)])
            records = records[len(seq.echo_rows):]
            seq.echo_rows = []

    def _take_all(self, order: list[Sequence], out: Step) -> list[tuple[Sequence, int]]:
        """Every output row's token (its mask ready first, if constrained; a verified draft's rows in order),
        then the logprobs of the rows that ask, in one pass; then the next masks are filled in the
        background while the engine goes on."""
        self.sampling.prepare([(seq.sampling, r) for seq in order
                               for r in (seq.rows if seq.sampling.matcher is None else seq.rows[:1])])
        picked = []
        for seq in order:
            try:
                picked.append((seq, self._pick_rows(seq)))
            except Exception as e:
                self._drop(seq, e, out)
        records = self._logprobs(picked, out)
        ready = []
        for seq, toks in picked:
            if self.active.get(seq.seq_id) is not seq:
                continue
            try:
                taken = self._take_rows(seq, toks, records.get(seq.seq_id), out)
            except Exception as e:
                self._drop(seq, e, out)
                continue
            seq.ahead = len(taken)
            if len(taken) == 1:
                ready.append((seq, taken[0]))
            else:
                ready += [(seq, tok) for tok in taken]
        self.sampling.masks_next()
        return ready

    def _pick_rows(self, seq: Sequence) -> list[int]:
        """The tokens of the sequence's output rows: its row's, or a verified draft's (spec.py): each row
        sampled as a step of its own, on while the token sampled is the draft's next."""
        s, draft = seq.sampling, seq.draft
        toks = [self.sampling.pick(s, seq.rows[0])]
        if toks[0] == RETRY:  # its mask refused the graph's pick: decoded again, under the mask
            return []
        for i, d in enumerate(draft):
            if toks[-1] != d or d in self._eog or (s.matcher is not None and s.matcher.is_stopped()):
                break
            if s.matcher is not None:  # the next row's mask, after this token
                self.sampling.masks_ready([s])
            toks.append(self.sampling.pick(s, seq.rows[i + 1]))
        return toks

    def _logprobs(self, picked: list[tuple[Sequence, list[int]]], out: Step) -> dict[int, list[TokenLogprob]]:
        """The logprob records of the picked tokens whose sequences ask for them (by sequence id). A
        pipelined step only copies their rows: the records are made after the next launch (``PENDING``
        until then, :class:`Deferred`; such a sequence has one row: it does not speculate)."""
        asking = [(seq, toks) for seq, toks in picked if seq.params.logprobs]
        try:
            if self.gpu_sampling and asking:  # the graph's rows first (one row each), then the host's
                asking.sort(key=lambda a: not a[0].sampling.graph_logprobs)
                ng = sum(seq.sampling.graph_logprobs for seq, _ in asking)
                wants = [(seq.rows[0], toks[0], seq.params.top_logprobs) for seq, toks in asking]
                numbers = self.sampling.graph_logprobs([w[0] for w in wants[:ng]], max(w[2] for w in wants[:ng])) \
                    if ng else None
                rows = self.sampling.rows([w[0] for w in wants[ng:]]) if ng < len(wants) else None
                self._deferred = Deferred(rows, wants, [seq for seq, _ in asking], numbers)
                return {seq.seq_id: [PENDING] for seq, _ in asking}
            wants = [(seq.rows[i], tok, seq.params.top_logprobs) for seq, toks in asking for i, tok in enumerate(toks)]
            records = self.output.logprob_records(wants)
        except Exception as e:
            for seq, _ in asking:
                self._drop(seq, e, out)
            return {}
        found: dict[int, list[TokenLogprob]] = {}
        for seq, toks in asking:
            found[seq.seq_id], records = records[: len(toks)], records[len(toks):]
        return found

    def _take_rows(self, seq: Sequence, toks: list[int], records: list[TokenLogprob] | None,
                   out: Step) -> list[int]:
        """The sequence's picked tokens taken (none when it ended); a verified draft's positions not kept
        leave the KV cache."""
        self.sampling_steps += 1 if toks else 0
        draft = seq.draft
        if len(toks) == 1 and not draft and not seq.tail:  # the common row: one token, nothing to undo
            t = self._take(seq, toks[0], records[0] if records else None, out, [])
            if seq.drafting is not None:
                self.spec.verified(seq, draft, toks, [] if t is None else [t])
            return [] if t is None else [t]
        written = seq.n_past + seq.tail  # the filler positions after its draft leave too
        seq.tail = 0
        seq.n_past -= len(draft)  # as without the draft: one more for each draft token kept
        if not toks:  # no token (RETRY): the step's token is fed again, at its position
            seq.n_past -= 1
        taken: list[int] = []
        for i, tok in enumerate(toks):
            seq.n_past += 1 if i else 0
            t = self._take(seq, tok, records[i] if records else None, out, taken, i == len(toks) - 1)
            if t is None:  # it ended: the tokens before are emitted
                taken = []
                break
            taken.append(t)
        self.spec.verified(seq, draft, toks, taken)
        if seq.n_past < written and self.active.get(seq.seq_id) is seq:
            L.llama_memory_seq_rm(self.mem, seq.seq_id, seq.n_past, -1)
        return taken

    def _take(self, seq: Sequence, tok: int, record: TokenLogprob | None, out: Step, before: list[int],
              last: bool = True) -> int | None:
        """The sequence's new token ``tok`` taken (``record``: its logprobs, if asked for), or None when
        it ended (end of generation, length; the step's tokens ``before`` it are emitted first). ``last``:
        the step's last token for the sequence (its matcher has taken all of them: only after the last
        does a stopped matcher mean the grammar completed here)."""
        self.sampled_tokens += 1
        p = seq.params
        closing = seq.sampling.closing
        matcher = None if closing is None else closing.matcher
        if (not p.ignore_eos or matcher is not None) and tok in self._eog:
            self._end(seq, "length" if closing is not None and closing.forced else "stop", out, before)
            return None
        if record is not None:
            seq.logprobs.append(record)
            if record is PENDING and self._deferred is not None:
                self._deferred.place(seq)
        seq.generated_token(tok)
        if p.tools and tok in self.chat.tool_format.special.values():
            seq.text.mark_here()  # a call opens with a control token (no text)
        if matcher is not None and last and matcher.is_stopped():  # the grammar is complete (closed early: length)
            self._end(seq, "length" if closing is not None and closing.forced else "stop", out, before, tok)
            return None
        if seq.generated >= p.max_tokens or seq.n_past + 1 >= self.cfg.ctx_per_slot:
            self._end(seq, "length", out, before, tok)
            return None
        return tok

    def _end(self, seq: Sequence, reason: str, out: Step, before: list[int], tok: int = -1) -> None:
        """The sequence ends at ``tok`` (-1: a token with no text): the step's tokens ``before`` it first
        (a stop string among them ends it there)."""
        seq.ahead = len(before) + (tok >= 0)  # the last one counted as generated (not an end of generation)
        for t in before:
            self._emit(seq, t, out)
            if self.active.get(seq.seq_id) is not seq:
                return
        self._finish(seq, reason, out, seq.text.push(self.output.piece(tok)) if tok >= 0 else "")

    def _emit(self, seq: Sequence, tok: int, out: Step) -> None:
        """Detokenise the token into the sequence's text; a stop string ends the sequence."""
        if seq.fault:
            FaultInjector.trigger(seq.fault)
        seq.ahead -= 1
        last = self.output.emit(seq, tok, out)
        if last is not None:
            if seq.ahead > 0:  # a verified draft's tokens after the stop: never generated
                seq.generated -= seq.ahead
                if seq.params.logprobs:
                    del seq.logprobs[-seq.ahead:]
            self._finish(seq, "stop", out, last)

    def _resolve_logprobs(self, out: Step) -> None:
        """The deferred logprob records made and put in place (:class:`Deferred`)."""
        d, self._deferred = self._deferred, None
        if d is None:
            return
        try:
            d.resolve(self.output)
        except Exception as e:
            for seq in d.seqs:
                if self.active.get(seq.seq_id) is seq:
                    self._drop(seq, e, out)

    def _finish(self, seq: Sequence, reason: str, out: Step, delta: str = "") -> None:
        if self._deferred is not None and self._deferred.waits(seq):  # its result carries its records
            d = self._deferred
            self._resolve_logprobs(out)
            self._deferred = d if d.records is not None else None  # the others' places are filled as they come
            if self.active.get(seq.seq_id) is not seq:
                return
        self.output.done(seq, reason, out, delta)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.sampling.release(seq.sampling)
        self.kv.release(seq)
        del self.active[seq.seq_id]
