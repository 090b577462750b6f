"""llamapool's own samplers in the decode graph: greedy picks that leave only the token, and greedy picks
with their logprobs that leave only ``3k`` numbers more.

llama.cpp's backend sampling (its graph samplers) hands each sampler a view of its row of the step's
logits, and copies to the host what the sampler leaves in its outputs (``sampled``, ``logits``, ``probs``,
``candidates``). Its own greedy sampler leaves the whole row in ``logits``: every greedy row's logits cross
to the host each step (64 rows of 128,256 floats, 32 MB a step at an 8B vocabulary). And a request that
asked for logprobs had its row copied and log-softmaxed and partially sorted on the host in numpy: a
third of the plain speed at 64 streams. The samplers here (their ``backend_apply`` adds ggml ops, as
llama.cpp's own greedy, top-k and dist samplers do) compute, once for all the step's output rows (the
first row's call builds the ops over the step's logits, the others take views of their results: one
op a row would be a kernel a row, and ggml's CUDA top-k a row took ~5 ms a step at 64 rows):

- ``greedy``: each row's argmax (``ggml_argmax``), and nothing else leaves the graph;
- ``logprobs``: the argmax, and each row's ``k`` likeliest tokens (``ggml_argsort_top_k`` over many rows,
  ``ggml_top_k`` over a few), their raw logits and softmax probabilities (``ggml_soft_max``, then
  ``ggml_get_rows``);
- ``masked`` (a constrained greedy row): the argmax of the row under its grammar's mask, and nothing
  else leaves the graph. A table ``[16, 65536]`` (4 MiB, made once in a buffer of the logits' backend)
  holds in row ``v`` 0 where bit ``j`` of ``v`` is set, else :data:`REFUSED`; the step's masked rows'
  masks (llguidance's uint32 words as uint16 halves, one int32 index each) and their rows of the logits
  are two graph inputs, set by the masked samplers' ``backend_set_input`` inside ``llama_decode``
  (so the masks must be complete before it). Four kernels for all masked rows: the rows (``get_rows``),
  their bias (``get_rows`` of the table, the first ``n_vocab`` of each row's taken), the sum, its argmax.
  A row whose mask is not applied this step (:attr:`GraphSamplers.apply`: "on_refusal" sampling) reads
  the table's all-allowed row: its plain argmax, checked on the host.

On the host, a logprobs row's log-sum-exp is ``vals[j] - log(probs[j])`` at the likeliest ``j`` (its
probability is at least ``1/n_vocab``, so the log is well conditioned), and each alternative's logprob
is ``vals - lse``: the log-softmax of the raw logits, as the host path gives
(:func:`llamapool.worker.sampling.log_softmax_top`).

Only greedy rows without penalties or biases take them (with ``Sampling.graph_masks`` "keeping", a
constrained greedy row keeps llama.cpp's greedy sampler instead: a refused pick is replaced from the
row's logits, which cross to the host every step). The samplers are written with llama-cpp-python's
ctypes bindings and ggml's C API, so they need no rebuild of llama.cpp; their callbacks run when
llama.cpp builds a graph, not every step (a graph is reused while the batch's shape and samplers stay).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

MAX_TOP = 20  # the most alternatives a row asks for (OpenAI's top_logprobs)
FEW_ROWS = 8  # up to this many rows, ggml_top_k (one selection a row); more, one argsort over them all
MASKED = 1 << 16  # a sampler context from here on: the masked greedy sampler of slot ``ctx - MASKED``
CHUNK_BITS = 16  # a mask's tokens one row of the table covers (a uint32 word of llguidance's mask: two rows)
ALLOW_ALL = (1 << CHUNK_BITS) - 1  # the table's row where every token of a chunk is allowed
REFUSED = -1e30  # a refused token's bias: finite, so a row that allows nothing still has an argmax
F32, I32 = 0, 26  # ggml_type
WEIGHTS = 1  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS: ops on the table run where it lies

_vp = ctypes.c_void_p


def _ggml() -> Any:
    """ggml's C API (the library llama_cpp loaded), with the signatures the sampler calls."""
    from llama_cpp._ggml import libggml as g

    i64 = ctypes.c_int64
    for name, args in (("ggml_top_k", [_vp, _vp, ctypes.c_int]), ("ggml_argsort_top_k", [_vp, _vp, ctypes.c_int]),
                       ("ggml_get_rows", [_vp, _vp, _vp]), ("ggml_cont", [_vp, _vp]),
                       ("ggml_reshape_2d", [_vp, _vp, i64, i64]), ("ggml_reshape_3d", [_vp, _vp, i64, i64, i64]),
                       ("ggml_view_1d", [_vp, _vp, i64, ctypes.c_size_t]), ("ggml_soft_max", [_vp, _vp]),
                       ("ggml_argmax", [_vp, _vp]),
                       ("ggml_view_2d", [_vp, _vp, i64, i64, ctypes.c_size_t, ctypes.c_size_t]),
                       ("ggml_set_name", [_vp, ctypes.c_char_p]), ("ggml_add", [_vp, _vp, _vp]),
                       ("ggml_new_tensor_1d", [_vp, ctypes.c_int, i64]),
                       ("ggml_new_tensor_2d", [_vp, ctypes.c_int, i64, i64]), ("ggml_init", [_InitParams]),
                       ("ggml_backend_alloc_ctx_tensors_from_buft", [_vp, _vp])):
        f = getattr(g, name)
        f.argtypes, f.restype = args, _vp
    for name, args in (("ggml_set_input", [_vp]), ("ggml_free", [_vp]), ("ggml_backend_buffer_free", [_vp]),
                       ("ggml_backend_buffer_set_usage", [_vp, ctypes.c_int]),
                       ("ggml_backend_tensor_set", [_vp, _vp, ctypes.c_size_t, ctypes.c_size_t])):
        f = getattr(g, name)
        f.argtypes, f.restype = args, None
    g.ggml_nelements.argtypes, g.ggml_nelements.restype = [_vp], ctypes.c_int64
    g.ggml_tensor_overhead.argtypes, g.ggml_tensor_overhead.restype = [], ctypes.c_size_t
    return g


class _InitParams(ctypes.Structure):
    """ggml's ``struct ggml_init_params``."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _vp), ("no_alloc", ctypes.c_bool)]


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


@dataclass(eq=False)
class _MaskedRows:
    """The masked rows of the graph being built: its two inputs (each masked row's mask in 16-bit chunks,
    ``[n_chunks * m]``, and its row of the step's logits, ``[m]``), their argmaxes (``[m]``), and what
    fills them: each column's slot and row, as llama.cpp applies the masked samplers."""

    whole: int  # the step's logits
    idx: int
    rows: int
    best: int
    chunks: np.ndarray  # the idx input's host copy, (m, n_chunks) int32
    slots: list[int] = field(default_factory=list)
    at: list[int] = field(default_factory=list)
    called: set[int] = field(default_factory=set)  # slots whose inputs were set since the last upload
    uploaded: bool = False


def mask_table() -> np.ndarray:
    """Row ``v`` of the table: 0 where bit ``j`` of ``v`` is set (an allowed token), else :data:`REFUSED`
    (``(2**CHUNK_BITS, CHUNK_BITS)`` float32: ggml's ``[CHUNK_BITS, 2**CHUNK_BITS]``, 4 MiB)."""
    bits = (np.arange(1 << CHUNK_BITS)[:, None] >> np.arange(CHUNK_BITS)) & 1
    return np.where(bits.astype(bool), 0.0, REFUSED).astype(np.float32)


class GraphSamplers:
    """The samplers' interface (one per engine: its callbacks must outlive every sampler made from it)
    and the reading of a step's logprob rows. Every logprobs row keeps :data:`MAX_TOP` alternatives (a
    request shows as many as it asks for): one row costs what another does, and a step's rows read as
    one array."""

    def __init__(self) -> None:
        self._g = _ggml()
        self._name_buf = ctypes.create_string_buffer(b"llamapool-graph")
        # llama_sampler_i, its pointer-returning callbacks typed as void * (ctypes callbacks return only
        # simple types); clone stays NULL (nothing clones these samplers)
        f = ctypes.CFUNCTYPE
        self._callbacks = (f(_vp, _vp)(self._name), L.llama_sampler_i_apply(self._apply_host),
                           L.llama_sampler_i_backend_init(self._init), L.llama_sampler_i_backend_apply(self._apply),
                           L.llama_sampler_i_backend_reset(self._reset))
        self._masked_callbacks = (f(_vp, _vp)(self._masked_name), L.llama_sampler_i_backend_init(self._init_masked),
                                  L.llama_sampler_i_backend_set_input(self._set_input))
        name, apply, init, backend_apply, reset = (ctypes.cast(c, _vp) for c in self._callbacks)
        self._iface = _Iface(name=name, apply=apply, backend_init=init, backend_apply=backend_apply,
                             backend_reset=reset)
        m_name, m_init, set_input = (ctypes.cast(c, _vp) for c in self._masked_callbacks)
        self._masked_iface = _Iface(name=m_name, apply=apply, backend_init=m_init, backend_apply=backend_apply,
                                    backend_set_input=set_input, backend_reset=reset)
        self._masked_name_buf = ctypes.create_string_buffer(b"llamapool-graph-masked")
        self._batch: dict[tuple[int, int], tuple[int, ...]] = {}  # the graph being built: (logits, k) -> results
        # masked rows: the constrained slots' masks (Masks.bits, set by the owner), the slots whose masked
        # sampler is in the graph (the owner keeps it), the table (ggml context, buffer, tensor: made on
        # the first masked sampler's backend) and the graph being built's masked rows
        self.mask_bits: np.ndarray | None = None
        self.masked_on: set[int] = set()
        # the masked slots whose masks the next step applies (None: all; the others' rows take their plain
        # argmax: their masks are still being filled, and the host checks the pick against them)
        self.apply: set[int] | None = None
        self._table: tuple[int, int, int] | None = None
        self._rows: _MaskedRows | None = None
        self.masked_inputs = 0  # masked samplers' inputs set (llama.cpp's calls: one a masked row a step)
        # llama_get_sampled_{logits,probs,candidates}_ith returning addresses (ints: no pointer objects),
        # keeping the GIL (called after the step's synchronize: see Sampling._sampled_token)
        lib, at = L.llama_cpp._lib, ctypes.PYFUNCTYPE(_vp, _vp, ctypes.c_int32)
        self._sampled_at = tuple(at((f"llama_get_sampled_{what}_ith", lib))
                                 for what in ("logits", "probs", "candidates"))

    def greedy(self) -> Any:
        """A sampler chain (freed with ``llama_sampler_free``) that picks greedily and leaves nothing else."""
        return self._chain(0)

    def logprobs(self) -> Any:
        """A sampler chain that picks greedily and keeps the row's :data:`MAX_TOP` likeliest tokens with
        their logits and probabilities."""
        return self._chain(MAX_TOP)

    def masked(self, slot: int) -> Any:
        """A sampler chain for slot ``slot``'s constrained greedy rows: the argmax of the row's logits
        under the slot's mask (row ``slot`` of :attr:`mask_bits`, read when llama.cpp sets the step's
        inputs: it must be complete before ``llama_decode``), and nothing else leaves the graph."""
        return self._chain(MASKED + slot, self._masked_iface)

    def _chain(self, k: int, iface: _Iface | None = None) -> Any:
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, self._make(k, iface or self._iface))
        return chain

    def _make(self, k: int, iface: _Iface) -> Any:
        ptr = ctypes.cast(ctypes.pointer(iface), ctypes.POINTER(L.llama_sampler_i))
        return L.llama_sampler_init(ptr, _vp(k))  # the sampler's context is k itself

    def close(self) -> None:
        """Free the table (after the context that used it)."""
        if self._table is not None:
            ctx, buf, _ = self._table
            self._table = None
            self._g.ggml_backend_buffer_free(buf)
            self._g.ggml_free(ctx)

    # ------------------------------------------------------------ callbacks (from llama.cpp)

    def _name(self, smpl: int) -> int:
        return ctypes.addressof(self._name_buf)

    def _init(self, smpl: Any, buft: Any, n_outputs_max_per_seq: int) -> bool:
        return True  # argmax, top_k, argsort, get_rows and soft_max: every backend has them

    def _masked_name(self, smpl: int) -> int:
        return ctypes.addressof(self._masked_name_buf)

    def _init_masked(self, smpl: Any, buft: Any, n_outputs_max_per_seq: int) -> bool:
        """The table, once, in a buffer of the backend that holds the step's logits (a failure leaves the
        masked samplers greedy, keeping their rows: the host applies the masks, :meth:`_apply_masked`)."""
        if self._table is None:
            try:
                self._table = self._make_table(buft)
            except Exception as e:  # a callback: nothing may escape
                print(f"llamapool: no mask table on this backend ({e!r}): masks are applied on the host",
                      file=sys.stderr, flush=True)
        return True

    def _make_table(self, buft: Any) -> tuple[int, int, int]:
        g, table = self._g, mask_table()
        ctx = g.ggml_init(_InitParams(2 * g.ggml_tensor_overhead(), None, True))
        if not ctx:
            raise MemoryError("ggml_init")
        t = g.ggml_new_tensor_2d(ctx, F32, CHUNK_BITS, 1 << CHUNK_BITS)
        g.ggml_set_name(t, b"llamapool_mask_table")
        buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buf:
            g.ggml_free(ctx)
            raise MemoryError(f"{table.nbytes} bytes for the mask table")
        g.ggml_backend_buffer_set_usage(buf, WEIGHTS)
        g.ggml_backend_tensor_set(t, table.ctypes.data, 0, table.nbytes)
        return ctx, buf, t

    def _reset(self, smpl: Any) -> None:
        """A graph is about to be built: the last one's batched results are not its."""
        self._batch.clear()
        self._rows = None

    def _apply(self, smpl: Any, ctx: int, gf: int, data: Any) -> None:
        """The row's outputs: views of results computed once for all the step's output rows."""
        g, k = self._g, int(smpl.contents.ctx or 0)
        d = data.contents
        if k >= MASKED:
            self._apply_masked(ctx, d, k - MASKED)
            return
        row = ctypes.cast(d.logits, ctypes.POINTER(_Tensor)).contents
        whole = row.view_src or d.logits  # the step's logits (a probe graph's row is a tensor of its own)
        t = ctypes.cast(whole, ctypes.POINTER(_Tensor)).contents
        # llama.cpp pads the step's logits with a row no sampler reads (its graph then keeps its shape)
        n, rows = int(t.ne[0]), max(1, int(t.ne[1]) - 1) if row.view_src else 1
        r = int(row.view_offs) // int(t.nb[1]) if row.view_src else 0
        if (whole, k) not in self._batch:
            self._batch[whole, k] = self._batched(ctx, whole, n, rows, int(t.nb[1]) if row.view_src else 4 * n, k)
        best, *rest = self._batch[whole, k]
        d.sampled = g.ggml_view_1d(ctx, best, 1, 4 * r)
        d.logits = None  # nothing of the row's logits leaves the graph
        if k:
            ids, vals, probs = rest
            d.candidates = g.ggml_view_1d(ctx, ids, k, 4 * k * r)
            d.logits = g.ggml_view_1d(ctx, vals, k, 4 * k * r)
            d.probs = g.ggml_view_1d(ctx, probs, k, 4 * k * r)

    def _batched(self, ctx: int, logits: int, n: int, rows: int, stride: int, k: int) -> tuple[int, ...]:
        """Over the first ``rows`` of ``logits`` (``n`` a row, ``stride`` bytes apart): each row's argmax
        (``[rows]``), and with ``k`` its ``k`` likeliest ids (``[k, rows]``, unordered), their logits and
        softmax probabilities (``[1, k, rows]``)."""
        g = self._g
        m = g.ggml_view_2d(ctx, logits, n, rows, stride, 0)
        best = g.ggml_argmax(ctx, m)
        g.ggml_set_name(best, b"graph_greedy")
        if not k:
            return (best,)
        ids = g.ggml_top_k(ctx, m, k) if rows <= FEW_ROWS else g.ggml_cont(ctx, g.ggml_argsort_top_k(ctx, m, k))
        vals = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, m, 1, n, rows), ids)
        probs = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, g.ggml_soft_max(ctx, m), 1, n, rows), ids)
        for tensor, name in ((ids, b"logprobs_ids"), (vals, b"logprobs_vals"), (probs, b"logprobs_probs")):
            g.ggml_set_name(tensor, name)
        return best, ids, vals, probs

    def _apply_masked(self, ctx: int, d: Any, slot: int) -> None:
        """A masked row's token: a view of the argmaxes computed once for all the graph's masked rows
        (:meth:`_masked_rows`; a probe graph, whose node count llama.cpp reserves room by, builds them
        too); its column is the next one. A graph without the table (or with more masked rows than
        expected) takes the plain argmax of the row, and keeps the row (the host applies the mask)."""
        g = self._g
        row = ctypes.cast(d.logits, ctypes.POINTER(_Tensor)).contents
        whole = row.view_src or d.logits  # the step's logits (a probe graph's row is a tensor of its own)
        t = ctypes.cast(whole, ctypes.POINTER(_Tensor)).contents
        st = self._rows
        if self._table is not None and (st is None or st.whole != whole):
            rows = max(1, int(t.ne[1]) - 1) if row.view_src else 1  # llama.cpp pads the logits with a row
            st = self._rows = self._masked_rows(ctx, whole, int(t.ne[0]), rows, int(t.nb[1]))
        if st is None or len(st.slots) >= len(st.chunks):
            d.sampled = g.ggml_argmax(ctx, d.logits)
            return
        d.sampled = g.ggml_view_1d(ctx, st.best, 1, 4 * len(st.slots))
        d.logits = None
        st.slots.append(slot)
        st.at.append(int(row.view_offs) // int(t.nb[1]) if row.view_src else 0)

    def _masked_rows(self, ctx: int, logits: int, n: int, rows: int, stride: int) -> _MaskedRows:
        """Over the graph's masked rows (as many as :attr:`masked_on` says are in the graph): each one's
        row of ``logits`` (``get_rows`` by the ``rows`` input), its bias (``get_rows`` of the table by
        the ``idx`` input: ``[CHUNK_BITS, n_chunks * m]``, a row's first ``n`` taken: the padding of the last
        word is never chosen), their sum's argmax: four kernels for all of them."""
        g = self._g
        assert self._table is not None
        m, n_chunks = max(1, len(self.masked_on)), 2 * -(-n // 32)
        idx = g.ggml_new_tensor_1d(ctx, I32, n_chunks * m)
        at = g.ggml_new_tensor_1d(ctx, I32, m)
        for tensor, name in ((idx, b"mask_chunks"), (at, b"mask_rows")):
            g.ggml_set_name(tensor, name)
            g.ggml_set_input(tensor)
        picked = g.ggml_get_rows(ctx, g.ggml_view_2d(ctx, logits, n, rows, stride, 0), at)
        bias = g.ggml_reshape_2d(ctx, g.ggml_get_rows(ctx, self._table[2], idx), CHUNK_BITS * n_chunks, m)
        bias = g.ggml_view_2d(ctx, bias, n, m, 4 * CHUNK_BITS * n_chunks, 0)
        best = g.ggml_argmax(ctx, g.ggml_add(ctx, picked, bias))
        g.ggml_set_name(best, b"graph_masked")
        return _MaskedRows(logits, idx, at, best, np.zeros((m, n_chunks), np.int32))

    def _set_input(self, smpl: Any) -> None:
        """A masked sampler whose sequence has a row in the micro-batch: the graph's masked inputs, all of
        them at once, from the first such call after the graph was built, or after a call of the same
        sampler (a micro-batch or a step that reuses the graph has the same samplers with rows); the
        inputs lie in host memory, copied to the backend when the graph runs."""
        st, slot = self._rows, int(smpl.contents.ctx or 0) - MASKED
        self.masked_inputs += 1
        if st is None:
            return
        if st.uploaded and slot not in st.called:
            st.called.add(slot)
            return
        st.called, st.uploaded = {slot}, True
        k = len(st.slots)
        try:  # every index in the table's range, whatever happens (a garbage index reads out of bounds)
            assert self.mask_bits is not None
            if self.apply is None:
                st.chunks[:k] = self.mask_bits.view(np.uint16)[st.slots]
            else:  # a row not applying its mask reads the table's row of all 16 tokens allowed
                st.chunks[:k] = ALLOW_ALL
                for j, sl in enumerate(st.slots):
                    if sl in self.apply:
                        st.chunks[j] = self.mask_bits.view(np.uint16)[sl]
        except Exception as e:  # a callback: nothing may escape
            print(f"llamapool: masks not read ({e!r}): every token refused", file=sys.stderr, flush=True)
            st.chunks[:k] = 0
        at = np.zeros(len(st.chunks), np.int32)
        at[:k] = st.at
        g = self._g
        g.ggml_backend_tensor_set(st.idx, st.chunks.ctypes.data, 0, st.chunks.nbytes)
        g.ggml_backend_tensor_set(st.rows, at.ctypes.data, 0, at.nbytes)

    def _apply_host(self, smpl: Any, cur_p: Any) -> None:
        """On the host (a graph that could not take the sampler): greedy."""
        arr = cur_p.contents
        logits = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_float)),
                                       shape=(arr.size, 3))[:, 1]  # llama_token_data: id, logit, p
        arr.selected = int(np.argmax(logits))

    # ------------------------------------------------------------ a step's rows

    def read(self, ctx: Any, idxs: list[int], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For output rows ``idxs`` of the step just decoded (each sampled by a chain of :meth:`logprobs`):
        the greedy token's logprob and the ``k`` (at most :data:`MAX_TOP`) likeliest tokens with theirs,
        likeliest first, equal values by token id (``(chosen, ids, values)``, shaped ``(n,)``,
        ``(n, k)``, ``(n, k)``)."""
        k = max(k, 1)
        m = int(L.llama_get_sampled_logits_count_ith(ctx, idxs[0]))
        if m != MAX_TOP:
            raise RuntimeError(f"output row {idxs[0]} has {m} logprob candidates, not {MAX_TOP}: not sampled by "
                               "a logprobs chain")
        # llama.cpp keeps a step's sampled logits, probabilities and candidates in three buffers of rows of
        # n_vocab: a row's place in one is its place in the others (one call a row, three for the first)
        at = self._sampled_at
        addrs = np.fromiter((at[0](ctx, i) or 0 for i in idxs), np.int64, len(idxs))
        if not addrs.all():
            raise RuntimeError("an output row has no logprob candidates")
        first = idxs[int(addrs.argmin())]
        offs = (addrs - addrs.min()) // 4
        span = int(offs.max()) + MAX_TOP
        cols = offs[:, None] + np.arange(MAX_TOP)
        v, p, c = (np.frombuffer(memoryview((ctypes.c_char * (4 * span)).from_address(int(f(ctx, first)))),
                                 dtype)[cols] for f, dtype in zip(at, (np.float32, np.float32, np.int32), strict=True))
        order = np.lexsort((c, -v), axis=-1)[:, :k]  # by value, largest first; equal values by token id
        vals, probs = np.take_along_axis(v, order, -1), np.take_along_axis(p, order, -1)
        lps = vals - (vals[:, :1] - np.log(probs[:, :1]))  # minus the row's log-sum-exp
        return lps[:, 0].copy(), np.take_along_axis(c, order, -1).astype(np.intp), lps
