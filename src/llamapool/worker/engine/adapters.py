"""A model's LoRA adapters: loaded once, resolved per request, applied to the context per decode.

llama.cpp applies adapters to a whole context (``llama_set_adapters_lora``), not per sequence, so a
step decodes the sequences of one adapter set only (:meth:`Engine._plan`: round robin over the sets
with work). A set is a key: ``()`` is the base model, else ``((adapter index, scale), ...)`` sorted,
scale-0 entries left out (llama.cpp skips them). Its :meth:`Adapters.tag` is what the prefix cache and
the host tier key KV by, so KV computed under one set is never reused under another.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import llama_cpp as L

from llamapool.protocol.params import ParamError
from llamapool.worker.engine.model import EngineError

Key = tuple[tuple[int, float], ...]  # an adapter set: (index, scale) pairs, sorted; () = the base model
BASE: Key = ()


class Adapters:
    """The adapters of ``lora`` ((name, path, scale) each) loaded for ``model``; the set the context has."""

    def __init__(self, model: Any, lora: Iterable[tuple[str, str, float]]):
        self.names: list[str] = []
        self.scales: list[float] = []
        self.handles: list[Any] = []
        self._ids: list[bytes] = []  # each adapter file's identity (in tags)
        for name, path, scale in lora:
            if not os.path.isfile(path):
                raise EngineError(f"LoRA adapter {name!r}: file {path} does not exist")
            handle = L.llama_adapter_lora_init(model, path.encode())
            if not handle:
                raise EngineError(f"LoRA adapter {name!r}: llama.cpp cannot load {path} for this model "
                                  f"(not a LoRA GGUF, or made for another base model: see the worker's log)")
            st = os.stat(path)
            self.names.append(name)
            self.scales.append(scale)
            self.handles.append(handle)
            self._ids.append(repr((os.path.realpath(path), st.st_size, st.st_mtime_ns)).encode())
        self.current: Key = BASE  # the set the context applies

    def resolve(self, lora: tuple[dict[str, Any], ...]) -> Key:
        """A request's ``lora`` entries (``{"id"|"name", "scale"?}``, later ones overriding earlier ones for
        the same adapter; no scale: the adapter's configured one) as a key; a :class:`ParamError` names the
        entry that is wrong."""
        if not lora:
            return BASE
        if not self.names:
            raise ParamError("lora", "'lora': this model has no LoRA adapters (a model's [[models.lora]] tables "
                                     "declare them)")
        chosen: dict[int, float] = {}
        for i, entry in enumerate(lora):
            if "id" in entry:
                idx = entry["id"]
                if not 0 <= idx < len(self.names):
                    raise ParamError(f"lora[{i}].id", f"'lora[{i}].id' is {idx}; this model's adapters are "
                                                      f"0 to {len(self.names) - 1} ({self._listed()})")
            else:
                name = entry["name"]
                if name not in self.names:
                    raise ParamError(f"lora[{i}].name", f"'lora[{i}].name': no adapter {name!r} in this model "
                                                        f"(its adapters: {self._listed()})")
                idx = self.names.index(name)
            scale = entry.get("scale")
            chosen[idx] = self.scales[idx] if scale is None else float(scale)
        return tuple(sorted((i, s) for i, s in chosen.items() if s != 0.0))

    def _listed(self) -> str:
        return ", ".join(f"{i}: {n!r}" for i, n in enumerate(self.names))

    def tag(self, key: Key) -> bytes:
        """What KV computed under ``key`` is cached by, beside its tokens (b"" for the base model)."""
        if not key:
            return b""
        text = repr([(self._ids[i], s) for i, s in key]).encode()
        return b"lora:" + hashlib.blake2b(text, digest_size=16).digest()

    def name(self, key: Key) -> str:
        """The set's name, as requests name it: an adapter's name ("a", or "a@0.5" at another scale than its
        configured one), several joined by "+" ("" for the base model)."""
        return "+".join(self.names[i] + ("" if s == self.scales[i] else f"@{s:g}") for i, s in key)

    def apply(self, ctx: Any, key: Key) -> None:
        """Make the context decode with the adapter set ``key`` (nothing to do when it already does)."""
        if key == self.current:
            return
        n = len(key)
        handles = (L.llama_adapter_lora_p_ctypes * max(1, n))(*[self.handles[i] for i, _ in key])
        scales = (ctypes.c_float * max(1, n))(*[s for _, s in key])
        L.llama_set_adapters_lora(ctx, handles if n else None, n, scales if n else None)
        self.current = key

    def close(self) -> None:
        for handle in self.handles:
            L.llama_adapter_lora_free(handle)
        self.handles = []


def fair_pick(keys: Iterable[Key], last: Key) -> Key:
    """The adapter set a step decodes, of the sets with work (``keys``): the one after ``last`` in a fixed
    order (round robin), so that each set with work gets a step in turn."""
    order = sorted(set(keys))
    if not order:
        return last
    later = [k for k in order if k > last]
    return later[0] if later else order[0]


__all__ = ["BASE", "Adapters", "Key", "fair_pick"]
