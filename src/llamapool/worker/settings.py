"""A model's engine settings, declared once: the ``[[models]]`` keys that reach the engine.

:class:`EngineSettings` is extended by ``config.ModelConfig`` (the keys as configured),
``worker.server.WorkerSpec`` (as one worker runs them: ``threads`` and ``max_batch_tokens`` resolved)
and ``worker.engine.EngineConfig`` (with the process's own facts: the model file, the GPUs), so a setting
and its default are written here alone. Pure Python: the config loads it without llama.cpp.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta

from llamapool.protocol.limits import MAX_LORA_SCALE

SPECULATIVE = ("auto", "ngram", "off")  # model.speculative's values
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
HOST_KV_SHARE = 4  # kv_host = "auto": a quarter of the machine's RAM, shared by its workers ...
HOST_KV_PER_SLOT_KV = 8  # ... and at most 8 times the worker's own KV cache
# the keys' constraints, which the config checks (config.py, llamapool.tables)
Positive = Annotated[int, Meta(gt=0)]
NonNegative = Annotated[int, Meta(ge=0)]
Speculative = Annotated[str, Meta(pattern=r"\A(auto|ngram|off|draft:.+)\Z",
                                  description='"auto", "ngram", "off" or "draft:<a GGUF path>"')]
Shares = Annotated[tuple[Annotated[float, Meta(ge=0)], ...],
                   Meta(description="a list of non-negative numbers (a share per GPU of a group)")]


def parse_size(text: str) -> tuple[float, str] | None:
    """``"16GiB"`` -> (16, "GiB"), ``"75%"`` -> (75, "%"), bytes with no unit; None when it is no size."""
    parts = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%|[a-zA-Z]*)\s*", text)
    if parts is None or (parts.group(2) != "%" and parts.group(2).lower() not in _UNITS):
        return None
    return float(parts.group(1)), parts.group(2)


def size_bytes(number: float, unit: str) -> int:
    return int(number * _UNITS[unit.lower()])


def machine_ram() -> int:
    """The machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_kv_bytes(setting: str, kv_bytes: int = 0, workers: int = 1, ram: int = 0) -> int:
    """``kv_host`` in bytes: "0" (off), a size ("16GiB"), or "auto": a quarter of the RAM split between the
    machine's ``workers``, at most 8x the worker's KV cache (``kv_bytes``; 0: unknown)."""
    if setting.strip().lower() in ("0", "off"):
        return 0
    if setting.strip().lower() == "auto":
        share = (ram or machine_ram()) // HOST_KV_SHARE // max(1, workers)
        return min(share, HOST_KV_PER_SLOT_KV * kv_bytes) if kv_bytes > 0 else share
    size = parse_size(setting)
    if size is None or size[1] == "%":
        raise ValueError(f"kv_host: must be \"auto\", \"0\" or a size such as \"16GiB\", got {setting!r}")
    return size_bytes(*size)


def step_budget(max_batch_tokens: int, slots: int, gpu: bool) -> int:
    """The per-step token budget a worker uses: the configured one, or the measured default."""
    if max_batch_tokens:
        return max_batch_tokens
    return max(4096 if gpu else 512, 2 * slots)


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The engine's settings of one model (docs/configuration.md explains each key)."""

    slots: Positive = 8  # parallel sequences per worker
    ctx_per_slot: Positive = 2048  # context tokens per parallel sequence (prompt + generation)
    # Per-step token budget: one token per decoding sequence, prompt chunks fill the rest.
    # 0 = auto: 4096 on a GPU (measured: docs/benchmarks.md), 512 on CPU workers (step_budget).
    max_batch_tokens: NonNegative = 0
    # How much prompt work a step takes, under max_batch_tokens (worker/scheduler.py StepTarget):
    # "auto" (sized from the step costs the worker measures and the prompts waiting), "off" (the
    # token budget alone), "<F>x" (F times the measured pure-decode step) or "<N>ms".
    target_step: str = "auto"
    n_ubatch: Positive = 1024  # llama.cpp physical micro-batch
    threads: NonNegative = 0  # CPU threads per worker; 0 -> the cores split between all CPU workers
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
    speculative: Speculative = "auto"
    chat_template: str = ""  # a Jinja2 chat template file (relative: to the config file); "" -> the GGUF's
    # Chat contents are tokenized as text: a user's "<end_of_turn>" stays text, only the template's own
    # special-token text becomes control tokens. true: contents' special-token text is parsed too
    # (callers that are trusted to write control tokens); docs/security.md.
    parse_special_in_content: bool = False
    tensor_split: Shares = ()  # per GPU of a group; () -> llama.cpp's split (by free memory)
    grammar_cache_mb: NonNegative = 0  # compiled grammars a worker keeps, in MiB; 0 -> 1/64 of RAM, 64 MiB to 1 GiB
    # The host-RAM KV tier (worker/engine/hostkv.py): a slot's KV copied to RAM before it is overwritten and
    # copied back when its prefix returns. "auto" (CPU workers: a quarter of the RAM split between the
    # machine's workers, at most 8x the worker's KV cache; GPU workers: off, not yet measured faster there),
    # a size ("16GiB"), or "0" (off). A worker's spec carries the bytes, resolved by the supervisor.
    kv_host: str = "auto"
    # LoRA adapters of the model ([[models.lora]] tables): (name, path, scale) each; a request names them by
    # name (or index) in ``lora``, or as its model (the adapter at its scale); worker/engine/adapters.py
    lora: tuple[tuple[str, str, float], ...] = ()
    # The model's multimodal projector (an mmproj GGUF, libmtmd: docs/models.md#images): a path (relative: to
    # the config file) or an hf: reference ("hf:OWNER/REPO": the repo's mmproj file, as llama-server -hf
    # finds it); "" -> the model takes no images
    mmproj: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_split, tuple):  # a JSON or TOML list
            object.__setattr__(self, "tensor_split", tuple(self.tensor_split))
        if not isinstance(self.lora, tuple) or any(not isinstance(a, tuple) for a in self.lora):  # from JSON
            object.__setattr__(self, "lora", tuple((str(n), str(p), float(s)) for n, p, s in self.lora))

    def engine_settings(self, **changes: Any) -> dict[str, Any]:
        """These settings alone (of any class that extends them), with ``changes``, as keyword
        arguments for another class that extends them."""
        names = [f.name for f in dataclasses.fields(EngineSettings)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"not an engine setting: {', '.join(unknown)}")
        return {n: changes.get(n, getattr(self, n)) for n in names}


__all__ = ["MAX_LORA_SCALE", "SPECULATIVE", "EngineSettings", "host_kv_bytes", "machine_ram", "parse_size",
           "size_bytes", "step_budget"]
