"""Constrained decoding with llguidance: grammars compiled off the engine thread, masks filled in parallel.

- :func:`spec_of` turns a request's parameters into an llguidance grammar: a JSON schema bounded first
  (:mod:`~llamapool.worker.schemas`), a GBNF/Lark grammar, a regex, or the tool calls of the chat
  template's format (with a ``response_format`` too: a call or an answer in the format).
- :class:`Grammars` compiles each distinct grammar once on a small thread pool, keeps the compiled
  matchers in a cache bounded in bytes (``model.grammar_cache_mb``; a sequence gets a copy), finds
  how many tokens the shortest reply of each grammar takes (:mod:`~llamapool.worker.closing`), and
  reports a grammar that does not compile as a :class:`~llamapool.protocol.params.ParamError`.
- :class:`Masks` fills the next-token bitmask of every constrained sequence with llguidance's parallel
  executor (it releases the GIL), most of them right after the launch, while the GPU runs the step: the
  next mask depends only on tokens already sampled.

The tokenizer comes straight from llama.cpp's vocabulary (``llguidance.llamacpp``): no HuggingFace.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamapool.protocol.params import ParamError, SamplingParams
from llamapool.worker.closing import IN, PLAN_LIMIT, WINDOW, Closer, Closing
from llamapool.worker.schemas import COMPACT, bounded
from llamapool.worker.tools import ToolFormat

# What a compiled grammar holds, estimated from its source: llguidance's lexer and parser tables grow
# with it (measured on Gemma 3's vocabulary: a 1 MB regex of alternatives holds 40 to 110 MB, 100 kB
# holds 3 to 6 MB; small grammars well under a megabyte).
COST_BASE = 64 << 10
COST_PER_CHAR = 48


def default_cache_bytes() -> int:
    """The compiled-grammar cache's default bound: 1/64 of the machine's memory, 64 MiB to 1 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return max(64 << 20, min(1 << 30, total // 64))


def grammar_cost(grammar: str) -> int:
    """The bytes a compiled grammar is taken to hold (the cache's unit)."""
    return COST_BASE + COST_PER_CHAR * len(grammar)


@dataclass(frozen=True)
class Spec:
    """What a request constrains: llguidance grammar text, the parameter to name when it is bad, and the
    text that opens a branch whose shortest completion may be longer than the start's (a tool call's
    opening: the closing must watch from that far before the end)."""

    grammar: str
    field: str
    opening: str = ""
    json: bool = False  # a JSON value alone (a schema's answer): it is complete only at its end


def spec_of(p: SamplingParams, tool_format: ToolFormat | None) -> Spec | None:
    """The constraint of ``p`` (None: unconstrained). Tool calls use the chat template's format."""
    import llguidance

    answer = _answer(p)
    if p.tools and p.tool_choice != "none" and tool_format is not None:
        schema = None if answer is None else bounded(answer[1])
        return Spec(tool_format.grammar(p.tools, p.tool_choice or "auto", p.parallel_tool_calls, schema), "tools",
                    tool_format.trigger)
    if answer is not None:
        return Spec(_json(answer[1], answer[0]), answer[0], json=True)
    if p.grammar is not None:
        try:
            return Spec(llguidance.grammar_from("grammar", p.grammar), "grammar")
        except ValueError as e:
            raise ParamError("grammar", f"'grammar' is not a valid GBNF or Lark grammar: {e}") from None
    if p.regex is not None:
        if (len(p.regex) - len(p.regex.rstrip("\\"))) % 2:  # llguidance would drop the lone backslash
            raise ParamError("regex", "'regex' ends with an unfinished escape (a lone '\\'); write '\\\\' "
                                      "for a backslash")
        return Spec(llguidance.grammar_from("regex", p.regex), "regex")
    return None


def _answer(p: SamplingParams) -> tuple[str, dict[str, Any]] | None:
    """The JSON schema a reply's answer follows, and its field (None: no format)."""
    rf = p.response_format
    if rf is not None and rf["type"] == "json_object":
        return "response_format", {"type": "object"}
    if rf is not None and rf["type"] == "json_schema":
        return "response_format.json_schema.schema", rf["json_schema"]["schema"]
    if p.json_schema is not None:
        return "json_schema", p.json_schema
    return None


def _json(schema: dict[str, Any], field: str) -> str:
    import llguidance

    try:  # compact JSON, as OpenAI writes it, with bounds where the schema gives none
        return llguidance.LLMatcher.grammar_from_json_schema(bounded(schema), defaults=COMPACT)
    except ValueError as e:
        raise ParamError(field, f"'{field}' is not a usable JSON schema: {e}") from None


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar: its matcher (shared: each sequence gets a copy), the tokens its shortest reply
    takes, as :class:`~llamapool.worker.closing.Closer` finds it (None: not found), and how many a
    reply through its ``opening`` branch takes (at least ``closing``): the closing watches a reply's
    last ``reach + WINDOW`` tokens."""

    matcher: Any
    closing: int | None
    reach: int = 0
    json: bool = False  # Spec.json


class Grammars:
    """Compiled grammars of one worker: tokenizer, cache and compile pool (any thread may submit)."""

    def __init__(self, vocab: Any, n_vocab: int, eog: frozenset[int], cache_bytes: int = 0):
        self._vocab, self._n_vocab, self._eog = vocab, n_vocab, eog
        self.cache_bytes = cache_bytes or default_cache_bytes()
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[Compiled]] = OrderedDict()
        self._held = 0  # the cache's bytes (grammar_cost of each entry)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        # built before the worker says it is ready (a second or more for a large vocabulary), so that the
        # first constrained requests do not wait for it
        self.closer = Closer(self.tokenizer(), n_vocab, min(eog) if eog else -1)

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built once (about a second for 262k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                with warnings.catch_warnings():  # it calls llama_token_get_attr, deprecated, once a token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(self._vocab, n_vocab=self._n_vocab,
                                                             eos_token=sorted(self._eog) or None)
            return self._tokenizer

    @property
    def held(self) -> int:
        """The bytes the cache's grammars are taken to hold."""
        return self._held

    def compile(self, spec: Spec) -> Future[Compiled]:
        """A future of the compiled grammar of ``spec``; it raises :class:`ParamError` naming ``spec.field``
        when the grammar does not compile. The least recently used grammars leave the cache while it
        holds more than ``cache_bytes`` (the newest always stays: the request waits on it)."""
        with self._lock:
            fut = self._cache.get(spec.grammar)
            if fut is not None:
                self._cache.move_to_end(spec.grammar)
                return fut
            fut = self._pool.submit(self._build, spec)
            self._cache[spec.grammar] = fut
            self._held += grammar_cost(spec.grammar)
            while self._held > self.cache_bytes and len(self._cache) > 1:
                self._drop(next(iter(self._cache)))
            return fut

    def _drop(self, grammar: str) -> None:
        if self._cache.pop(grammar, None) is not None:
            self._held -= grammar_cost(grammar)

    def _build(self, spec: Spec) -> Compiled:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), spec.grammar, log_level=0)
        if matcher.is_error():
            with self._lock:
                self._drop(spec.grammar)
            raise ParamError(spec.field, f"'{spec.field}' cannot be compiled: {matcher.get_error()}")
        plan = self.closer.plan(matcher, PLAN_LIMIT)
        closing = None if plan is None else len(plan)
        return Compiled(matcher, closing, max(closing or 0, self._reach(matcher, spec.opening)), spec.json)

    def _reach(self, matcher: Any, opening: str) -> int:
        """Tokens a reply that starts with ``opening`` takes at least (0: no opening, or none found)."""
        if not opening:
            return 0
        toks = self.tokenizer().tokenize_str(opening, parse_special=True)
        n = matcher.try_consume_tokens(toks)
        try:
            plan = self.closer.plan(matcher, PLAN_LIMIT, IN) if n == len(toks) else None
            return 0 if plan is None else n + len(plan)
        finally:
            if n:
                matcher.rollback(n)

    def start(self, compiled: Compiled, budget: int) -> Closing:
        """A sequence's own copy of ``compiled``, closing within ``budget`` tokens."""
        return Closing(compiled.matcher.deep_copy(), self.closer, budget, compiled.reach + WINDOW,
                       free_text=not compiled.json)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Masks:
    """The next-token bitmasks of the constrained sequences, one row per slot, all filled on the engine
    thread (no thread of their own: the fill releases the GIL, a Python thread would wait for it).

    - ``inline`` (a CPU worker): at once, one row after another. Its decode takes every core, so a fill
      beside it would not overlap it, only wait to be scheduled (~0.15-0.3 ms a step against ~10 µs of
      filling for 4 rows of the tiny model, engine_steps.py, in git history); and llguidance's parallel
      executor hands each fill to a pool thread, which then spins before it sleeps (on this 2-core VM,
      8 streams of ``json_schema``: the worker's CPU a token went from 130-140 to 115 µs,
      bench_sampling.py, in git history);
    - else (a GPU worker) with llguidance's parallel executor: the rows the next launch applies
      (``urgent``) at once, the others (``later``) when :meth:`fill_later` is called, right after the
      launch, while the GPU computes. A mask thread did that before, but it had to take the GIL from
      the engine thread first: on an H100 at 1B, 64 ``json_schema`` streams, the engine then waited
      ~0.24 ms a step for masks not filled yet (py-spy, job QQ).
    """

    def __init__(self, slots: int, n_vocab: int, inline: bool = False):
        import llguidance
        import llguidance.numpy as lln

        self.inline = inline
        self.n_vocab = n_vocab
        self.bits = lln.allocate_token_bitmask(slots, n_vocab)
        self._executor = None if inline else llguidance.LLExecutor(num_threads=None)
        self._later: list[tuple[Any, int]] = []  # rows to fill after the launch
        self.failed: dict[int, Exception] = {}  # slot -> what filling its mask raised (its sequence fails)

    def start(self, rows: list[tuple[Any, int]], urgent: Sequence[tuple[Any, int]] = ()) -> None:
        """Fill the rows of ``(matcher, slot)``: the ``urgent`` ones now, the others at :meth:`fill_later`
        (now where ``inline``)."""
        now = [*urgent, *rows] if self.inline else list(urgent)
        if now:
            self._fill(now)
        if not self.inline:
            self._later += rows

    def forget(self, slot: int) -> None:
        """The slot's sequence ended: a fill left for later is not made (the slot's next sequence may have
        its first mask by then, which it would overwrite)."""
        self._later = [row for row in self._later if row[1] != slot]

    def fill_later(self) -> None:
        """Fill the rows left for later (right after a launch, or before a mask is read)."""
        if self._later:
            rows, self._later = self._later, []
            self._fill(rows)

    def _fill(self, rows: list[tuple[Any, int]]) -> None:
        """Fill the rows; if that raises, each alone, and what one raises is kept for its slot
        (:meth:`check`): one matcher's failure is its sequence's, not the engine's."""
        import llguidance.numpy as lln

        if self._executor is not None:
            try:
                lln.fill_next_token_bitmask_par(self._executor, rows, self.bits)
                return
            except Exception:
                pass
        for matcher, slot in rows:
            try:
                lln.fill_next_token_bitmask(matcher, self.bits, slot)
            except Exception as e:
                self.failed[slot] = e

    def check(self, slot: int) -> None:
        """Raise what filling the slot's mask raised, if it did (once)."""
        if self.failed:
            e = self.failed.pop(slot, None)
            if e is not None:
                raise e

    def wait(self) -> None:
        """Every row started is filled."""
        self.fill_later()

    def allows(self, slot: int, tok: int) -> bool:
        return bool((int(self.bits[slot, tok >> 5]) >> (tok & 31)) & 1)

    def allowed(self, slot: int) -> np.ndarray:
        """The slot's mask as booleans over the vocabulary."""
        return np.unpackbits(self.bits[slot].view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def close(self) -> None:
        self._later = []
