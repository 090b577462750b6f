"""The engine's sampling part: how each sequence's next token is chosen.

A sequence's sampling state (:class:`SeqSampling`) is its llama.cpp sampler chain, where that chain
runs, and its grammar matcher. Where it runs:

- **in the decode graph** (GPU sampling): every slot has a greedy chain attached to the graph (llamapool's
  own, :mod:`llamapool.worker.graph_samplers`: only the token leaves the GPU), and a request with other
  parameters attaches its own chain. A greedy request with **logprobs** is sampled there too, by a chain
  that also computes the row's likeliest tokens and their probabilities in the graph. A constrained
  greedy row is sampled there too, by the slot's masked chain (``graph_masks``, "on_refusal" by
  default): only its token leaves the graph. Where its last mask was narrow (the grammar's structure)
  the graph adds its mask (an input of the step, uploaded inside ``llama_decode``:
  :meth:`Sampling.before_launch` waits for it first); where it was wide (a free string) the row's plain
  argmax is checked on the host against the mask filled meanwhile, and a refused one is decoded again
  under its mask (:data:`RETRY`: the row's step is lost, its logits never copied);
- **on the host**, from the row's logits, for what the graph cannot do: penalties (llama.cpp's
  repetition penalty, OpenAI's presence and frequency penalties), ``logit_bias``, the logprobs of
  sampled, constrained or echoed requests, and the
  sampled (not greedy) constrained rows, drawn first and drawn again from the masked row when refused
  (as llama.cpp's own grammar sampler does). Greedy host rows pick with numpy's argmax over the
  logits in place, in one call for the step's rows.

Masks are filled by :class:`~llamapool.worker.constraints.Masks` on the engine thread: those the next
launch applies at once, the others right after the launch, while the GPU runs the step (a CPU worker's,
whose decode takes every core, all at once), and only constrained rows
pay anything: unconstrained rows in the same batch take the path they take without them. A row the graph
samples under its mask does not speculate (``verifies``: no constrained request does in the graph).
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass
from typing import Any

import llama_cpp as L
import numpy as np

from llamapool.protocol.params import ParamError, SamplingParams
from llamapool.worker.closing import Closing
from llamapool.worker.constraints import Masks
from llamapool.worker.graph_samplers import GraphSamplers

PENALTY_LAST_N = 64  # repeat_penalty's window (llama.cpp's default)
RETRY = -2  # :meth:`Sampling.pick`: no token this step; the row is decoded again with its mask in the graph
WIDE = 0.5  # "on_refusal": a mask allowing at least this share of the vocabulary lets the next pick go unmasked
PROBE = 64  # the tokens (a fixed random sample of the vocabulary) a mask's share is estimated from
GRAPH_MASKS = ("on_refusal", "always", "keeping")  # how a constrained greedy row is sampled in the graph


@dataclass(eq=False)
class SeqSampling:
    """One sequence's sampling: its host chain (None: the slot's greedy chain in the graph samples it),
    whether its chain runs in the graph, and its grammar (None: unconstrained): the matcher, with the
    budget it must close within."""

    slot: int
    params: SamplingParams
    chain: Any
    in_graph: bool
    closing: Closing | None = None
    masked: bool = False  # its mask for the next token is filled, or being filled
    graph_masked: bool = False  # sampled by the slot's masked chain (GraphSamplers.masked)
    mask_now: bool = False  # the next launch applies its mask (complete by then): "always", a retry, or
    # "on_refusal" after a narrow mask (the grammar's structure, where a plain argmax is likely refused)

    @property
    def matcher(self) -> Any:
        return None if self.closing is None else self.closing.matcher

    @property
    def graph_logprobs(self) -> bool:
        """Its logprobs are computed in the decode graph (:class:`GraphSamplers`)."""
        return self.in_graph and self.params.logprobs

    @property
    def host_greedy(self) -> bool:
        """Picked by argmax over the raw logits: nothing (penalty, bias) changes them first."""
        return not self.in_graph and self.params.greedy and not self.params.adjusts_logits


class Sampling:
    """Sampler chains of all slots, their place (graph or host) and the constrained rows' masks.

    Made before the context (the graph's chains go into its parameters: :meth:`context_params`), bound
    to it after (:meth:`bind`). Only the engine thread calls it.
    """

    def __init__(self, slots: int, n_vocab: int, gpu: bool, window: int = 1 << 16, rows_per_seq: int = 1):
        self.gpu = gpu
        # a sequence's output rows a step the graph may sample (>1: a speculating greedy sequence's token
        # and drafts, llamapool's greedy taking any number of a sequence's rows)
        self.rows_per_seq = rows_per_seq if gpu else 1
        self.n_vocab = n_vocab
        self.window = window  # the most tokens a sequence generates (presence/frequency penalties see all)
        self._graph = GraphSamplers() if gpu else None
        # each slot's greedy chains (GPU sampling): llamapool's, which leaves only the token (attached with the
        # context), and llama.cpp's, which keeps the row's logits (a constrained row's; made when first needed)
        self._greedy: dict[int, Any] = {i: self._graph.greedy() for i in range(slots)} if self._graph else {}
        self._keeping: dict[int, Any] = {}
        self._masked: dict[int, Any] = {}  # each slot's masked greedy chain (a constrained row's; made when needed)
        # how the graph samples a constrained greedy row (GRAPH_MASKS):
        # - "on_refusal": by the slot's masked chain, its mask applied where the last one was narrow
        #   (the grammar's structure: filled before the launch) or where the host refused the row's
        #   plain argmax (the row is decoded again: RETRY); a wide mask (a free string) is filled while
        #   the GPU runs the step and checked on the host. No logits leave the GPU;
        # - "always": by the masked chain, its mask applied every step. A graph's masks are inputs,
        #   complete before the launch, so their filling no longer overlaps the GPU's step: on an H100
        #   at 64 streams (1B and 8B, graph_mask_check.py, in git history) the rows ran at 0.79-0.83x of
        #   "keeping", plain rows beside them at 0.68-0.75x;
        # - "keeping": by llama.cpp's greedy chain, which copies the row's logits to the host every step
        #   (32 MB a step at 64 rows of 128,256 tokens) for a refused pick, replaced from them.
        self.graph_masks = "on_refusal"
        self.retries = 0  # rows decoded again under their mask (RETRY)
        self._on: dict[int, Any] = dict(self._greedy)  # what the graph samples each slot with (None: nothing)
        self._seq_cfg: Any = None
        self.ctx: Any = None
        self.masks: Masks | None = None
        self._slots = slots
        self.states: dict[int, SeqSampling] = {}  # slot -> the running sequence's sampling
        self._row = ctypes.c_float * n_vocab  # one row of logits, viewed in place
        self._best: dict[int, int] = {}  # output row -> its argmax, taken for the step's greedy host rows
        probe = np.random.default_rng(0).choice(n_vocab, min(PROBE, n_vocab), replace=False)
        self._probe = (probe >> 5, (probe & 31).astype(np.uint32))  # each probe token's word and bit in a mask
        self._wide: dict[int, bool] = {}  # slot -> its mask for this step's pick allows WIDE of the probe
        # a row's token from the graph: llama.cpp synchronizes in every such call, and llama_cpp's binding
        # releases the GIL for it, which the engine thread then waits to take back (the worker's I/O
        # thread runs Python meanwhile): 4.5 µs a row on an H100 host at 64 streams (py-spy, job QQ).
        # Called after the step's synchronize (Engine._collect), this one keeps the GIL.
        self._sampled_token = ctypes.PYFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)(
            ("llama_get_sampled_token_ith", L.llama_cpp._lib))

    def context_params(self, cp: Any) -> None:
        """Attach each slot's greedy chain to the decode graph (GPU sampling)."""
        if not self.gpu:
            return
        self._seq_cfg = (L.llama_sampler_seq_config * len(self._greedy))(
            *[L.llama_sampler_seq_config(i, ctypes.cast(ch, ctypes.c_void_p)) for i, ch in self._greedy.items()])
        cp.samplers = ctypes.cast(self._seq_cfg, ctypes.POINTER(L.llama_sampler_seq_config))
        cp.n_samplers = len(self._greedy)
        cp.n_outputs_max_per_seq = self.rows_per_seq

    def bind(self, ctx: Any) -> None:
        self.ctx = ctx

    def in_graph(self, p: SamplingParams) -> bool:
        """Whether the decode graph samples for ``p``: GPU sampling, and nothing the graph cannot do
        (penalties and biases are applied on the host, and so are masks, but for a greedy row's:
        llama.cpp's in-graph samplers are its greedy, top-k/p, min-p, temperature and dist ones; logprobs
        are computed there for an unconstrained greedy request whose prompt's are not asked for)."""
        if not self.gpu or p.adjusts_logits:
            return False
        if p.logprobs:
            return p.greedy and not p.constrained and not p.echo
        return p.greedy or not p.constrained

    def verifies(self, p: SamplingParams) -> bool:
        """Whether the graph samples all of a speculating request's rows (its token and its drafts): an
        unconstrained greedy request without logprobs, where the graph takes several rows a sequence."""
        return self.rows_per_seq > 1 and self.in_graph(p) and p.greedy and not p.constrained and not p.logprobs

    def check(self, p: SamplingParams) -> None:
        """What only the model can check: ``logit_bias`` names tokens of its vocabulary."""
        bad = [t for t in p.logit_bias or () if int(t) >= self.n_vocab]
        if bad:
            raise ParamError("logit_bias", f"'logit_bias' names token {bad[0]}, outside the model's vocabulary "
                                           f"(token ids 0 to {self.n_vocab - 1})")

    # ------------------------------------------------------------ a sequence's lifetime

    def admit(self, slot: int, p: SamplingParams, closing: Closing | None = None, host: bool = False) -> SeqSampling:
        """The sampling of a sequence starting in ``slot`` (llama.cpp may refuse a chain: it raises);
        ``host``: on the host even where the graph could (a speculating sequence has several rows a step,
        and llama.cpp's backend sampling takes one)."""
        in_graph = self.in_graph(p) and not host
        if in_graph and p.logprobs:
            assert self._graph is not None
            chain = self._graph.logprobs()
        else:
            chain = None if in_graph and p.greedy else _chain(p, self.n_vocab, self.window)
        masked = in_graph and chain is None and p.constrained and self.graph_masks != "keeping"
        if self.gpu:  # the graph's chain for the slot: greedy, the request's own, or none (logits to the host)
            try:
                self._put(slot, (self._greedy_for(slot, "masked" if masked else "keeping" if p.constrained else "")
                                 if chain is None else chain) if in_graph else None)
            except Exception:
                if chain is not None:
                    L.llama_sampler_free(chain)
                raise
        state = SeqSampling(slot, p, chain, in_graph, closing, graph_masked=masked,
                            mask_now=masked and self.graph_masks == "always")
        if closing is not None and self.masks is None:
            self.masks = Masks(self._slots, self.n_vocab, inline=not self.gpu)
            if self._graph is not None:
                self._graph.mask_bits = self.masks.bits
        self.states[slot] = state
        return state

    def release(self, state: SeqSampling) -> None:
        """Free the sequence's host chain. The graph is left as it is: changing it makes the next decode
        re-plan, and would wait for the batch in flight; the next sequence of the slot changes it if it
        needs another chain (a chain left in the graph is freed then)."""
        self.states.pop(state.slot, None)
        if self.masks is not None:
            self.masks.forget(state.slot)
        if state.chain is not None and state.chain is not self._on.get(state.slot):
            L.llama_sampler_free(state.chain)

    def _greedy_for(self, slot: int, kind: str = "") -> Any:
        """The slot's greedy chain of ``kind`` ("": llamapool's; "masked": llamapool's under the slot's
        mask; "keeping": llama.cpp's, which keeps the row's logits): the one in the graph, or a new one
        (a chain taken off the graph is not put back: llama.cpp set it up for the graph it was in)."""
        assert self._graph is not None
        graph = self._graph
        chains, make = {"": (self._greedy, graph.greedy), "keeping": (self._keeping, _greedy_chain),
                        "masked": (self._masked, lambda: graph.masked(slot))}[kind]
        ch = chains.get(slot)
        if ch is not None and self._on.get(slot) is ch:
            return ch
        if ch is not None:
            L.llama_sampler_free(ch)  # off the graph since another chain or none replaced it
        ch = chains[slot] = make()
        return ch

    def _put(self, slot: int, chain: Any) -> None:
        """Let the graph sample ``slot`` with ``chain`` (None: not at all), changing it only if it must; a
        finished sequence's own chain that it replaces is freed (the slot's greedy chains are freed when
        made anew)."""
        old = self._on.get(slot)
        if old is chain:
            return
        self._attach(slot, chain)
        self._on[slot] = chain
        if self._graph is not None:  # how many masked rows a graph may have
            (self._graph.masked_on.add if chain is self._masked.get(slot) else self._graph.masked_on.discard)(slot)
        if old is not None and not self._own(slot, old) and all(s.chain is not old for s in self.states.values()):
            L.llama_sampler_free(old)

    def _own(self, slot: int, chain: Any) -> bool:
        """``chain`` is one of the slot's greedy chains (freed when made anew, or on close)."""
        return any(chain is chains.get(slot) for chains in (self._greedy, self._keeping, self._masked))

    def _attach(self, slot: int, chain: Any) -> None:
        """Put ``chain`` on ``slot`` in the decode graph (None: take it off; the next decode re-plans)."""
        L.llama_synchronize(self.ctx)  # never change the graph's samplers under a batch in flight
        if not L.llama_set_sampler(self.ctx, slot, chain):
            raise RuntimeError(f"llama.cpp refused a sampler for sequence {slot}")

    # ------------------------------------------------------------ one step

    def prepare(self, rows: list[tuple[SeqSampling, int]]) -> None:
        """Before sampling a step's output ``rows`` (``(sampling, output row)``): the constrained rows'
        masks are ready, and the greedy host rows' argmaxes are taken in one numpy call."""
        self.masks_ready([s for s, _ in rows])
        if self.graph_masks == "on_refusal" and self.masks is not None:
            slots = [s.slot for s, _ in rows if s.graph_masked]
            if slots:
                words, shifts = self._probe
                share = ((self.masks.bits[np.array(slots)[:, None], words] >> shifts) & 1).mean(axis=1)
                self._wide = dict(zip(slots, (share >= WIDE).tolist(), strict=True))
        greedy = [idx for s, idx in rows if s.host_greedy]
        self._best = dict(zip(greedy, self._argmax(greedy), strict=True)) if len(greedy) > 1 else {}

    def _argmax(self, idxs: list[int]) -> list[int]:
        """The argmax of each output row, in one call over them (:meth:`_block`)."""
        return [int(t) for t in self._block(idxs).argmax(axis=1)]

    def masks_ready(self, states: list[SeqSampling]) -> None:
        """Before sampling: the masks started after the last step are done (a new sequence's first
        mask is filled now)."""
        if self.masks is None:
            return
        self.masks.wait()
        self._first_masks(states)

    def _first_masks(self, states: list[SeqSampling]) -> None:
        """The first masks of the new constrained sequences among ``states``, filled now."""
        assert self.masks is not None
        fresh = [s for s in states if s.matcher is not None and not s.masked]
        if fresh:
            for s in fresh:  # a failure left by a sequence that ended before it was sampled is not theirs
                self.masks.failed.pop(s.slot, None)
            self.masks.start([], [(s.matcher, s.slot) for s in fresh])
            for s in fresh:
                s.masked = True

    def masks_next(self) -> None:
        """After sampling: fill the running constrained sequences' next masks, those the next launch
        applies at once, the others after it (:meth:`after_launch`)."""
        if self.masks is None:
            return
        todo = [s for s in self.states.values() if s.matcher is not None and not s.masked
                and not s.matcher.is_stopped()]
        for s in todo:
            s.masked = True
        self.masks.start([(s.matcher, s.slot) for s in todo if not s.mask_now],
                         [(s.matcher, s.slot) for s in todo if s.mask_now])

    def before_launch(self) -> None:
        """Right before ``llama_decode``: the masks the graph applies are complete (they are its inputs,
        read inside ``llama_decode``). With "always", every masked row's (filled when the last step's
        tokens were taken). With
        "on_refusal", a retried row's (complete: no token was taken since), a row's whose last mask was
        narrow (filled at once: :meth:`masks_next`) and a new sequence's first mask (filled now: its
        prompt's last row is picked under it), while the others' fill goes on."""
        if self.masks is None or self._graph is None:
            return
        if self.graph_masks == "always":
            if any(s.graph_masked for s in self.states.values()):
                self.masks_ready([s for s in self.states.values() if s.graph_masked])
            self._graph.apply = None
            return
        fresh = [s for s in self.states.values() if s.graph_masked and s.matcher is not None and not s.masked]
        if fresh:
            self._first_masks(fresh)
            for s in fresh:
                s.mask_now = True
        self._graph.apply = {s.slot for s in self.states.values() if s.mask_now}

    def after_launch(self) -> None:
        """Right after ``llama_decode`` returns: the masks left for later are filled while the GPU computes."""
        if self.masks is not None:
            self.masks.fill_later()

    def pick(self, s: SeqSampling, idx: int) -> int:
        """The sequence's token from output row ``idx`` of the step just decoded (:data:`RETRY`: none,
        a constrained row whose argmax its mask refused is decoded again, its mask then applied)."""
        if s.in_graph:  # a constrained greedy row too: the graph's argmax, under the mask or checked against it
            tok: int = self._sampled_token(self.ctx, idx)
            if s.matcher is None:
                return tok
            return self._pick_masked(s, idx, tok) if s.graph_masked else self._pick_constrained(s, idx, tok)
        if s.matcher is None:
            if s.host_greedy:
                return self._best[idx] if idx in self._best else int(self._logits(idx).argmax())
            return int(L.llama_sampler_sample(s.chain, self.ctx, idx))
        return self._pick_constrained(s, idx)

    def _pick_masked(self, s: SeqSampling, idx: int, tok: int) -> int:
        """A row of the slot's masked chain. Under its mask its token is allowed; without it (a pick
        checked on the host) a refused token is picked again: the row is decoded again (:data:`RETRY`)
        under its mask. A refused token is taken where the mask allows nothing (as the host path
        takes it), replaced from the row's logits where the graph could not apply masks and kept them;
        else the sequence fails."""
        assert self.masks is not None and s.closing is not None
        self.masks.check(s.slot)  # its mask could not be filled: this sequence fails, the others go on
        if not self.masks.allows(s.slot, tok) and self.masks.bits[s.slot].any():
            if L.llama_get_sampled_logits_count_ith(self.ctx, idx) == self.n_vocab:
                return self._pick_constrained(s, idx, tok)
            if s.mask_now:
                raise RuntimeError(f"the decode graph picked token {tok}, which the mask of slot {s.slot} "
                                   "refuses")
            s.mask_now = True  # its mask stays filled (s.masked): no token was taken
            self.retries += 1
            return RETRY
        if self.graph_masks != "always":  # the next mask is likely as narrow or as wide as this one
            s.mask_now = not self._wide.get(s.slot, False)
        s.masked = False
        return s.closing.take(tok)

    def _pick_constrained(self, s: SeqSampling, idx: int, drawn: int = -1) -> int:
        """A constrained row's token: the likeliest (``drawn`` by the graph, or the host's argmax) if the
        mask allows it, else the likeliest allowed one from the row's logits (llama.cpp keeps a row's
        logits beside the token its graph sampled)."""
        assert self.masks is not None
        self.masks.check(s.slot)  # its mask could not be filled: this sequence fails, the others go on
        if drawn >= 0 or s.host_greedy:
            tok = drawn if drawn >= 0 else self._best[idx] if idx in self._best else int(self._logits(idx).argmax())
            if not self.masks.allows(s.slot, tok):  # the likeliest allowed token
                ids = np.flatnonzero(self.masks.allowed(s.slot))
                tok = int(ids[self._logits(idx)[ids].argmax()]) if ids.size else tok
        elif s.params.adjusts_logits:  # mask first: penalties must count only the token kept
            logits = self._logits(idx)
            logits[~self.masks.allowed(s.slot)] = -np.inf
            tok = int(L.llama_sampler_sample(s.chain, self.ctx, idx))
        else:
            tok = int(L.llama_sampler_sample(s.chain, self.ctx, idx))
            if not self.masks.allows(s.slot, tok):  # mask the row in place and sample again
                logits = self._logits(idx)
                logits[~self.masks.allowed(s.slot)] = -np.inf
                tok = int(L.llama_sampler_sample(s.chain, self.ctx, idx))
        assert s.closing is not None
        s.masked = False
        return s.closing.take(tok)  # the token, or in a reply's last tokens one that closes it in time

    def logprobs(self, idxs: list[int], toks: list[int], top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For output rows ``idxs`` of the step just decoded: :func:`log_softmax_top` of their logits."""
        return log_softmax_top(self._block(idxs), toks, top)

    def graph_logprobs(self, idxs: list[int], top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`logprobs`, for rows sampled with their logprobs in the graph (their tokens are the
        greedy picks): from the few numbers a row's graph left on the host."""
        assert self._graph is not None
        return self._graph.read(self.ctx, idxs, top)

    def rows(self, idxs: list[int]) -> np.ndarray:
        """A copy of output rows ``idxs``' logits (the next decode reuses their buffer)."""
        return np.array(self._block(idxs))

    def _block(self, idxs: list[int]) -> np.ndarray:
        """Output rows ``idxs``' logits as one ``(n, n_vocab)`` array: a view of the step's logits where
        they lie one after another in order (llama.cpp writes a step's host rows in batch order), else
        rows gathered from the span they lie in, or copied one by one."""
        addrs = [self._address(i) for i in idxs]
        lo, stride = min(addrs), 4 * self.n_vocab
        if all((a - lo) % stride == 0 for a in addrs):
            span = [(a - lo) // stride for a in addrs]
            rows = max(span) + 1
            if rows <= 4 * len(addrs):  # one buffer: view it, take the rows asked for
                block = np.frombuffer(memoryview((ctypes.c_float * (self.n_vocab * rows)).from_address(lo)),
                                      np.float32).reshape(rows, self.n_vocab)
                return block if span == list(range(rows)) else block[span]
        return np.stack([self._logits(i) for i in idxs])

    def _address(self, idx: int) -> int:
        return ctypes.cast(L.llama_get_logits_ith(self.ctx, idx), ctypes.c_void_p).value or 0

    def _logits(self, idx: int) -> np.ndarray:
        """Output row ``idx``'s logits, in place (writable: a mask is applied to them)."""
        return np.frombuffer(memoryview(self._row.from_address(self._address(idx))), np.float32)

    def close(self) -> None:
        if self.masks is not None:
            self.masks.close()
        for slot, ch in self._on.items():  # finished sequences' chains still in the graph
            if ch is not None and not self._own(slot, ch):
                L.llama_sampler_free(ch)
        for ch in [*self._greedy.values(), *self._keeping.values(), *self._masked.values()]:
            L.llama_sampler_free(ch)
        if self._graph is not None:
            self._graph.close()


CHUNK = 1 << 18  # log_softmax_top: logits a pass takes at once (1 MB: its temporaries stay in the cache)


def log_softmax_top(block: np.ndarray, toks: list[int], top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the rows of ``block`` (logits, ``(n, n_vocab)``), in numpy passes over as many rows at once as
    :data:`CHUNK` holds (on 64 rows of 128,256 logits, one pass over all of them was 1.7x slower: its
    temporaries left the cache): the log-probability of ``toks[k]`` in row ``k``, and the ``top``
    likeliest tokens of each row with theirs, likeliest first (``(chosen, ids, values)``, shaped ``(n,)``,
    ``(n, top)``, ``(n, top)``). The log-softmax of the model's logits as the sampler saw them (before
    temperature, top-k/p, penalties; after a grammar's mask when one was applied to the row)."""
    step = max(1, CHUNK // block.shape[1])
    if len(toks) <= step:
        return _log_softmax_top(block, toks, top)
    parts = [_log_softmax_top(block[i:i + step], toks[i:i + step], top) for i in range(0, len(toks), step)]
    chosen, ids, vals = zip(*parts, strict=True)
    return np.concatenate(chosen), np.concatenate(ids), np.concatenate(vals)


def _log_softmax_top(block: np.ndarray, toks: list[int], top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = np.arange(len(toks))[:, None]  # each row's index, for picking within rows
    m = block.max(axis=1, keepdims=True)
    e = np.subtract(block, m)
    np.exp(e, out=e)  # in place: one temporary the size of the block
    lse = m + np.log(e.sum(axis=1, keepdims=True))
    chosen = (block[rows, np.asarray(toks, dtype=np.intp)[:, None]] - lse)[:, 0]
    if not top:
        return chosen, np.empty((len(toks), 0), np.intp), np.empty((len(toks), 0))
    ids, vals = top_k(block, top)
    return chosen, ids, vals - lse


GROUPS_OF = 64  # top_k: a row's columns in this many strided groups


def top_k(block: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``top`` largest values of each row of ``block`` and their columns, largest first (equal values
    in column order). Each row's ``top`` largest are at least the ``top``-th largest of the maxima of
    64 strided groups of its columns (those maxima are ``top`` of its values): only the values above that
    bound are sorted, a few dozen a row, where ``argpartition`` selects over the whole vocabulary (5.9
    against about 1.5 ms for 64 rows of 32,000); in a small vocabulary, at least the ``top``-th largest
    value itself. A row with too few or too many such values (a masked row, NaNs) takes
    ``argpartition``."""
    n, v = block.shape
    width = v // GROUPS_OF
    ids, vals = np.empty((n, top), np.intp), np.empty((n, top), block.dtype)
    todo = np.arange(n)
    if top < v:
        if width >= 4 * top:
            maxima = block[:, : width * GROUPS_OF].reshape(n, GROUPS_OF, width).max(axis=1)
            bound = np.partition(maxima, -top, axis=1)[:, -top, None]
        else:  # a small vocabulary: the top-th largest value itself (numpy's argpartition takes 4x longer)
            bound = np.partition(block, v - top, axis=1)[:, v - top, None]
        r, c = np.divmod(np.flatnonzero(block >= bound), v)
        counts = np.bincount(r, minlength=n)
        fit = (counts >= top) & (counts <= 16 * top + 64)
        keep = fit[r]
        r, c = r[keep], c[keep]
        found = block[r, c]
        order = np.lexsort((c, -found, r))  # by row, then value (largest first), then column
        r, c, found = r[order], c[order], found[order]
        done = np.flatnonzero(fit)
        at = np.searchsorted(r, done)[:, None] + np.arange(top)
        ids[done], vals[done] = c[at], found[at]
        todo = np.flatnonzero(~fit)
    if todo.size:
        sub = block if todo.size == n else block[todo]
        rows = np.arange(todo.size)[:, None]
        part = np.argpartition(sub, -top, axis=1)[:, -top:]
        pv = sub[rows, part]
        order = np.argsort(-pv, axis=1, kind="stable")
        ids[todo], vals[todo] = part[rows, order], pv[rows, order]
    return ids, vals


def _greedy_chain() -> Any:
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    return chain


def _chain(p: SamplingParams, n_vocab: int, window: int = 1 << 16) -> Any:
    """llama.cpp's sampler chain for ``p``: biases, penalties, then the pick (greedy, or the filters,
    temperature and a seeded draw). Penalties see only the tokens the chain accepted, the generated
    ones (OpenAI's semantics): the prompt is never fed to it."""
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    add = L.llama_sampler_chain_add
    if p.logit_bias:  # llama.cpp copies the array
        biases = (L.llama_logit_bias * len(p.logit_bias))(
            *[L.llama_logit_bias(int(t), b) for t, b in p.logit_bias.items()])
        add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
    # llama.cpp of llama-cpp-python 0.3.36: (n_vocab, last_n, repeat, freq, present); its penalty is
    # OpenAI's: logit -= count * freq + (count > 0) * present
    if p.repeat_penalty != 1.0:
        add(chain, L.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, p.repeat_penalty, 0.0, 0.0))
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:  # over every generated token
        last_n = max(1, min(p.max_tokens, window))
        add(chain, L.llama_sampler_init_penalties(n_vocab, last_n, 1.0, p.frequency_penalty, p.presence_penalty))
    if p.greedy:
        add(chain, L.llama_sampler_init_greedy())
        return chain
    if p.top_k > 0:
        add(chain, L.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        add(chain, L.llama_sampler_init_min_p(p.min_p, 1))
    add(chain, L.llama_sampler_init_temp(p.temperature))
    seed = p.seed if p.seed is not None else random.getrandbits(32)
    add(chain, L.llama_sampler_init_dist(seed))
    return chain
