"""Images through libmtmd: the projector (a model's ``mmproj``), a prompt's images as tokens, and their
embeddings fed into the context.

An image in a chat prompt becomes what ``mtmd_tokenize`` makes of libmtmd's media marker: text tokens
(the model's image opening and closing, e.g. Gemma 3's ``<start_of_image>``) around an image chunk of
``n`` positions. In the prompt's token array the chunk's positions hold pseudo token ids derived from the
image's content hash (:func:`pseudo_ids`): the prefix cache, the host tier and kv-events match a
returning image as they match text, so it is neither encoded nor prefilled again. The ids are never fed as
tokens: a step feeds a chunk's embeddings (``mtmd_encode_chunk``) in a ``llama_decode`` of their own
(:class:`EmbdBatch`, ``Engine._feed_media``). Projectors with M-RoPE (2-D positions: Qwen2-VL and later)
are refused: llamapool's batches carry one position a token.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.worker.engine.model import EngineError


@dataclass(eq=False)
class Chunks:
    """An ``mtmd_input_chunks`` list, freed with this object."""

    ptr: Any
    free: Any  # mtmd_input_chunks_free (held: at interpreter exit no module can be imported)

    def __del__(self) -> None:
        if self.ptr:
            self.free(self.ptr)
            self.ptr = None


@dataclass(eq=False)
class MediaSpan:
    """An image chunk in a prompt: positions ``start .. start + n`` (pseudo ids in the token array)."""

    start: int
    n: int
    chunk: Any  # the mtmd_input_chunk (owned by ``owner``); None once fed (its preprocessed pixels freed)
    owner: Chunks | None
    digest: str  # the image's sha256

    @property
    def end(self) -> int:
        return self.start + self.n


def pseudo_ids(digest: str, n: int, n_vocab: int) -> np.ndarray:
    """``n`` token ids standing for the image of sha256 ``digest`` in the prefix cache's keys: the same
    image, the same ids (in every process: they come from the digest alone)."""
    seed = int.from_bytes(hashlib.sha256(f"llamapool-image:{digest}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, n_vocab, n, dtype=np.int64).astype(np.int32)


class Projector:
    """A model's mmproj, loaded by libmtmd on the engine thread; its calls are the engine thread's alone."""

    def __init__(self, path: str, model: Any, gpu: bool, n_threads: int):
        try:
            from llama_cpp import mtmd_cpp as M
        except (FileNotFoundError, OSError) as e:
            raise EngineError(f"model.mmproj is set, but llama-cpp-python was built without libmtmd ({e}): "
                              f"rebuild it (make install)") from None
        from llamapool.worker.llamalog import route_llama_logs

        self.M = M
        logs = route_llama_logs().callback  # libmtmd's log as llama.cpp's (worker/llamalog.py)
        M.mtmd_log_set(logs, ctypes.c_void_p(0))
        M.mtmd_helper_log_set(logs, ctypes.c_void_p(0))
        p = M.mtmd_context_params_default()
        p.use_gpu = gpu
        p.print_timings = False
        p.n_threads = max(1, n_threads)
        p.warmup = False
        self.ctx = M.mtmd_init_from_file(path.encode(), model, p)
        if not self.ctx:
            raise EngineError(f"libmtmd could not load the projector {path} (model.mmproj) for this model: not an "
                              f"mmproj GGUF, or made for another model (its embedding width must match)")
        if not M.mtmd_support_vision(self.ctx):
            self.close()
            raise EngineError(f"the projector {path} (model.mmproj) has no vision encoder; llamapool takes images only")
        if M.mtmd_decode_use_mrope(self.ctx):
            self.close()
            raise EngineError(f"the projector {path} (model.mmproj) uses M-RoPE (2-D image positions, Qwen2-VL "
                              f"and later), which llamapool does not support yet")
        # the engine thread encodes; the I/O thread may tokenize too (a render: worker/tasks.py): one at a time
        self.lock = threading.Lock()
        self.non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, None))
        self.marker = M.mtmd_default_marker()
        self.n_embd = L.llama_model_n_embd_inp(model)

    def close(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
            self.ctx = None

    def tokenize(self, data: bytes, digest: str) -> list[tuple[list[int], Chunks | None, Any]]:
        """The image's segments: ``(text tokens, None, None)`` and ``([], owner, image chunk)`` in order;
        ``ValueError`` when libmtmd cannot decode it."""
        with self.lock:
            return self._tokenize(data, digest)

    def _tokenize(self, data: bytes, digest: str) -> list[tuple[list[int], Chunks | None, Any]]:
        M = self.M
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if not bitmap:
            raise ValueError("could not be decoded as an image")
        try:
            if M.mtmd_bitmap_is_audio(bitmap):
                raise ValueError("is audio, not an image (llamapool takes images only)")
            M.mtmd_bitmap_set_id(bitmap, digest.encode())
            owner = Chunks(M.mtmd_input_chunks_init(), M.mtmd_input_chunks_free)
            text = M.mtmd_input_text(self.marker, len(self.marker), False, True)
            arr = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = M.mtmd_tokenize(self.ctx, owner.ptr, ctypes.byref(text), arr, 1)
        finally:
            M.mtmd_bitmap_free(bitmap)
        if rc != 0:
            raise ValueError(f"could not be prepared for the projector (mtmd_tokenize returned {rc})")
        out: list[tuple[list[int], Chunks | None, Any]] = []
        for i in range(M.mtmd_input_chunks_size(owner.ptr)):
            chunk = M.mtmd_input_chunks_get(owner.ptr, i)
            kind = M.mtmd_input_chunk_get_type(chunk)
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                out.append(([int(toks[k]) for k in range(n.value)], None, None))
            elif kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                if M.mtmd_input_chunk_get_n_pos(chunk) != M.mtmd_input_chunk_get_n_tokens(chunk):
                    raise ValueError("needs positions other than one a token, which llamapool does not support")
                out.append(([], owner, chunk))
            else:
                raise ValueError("is not an image (llamapool takes images only)")
        return out

    def encode(self, span: MediaSpan) -> np.ndarray:
        """The image chunk's embeddings, ``(n, n_embd)`` float32 (a copy: the next encode overwrites them)."""
        M = self.M
        with self.lock:
            rc = M.mtmd_encode_chunk(self.ctx, span.chunk)
            if rc != 0:
                raise RuntimeError(f"the projector could not encode the image (mtmd_encode_chunk returned {rc})")
            ptr = M.mtmd_get_output_embd(self.ctx)
            raw = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(raw, shape=(span.n * self.n_embd,)).reshape(span.n, self.n_embd).copy()


class EmbdBatch:
    """A ``llama_batch`` of embeddings (rows of ``n_embd`` floats), numpy-owned, no output rows."""

    def __init__(self, capacity: int, n_embd: int):
        self.capacity = capacity
        self.n_embd = n_embd
        self.embd = np.zeros((capacity, n_embd), dtype=np.float32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        raw: Any = L.llama_batch()
        raw.token = None
        raw.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        raw.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        raw.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        raw.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        raw.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.raw = raw
        self.n = 0

    def add(self, seq_id: int, pos: int, rows: np.ndarray) -> None:
        n = len(rows)
        self.embd[self.n : self.n + n] = rows
        self.pos[self.n : self.n + n] = np.arange(pos, pos + n, dtype=np.int32)
        self.seq[self.n : self.n + n] = seq_id
        self.n += n

    def decode(self, ctx: Any) -> int:
        """``llama_decode`` of the rows added (then none are left); its return code."""
        if not self.n:
            return 0
        self.raw.n_tokens = self.n
        rc = int(L.llama_decode(ctx, self.raw))
        self.n = 0
        return rc
