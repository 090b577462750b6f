"""Constrained decoding with llguidance: grammars compiled off the engine thread, masks filled in parallel.

- :class:`Grammars` turns a request's parameters into an llguidance grammar, compiles each distinct
  grammar once (a cache of compiled matchers; a sequence gets a copy) on a small thread pool, and
  reports a grammar that does not compile as a :class:`~llamapool.protocol.params.ParamError`.
- :class:`Masks` fills the next-token bitmask of every constrained sequence with llguidance's parallel
  executor on a background thread (it releases the GIL), while the GPU runs the step: the next mask
  depends only on tokens already sampled.

The tokenizer comes straight from llama.cpp's vocabulary (``llguidance.llamacpp``): no HuggingFace.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamapool.protocol.params import ParamError, SamplingParams
from llamapool.worker.tools import ToolFormat

CACHE_SIZE = 64  # compiled grammars kept (the schema of a tool list is sent again and again)


@dataclass(frozen=True)
class Spec:
    """What a request constrains: llguidance grammar text, and the parameter to name when it is bad."""

    grammar: str
    field: str


def spec_of(p: SamplingParams, tool_format: ToolFormat | None) -> Spec | None:
    """The constraint of ``p`` (None: unconstrained). Tool calls use the chat template's format."""
    import llguidance

    rf = p.response_format
    if rf is not None and rf["type"] == "json_object":
        return Spec(_json({"type": "object"}, "response_format"), "response_format")
    if rf is not None and rf["type"] == "json_schema":
        return Spec(_json(rf["json_schema"]["schema"], "response_format.json_schema.schema"),
                    "response_format.json_schema.schema")
    if p.json_schema is not None:
        return Spec(_json(p.json_schema, "json_schema"), "json_schema")
    if p.grammar is not None:
        try:
            return Spec(llguidance.grammar_from("grammar", p.grammar), "grammar")
        except ValueError as e:
            raise ParamError("grammar", f"'grammar' is not a valid GBNF or Lark grammar: {e}") from None
    if p.regex is not None:
        return Spec(llguidance.grammar_from("regex", p.regex), "regex")
    if p.tools and p.tool_choice != "none" and tool_format is not None:
        return Spec(tool_format.grammar(p.tools, p.tool_choice or "auto", p.parallel_tool_calls), "tools")
    return None


def _json(schema: dict[str, Any], field: str) -> str:
    import llguidance

    try:  # compact JSON, as OpenAI writes it: no runs of whitespace for a model to wander in
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise ParamError(field, f"'{field}' is not a usable JSON schema: {e}") from None


class Grammars:
    """Compiled grammars of one worker: tokenizer, cache and compile pool (any thread may submit)."""

    def __init__(self, vocab: Any, n_vocab: int, eog: frozenset[int]):
        self._vocab, self._n_vocab, self._eog = vocab, n_vocab, eog
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        # built before the worker says it is ready (a second or more for a large vocabulary), so that the
        # first constrained requests do not wait for it
        self.tokenizer()

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

    def compile(self, spec: Spec) -> Future[Any]:
        """A future of a compiled matcher for ``spec`` (shared: copy it per sequence with ``deep_copy``);
        it raises :class:`ParamError` naming ``spec.field`` when the grammar does not compile."""
        with self._lock:
            fut = self._cache.get(spec.grammar)
            if fut is not None:
                self._cache.move_to_end(spec.grammar)
                return fut
            fut = self._pool.submit(self._build, spec)
            self._cache[spec.grammar] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _build(self, spec: Spec) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), spec.grammar, log_level=0)
        if matcher.is_error():
            with self._lock:
                self._cache.pop(spec.grammar, None)
            raise ParamError(spec.field, f"'{spec.field}' cannot be compiled: {matcher.get_error()}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Masks:
    """The next-token bitmasks of the constrained sequences, one row per slot, filled in the background."""

    def __init__(self, slots: int, n_vocab: int):
        import llguidance
        import llguidance.numpy as lln

        self.n_vocab = n_vocab
        self.bits = lln.allocate_token_bitmask(slots, n_vocab)
        self._executor = llguidance.LLExecutor(num_threads=None)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self._pending: Future[None] | None = None

    def start(self, rows: list[tuple[Any, int]]) -> None:
        """Fill the rows of ``(matcher, slot)`` in the background (the caller must :meth:`wait` first)."""
        if rows:
            self._pending = self._pool.submit(self._fill, rows)

    def _fill(self, rows: list[tuple[Any, int]]) -> None:
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask_par(self._executor, rows, self.bits)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def allows(self, slot: int, tok: int) -> bool:
        return bool((int(self.bits[slot, tok >> 5]) >> (tok & 31)) & 1)

    def allowed(self, slot: int) -> np.ndarray:
        """The slot's mask as booleans over the vocabulary."""
        return np.unpackbits(self.bits[slot].view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=False)
