"""A model's LoRA adapters: loaded at start ([[models.lora]]) or at run time (``llamapool load NAME --lora
PATH``), resolved per request, applied to the context per decode, and freed at run time once unused.

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

from llamapool.protocol.params import resolve_lora
from llamapool.worker.engine.model import EngineError

Key = tuple[tuple[int, float], ...]  # an adapter set: (index, scale) pairs, sorted; () = the base model
BASE: Key = ()


class Adapters:
    """The adapters of ``lora`` ((name, path, scale) each) loaded for ``model``, those loaded and unloaded at
    run time (:meth:`load`, :meth:`unload`), and the set the context has. An adapter's place in the lists is
    what keys name; a freed one's place stays empty (None), so that the keys of running sequences hold."""

    def __init__(self, model: Any, lora: Iterable[tuple[str, str, float]]):
        self.model = model
        self.names: list[str | None] = []  # None: freed
        self.scales: list[float] = []
        self.handles: list[Any] = []
        self._ids: list[bytes] = []  # each adapter file's identity (in tags)
        self.paths: list[str] = []  # each adapter's file, its real path
        self.runtime: set[int] = set()  # the places loaded at run time: those an unload may free
        self.closing: set[int] = set()  # being unloaded: no new request takes them; freed once none uses them
        self.unheld: list[str] = []  # unloads of names it does not have (a load it refused): answered as freed
        self._tags: dict[bytes, Key] = {}  # each tag handed out, and its set (an unload drops their KV)
        for name, path, scale in lora:
            why = self._load(name, path, scale)
            if why:
                raise EngineError(why)
        self.current: Key = BASE  # the set the context applies

    def _load(self, name: str, path: str, scale: float) -> str:
        """Load one adapter into a new place: "" once loaded, else why not."""
        if not os.path.isfile(path):
            return f"LoRA adapter {name!r}: file {path} does not exist"
        handle = L.llama_adapter_lora_init(self.model, path.encode())
        if not handle:
            return (f"LoRA adapter {name!r}: llama.cpp cannot load {path} for this model (not a LoRA GGUF, or "
                    f"made for another base model: see the worker's log)")
        st = os.stat(path)
        self.names.append(name)
        self.scales.append(scale)
        self.handles.append(handle)
        self.paths.append(os.path.realpath(path))
        self._ids.append(repr((self.paths[-1], st.st_size, st.st_mtime_ns)).encode())
        return ""

    def _place(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def load(self, name: str, path: str, scale: float) -> str:
        """A run-time load (the router's LoadAdapter): "" once loaded (or already loaded from that file: its
        scale is set), else why not."""
        idx = self._place(name)
        if idx is not None and idx in self.closing:
            return f"adapter {name!r} is still being unloaded on this worker"
        if idx is not None:
            if idx not in self.runtime or self.paths[idx] != os.path.realpath(path):
                return f"this worker already has an adapter {name!r} (from another file)"
            self.scales[idx] = scale
            return ""
        why = self._load(name, path, scale)
        if not why:
            self.runtime.add(len(self.names) - 1)
        return why

    def unload(self, name: str) -> str:
        """A run-time unload (the router's UnloadAdapter): no new request takes it from now on, and
        :meth:`free_unused` frees it once no sequence uses it; "" or why not (nothing to do for a name it
        does not have)."""
        idx = self._place(name)
        if idx is None:
            self.unheld.append(name)
            return ""
        if idx not in self.runtime:
            return f"adapter {name!r} is declared in the config ([[models.lora]]): a reload without it removes it"
        self.closing.add(idx)
        return ""

    def free_unused(self, ctx: Any, in_use: Iterable[Key]) -> tuple[list[str], set[bytes]]:
        """The adapters being unloaded that no set in ``in_use`` holds, freed: their names, and the tags of the
        KV computed with them (the caller drops it)."""
        names, self.unheld = self.unheld, []
        used = {i for key in in_use for i, _ in key}
        gone = sorted(self.closing - used)
        if not gone:
            return names, set()
        L.llama_synchronize(ctx)  # a batch in flight (GPU sampling's pipeline) is done with the context's set
        if any(i in gone for i, _ in self.current):
            self.apply(ctx, BASE)
        tags = set()
        for idx in gone:
            L.llama_adapter_lora_free(self.handles[idx])
            names.append(str(self.names[idx]))
            self.names[idx], self.handles[idx] = None, None
            self.closing.discard(idx)
            self.runtime.discard(idx)
            tags |= {t for t, key in self._tags.items() if any(i == idx for i, _ in key)}
        for t in tags:
            del self._tags[t]
        return names, tags

    def resolve(self, lora: tuple[dict[str, Any], ...]) -> Key:
        """A request's ``lora`` entries (``{"id"|"name", "scale"?}``: :func:`params.resolve_lora`, an id being a
        place among the adapters it may take) as a key; a :class:`ParamError` names the entry that is wrong."""
        if not lora:
            return BASE
        live = [i for i, n in enumerate(self.names) if n is not None and i not in self.closing]
        chosen = resolve_lora(lora, [str(self.names[i]) for i in live], [self.scales[i] for i in live])
        return tuple(sorted((live[p], s) for p, s in chosen.items() if s != 0.0))

    def tag(self, key: Key) -> bytes:
        """What KV computed under ``key`` is cached by, beside its tokens (b"" for the base model)."""
        if not key:
            return b""
        text = repr([(self._ids[i], s) for i, s in key]).encode()
        tag = b"lora:" + hashlib.blake2b(text, digest_size=16).digest()
        self._tags[tag] = key
        return tag

    def name(self, key: Key) -> str:
        """The set's name, as requests name it: an adapter's name ("a", or "a@0.5" at another scale than its
        configured one), several joined by "+" ("" for the base model)."""
        return "+".join(f"{self.names[i]}" + ("" if s == self.scales[i] else f"@{s:g}") for i, s in key)

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
            if handle:
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
