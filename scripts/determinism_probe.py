"""Issue 46: where a CPU worker's numbers depend on what else is in the batch. Two measurements:

``ops``: llama.cpp's CPU matrix product (``ggml_mul_mat``, as llama-cpp-python's build runs it) of one
activation row against a weight matrix, computed alone (n = 1) and as the first of n rows, for each
weight type a GGUF holds and the KV cache's F16: is the row bitwise the same? llama.cpp takes its
``vec_dot`` kernels for one row and llamafile's tinyBLAS (``llamafile_sgemm``: F32, F16, BF16, Q8_0,
Q4_0, Q5_0, IQ4_NL) for two rows or more.

``model``: the real model's numbers for the same token computed in different batch compositions, as
the engine makes them (``EngineConfig``'s context: one KV stream a sequence, no flash attention, plain
weight layouts): a prompt's last token in one chunk of the whole prompt, after a reused prefix (the
token alone, or with one more), in chunks of other sizes, beside another sequence's decode token in one
``llama_decode``; and a decode token alone, beside another decoding sequence, beside one with a long
context. For each: the last row's logits bitwise equal to the reference's? their largest difference,
and the greedy text that follows (24 tokens) equal?

    PYTHONPATH=src .venv/bin/python scripts/determinism_probe.py ops
    PYTHONPATH=src .venv/bin/python scripts/determinism_probe.py model [--model models/gemma-3-270m-q4_k_m.gguf]

Results: docs/results/determinism-cpu.md.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
from dataclasses import dataclass

import numpy as np

TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _ggml() -> ctypes.CDLL:
    """libggml-base and libggml-cpu of the installed llama-cpp-python, their functions typed."""
    import llama_cpp

    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in ("libggml-base.so", "libggml-cpu.so"):
        path = next(iter(glob.glob(os.path.join(libdir, name + "*"))), None)
        if path is None:
            sys.exit(f"no {name} in {libdir}")
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(glob.glob(os.path.join(libdir, "libggml-cpu.so*"))[0])
    p = ctypes.c_void_p
    lib.ggml_init.restype, lib.ggml_init.argtypes = p, [InitParams]
    lib.ggml_free.argtypes = [p]
    lib.ggml_new_tensor_2d.restype = p
    lib.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.ggml_mul_mat.restype, lib.ggml_mul_mat.argtypes = p, [p, p, p]
    lib.ggml_new_graph.restype, lib.ggml_new_graph.argtypes = p, [p]
    lib.ggml_build_forward_expand.argtypes = [p, p]
    lib.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    lib.ggml_get_data.restype, lib.ggml_get_data.argtypes = p, [p]
    lib.ggml_nbytes.restype, lib.ggml_nbytes.argtypes = ctypes.c_size_t, [p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p]
    lib.ggml_cpu_init()
    return lib


def mul_mat_row0(lib: ctypes.CDLL, wtype: int, w: np.ndarray, x: np.ndarray, threads: int) -> np.ndarray:
    """Row 0 of ``x @ w.T`` as ggml computes it with ``w`` stored as ``wtype`` and the rows ``x`` (F32)."""
    m, k = w.shape
    n = x.shape[0]
    ctx = lib.ggml_init(InitParams(64 << 20, None, False))
    try:
        a = lib.ggml_new_tensor_2d(ctx, wtype, k, m)
        b = lib.ggml_new_tensor_2d(ctx, 0, k, n)
        w32 = np.ascontiguousarray(w, dtype=np.float32)
        if wtype == 0:
            ctypes.memmove(lib.ggml_get_data(a), w32.ctypes.data, w32.nbytes)
        else:
            lib.ggml_quantize_chunk(wtype, w32.ctypes.data, lib.ggml_get_data(a), 0, m, k, None)
        xs = np.ascontiguousarray(x, dtype=np.float32)
        ctypes.memmove(lib.ggml_get_data(b), xs.ctypes.data, xs.nbytes)
        c = lib.ggml_mul_mat(ctx, a, b)
        g = lib.ggml_new_graph(ctx)
        lib.ggml_build_forward_expand(g, c)
        lib.ggml_graph_compute_with_ctx(ctx, g, threads)
        out = np.ctypeslib.as_array(ctypes.cast(lib.ggml_get_data(c), ctypes.POINTER(ctypes.c_float)), (n, m))
        return out[0].copy()
    finally:
        lib.ggml_free(ctx)


def ops(args: argparse.Namespace) -> None:
    lib = _ggml()
    rng = np.random.default_rng(0)
    ns = (1, 2, 3, 4, 7, 8, 16, 64)
    print(f"row 0 of a {args.m} x {args.k} product: n rows -> equal to n = 1 / to n = 2 (max |diff| to n = 1)")
    for name, t in TYPES.items():
        w = rng.standard_normal((args.m, args.k)).astype(np.float32)
        x = rng.standard_normal((max(ns), args.k)).astype(np.float32)
        rows = {n: mul_mat_row0(lib, t, w, x[:n], args.threads) for n in ns}
        cells = []
        for n in ns[1:]:
            d = float(np.max(np.abs(rows[n] - rows[1])))
            cells.append(f"n={n}: {'=' if np.array_equal(rows[n], rows[1]) else '≠'}"
                         f"{'=' if np.array_equal(rows[n], rows[2]) else '≠'} ({d:.1e})")
        print(f"{name:5} " + "  ".join(cells))


# ---------------------------------------------------------------- the model


@dataclass
class Entry:
    """A sequence's tokens in one ``llama_decode``: ids at positions from ``pos``; logits of the last?"""

    seq: int
    tokens: list[int]
    pos: int
    out: bool = True


class Model:
    """The engine's llama.cpp context (``EngineConfig``), fed hand-built batches."""

    def __init__(self, path: str, slots: int, ctx_per_slot: int, threads: int, gpu: bool = False):
        import llama_cpp as L

        from llamapool.worker.engine.model import EngineConfig, context_params, load_model

        self.L = L
        cfg = EngineConfig(model_path=path, slots=slots, ctx_per_slot=ctx_per_slot, max_batch_tokens=1024,
                           n_ubatch=1024, threads=threads, gpu=gpu)
        self.model, self._keep = load_model(cfg)
        self.ctx = L.llama_init_from_model(self.model, context_params(cfg))
        self.mem = L.llama_get_memory(self.ctx)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(2048, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        from llamapool.worker.vocab import tokenize

        return tokenize(self.vocab, text, add_special=True, parse_special=False)

    def text(self, toks: list[int]) -> str:
        buf = ctypes.create_string_buffer(256)
        out = b""
        for t in toks:
            n = self.L.llama_token_to_piece(self.vocab, t, buf, 256, 0, False)
            out += buf.raw[:n]
        return out.decode(errors="replace")

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def decode(self, entries: list[Entry]) -> list[np.ndarray]:
        """One ``llama_decode`` of the entries in the order given; the logits of each entry that asks."""
        b, i, rows = self.batch, 0, []
        for e in entries:
            for j, t in enumerate(e.tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = t, e.pos + j, 1
                b.seq_id[i][0] = e.seq
                b.logits[i] = e.out and j == len(e.tokens) - 1
                if b.logits[i]:
                    rows.append(i)
                i += 1
        b.n_tokens = i
        rc = self.L.llama_decode(self.ctx, b)
        if rc:
            raise RuntimeError(f"llama_decode returned {rc}")
        ptr = [self.L.llama_get_logits_ith(self.ctx, r) for r in rows]
        return [np.ctypeslib.as_array(p, (self.n_vocab,)).copy() for p in ptr]


def prefill(m: Model, seq: int, toks: list[int], chunks: list[int], beside: list[Entry] | None = None) -> np.ndarray:
    """The prompt ``toks`` computed in chunks of the sizes given (the rest: one last chunk); ``beside``: entries
    decoded in the first chunk's ``llama_decode`` too, in sequence-id order as the engine fills a batch (its
    first micro-batch then holds one token of each). The last token's logits."""
    pos, logits = 0, None
    sizes = [*chunks, len(toks) - sum(chunks)]
    for k, n in enumerate(sizes):
        if n <= 0:
            continue
        e = Entry(seq, toks[pos: pos + n], pos, pos + n == len(toks))
        es = sorted([*(beside or [] if k == 0 else []), e], key=lambda x: x.seq)  # as the engine fills a batch
        got = m.decode(es)
        pos += n
        if e.out:
            logits = got[-1]
    assert logits is not None
    return logits


def greedy(m: Model, seq: int, first: np.ndarray, pos: int, n: int,
           neighbours: list[tuple[int, np.ndarray, int]] | None = None) -> list[int]:
    """``n`` greedy tokens from the logits ``first`` at position ``pos``; each step one ``llama_decode`` of this
    sequence's token, beside ``neighbours`` (each: its sequence, logits, position; they decode greedily too)."""
    out = [int(np.argmax(first))]
    nbs = list(neighbours or [])
    while len(out) < n:
        es = [Entry(seq, [out[-1]], pos)] + [Entry(s, [int(np.argmax(lg))], p) for s, lg, p in nbs]
        got = m.decode(es)
        nbs = [(s, lg, p + 1) for (s, _, p), lg in zip(nbs, got[1:], strict=True)]
        out.append(int(np.argmax(got[0])))
        pos += 1
    return out


def model(args: argparse.Namespace) -> None:
    m = Model(args.model, 9, 1024, args.threads, args.gpu)
    n_out = args.tokens
    prompts = ["Once upon a time",
               "The history of the city begins in the twelfth century, when a small market grew up on the "
               "banks of the river. Over the next three hundred years",
               " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(12))
               + "\nQuestion: is the number 7 even or odd?\nAnswer: the number 7 is"]
    long_text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    print(f"model {args.model}, {'GPU' if args.gpu else f'{args.threads} threads'}, {n_out} tokens")
    for prompt in prompts:
        toks = m.tokenize(prompt)
        n = len(toks)
        print(f"\nprompt {prompt[:40]!r}... ({n} tokens); reference: one chunk, then decoding alone")
        m.clear()
        ref = prefill(m, 0, toks, [])
        ref_text = greedy(m, 0, ref, n, n_out)
        print(f"  reference text: {m.text(ref_text)!r}")

        def report(name: str, logits: np.ndarray, text: list[int], ref: np.ndarray = ref,
                   ref_text: list[int] = ref_text) -> None:
            same = np.array_equal(logits, ref)
            d = float(np.max(np.abs(logits - ref)))
            print(f"  {name:46} logits {'=' if same else '≠'} (max |diff| {d:.2e})  text "
                  f"{'=' if text == ref_text else '≠ ' + repr(m.text(text))}")

        for name, chunks in [("prefix reused, last token alone (n-1 | 1)", [n - 1]),
                             ("prefix reused, last two (n-2 | 2)", [n - 2]),
                             ("chunks of 3", [3] * ((n - 1) // 3)),
                             ("chunks of 2", [2] * ((n - 1) // 2)),
                             ("first token alone (1 | n-1)", [1])]:
            m.clear()
            lg = prefill(m, 0, toks, chunks)
            report(name, lg, greedy(m, 0, lg, n, n_out))
        # a prompt beside another sequence's decode token in one llama_decode (split_equal's first
        # micro-batch holds one token of each sequence)
        other = m.tokenize("A recipe for bread:")
        m.clear()
        prefill(m, 1, other, [])
        lg = prefill(m, 0, toks, [], beside=[Entry(1, [other[-1]], len(other), False)])
        m.L.llama_memory_seq_rm(m.mem, 1, -1, -1)
        report("prompt beside a decode token (1 llama_decode)", lg, greedy(m, 0, lg, n, n_out))
        # decoding beside neighbours that decode too: a short prompt, a long one (more KV cells), 7 short ones
        # (8 rows: llama.cpp's tiled K-quant kernels take over from vec_dot)
        for name, texts in [("decoding beside a neighbour", ["A recipe for bread:"]),
                            ("decoding beside a long neighbour", [long_text]),
                            ("decoding beside 7 neighbours", [f"Item {i}: a recipe for bread" for i in range(7)])]:
            m.clear()
            nbs = []
            for i, text in enumerate(texts):
                nt = m.tokenize(text)
                nbs.append((i + 1, prefill(m, i + 1, nt, [512] * ((len(nt) - 1) // 512)), len(nt)))
            lg = prefill(m, 0, toks, [])
            report(name, lg, greedy(m, 0, lg, n, n_out, nbs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("ops")
    o.add_argument("--m", type=int, default=256, help="weight rows")
    o.add_argument("--k", type=int, default=768, help="the reduced dimension (K-quants: a multiple of 256)")
    o.add_argument("--threads", type=int, default=2)
    mo = sub.add_parser("model")
    mo.add_argument("--model", default="models/gemma-3-270m-q4_k_m.gguf")
    mo.add_argument("--threads", type=int, default=2)
    mo.add_argument("--tokens", type=int, default=24, help="greedy tokens after each prompt")
    mo.add_argument("--gpu", action="store_true", help="every layer on the GPU, as a GPU worker (no mode there)")
    args = ap.parse_args()
    ops(args) if args.what == "ops" else model(args)


if __name__ == "__main__":
    main()
