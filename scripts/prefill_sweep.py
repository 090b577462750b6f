#!/usr/bin/env python3
"""What sets prefill speed: llama.cpp alone, B prompts of P tokens in one context (issue 25).

Three subcommands, each appending JSON lines to ``--jsonl``:

``make``   the random models: the 8B shape (Llama-3.1-8B's dimensions) in q8_0 with
           ``llamapool.modelgen.make_model``, then requantised with ``llama_model_quantize``
           (``allow_requantize``): ``--q4km`` to Q4_K_M (ftype 15), ``--f16`` to F16 (ftype 1, the
           cuBLAS path: dense half-precision GEMMs instead of llama.cpp's quantised MMQ kernels).

``sweep``  one model, one context per configuration: per-sequence KV streams (``kv_unified``
           false, as llamapool and llama-server run), B sequences, their prompts of P random token
           ids computed in batches of ``n_batch`` tokens in sequence-id order (as a llamapool step
           holds them; logits only for each prompt's last token), timed from the first
           ``llama_decode`` to ``llama_synchronize``; then ``--decode-steps`` steps of one token per
           sequence (every token's logits), to see what a setting costs decode. A configuration is
           ``ub=N,nb=N,fa=0|1,kv=f16|q8_0`` (defaults: ub 1024, nb 4096 + B as the engine sizes its
           batch, fa 1, kv f16). Also records NVML's used GPU memory after the model, after the
           context and after the prefill (the compute buffer and the CUDA pool), and the FLOP rate.

``best``   the fastest ``n_ubatch`` of a label (flash attention on, f16 KV), for a shell script.

``table``  a markdown table of the sweep rows of one or more files.

The jobs of issue 25 that ran it on an H100: ``docs/results/h100-issue25/job1.sh`` (models, sweep) and
``job2.sh`` (llamapool, llama-server and the ceiling through ``scripts/gpu_bench.py``).

    PYTHONPATH=src python3 scripts/prefill_sweep.py make --dir /tmp/m --shape 8b --q4km --jsonl o.jsonl
    PYTHONPATH=src python3 scripts/prefill_sweep.py sweep --model /tmp/m/m8b-q8_0.gguf --label q8_0 \
        --jsonl o.jsonl ub=512 ub=1024 ub=2048 ub=4096 ub=1024,kv=q8_0 ub=1024,fa=0
    python3 scripts/prefill_sweep.py table o.jsonl

The FLOPs of a prompt token: ``2 x n_params`` (the brief's convention, embeddings and output
included) plus causal attention, ``4 x n_layer x n_embd x (P + 1) / 2`` (QK^T and PV over the
average context); ``matmul`` also gives the tighter figure without the token embedding and the
output matrix (prefill computes logits for one token per prompt). The fraction is of
``--peak-tflops`` (default: by GPU name, H100 SXM / H200 989 TFLOP/s dense bf16, H100 PCIe 756).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp as L  # first: CUDA model loads segfaulted after numpy/pyzmq imports

SHAPES: dict[str, dict[str, Any]] = {
    "8b": {"n_embd": 4096, "n_layer": 32, "n_head": 32, "n_head_kv": 8, "n_ff": 14336, "n_vocab": 128256},
    "1b": {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "n_ff": 8192, "n_vocab": 32000},
    # the CPU check: small, but wide enough for the k-quants (256-wide blocks)
    "tiny": {"n_embd": 256, "n_layer": 2, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "n_vocab": 1000},
}
KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0}
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
                    ("A100", 312.0))


def log(msg: str) -> None:
    print(f"[prefill_sweep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def emit(path: str, row: dict[str, Any]) -> None:
    log(json.dumps(row))
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- make

def quantize(src: Path, dst: Path, ftype: int, threads: int) -> float:
    qp = L.llama_model_quantize_default_params()
    qp.ftype = ftype
    qp.allow_requantize = True
    qp.nthread = threads
    t0 = time.monotonic()
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(qp))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {dst} (ftype {ftype}) returned {rc}")
    return time.monotonic() - t0


def cmd_make(args: argparse.Namespace) -> int:
    from llamapool.modelgen import make_model

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    q8 = d / f"m{args.shape}-q8_0.gguf"
    if not q8.exists():  # made once: a later call only adds requantisations
        t0 = time.monotonic()
        make_model(q8, **shape, qtype="q8_0")
        emit(args.jsonl, {"mode": "make", "model": str(q8), "qtype": "q8_0", "shape": shape,
                          "bytes": q8.stat().st_size, "seconds": round(time.monotonic() - t0, 1)})
    for flag, name, ftype in ((args.q4km, "Q4_K_M", L.LLAMA_FTYPE_MOSTLY_Q4_K_M),
                              (args.f16, "F16", L.LLAMA_FTYPE_MOSTLY_F16)):
        if flag:
            out = d / f"m{args.shape}-{name}.gguf"
            s = quantize(q8, out, ftype, args.threads)
            emit(args.jsonl, {"mode": "make", "model": str(out), "qtype": name, "from": str(q8), "ftype": ftype,
                              "threads": args.threads, "bytes": out.stat().st_size, "seconds": round(s, 1)})
    return 0


# ---------------------------------------------------------------- sweep

def parse_config(spec: str, b: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"ub": 1024, "nb": 4096 + b, "fa": 1, "kv": "f16"}
    for part in filter(None, spec.split(",")):
        k, _, v = part.partition("=")
        if k not in cfg:
            raise SystemExit(f"config {spec!r}: unknown key {k!r} (ub, nb, fa, kv)")
        cfg[k] = v if k == "kv" else int(v)
    if cfg["kv"] not in KV_TYPES:
        raise SystemExit(f"config {spec!r}: kv must be one of {sorted(KV_TYPES)}")
    return cfg


class Nvml:
    """Used memory of GPU 0 in MiB (None without NVML or a GPU)."""

    def __init__(self) -> None:
        self.h: Any = None
        self.name = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(self.h)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # no NVML, no GPU: the CPU check
            self.h = None

    def used_mib(self) -> float | None:
        if self.h is None:
            return None
        return round(self.nv.nvmlDeviceGetMemoryInfo(self.h).used / 2**20, 1)


def peak_for(name: str, given: float) -> float:
    if given:
        return given
    for key, tf in PEAK_BF16_TFLOPS:
        if key in name:
            return tf
    return 989.4


class Batches:
    """Prebuilt ``llama_batch`` objects (filled before the clock starts)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, rows: list[tuple[int, int, int, bool]], n_seq_max: int) -> Any:
        b = L.llama_batch_init(len(rows), 0, n_seq_max)
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        self.items.append(b)
        return b

    def free(self) -> None:
        for b in self.items:
            L.llama_batch_free(b)
        self.items.clear()


def flops_per_token(model: Any, p: int) -> dict[str, float]:
    n_params = float(L.llama_model_n_params(model))
    n_embd, n_layer = L.llama_model_n_embd(model), L.llama_model_n_layer(model)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    attn = 4.0 * n_layer * n_embd * (p + 1) / 2
    return {"n_params": n_params, "brief": 2 * n_params + attn,
            "matmul": 2 * (n_params - 2.0 * n_vocab * n_embd) + attn, "attention": attn}


def run_config(model: Any, cfg: dict[str, Any], b: int, p: int, steps: int, gpu: bool, nvml: Nvml,
               seed: int) -> dict[str, Any]:
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, n_vocab) for _ in range(p)] for _ in range(b)]
    cp = L.llama_context_default_params()
    cp.n_ctx = b * (p + steps + 8)
    cp.n_batch = max(cfg["nb"], b)
    cp.n_ubatch = min(cfg["ub"], cp.n_batch)
    cp.n_seq_max = b
    cp.kv_unified = False
    cp.no_perf = True
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg["fa"] else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = KV_TYPES[cfg["kv"]]
    mem0 = nvml.used_mib()
    t_ctx = time.perf_counter()
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        return {"error": "llama_init_from_model failed"}
    row: dict[str, Any] = {"ctx_s": round(time.perf_counter() - t_ctx, 2), "n_ctx": cp.n_ctx,
                           "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch}
    mem_ctx = nvml.used_mib()
    batches = Batches()
    try:
        mem = L.llama_get_memory(ctx)
        flat = [(t, j, s, j == p - 1) for s, pr in enumerate(prompts) for j, t in enumerate(pr)]
        chunks = [batches.add(flat[i:i + cp.n_batch], b) for i in range(0, len(flat), cp.n_batch)]
        dec = [batches.add([(rng.randrange(3, n_vocab), p + k, s, True) for s in range(b)], b) for k in range(steps)]
        # warm-up: the first batch (kernels loaded, the CUDA pool grown), then an empty cache again
        t_w = time.perf_counter()
        if L.llama_decode(ctx, chunks[0]) != 0:
            return {**row, "error": "llama_decode failed (warm-up)"}
        L.llama_synchronize(ctx)
        row["warmup_s"] = round(time.perf_counter() - t_w, 3)
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        for ch in chunks:
            if L.llama_decode(ctx, ch) != 0:
                return {**row, "error": "llama_decode failed (prefill)"}
        L.llama_synchronize(ctx)
        t1 = time.perf_counter()
        mem_pf = nvml.used_mib()
        for d in dec:
            if L.llama_decode(ctx, d) != 0:
                return {**row, "error": "llama_decode failed (decode)"}
        L.llama_synchronize(ctx)
        t2 = time.perf_counter()
        row.update(prefill_s=round(t1 - t0, 4), prefill_tok_s=round(b * p / (t1 - t0), 1),
                   batches=len(chunks), decode_steps=steps,
                   decode_step_ms=round(1e3 * (t2 - t1) / max(1, steps), 3),
                   decode_tok_s=round(b * steps / max(t2 - t1, 1e-9), 1))
        if mem0 is not None and mem_ctx is not None and mem_pf is not None:
            row.update(mem_ctx_mib=round(mem_ctx - mem0, 1), mem_after_prefill_mib=round(mem_pf - mem0, 1))
        return row
    finally:
        batches.free()
        L.llama_free(ctx)


def cmd_sweep(args: argparse.Namespace) -> int:
    from llamapool.worker.engine import quiet_llama_logs

    if not args.verbose:
        quiet_llama_logs()
    L.llama_backend_init()
    nvml = Nvml()
    peak = peak_for(nvml.name, args.peak_tflops)
    mem0 = nvml.used_mib()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0 if args.cpu else -1
    mp.split_mode = L.LLAMA_SPLIT_MODE_NONE
    t0 = time.monotonic()
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        raise SystemExit(f"cannot load {args.model}")
    fl = flops_per_token(model, args.P)
    emit(args.jsonl, {"mode": "sweep-model", "label": args.label, "model": args.model, "gpu": nvml.name,
                      "peak_tflops": peak, "load_s": round(time.monotonic() - t0, 1),
                      "model_mib": None if mem0 is None else round((nvml.used_mib() or 0) - mem0, 1),
                      "flops_per_token": fl, "B": args.B, "P": args.P})
    last = 0.0
    failed = 0
    try:
        for spec in args.configs:
            cfg = parse_config(spec, args.B)
            if args.deadline and time.time() + last * 1.2 > args.deadline:
                emit(args.jsonl, {"mode": "sweep-skipped", "label": args.label, "config": spec,
                                  "why": "deadline"})
                continue
            t = time.monotonic()
            try:
                r = run_config(model, cfg, args.B, args.P, args.decode_steps, not args.cpu, nvml, args.seed)
            except Exception as e:  # one configuration failing must not end the sweep
                r = {"error": repr(e)}
            last = time.monotonic() - t
            row = {"mode": "sweep", "label": args.label, "config": spec, **cfg, "B": args.B, "P": args.P,
                   "gpu": nvml.name, **r, "wall_s": round(last, 1)}
            if "prefill_tok_s" in r:
                row["tflops_brief"] = round(r["prefill_tok_s"] * fl["brief"] / 1e12, 1)
                row["tflops_matmul"] = round(r["prefill_tok_s"] * fl["matmul"] / 1e12, 1)
                row["of_peak_brief"] = round(row["tflops_brief"] / peak, 3)
                row["of_peak_matmul"] = round(row["tflops_matmul"] / peak, 3)
            else:
                failed += 1
            emit(args.jsonl, row)
    finally:
        L.llama_model_free(model)
    return 1 if failed == len(args.configs) else 0


# ---------------------------------------------------------------- best

def cmd_best(args: argparse.Namespace) -> int:
    """The n_ubatch of the fastest prefill row of ``--label`` (flash attention on, f16 KV), for a shell."""
    rows = [json.loads(ln) for ln in open(args.file) if ln.strip()]
    ok = [r for r in rows if r.get("mode") == "sweep" and r.get("label") == args.label and "prefill_tok_s" in r
          and r["fa"] == 1 and r["kv"] == "f16"]
    print(max(ok, key=lambda r: r["prefill_tok_s"])["ub"] if ok else args.default)
    return 0


# ---------------------------------------------------------------- table

def cmd_table(args: argparse.Namespace) -> int:
    rows = [json.loads(ln) for f in args.files for ln in open(f) if ln.strip()]
    sweep = [r for r in rows if r.get("mode") == "sweep"]
    base: dict[str, float] = {}
    for r in sweep:  # the first row at the engine's defaults, per model: the baseline
        if (r["ub"], r["fa"], r["kv"]) == (1024, 1, "f16") and r["nb"] == 4096 + r["B"] and "prefill_tok_s" in r:
            base.setdefault(r["label"], r["prefill_tok_s"])
    print("| model | n_ubatch | n_batch | flash attn | KV | prefill tok/s | vs ub 1024 | TFLOP/s (2N+attn) "
          "| of peak | TFLOP/s (matmul) | decode ms/step (B, +1 token) | GPU MiB: context / after prefill |")
    print("|" + "---|" * 12)
    for r in sweep:
        if "prefill_tok_s" not in r:
            print(f"| {r['label']} | {r['ub']} | {r['nb']} | {'on' if r['fa'] else 'off'} | {r['kv']} | "
                  f"failed: {r.get('error', '?')} |" + " |" * 7)
            continue
        b = base.get(r["label"])
        print(f"| {r['label']} | {r['ub']:,} | {r['nb']:,} | {'on' if r['fa'] else 'off'} | {r['kv']} | "
              f"{r['prefill_tok_s']:,.0f} | {r['prefill_tok_s'] / b if b else 0:.2f} | {r['tflops_brief']:.0f} | "
              f"{r['of_peak_brief']:.1%} | {r['tflops_matmul']:.0f} | {r['decode_step_ms']:.2f} | "
              f"{r.get('mem_ctx_mib', '-')} / {r.get('mem_after_prefill_mib', '-')} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="the random q8_0 model, and its requantisations")
    mk.add_argument("--dir", required=True)
    mk.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    mk.add_argument("--q4km", action="store_true", help="also Q4_K_M (llama_model_quantize, ftype 15)")
    mk.add_argument("--f16", action="store_true", help="also F16 (ftype 1)")
    mk.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    mk.add_argument("--jsonl", required=True)
    sw = sub.add_parser("sweep", help="prefill tok/s per configuration, one model")
    sw.add_argument("--model", required=True)
    sw.add_argument("--label", required=True)
    sw.add_argument("--jsonl", required=True)
    sw.add_argument("-B", "--B", type=int, default=64, help="sequences (prompts)")
    sw.add_argument("-P", "--P", type=int, default=1024, help="prompt tokens each")
    sw.add_argument("--decode-steps", type=int, default=32)
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--cpu", action="store_true", help="no GPU layers (checks the script)")
    sw.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 TFLOP/s (default: by name)")
    sw.add_argument("--deadline", type=float, default=0.0,
                    help="epoch seconds: skip a configuration that would end after it (by the last one's time)")
    sw.add_argument("--verbose", action="store_true", help="llama.cpp's logs")
    sw.add_argument("configs", nargs="+", help="ub=N,nb=N,fa=0|1,kv=f16|q8_0")
    be = sub.add_parser("best", help="the fastest n_ubatch of a label (f16 KV, flash attention on)")
    be.add_argument("file")
    be.add_argument("--label", required=True)
    be.add_argument("--default", type=int, default=1024)
    tb = sub.add_parser("table", help="markdown table of sweep rows")
    tb.add_argument("files", nargs="+")
    args = ap.parse_args()
    return {"make": cmd_make, "sweep": cmd_sweep, "best": cmd_best, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
