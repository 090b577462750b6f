"""The llama.cpp model and context: the engine's configuration, loading, and the context's parameters."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import llama_cpp as L

from llamapool.worker.settings import EngineSettings, step_budget


class EngineError(Exception):
    """The model or context could not be created; ``permanent`` when retrying cannot help."""

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """A model's :class:`EngineSettings` and this process's facts: the model file, its GPUs. A
    ``max_batch_tokens`` of 0 is resolved here (``step_budget``)."""

    model_path: str
    gpu: bool = False
    n_gpus: int = 1  # GPUs this process sees (with gpu): more than one splits the layers between them
    backend_sampling: bool | None = None  # None: as gpu_sampling on a GPU; True forces it (tests)
    kv_unified: bool = False  # one KV stream for all sequences (benchmarks only: slower, see context_params)
    kv_events_block: int = 0  # [kv_events]: the block size of the KV-cache events it reports (0: none)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.max_batch_tokens:
            object.__setattr__(self, "max_batch_tokens", step_budget(0, self.slots, self.gpu))


def model_params(cfg: EngineConfig) -> tuple[Any, Any]:
    """llama.cpp's model parameters: every layer on the GPU(s), none on CPU workers. Over several GPUs
    (a worker of a GPU group) the layers are split between them (split mode layer, ``tensor_split``
    shares if given). Returns the parameters and the ctypes array they point to (keep it alive)."""
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = -1 if cfg.gpu else 0
    mp.main_gpu = 0
    # On the CPU, llama.cpp's repacked weight layouts (e.g. Q4_K for AVX2) compute a batch of rows with
    # other kernels than one row, so a prompt's greedy text would depend on what runs beside it (seen on
    # an AMD EPYC without AVX-512). Plain layouts keep every row's arithmetic the same, batched or not.
    mp.use_extra_bufts = cfg.gpu
    keep = None
    if cfg.gpu and cfg.n_gpus > 1:
        mp.split_mode = L.LLAMA_SPLIT_MODE_LAYER
        if cfg.tensor_split:
            keep = (ctypes.c_float * max(L.llama_max_devices(), len(cfg.tensor_split)))(*cfg.tensor_split)
            mp.tensor_split = ctypes.cast(keep, ctypes.POINTER(ctypes.c_float))
    else:
        mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
    return mp, keep


def context_params(cfg: EngineConfig) -> Any:
    """llama.cpp's context parameters for the engine (the sampling part adds its graph samplers)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = cfg.slots * cfg.ctx_per_slot
    # A step holds at most the budget plus one padding token per free slot (see batch.fill).
    cp.n_batch = cfg.max_batch_tokens + cfg.slots
    cp.n_ubatch = min(cfg.n_ubatch, cp.n_batch)
    cp.n_seq_max = cfg.slots
    # One KV stream per sequence: attention for a token reads only its own sequence's cells.
    # A unified cache makes every token attend over (masked) cells of all sequences, so a
    # step costs B x total context: 2.8x slower at 64 sequences of 1,024 tokens on an H200.
    cp.kv_unified = cfg.kv_unified
    # A sliding-window model (Gemma 3: llama.cpp's iSWA cache) keeps every position of the window
    # layers too, so a prefix trimmed with seq_rm or copied with seq_cp is exact; a window-sized
    # cache drops positions that a reused prefix still needs (tests/test_real_model.py).
    cp.swa_full = True
    cp.no_perf = True
    # Flash attention on GPUs only: llama.cpp's CPU flash attention computes a sequence's row otherwise
    # when other sequences share the batch, so a prompt's greedy text would depend on its neighbours.
    cp.flash_attn_type = (
        L.LLAMA_FLASH_ATTN_TYPE_AUTO if cfg.flash_attn and cfg.gpu else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    if cfg.threads > 0:
        cp.n_threads = cp.n_threads_batch = cfg.threads
    return cp


def visible_gpus() -> list[str]:
    """The GPU devices llama.cpp sees in this process, as ``name (PCI bus id)`` strings."""

    class Props(ctypes.Structure):
        _fields_ = [
            ("name", ctypes.c_char_p),
            ("description", ctypes.c_char_p),
            ("memory_free", ctypes.c_size_t),
            ("memory_total", ctypes.c_size_t),
            ("type", ctypes.c_int),
            ("device_id", ctypes.c_char_p),
            ("_caps", ctypes.c_byte * 64),
        ]

    lib = L.llama_cpp._lib  # type: ignore[attr-defined]
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get_props.argtypes = [ctypes.c_void_p, ctypes.POINTER(Props)]
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        props = Props()
        lib.ggml_backend_dev_get_props(lib.ggml_backend_dev_get(i), ctypes.byref(props))
        if props.type in (1, 2):  # GGML_BACKEND_DEVICE_TYPE_GPU / IGPU
            desc = (props.description or b"").decode(errors="replace")
            bus = (props.device_id or b"?").decode(errors="replace")
            found.append(f"{desc} ({bus})")
    return found


def quiet_llama_logs() -> None:
    """Keep llama.cpp's warnings and errors (the evidence after a crash), drop its info chatter."""
    from llama_cpp import _logger

    _logger.set_verbose(False)


def load_model(cfg: EngineConfig) -> tuple[Any, Any]:
    """llama.cpp set up (its log through llamapool's logger) and the model loaded, with the ctypes array its
    parameters point to (keep it alive); :class:`EngineError` when the file is missing or unusable."""
    if not os.path.isfile(cfg.model_path):
        raise EngineError(f"model file {cfg.model_path} does not exist")
    from llamapool.worker.llamalog import route_llama_logs

    route_llama_logs()
    if cfg.deterministic and not cfg.gpu:
        # K-quant products of 8 rows or more take llama.cpp's "tiled" kernels, whose sums round otherwise
        # than one row's vec_dot: off, every row is computed alike (read once, at the process's first product)
        os.environ["GGML_CPU_TILED_MM"] = "0"
    L.llama_backend_init()
    mp, keep = model_params(cfg)
    model = L.llama_model_load_from_file(cfg.model_path.encode(), mp)
    if not model:
        raise EngineError(f"llama.cpp could not load model {cfg.model_path} (corrupt or unsupported)")
    return model, keep
