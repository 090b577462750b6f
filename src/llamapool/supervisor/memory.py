"""What a worker of a model needs in memory, estimated from its GGUF header (no llama.cpp here).

:func:`estimate` reads the header (``gguf_header.py``: no weights are read; well under a second) and adds
the three buffers llama.cpp allocates when a worker loads the model with ``slots`` sequences of
``ctx_per_slot`` tokens and micro-batches of ``n_ubatch`` tokens (engine/model.py's parameters):

- **weights**: the bytes of the tensors' data (every part of a split GGUF);
- **KV cache**: ``n_layer x n_head_kv x (key_length + value_length) x slots x ctx_seq x 2`` bytes (f16
  cache), ``ctx_seq`` being ``ctx_per_slot`` rounded up to a multiple of 256 as llama.cpp does for a
  cache with one stream per sequence. ``n_head_kv`` may be given per layer; ``key_length`` and
  ``value_length`` default to ``n_embd / n_head``. Sliding-window layers count at full size, as the
  engine keeps them (``swa_full``), so an iSWA model (Gemma 3) is not under-estimated;
- **compute**: llama.cpp's compute buffer, sized for its worst case, a micro-batch of ``n_ubatch``
  tokens that are all output rows. Its allocator reuses memory, so the peak is the larger of the
  logits and (without flash attention, as on CPU workers) the attention scores, plus a few rows of
  activations::

      max(n_vocab x n_ubatch x 4,                            the logits
          (n_head + 2) x ctx_seq x n_ubatch x 4)             KQ, its mask and softmax (no flash attention)
      + (n_embd + n_ff) x n_ubatch x 4                        activations

  and, on a CPU worker, the host output buffer (``n_vocab x slots x 4``: a step's rows of logits),
  which lives in the same RAM.

Calibrated with tests/memory_calibrate.py against the buffer sizes llama.cpp prints when it loads
Gemma 3 270M, SmolLM2 135M and the tests' tiny model on CPU (within +0 to +16 % of llama.cpp's
total, never below), and against the context memory NVML measured for an 8B q8_0 model on an H100
(docs/benchmarks.md's prefill sweep: within +2 %).

Each estimate adds the worker **process** itself. On a CPU worker (``CPU_PROCESS``): Python,
llamapool's worker modules, llama.cpp's threads; a worker of the tests' tiny model, whose buffers are
26 MiB, held 71 MiB of RSS once ready and 89 MiB after a request. Its whole RSS stays below the
estimate: the compute buffer is touched only as far as a step's rows reach. On a GPU
(``GPU_PROCESS``): the CUDA context, which a bare one took 529 MiB of an H200 (CUDA 13, driver 580)
and 607 MiB once cuBLAS had run; llama.cpp's kernels and its CUDA memory pool come on top (not yet
measured with llama.cpp's CUDA build).

``n_ubatch`` is the micro-batch the worker really uses, :func:`worker_ubatch`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from llamapool.gguf_header import Header, Skipped, read_header

CPU_PROCESS = 96 << 20  # a CPU worker's RSS beside llama.cpp's buffers (see above)
GPU_PROCESS = 768 << 20  # a GPU worker's device memory beside llama.cpp's buffers: the CUDA context (see above)
KV_BYTES = 2  # f16 cache (llama.cpp's default type_k / type_v)
CTX_PAD = 256  # llama.cpp pads each sequence's context (one KV stream per sequence) to a multiple of this
ATT_EXTRA = 2  # rows of attention scores beyond one a head: the mask and what the allocator keeps beside
_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def fmt_bytes(n: int | float) -> str:
    """Bytes for a log line: ``253 MiB``, ``17.6 GiB``."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.0f} MiB"
    return f"{n / 1024:.0f} KiB" if abs(n) >= 1024 else f"{int(n)} B"


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """A worker's estimated memory, in bytes."""

    weights: int
    kv: int
    compute: int
    slots: int
    ctx_per_slot: int
    process: int = 0  # the worker process beside llama.cpp's buffers (CUDA context, or RAM of a CPU worker)
    host: int = 0  # a CPU worker's host KV tier (workers.kv_host), in the same RAM
    projector: int = 0  # the model's mmproj (model.mmproj): its file's bytes

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.host + self.process + self.projector

    def text(self) -> str:
        """``253 MiB weights + 36 MiB KV (8 x 2048 tokens) + 70 MiB compute + 96 MiB process = 455 MiB``."""
        host = f" + {fmt_bytes(self.host)} host KV tier" if self.host else ""
        process = f" + {fmt_bytes(self.process)} process" if self.process else ""
        proj = f" + {fmt_bytes(self.projector)} projector" if self.projector else ""
        return (f"{fmt_bytes(self.weights)} weights{proj} + {fmt_bytes(self.kv)} KV ({self.slots} x "
                f"{self.ctx_per_slot} tokens) + {fmt_bytes(self.compute)} compute{host}{process} = "
                f"{fmt_bytes(self.total)}")


@dataclass(frozen=True, slots=True)
class Shape:
    """What the estimate needs from a GGUF header."""

    arch: str
    weights: int  # bytes of tensor data
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    key_length: int
    value_length: int
    n_vocab: int


def _parts(path: str) -> list[str]:
    """The files of a (possibly split) GGUF: ``-00001-of-00003.gguf`` names its siblings."""
    m = _PART.search(path)
    if not m:
        return [path]
    return [path[:m.start()] + f"-{i:05d}-of-{m.group(2)}.gguf" for i in range(1, int(m.group(2)) + 1)]


def _tensor_bytes(path: str, h: Header) -> int:
    """The bytes of the tensors' data: from their types' block sizes; the file past the header for a type
    this gguf package does not know."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    total = 0
    for _, elements, ggml_type in h.tensors:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            return os.path.getsize(path) - h.data_offset
        total += elements // block * size
    return total


def read_shape(path: str | os.PathLike[str]) -> Shape:
    """The header of a GGUF file; ValueError naming the file and the key when one is missing or odd."""
    path = str(path)
    h = read_header(path)
    arch = h.fields.get("general.architecture")
    if not arch:
        raise ValueError(f"{path}: not a model GGUF (no general.architecture)")

    def number(key: str, default: int | None = None) -> int:
        v = h.fields.get(f"{arch}.{key}")
        if v is None or isinstance(v, Skipped):
            if default is None:
                raise ValueError(f"{path}: the GGUF header has no {arch}.{key}")
            return default
        if isinstance(v, list):  # given per layer (e.g. feed_forward_length of some models): the largest
            v = max(v) if v else 0
        if not isinstance(v, int | float):
            raise ValueError(f"{path}: {arch}.{key} is not a number ({v!r})")
        return int(v)

    n_layer = number("block_count")
    n_embd = number("embedding_length")
    n_head = number("attention.head_count")
    if n_layer <= 0 or n_embd <= 0 or n_head <= 0:
        raise ValueError(f"{path}: block_count, embedding_length and attention.head_count must be > 0 "
                         f"(got {n_layer}, {n_embd}, {n_head})")
    kv = h.fields.get(f"{arch}.attention.head_count_kv")
    if kv is None:
        heads_kv = (n_head,) * n_layer
    elif isinstance(kv, list):
        heads_kv = tuple(int(x) for x in kv[:n_layer]) + (n_head,) * max(0, n_layer - len(kv))
    else:
        heads_kv = (int(kv),) * n_layer
    head_dim = n_embd // n_head
    vocab = number("vocab_size", 0)
    if not vocab:
        tokens = h.fields.get("tokenizer.ggml.tokens")
        vocab = tokens.length if isinstance(tokens, Skipped) else len(tokens or ())
    weights = _tensor_bytes(path, h)
    for part in _parts(path)[1:]:
        weights += _tensor_bytes(part, read_header(part))
    return Shape(str(arch), weights, n_layer, n_embd, number("feed_forward_length", 4 * n_embd), n_head, heads_kv,
                 number("attention.key_length", head_dim), number("attention.value_length", head_dim), vocab)


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def worker_ubatch(n_ubatch: int, max_batch_tokens: int, slots: int) -> int:
    """The micro-batch a worker runs: llama.cpp's ``n_ubatch`` is at most its ``n_batch``, the step budget
    plus a token a slot (engine/model.py's context_params)."""
    return min(n_ubatch, max_batch_tokens + slots)


def need_of(shape: Shape, slots: int, ctx_per_slot: int, n_ubatch: int, gpu: bool,
            flash_attn: bool = True) -> MemoryNeed:
    """The estimate for a header already read (the formula of the module docstring)."""
    for name, v in (("slots", slots), ("ctx_per_slot", ctx_per_slot), ("n_ubatch", n_ubatch)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"memory estimate: {name} must be a positive integer (got {v!r})")
    ctx_seq = _pad(ctx_per_slot, CTX_PAD)
    kv = sum(h * (shape.key_length + shape.value_length) for h in shape.n_head_kv) * slots * ctx_seq * KV_BYTES
    f32 = 4
    peak = shape.n_vocab * n_ubatch * f32
    if not (flash_attn and gpu):  # llamapool runs flash attention on GPUs only (engine/model.py)
        peak = max(peak, (shape.n_head + ATT_EXTRA) * ctx_seq * n_ubatch * f32)
    compute = peak + (shape.n_embd + shape.n_ff) * n_ubatch * f32
    if not gpu:
        compute += shape.n_vocab * slots * f32  # the host's output buffer: in the same RAM on a CPU worker
    return MemoryNeed(shape.weights, kv, compute, slots, ctx_per_slot, GPU_PROCESS if gpu else CPU_PROCESS)


def estimate(path: str | os.PathLike[str], slots: int, ctx_per_slot: int, n_ubatch: int, gpu: bool,
             flash_attn: bool = True, mmproj: str = "") -> MemoryNeed:
    """What a worker of the GGUF at ``path`` needs (the module docstring's formula), its projector
    ``mmproj`` (a file: its size) included. ``FileNotFoundError`` for a missing file, ``ValueError`` for one
    that is not a model GGUF."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    need = need_of(read_shape(path), slots, ctx_per_slot, n_ubatch, gpu, flash_attn)
    if mmproj:
        if not Path(mmproj).is_file():
            raise FileNotFoundError(f"projector file {mmproj} (model.mmproj) does not exist")
        need = dataclasses.replace(need, projector=os.path.getsize(mmproj))
    return need
