"""Host memory for the KV tier's entries: page-locked slabs on a GPU worker, allocated at start and reused.

Copying a sequence's KV out of VRAM into fresh pageable memory ran at 2.4 GB/s on an H200 (8B q8_0, 16
slots: the driver stages every copy and each new page faults), so saving one 5k-token session (640 MiB)
held the engine thread ~0.2 s; into page-locked memory (ggml's CUDA host buffer type: ``cudaMallocHost``)
a restore ran at 44 GB/s. Allocating page-locked memory is itself slow (~0.3 s a GiB), and when a thread
of its own allocated the slabs while the worker served (2026-12-03: 31 GiB during an 8B agent run) the
saves averaged 145 ms (~3 GB/s: pageable speed) and the run was slower than its saves and restores
account for. So the memory is cut into slabs of one size,
a slot's largest state (``ctx_per_slot`` tokens, sized from the state a few tokens take: :func:`hostkv
.state_bytes_per_token`), all allocated before the worker reports ready and never given back before it
stops: every entry takes one slab, whatever its length.
On a CPU worker (or where the CUDA host buffer cannot be had) entries are plain numpy arrays.
"""

from __future__ import annotations

import ctypes
import time
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
    it back. ``limit``: the bytes the slabs may take in all; ``slot_bytes``: a slot's largest state (0:
    unknown, no slabs)."""

    def __init__(self, gpu: bool, limit: int, slot_bytes: int):
        self.limit = limit
        found = _cuda_host_alloc() if gpu and slot_bytes > 0 else None
        self._lib: Any = found[1] if found is not None else None
        self.slab = -(-(slot_bytes + MARGIN) // 4096) * 4096 if found is not None else 0  # a slab's bytes
        self.slabs: list[tuple[int, int]] = []  # (base address, buffer handle), every one allocated
        self.free: list[int] = []  # base addresses of the free slabs
        self.in_use: set[int] = set()
        self.alloc_seconds = 0.0
        if found is not None:
            alloc, lib = found
            t0 = time.perf_counter()
            for _ in range(limit // self.slab):
                handle: Any = alloc(self.slab)
                base = lib.ggml_backend_buffer_get_base(handle) if handle else None
                if not base:  # no more page-locked memory: make do with these
                    if handle:
                        lib.ggml_backend_buffer_free(handle)
                    break
                self.slabs.append((int(base), int(handle)))
                self.free.append(int(base))
            self.alloc_seconds = time.perf_counter() - t0

    @property
    def pinned(self) -> bool:
        return bool(self.slabs)

    def held(self, arr: np.ndarray) -> int:
        """What an entry's state takes of the bound: its slab, or its own bytes."""
        return self.slab if self.held_pinned(arr) else int(arr.nbytes)

    def held_pinned(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` (from ``get``) is a page-locked slab."""
        return arr.ctypes.data in self.in_use

    def bound(self, size: int) -> int:
        """What a state of ``size`` bytes will take of the bound (a slab, or its size)."""
        return self.slab if self.pinned and size <= self.slab else size

    def get(self, size: int) -> np.ndarray:
        """Room for a state of ``size`` bytes: a free slab (``bound`` counted it), or numpy memory when it
        does not fit one or none is free (not expected: the store's bound counts slabs)."""
        if not self.free or size > self.slab:
            return np.empty(size, dtype=np.uint8)
        base = self.free.pop()
        self.in_use.add(base)
        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))

    def give(self, arr: np.ndarray) -> None:
        """``arr`` (from ``get``) is no longer used: its slab is free for the next entry."""
        base = arr.ctypes.data
        if base in self.in_use:
            self.in_use.discard(base)
            self.free.append(base)

    def close(self) -> None:
        for _, handle in self.slabs:
            self._lib.ggml_backend_buffer_free(handle)
        self.slabs.clear()
        self.free.clear()
        self.in_use.clear()


__all__ = ["HostBuffers"]
