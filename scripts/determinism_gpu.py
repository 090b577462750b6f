"""Issue 46 on a GPU: does ``model.deterministic`` (patch 0002, ``GGML_CUDA_DETERMINISTIC``) make a greedy
reply a function of the request alone, and what does it cost? Through the HTTP API, as users send.

Models: random q8_0 of the 1B body and of Llama-3.1-8B's shape (``--shapes``; random weights have
near-ties everywhere, so any numeric difference shows in the text). Two daemons on one GPU, up at once:
"off" (``deterministic = false``) and "on"; both need a llama.cpp built with patch 0002 (the "on" worker
refuses to start without it). Each: one GPU worker of ``--slots`` slots.

Identity, per daemon: 16 greedy prompts (8 of 64 random tokens, 8 of 600), 64 tokens each, first sent one
at a time (the reference); then, each compared with the reference reply by reply: the same again (their
prefixes cached), again with ``cache_prompt: false``, all 16 at once, beside 48 sampled neighbours
(temperature 1, prompts of 16-800 tokens), and arriving while 48 sampled streams decode; and 4 seeded
sampled requests (temperature 0.8), alone and beside the neighbours.

Cost: tok/s of ``--streams`` streams (P128, G128, greedy, 2 x streams requests) and of one stream (4
requests, G128), on each daemon in turn, ``--rounds`` times alternating which goes first.

    . scripts/gpu_env.sh && python3 scripts/determinism_gpu.py --out OUT   # a llama_cpp built with 0002
    PYTHONPATH=src python3 scripts/determinism_gpu.py --out /tmp/dg --cpu  # the tiny model (checks the script)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import (  # first (it imports llama_cpp first: CUDA model loads segfaulted after numpy's import)
    CPU_SHAPE,
    GPU_SHAPE,
    SHAPE_8B,
    daemon_config,
    free_port,
    start_daemon,
    stop_daemon,
    wait_ready,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokens(rng: random.Random, n_vocab: int, n: int) -> list[int]:
    return [rng.randrange(1, n_vocab) for _ in range(n)]


async def send(url: str, reqs: list[dict[str, Any]], streams: int, delay: float = 0.0) -> list[str]:
    """Each request (a /v1/completions body) ``streams`` at a time, after ``delay`` seconds; the texts."""
    import aiohttp

    await asyncio.sleep(delay)
    texts = [""] * len(reqs)
    queue = list(enumerate(reqs))

    async def client(session: Any) -> None:
        while queue:
            i, body = queue.pop(0)
            async with session.post(url + "/v1/completions", json=body) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {data}")
            texts[i] = data["choices"][0]["text"]

    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(min(streams, len(reqs)))))
    return texts


async def together(url: str, greedy: list[dict[str, Any]], others: list[dict[str, Any]], delay: float) -> list[str]:
    """``others`` all at once and, ``delay`` seconds later, ``greedy`` all at once; ``greedy``'s texts."""
    mine, _ = await asyncio.gather(send(url, greedy, len(greedy), delay), send(url, others, len(others)))
    return mine


def identity(url: str, n_vocab: int, gen: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [tokens(rng, n_vocab, 64) for _ in range(8)] + [tokens(rng, n_vocab, 600) for _ in range(8)]
    greedy = [{"prompt": p, "max_tokens": gen, "temperature": 0, "ignore_eos": True} for p in prompts]
    seeded = [{"prompt": p, "max_tokens": gen, "temperature": 0.8, "seed": 11 + i, "ignore_eos": True}
              for i, p in enumerate(prompts[:4])]
    neighbours = [{"prompt": tokens(rng, n_vocab, rng.randrange(16, 800)), "max_tokens": 128, "temperature": 1.0,
                   "ignore_eos": True} for _ in range(48)]
    long = [{**n, "max_tokens": 256} for n in neighbours]
    ref = asyncio.run(send(url, greedy, 1))
    ref_seeded = asyncio.run(send(url, seeded, 1))
    cases = {
        "again (prefix cached)": asyncio.run(send(url, greedy, 1)),
        "cache_prompt false": asyncio.run(send(url, [{**g, "cache_prompt": False} for g in greedy], 1)),
        "all 16 at once": asyncio.run(send(url, greedy, len(greedy))),
        "beside 48 sampled": asyncio.run(together(url, greedy, neighbours, 0.0)),
        "arriving mid-decode": asyncio.run(together(url, greedy, long, 0.5)),
    }
    out: dict[str, Any] = {k: sum(a == b for a, b in zip(ref, v, strict=True)) for k, v in cases.items()}
    out["seeded, alone again"] = sum(a == b for a, b in zip(ref_seeded, asyncio.run(send(url, seeded, 1)),
                                                            strict=True))
    out["seeded, beside 48 sampled"] = sum(a == b for a, b in zip(ref_seeded, asyncio.run(
        together(url, seeded, neighbours, 0.0)), strict=True))
    return out


def speed(url: str, n_vocab: int, streams: int, n: int, gen: int, seed: int) -> float:
    rng = random.Random(seed)
    reqs = [{"prompt": tokens(rng, n_vocab, 128), "max_tokens": gen, "temperature": 0, "ignore_eos": True}
            for _ in range(n)]
    t0 = time.perf_counter()
    asyncio.run(send(url, reqs, streams))
    return n * gen / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=["1b", "8b"], choices=("1b", "8b"))
    ap.add_argument("--cpu", action="store_true", help="the tiny model on the CPU (checks the script)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen", type=int, default=64, help="tokens a greedy reply in the identity checks")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after which no shape starts")
    ap.add_argument("--models", default="", metavar="DIR",
                    help="DIR/1b.gguf, DIR/8b.gguf: written by another process meanwhile (waited for); else made here")
    args = ap.parse_args()
    from llamapool.modelgen import make_model

    t_start = time.monotonic()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lp-det-"))
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        log(json.dumps(row))
        with open(out / "determinism_gpu.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")

    slots, streams = (8, 8) if args.cpu else (args.slots, args.streams)
    for shape in ["cpu"] if args.cpu else args.shapes:
        if time.monotonic() - t_start > args.deadline:
            break
        dims: dict[str, Any] = CPU_SHAPE if shape == "cpu" else GPU_SHAPE if shape == "1b" else SHAPE_8B
        t0 = time.monotonic()
        if args.models:
            model = str(Path(args.models) / f"{shape}.gguf")
            while not Path(model + ".done").exists() and time.monotonic() - t_start < args.deadline:
                time.sleep(1)
        else:
            model = str(make_model(tmp / f"{shape}.gguf", **dims))
        n_vocab = int(dims.get("n_vocab", 512))
        record({"mode": "model", "shape": shape, "gen_s": round(time.monotonic() - t0, 1)})
        daemons = {}
        for det in ("off", "on"):
            port = free_port()
            more = f"deterministic = {'true' if det == 'on' else 'false'}\n"
            cfg = daemon_config(tmp, f"{shape}-{det}", model, "[0]", slots, 1280, more, args.cpu) + \
                f'[http]\nlisten = "127.0.0.1:{port}"\nprocesses = 1\n'
            proc, ep, logf = start_daemon(cfg, tmp, f"{shape}-{det}", out / "logs")
            daemons[det] = (proc, ep, logf, f"http://127.0.0.1:{port}")
        try:
            for proc, ep, logf, _url in daemons.values():
                wait_ready(ep, 1, proc, logf)
            for det, (*_, url) in daemons.items():
                asyncio.run(send(url, [{"prompt": [1, 2, 3], "max_tokens": 8}], 1))  # warm up
                t0 = time.monotonic()
                record({"mode": "identity", "shape": shape, "deterministic": det, "of": 16, "seeded_of": 4,
                        **identity(url, n_vocab, args.gen, seed=5), "seconds": round(time.monotonic() - t0, 1)})
            for *_, url in daemons.values():  # warm up: many-row graphs, the step-cost fit
                speed(url, n_vocab, streams, streams, 16, 99)
            for r in range(args.rounds):
                for det in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
                    url = daemons[det][3]
                    record({"mode": "speed", "shape": shape, "deterministic": det, "round": r,
                            f"tok_s_{streams}_streams": round(speed(url, n_vocab, streams, 2 * streams, 128, r), 1),
                            "tok_s_1_stream": round(speed(url, n_vocab, 1, 4, 128, r), 1)})
        finally:
            for proc, _ep, logf, _url in daemons.values():
                errors = stop_daemon(proc, logf)
                if errors:
                    record({"mode": "error", "shape": shape, "log": str(logf), "cuda_errors": errors})
    (out / "summary.md").write_text(summary(rows, streams))
    print((out / "summary.md").read_text())
    return 0


def summary(rows: list[dict[str, Any]], streams: int) -> str:
    lines = ["| shape | deterministic | " + " | ".join(k for k in next(
        (r for r in rows if r["mode"] == "identity"), {}) if k not in ("mode", "shape", "deterministic")) + " |"]
    lines.append("|---" * (lines[0].count("|") - 1) + "|")
    for r in rows:
        if r["mode"] == "identity":
            lines.append(f"| {r['shape']} | {r['deterministic']} | " + " | ".join(
                str(v) for k, v in r.items() if k not in ("mode", "shape", "deterministic")) + " |")
    lines += ["", f"| shape | tok/s {streams} streams, off / on | on / off | tok/s 1 stream, off / on | on / off |",
              "|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows if r["mode"] == "speed"):
        def mean(det: str, key: str, shape: str = shape) -> float:
            v = [r[key] for r in rows if r["mode"] == "speed" and r["shape"] == shape and r["deterministic"] == det]
            return sum(v) / len(v) if v else float("nan")
        many, one = f"tok_s_{streams}_streams", "tok_s_1_stream"
        lines.append(f"| {shape} | {mean('off', many):.0f} / {mean('on', many):.0f} | "
                     f"{mean('on', many) / mean('off', many):.2f}x | {mean('off', one):.0f} / {mean('on', one):.0f} | "
                     f"{mean('on', one) / mean('off', one):.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
