"""Host memory for the KV tier's entries: page-locked on a GPU worker, kept for reuse.

Copying a sequence's KV out of VRAM into fresh pageable memory ran at 2.4 GB/s on an H200 (8B q8_0, 16
slots: the driver stages every copy, and each new page faults), so saving one 5k-token session (640 MiB)
held the engine thread ~0.2 s. Page-locked memory (ggml's CUDA host buffer type: ``cudaMallocHost``) is
copied by DMA; allocating it is slow, so a freed buffer is kept and given to the next entry it fits.
On a CPU worker (or where the CUDA host buffer cannot be had) buffers are plain numpy arrays.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

ROUND = 16 << 20  # a page-locked buffer's size is rounded up to this (entries grow a turn at a time)


def _cuda_host_alloc() -> tuple[Any, Any] | None:
    """(alloc(size) -> buffer, and the ggml library) through ggml's CUDA host buffer type; None off a CUDA build."""
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
    """Buffers by size: ``get`` gives an array of exactly ``size`` bytes (a view of a buffer at least that big),
    ``give`` takes it back for reuse. ``limit``: bytes of page-locked memory held at most, in use or kept."""

    def __init__(self, gpu: bool, limit: int):
        self.limit = limit
        found = _cuda_host_alloc() if gpu else None
        self._alloc: Any = found[0] if found is not None else None
        self._lib: Any = found[1] if found is not None else None
        self.free: list[tuple[int, int, int]] = []  # (size, base address, buffer handle) kept for reuse
        self.owner: dict[int, tuple[int, int, int]] = {}  # base address -> (size, base, handle) in use
        self.held = 0  # page-locked bytes, in use or kept

    @property
    def pinned(self) -> bool:
        return self._alloc is not None

    def get(self, size: int) -> np.ndarray:
        if self._alloc is None:
            return np.empty(size, dtype=np.uint8)
        fits = [b for b in self.free if size <= b[0] <= 2 * size + ROUND]
        if fits:
            buf = min(fits)
            self.free.remove(buf)
        else:
            want = -(-size // ROUND) * ROUND
            while self.free and self.held + want > self.limit:  # room for it: kept buffers let go first
                self._release(self.free.pop(self.free.index(max(self.free))))
            handle: Any = self._alloc(want) if self.held + want <= self.limit else None
            base = self._lib.ggml_backend_buffer_get_base(handle) if handle else None
            if not base:  # no page-locked memory to be had (or no room for it): pageable
                if handle:
                    self._lib.ggml_backend_buffer_free(handle)
                return np.empty(size, dtype=np.uint8)
            buf = (want, int(base), int(handle))
            self.held += want
        self.owner[buf[1]] = buf
        return np.ctypeslib.as_array((ctypes.c_uint8 * buf[0]).from_address(buf[1]))[:size]

    def give(self, arr: np.ndarray) -> None:
        """``arr`` (from ``get``) is no longer used: its page-locked buffer is kept for the next entry."""
        buf = self.owner.pop(arr.ctypes.data, None)
        if buf is not None:
            self.free.append(buf)

    def _release(self, buf: tuple[int, int, int]) -> None:
        assert self._lib is not None
        self._lib.ggml_backend_buffer_free(buf[2])
        self.held -= buf[0]

    def close(self) -> None:
        for buf in [*self.free, *self.owner.values()]:
            self._release(buf)
        self.free.clear()
        self.owner.clear()


__all__ = ["HostBuffers"]
