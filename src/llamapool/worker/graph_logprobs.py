"""Greedy picks with logprobs computed in the decode graph: only ``3k + 1`` numbers a row leave the GPU.

A request that asks for logprobs used to have its whole logits row copied to the host every step
(32,000 floats at 1B, 128,256 at 8B) and log-softmaxed and partially sorted there in numpy: a third of
the plain speed at 64 streams. This module is a llama.cpp sampler (its ``backend_apply`` adds ggml ops
to the decode graph, as llama.cpp's own greedy, top-k and dist samplers do) that computes, once for
all the step's output rows (llama.cpp calls a sampler for each row, with a view of its row of the
step's logits; the first call builds the batched ops, the others take views of their results: one op
a row would be a kernel a row, and ggml's CUDA top-k a row took ~5 ms a step at 64 rows):

- ``ids``: each row's ``k`` likeliest tokens, likeliest first (``ggml_argsort_top_k``),
- ``vals``: their raw logits (``ggml_get_rows``),
- ``probs``: their softmax probabilities (``ggml_soft_max`` over the rows, then ``ggml_get_rows``),
- ``sampled``: the greedy pick, the first of ``ids``,

and hands them to llama.cpp's backend-sampling outputs (``logits``, ``probs``, ``candidates``,
``sampled``), which copy just those to the host. There, the row's log-sum-exp is
``vals[j] - log(probs[j])`` at the likeliest ``j`` (its probability is at least ``1/n_vocab``, so the
log is well conditioned), and each alternative's logprob is ``vals - lse``: the log-softmax of the raw
logits, as the host path gives (:func:`llamapool.worker.sampling.log_softmax_top`).

Only greedy rows without penalties, biases or a grammar take it (their pick is the row's argmax, so
the chosen token is the first of the top ``k``); other logprob rows are still computed on the host.
The sampler is written with llama-cpp-python's ctypes bindings and ggml's C API, so it needs no
rebuild of llama.cpp; its callbacks run when llama.cpp builds a graph, not every step (a graph is
reused while the batch's shape and samplers stay).
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as L
import numpy as np

MAX_TOP = 20  # the most alternatives a row asks for (OpenAI's top_logprobs)

_vp = ctypes.c_void_p


def _ggml() -> Any:
    """ggml's C API (the library llama_cpp loaded), with the signatures the sampler calls."""
    from llama_cpp._ggml import libggml as g

    i64 = ctypes.c_int64
    for name, args in (("ggml_top_k", [_vp, _vp, ctypes.c_int]), ("ggml_argsort_top_k", [_vp, _vp, ctypes.c_int]),
                       ("ggml_get_rows", [_vp, _vp, _vp]), ("ggml_cont", [_vp, _vp]),
                       ("ggml_reshape_2d", [_vp, _vp, i64, i64]), ("ggml_reshape_3d", [_vp, _vp, i64, i64, i64]),
                       ("ggml_view_1d", [_vp, _vp, i64, ctypes.c_size_t]), ("ggml_soft_max", [_vp, _vp]),
                       ("ggml_set_name", [_vp, ctypes.c_char_p])):
        f = getattr(g, name)
        f.argtypes, f.restype = args, _vp
    g.ggml_nelements.argtypes, g.ggml_nelements.restype = [_vp], ctypes.c_int64
    return g


class _Tensor(ctypes.Structure):
    """The head of ggml's ``struct ggml_tensor`` (ggml.h), up to the view fields the sampler reads."""

    _fields_ = [("type", ctypes.c_int), ("buffer", _vp), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", _vp * 10), ("view_src", _vp), ("view_offs", ctypes.c_size_t)]


class _Iface(ctypes.Structure):
    """llama.cpp's ``llama_sampler_i``: the fields up to ``backend_apply`` (the rest stay NULL)."""

    _fields_ = [("name", _vp), ("accept", _vp), ("apply", _vp), ("reset", _vp), ("clone", _vp), ("free", _vp),
                ("backend_init", _vp), ("backend_accept", _vp), ("backend_apply", _vp),
                ("backend_set_input", _vp), ("backend_reset", _vp), ("copy_state", _vp)]


class GraphLogprobs:
    """The sampler's interface (one per engine: its callbacks must outlive every sampler made from it)
    and the reading of a step's rows. Every row keeps :data:`MAX_TOP` alternatives (a request shows as
    many as it asks for): one row costs what another does, and a step's rows read as one array."""

    def __init__(self) -> None:
        self._g = _ggml()
        self._name_buf = ctypes.create_string_buffer(b"llamapool-logprobs")
        # llama_sampler_i, its pointer-returning callbacks typed as void * (ctypes callbacks return only
        # simple types); clone stays NULL (nothing clones these samplers)
        f = ctypes.CFUNCTYPE
        self._callbacks = (f(_vp, _vp)(self._name), L.llama_sampler_i_apply(self._apply_host),
                           L.llama_sampler_i_backend_init(self._init), L.llama_sampler_i_backend_apply(self._apply),
                           L.llama_sampler_i_backend_reset(self._reset))
        name, apply, init, backend_apply = (ctypes.cast(c, _vp) for c in self._callbacks[:4])
        self._iface = _Iface(name=name, apply=apply, backend_init=init, backend_apply=backend_apply,
                             backend_reset=ctypes.cast(self._callbacks[4], _vp))
        self._batch: dict[int, tuple[int, int, int, int]] = {}  # the graph being built: its logits -> results

    def chain(self) -> Any:
        """A sampler chain (freed with ``llama_sampler_free``) that picks greedily and keeps the row's
        :data:`MAX_TOP` likeliest tokens with their logits and probabilities."""
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, self._make(MAX_TOP))
        return chain

    def _make(self, k: int) -> Any:
        iface = ctypes.cast(ctypes.pointer(self._iface), ctypes.POINTER(L.llama_sampler_i))
        return L.llama_sampler_init(iface, _vp(k))  # the sampler's context is k itself

    # ------------------------------------------------------------ callbacks (from llama.cpp)

    def _name(self, smpl: int) -> int:
        return ctypes.addressof(self._name_buf)

    def _init(self, smpl: Any, buft: Any, n_outputs_max_per_seq: int) -> bool:
        return True  # top_k, get_rows, soft_max and argmax: every backend has them

    def _reset(self, smpl: Any) -> None:
        """A graph is about to be built: the last one's batched results are not its."""
        self._batch.clear()

    def _apply(self, smpl: Any, ctx: int, gf: int, data: Any) -> None:
        """The row's outputs: views of results computed once for all the step's output rows (llama.cpp
        hands each sampler a view of its row of the step's logits; one op over all rows is one kernel,
        where one a row would be one a row: at 64 rows, ggml's CUDA top-k alone took ~5 ms a step)."""
        g, k = self._g, int(smpl.contents.ctx or 0)
        d = data.contents
        row = ctypes.cast(d.logits, ctypes.POINTER(_Tensor)).contents
        whole = row.view_src or d.logits  # the step's logits (a probe graph's row is a tensor of its own)
        t = ctypes.cast(whole, ctypes.POINTER(_Tensor)).contents
        n, rows = int(t.ne[0]), int(t.ne[1]) if row.view_src else 1
        r = int(row.view_offs) // int(t.nb[1]) if row.view_src else 0
        if whole not in self._batch:
            self._batch[whole] = self._batched(ctx, whole, n, rows, k)
        ids, vals, probs, _ = self._batch[whole]
        at = 4 * k * r
        d.candidates = g.ggml_view_1d(ctx, ids, k, at)
        d.logits = g.ggml_view_1d(ctx, vals, k, at)
        d.probs = g.ggml_view_1d(ctx, probs, k, at)
        d.sampled = g.ggml_view_1d(ctx, ids, 1, at)  # sorted likeliest first: the greedy pick

    def _batched(self, ctx: int, logits: int, n: int, rows: int, k: int) -> tuple[int, int, int, int]:
        """Over all ``rows`` of ``logits`` (``n`` a row): the ``k`` likeliest ids sorted (``[k, rows]``), their
        logits and softmax probabilities (``[1, k, rows]`` each)."""
        g = self._g
        m = g.ggml_reshape_2d(ctx, logits, n, rows)
        ids = g.ggml_cont(ctx, g.ggml_argsort_top_k(ctx, m, k))
        vals = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, m, 1, n, rows), ids)
        probs = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, g.ggml_soft_max(ctx, m), 1, n, rows), ids)
        for tensor, name in ((ids, b"logprobs_ids"), (vals, b"logprobs_vals"), (probs, b"logprobs_probs")):
            g.ggml_set_name(tensor, name)
        return ids, vals, probs, rows

    def _apply_host(self, smpl: Any, cur_p: Any) -> None:
        """On the host (a graph that could not take the sampler): greedy."""
        arr = cur_p.contents
        logits = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_float)),
                                       shape=(arr.size, 3))[:, 1]  # llama_token_data: id, logit, p
        arr.selected = int(np.argmax(logits))

    # ------------------------------------------------------------ a step's rows

    def read(self, ctx: Any, idxs: list[int], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For output rows ``idxs`` of the step just decoded (each sampled by a chain of :meth:`chain`):
        the greedy token's logprob and the ``k`` (at most :data:`MAX_TOP`) likeliest tokens with theirs,
        likeliest first, equal values by token id (``(chosen, ids, values)``, shaped ``(n,)``,
        ``(n, k)``, ``(n, k)``)."""
        k = max(k, 1)
        m = int(L.llama_get_sampled_logits_count_ith(ctx, idxs[0]))
        if m != MAX_TOP:
            raise RuntimeError(f"output row {idxs[0]} has {m} logprob candidates, not {MAX_TOP}: not sampled by "
                               "a logprobs chain")
        v = _gather([L.llama_get_sampled_logits_ith(ctx, i) for i in idxs], np.float32)
        p = _gather([L.llama_get_sampled_probs_ith(ctx, i) for i in idxs], np.float32)
        c = _gather([L.llama_get_sampled_candidates_ith(ctx, i) for i in idxs], np.int32)
        order = np.lexsort((c, -v), axis=-1)[:, :k]  # by value, largest first; equal values by token id
        vals, probs = np.take_along_axis(v, order, -1), np.take_along_axis(p, order, -1)
        lps = vals - (vals[:, :1] - np.log(probs[:, :1]))  # minus the row's log-sum-exp
        return lps[:, 0].copy(), np.take_along_axis(c, order, -1).astype(np.intp), lps


def _gather(ptrs: list[Any], dtype: type[np.generic]) -> np.ndarray:
    """The :data:`MAX_TOP` 4-byte values at each of ``ptrs`` (rows of one llama.cpp buffer), as one array:
    a view of the span they lie in, indexed (a copy of just those)."""
    addrs = np.array([ctypes.cast(q, _vp).value or 0 for q in ptrs], np.int64)
    if not addrs.all():
        raise RuntimeError("an output row has no logprob candidates")
    lo = int(addrs.min())
    span = np.frombuffer(memoryview((ctypes.c_char * (int(addrs.max()) - lo + 4 * MAX_TOP)).from_address(lo)), dtype)
    return span[((addrs - lo) // 4)[:, None] + np.arange(MAX_TOP)]
