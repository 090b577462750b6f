"""Host memory for the KV tier's entries: page-locked slabs on a GPU worker, allocated once and reused.

Copying a sequence's KV out of VRAM into fresh pageable memory ran at 2.4 GB/s on an H200 (8B q8_0, 16
slots: the driver stages every copy and each new page faults), so saving one 5k-token session (640 MiB)
held the engine thread ~0.2 s; into page-locked memory (ggml's CUDA host buffer type: ``cudaMallocHost``)
a restore ran at 44 GB/s. Allocating page-locked memory is itself slow (~0.3 s a GiB), and entries of
every size came and went, so buffers sized to each entry were allocated again and again. So the memory is
cut into slabs of one size, a slot's largest state (``ctx_per_slot`` tokens), allocated by a thread of
their own at the first save (while they are being allocated, a save that finds none free is skipped: the
engine thread never allocates them) and never given back before the worker stops: every entry takes one
slab, whatever its length.
On a CPU worker (or where the CUDA host buffer cannot be had) entries are plain numpy arrays.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np

MARGIN = 1 << 20  # a slab's bytes beyond ``ctx_per_slot`` tokens' share of a state (its headers)


def _cuda_host_alloc() -> tuple[Any, Any] | None:
    """(alloc(size) -> buffer, the ggml base library) through ggml's CUDA host buffer type; None off a CUDA build."""
    import llama_cpp.llama_cpp as raw

    lib_dir = Path(getattr(raw._lib, "_name", "") or raw.__file__).parent  # type: ignore[attr-defined]
    cuda = sorted(lib_dir.glob("libggml-cuda.so*"))
    base = sorted(lib_dir.glob("libggml-base.so*"))
    if not cuda or not base:
        return None
    try:
        lc, lb = ctypes.CDLL(str(cuda[0])), ctypes.CDLL(str(base[0]))
        lc.ggml_backend_cuda_host_buffer_type.restype = ctypes.c_void_p
        lb.ggml_backend_buft_alloc_buffer.restype = ctypes.c_void_p
        lb.ggml_backend_buft_alloc_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lb.ggml_backend_buffer_get_base.restype = ctypes.c_void_p
        lb.ggml_backend_buffer_get_base.argtypes = [ctypes.c_void_p]
        lb.ggml_backend_buffer_free.argtypes = [ctypes.c_void_p]
        buft = lc.ggml_backend_cuda_host_buffer_type()
    except (OSError, AttributeError):
        return None
    if not buft:
        return None
    return (lambda size: lb.ggml_backend_buft_alloc_buffer(buft, size)), lb


class HostBuffers:
    """``get(size)``: an array of ``size`` bytes (a view of a free slab, or numpy memory); ``give`` takes
    it back. ``limit``: the bytes the slabs may take in all; ``max_tokens``: the most tokens an entry holds."""

    def __init__(self, gpu: bool, limit: int, max_tokens: int):
        self.limit, self.max_tokens = limit, max_tokens
        found = _cuda_host_alloc() if gpu else None
        self._alloc: Any = found[0] if found is not None else None
        self._lib: Any = found[1] if found is not None else None
        self.slab = 0  # a slab's bytes, set at the first get
        self.count = 0  # slabs to allocate in all
        self.slabs: list[tuple[int, int]] = []  # (base address, buffer handle), every one allocated
        self.free: list[int] = []  # base addresses of the free slabs
        self.in_use: set[int] = set()
        self._lock = threading.Lock()
        self._filler: threading.Thread | None = None
        self._closed = False

    @property
    def pinned(self) -> bool:
        return self._alloc is not None and self.count > 0

    def held(self, arr: np.ndarray) -> int:
        """What an entry's state takes of the bound: its slab, or its own bytes."""
        return self.slab if arr.ctypes.data in self.in_use else int(arr.nbytes)

    def bound(self, size: int, tokens: int) -> int:
        """What a state of ``size`` bytes holding ``tokens`` tokens will take of the bound (a slab, or its size);
        the first call sizes the slabs and starts their allocation."""
        if self._alloc is not None and not self.slab and tokens:
            self._start(size, tokens)
        return self.slab if self.pinned and size <= self.slab else size

    def held_pinned(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` (from ``get``) is a page-locked slab."""
        return arr.ctypes.data in self.in_use

    def get(self, size: int) -> np.ndarray | None:
        """Room for a state of ``size`` bytes (``bound`` was asked first); None while the slabs are still
        being allocated and none is free: allocating page-locked memory on the caller's (the engine's) thread
        held every stream ~0.3 s a GiB, and copying into pageable memory runs at a twentieth of the speed."""
        if not self.pinned or size > self.slab:
            return np.empty(size, dtype=np.uint8)
        with self._lock:
            base = self.free.pop() if self.free else None
            filling = len(self.slabs) < self.count and not self._closed
        if base is None and filling:
            return None
        if base is None:  # every slab in use (the store's bound counts slabs: not expected)
            return np.empty(size, dtype=np.uint8)
        with self._lock:
            self.in_use.add(base)
        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))

    def give(self, arr: np.ndarray) -> None:
        """``arr`` (from ``get``) is no longer used: its slab is free for the next entry."""
        base = arr.ctypes.data
        with self._lock:
            if base in self.in_use:
                self.in_use.discard(base)
                self.free.append(base)

    def _start(self, size: int, tokens: int) -> None:
        """Size the slabs from the first state saved, and allocate them on a thread of their own."""
        self.slab = -(-(size * self.max_tokens // max(1, tokens) + MARGIN) // 4096) * 4096
        self.count = self.limit // self.slab
        if self.count:
            self._filler = threading.Thread(target=self._fill, name="kv-host-slabs", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        while not self._closed:
            base = self._one()
            if base is None:
                return
            with self._lock:
                self.free.append(base)

    def _one(self) -> int | None:
        """A new slab (None once ``count`` are allocated, or when none can be had)."""
        with self._lock:
            if len(self.slabs) >= self.count or self._closed:
                return None
            self.slabs.append((0, 0))  # its place, while it is allocated outside the lock
        handle: Any = self._alloc(self.slab)
        base = self._lib.ggml_backend_buffer_get_base(handle) if handle else None
        with self._lock:
            self.slabs.remove((0, 0))
            if not base:
                self.count = len(self.slabs)  # no more page-locked memory: make do with these
                if handle:
                    self._lib.ggml_backend_buffer_free(handle)
                return None
            self.slabs.append((int(base), int(handle)))
        return int(base)

    def close(self) -> None:
        self._closed = True
        if self._filler is not None:
            self._filler.join()
        with self._lock:
            for _, handle in self.slabs:
                if handle:
                    self._lib.ggml_backend_buffer_free(handle)
            self.slabs.clear()
            self.free.clear()
            self.in_use.clear()


__all__ = ["HostBuffers"]
