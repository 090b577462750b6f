"""The llama.cpp patches llamapool carries (patches/llama.cpp/): the setting each one reads from a
worker's environment, and whether the llama.cpp a worker loaded has it.

0001 (``GGML_CUDA_CUBLAS_MIN_BATCH``): quantised matrix products with at least N rows of activations
(prompt batches) dequantise and run in cuBLAS instead of llama.cpp's MMQ kernels; decode steps keep
MMQ. llama.cpp reads the variable once, when its CUDA backend first chooses a kernel, so the
supervisor puts it into each worker's environment before the worker starts (``model.prefill_cublas_min_rows``).

0002 (``GGML_CUDA_DETERMINISTIC``): batch-invariant CUDA kernels, a row's numbers independent of the batch
it is computed in (quantised products always in MMQ, each output tile reduced whole by one block; flash
attention always in its MMA kernel at its widest tile, no split of the KV). ``model.deterministic`` on a
GPU worker sets it; a worker whose llama.cpp lacks the patch refuses to start (the mode's promise could
not hold).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path

CUBLAS_MIN_BATCH_ENV = "GGML_CUDA_CUBLAS_MIN_BATCH"
CUBLAS_PATCH = "patches/llama.cpp/0001-cuda-cublas-for-large-quantized-batches.patch"
DETERMINISTIC_ENV = "GGML_CUDA_DETERMINISTIC"
DETERMINISTIC_PATCH = "patches/llama.cpp/0002-cuda-batch-invariant-kernels.patch"


def worker_env(prefill_cublas_min_rows: int, deterministic: bool = False) -> dict[str, str]:
    """The variables a worker's llama.cpp reads for the model's settings (``0``: llama.cpp's own choice)."""
    return {CUBLAS_MIN_BATCH_ENV: str(max(0, prefill_cublas_min_rows)),
            DETERMINISTIC_ENV: "1" if deterministic else "0"}


def _has_bytes(path: Path, needle: bytes) -> bool:
    with open(path, "rb") as fh:
        try:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return mm.find(needle) >= 0
        except ValueError:  # an empty file cannot be mapped
            return False


def cuda_libraries(lib_dir: Path) -> list[Path]:
    """The CUDA backend's shared libraries among llama.cpp's (``libggml-cuda.so`` in llama-cpp-python)."""
    if not lib_dir.is_dir():
        return []
    return sorted({p.resolve() for p in lib_dir.glob("*ggml-cuda*") if p.is_file()})  # one per file, not per link


def cublas_rows_ignored(env: Mapping[str, str], lib_dir: Path) -> str:
    """Why ``prefill_cublas_min_rows`` does nothing in the llama.cpp loaded from ``lib_dir`` ("" when the
    setting is 0 or the build has the patch): no CUDA backend, or one built without patch 0001."""
    rows = env.get(CUBLAS_MIN_BATCH_ENV, "").strip()
    if rows in ("", "0"):
        return ""
    libs = cuda_libraries(lib_dir)
    if not libs:
        return (f"prefill_cublas_min_rows = {rows} does nothing: the llama.cpp in {lib_dir} has no CUDA backend "
                f"(build it with `make install CUDA=1`, docs/install.md)")
    if any(_has_bytes(p, CUBLAS_MIN_BATCH_ENV.encode()) for p in libs):
        return ""
    return (f"prefill_cublas_min_rows = {rows} does nothing: {libs[0]} was built without {CUBLAS_PATCH} "
            f"(llama.cpp's own kernel choice stays; rebuild with `make install CUDA=1`, docs/install.md)")


def deterministic_unsupported(env: Mapping[str, str], lib_dir: Path) -> str:
    """Why a GPU worker cannot keep ``model.deterministic``'s promise with the llama.cpp loaded from
    ``lib_dir`` ("" when the mode is off or the CUDA backend has patch 0002)."""
    if env.get(DETERMINISTIC_ENV, "").strip() in ("", "0"):
        return ""
    libs = cuda_libraries(lib_dir)
    if libs and any(_has_bytes(p, DETERMINISTIC_ENV.encode()) for p in libs):
        return ""
    what = f"{libs[0]} was built without {DETERMINISTIC_PATCH}" if libs else \
        f"the llama.cpp in {lib_dir} has no CUDA backend"
    return (f"model.deterministic = true on a GPU worker needs batch-invariant CUDA kernels, and {what} "
            f"(rebuild with `make install CUDA=1`, docs/install.md; or set model.deterministic = false)")
