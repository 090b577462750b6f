"""Calibrate supervisor/memory.py: its estimate beside what llama.cpp allocates, and a CPU worker's RSS.

Each case runs in a child process that loads the model as a worker does (engine/model.py's model and
context parameters: CPU, no repacked layouts, no flash attention, one KV stream per slot, full-size
sliding-window cache), with llama.cpp's log on stderr, then decodes one full micro-batch (``slots`` rows of it
outputs, as a worker's step has about one a sequence) so that the weights are paged in and the buffers
touched.
The parent reads the buffer sizes llama.cpp prints ("model buffer size", "KV buffer size", "compute
buffer size", "output buffer size") and the child's RSS, and prints one row per case:

    PYTHONPATH=src .venv/bin/python tests/memory_calibrate.py [GGUF ...]

Without arguments: Gemma 3 270M and SmolLM2 135M from models/, and the tests' tiny model (written to a
temporary folder). RSS: ``base`` after importing llama_cpp, ``load`` after the context is created,
``run`` after the decode (VmRSS; weights are a read-only file mapping, counted once resident).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
# slots, ctx_per_slot, n_ubatch
CASES = [(8, 2048, 520), (4, 1024, 256), (16, 4096, 520), (2, 512, 1024), (3, 1000, 256)]
_SIZE = re.compile(r"(model|KV|compute|output) buffer size\s*=\s*([\d.]+) MiB")


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(path: str, slots: int, ctx: int, ubatch: int) -> None:
    import llama_cpp as L
    import llama_cpp._logger as llog

    from llamapool.worker.engine.model import EngineConfig, context_params, model_params

    llog.set_verbose(True)  # llama.cpp's log to stderr
    base = rss()
    cfg = EngineConfig(model_path=path, slots=slots, ctx_per_slot=ctx, max_batch_tokens=max(ubatch, 512),
                       n_ubatch=ubatch, gpu=False, threads=1)
    L.llama_backend_init()
    mp, _keep = model_params(cfg)
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = context_params(cfg)
    cp.n_ubatch = ubatch
    ctx_ = L.llama_init_from_model(model, cp)
    assert ctx_, "no context"
    loaded = rss()
    n = min(ubatch, ctx)
    batch = L.llama_batch_init(n, 0, 1)
    for i in range(n):
        batch.token[i] = 1 + i % 100
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i >= n - slots  # a step's outputs: about one row a sequence
    batch.n_tokens = n
    rc = L.llama_decode(ctx_, batch)
    ran = rss()
    print(json.dumps({"base": base, "load": loaded, "run": ran, "decode": rc}), flush=True)


def measure(path: str, slots: int, ctx: int, ubatch: int) -> dict[str, float]:
    p = subprocess.run([sys.executable, __file__, "--child", path, str(slots), str(ctx), str(ubatch)],
                       capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
                       check=False)
    if p.returncode:
        raise RuntimeError(f"{path}: child failed ({p.returncode}): {p.stderr[-2000:]}")
    sizes: dict[str, float] = {}
    for kind, mib in _SIZE.findall(p.stderr):
        sizes[kind] = sizes.get(kind, 0.0) + float(mib) * MiB  # an iSWA model has two KV caches
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return {**sizes, **{k: float(v) for k, v in out.items()}}


def worker_rss(path: str, slots: int, ctx: int, max_batch_tokens: int, n_ubatch: int) -> tuple[int, int]:
    """A real daemon's CPU worker (``llamapool serve``, one worker): its RSS once ready, and after a request
    of a long prompt (the weights paged in, a full micro-batch run)."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import launch

    def pid_rss(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    path = str(Path(path).resolve())
    d = launch(Path(tempfile.mkdtemp()), path, workers={"devices": "cpu", "cpu_workers": 1, "slots": slots},
               model={"path": path, "ctx_per_slot": ctx, "max_batch_tokens": max_batch_tokens, "n_ubatch": n_ubatch})
    try:
        pid = d.wait_ready(1, timeout=300)["workers"][0]["pid"]
        ready = pid_rss(pid)
        with d.client() as c:
            c.generate("the " * min(ctx - 64, 2 * max_batch_tokens), max_tokens=16, timeout=300)
        return ready, pid_rss(pid)
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=4, metavar=("PATH", "SLOTS", "CTX", "UBATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--daemon", action="store_true", help="also a real daemon's worker RSS at the defaults "
                    "(8 slots x 2048, max_batch_tokens 512, n_ubatch 1024)")
    ap.add_argument("paths", nargs="*", help="GGUF files (default: Gemma 3 270M, SmolLM2 135M, the tests' tiny one)")
    args = ap.parse_args()
    if args.child:
        path, slots, ctx, ubatch = args.child
        child(path, int(slots), int(ctx), int(ubatch))
        return
    from llamapool.supervisor.memory import estimate

    paths = args.paths
    if not paths:
        from llamapool.modelgen import make_model

        tiny = make_model(Path(tempfile.mkdtemp()) / "tiny.gguf")
        paths = [str(ROOT / "models/gemma-3-270m-q4_k_m.gguf"), str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                 str(tiny)]
    print("model                     slots x ctx  ubatch | llama.cpp MiB: weights     KV compute+out   total | "
          "estimate MiB: weights     KV compute   total  ratio | RSS MiB: base  load   run | est+process / run")
    for path in paths:
        for slots, ctx, ubatch in CASES:
            m = measure(path, slots, ctx, ubatch)
            e = estimate(path, slots, ctx, ubatch, gpu=False)
            got = m.get("model", 0) + m.get("KV", 0) + m.get("compute", 0) + m.get("output", 0)
            buffers = e.total - e.process
            print(f"{Path(path).name[:25]:25} {slots:5} x {ctx:<5} {ubatch:6} | {m.get('model', 0) / MiB:21.1f} "
                  f"{m.get('KV', 0) / MiB:6.1f} {(m.get('compute', 0) + m.get('output', 0)) / MiB:12.1f} "
                  f"{got / MiB:7.1f} | {e.weights / MiB:21.1f} {e.kv / MiB:6.1f} {e.compute / MiB:7.1f} "
                  f"{buffers / MiB:7.1f} {buffers / got:6.2f} | {m['base'] / MiB:12.0f} {m['load'] / MiB:5.0f} "
                  f"{m['run'] / MiB:5.0f} | {e.total / m['run']:16.2f}", flush=True)
    if args.daemon:
        from llamapool.supervisor.memory import worker_ubatch

        print("\nllamapool serve, one CPU worker, 8 slots x 2048, max_batch_tokens 512, n_ubatch 1024 (runs 520):")
        for path in paths:
            ready, after = worker_rss(path, 8, 2048, 512, 1024)
            e = estimate(path, 8, 2048, worker_ubatch(1024, 512, 8), gpu=False)
            print(f"{Path(path).name[:25]:25} estimate {e.text()} | worker RSS ready {ready / MiB:.0f} MiB, after a "
                  f"request {after / MiB:.0f} MiB: estimate / RSS {e.total / after:.2f}", flush=True)


if __name__ == "__main__":
    main()
