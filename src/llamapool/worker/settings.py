"""A model's engine settings, declared once: the ``[[models]]`` keys that reach the engine.

:class:`EngineSettings` is extended by ``config.ModelConfig`` (the keys as configured),
``worker.server.WorkerSpec`` (as one worker runs them: ``threads`` and ``max_batch_tokens`` resolved)
and ``worker.engine.EngineConfig`` (with the process's own facts: the model file, the GPUs), so a setting
and its default are written here alone. Pure Python: the config loads it without llama.cpp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SPECULATIVE = ("auto", "ngram", "off")  # model.speculative's values


def step_budget(max_batch_tokens: int, slots: int, gpu: bool) -> int:
    """The per-step token budget a worker uses: the configured one, or the measured default."""
    if max_batch_tokens:
        return max_batch_tokens
    return max(4096 if gpu else 512, 2 * slots)


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The engine's settings of one model (docs/configuration.md explains each key)."""

    slots: int = 8  # parallel sequences per worker
    ctx_per_slot: int = 2048  # context tokens per parallel sequence (prompt + generation)
    # Per-step token budget: one token per decoding sequence, prompt chunks fill the rest.
    # 0 = auto: 4096 on a GPU (measured: docs/benchmarks.md), 512 on CPU workers (step_budget).
    max_batch_tokens: int = 0
    # How much prompt work a step takes, under max_batch_tokens (worker/scheduler.py StepTarget):
    # "auto" (sized from the step costs the worker measures and the prompts waiting), "off" (the
    # token budget alone), "<F>x" (F times the measured pure-decode step) or "<N>ms".
    target_step: str = "auto"
    n_ubatch: int = 1024  # llama.cpp physical micro-batch
    threads: int = 0  # CPU threads per worker; 0 -> the cores split between all CPU workers
    # flash attention (on GPUs only: llama.cpp's CPU flash attention computes a sequence's row otherwise
    # when other sequences share the batch)
    flash_attn: bool = True
    gpu_sampling: bool = True  # sample on the GPU (llama.cpp backend sampling) on GPU workers
    prefix_cache: bool = True  # reuse the KV of shared prompt prefixes
    # a request's greedy reply (and a seeded sampled one) depends on the request alone, not on the prefix
    # cache or the requests beside it (docs/http.md#determinism: what it costs); GPU workers need llama.cpp
    # built with patches/llama.cpp/0002 (batch-invariant kernels: llama_patches) and refuse to start without
    deterministic: bool = False
    # Speculative decoding (worker/engine/spec.py): "ngram" (drafts from the prompt and output, verified in
    # the batch), "off", or "auto": ngram on GPU workers, off on CPU workers (llama.cpp's CPU kernels
    # compute a sequence's row otherwise for one query token than for several, so greedy text would
    # change at near-ties: docs/configuration.md)
    speculative: str = "auto"
    chat_template: str = ""  # a Jinja2 chat template file (relative: to the config file); "" -> the GGUF's
    # Chat contents are tokenized as text: a user's "<end_of_turn>" stays text, only the template's own
    # special-token text becomes control tokens. true: contents' special-token text is parsed too
    # (callers that are trusted to write control tokens); docs/security.md.
    parse_special_in_content: bool = False
    tensor_split: tuple[float, ...] = ()  # per GPU of a group; () -> llama.cpp's split (by free memory)
    grammar_cache_mb: int = 0  # compiled grammars a worker keeps, in MiB; 0 -> 1/64 of RAM, 64 MiB to 1 GiB

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_split, tuple):  # a JSON or TOML list
            object.__setattr__(self, "tensor_split", tuple(self.tensor_split))

    def engine_settings(self, **changes: Any) -> dict[str, Any]:
        """These settings alone (of any class that extends them), with ``changes``, as keyword
        arguments for another class that extends them."""
        names = [f.name for f in dataclasses.fields(EngineSettings)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"not an engine setting: {', '.join(unknown)}")
        return {n: changes.get(n, getattr(self, n)) for n in names}


__all__ = ["SPECULATIVE", "EngineSettings", "step_budget"]
