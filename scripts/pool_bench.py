#!/usr/bin/env python3
"""A pool that follows demand, measured (issue 42): more models than the device holds, skewed traffic
that shifts between them, against the busy model served alone.

1. ``alone``: one model, ``load = "always"``, ``--streams`` greedy streams for ``--seconds``: tok/s.
2. ``pool``: ``--models`` on-demand models (links to the same GGUF, so each is its own model to the
   pool) whose needs add up to more than the device; each phase of ``--seconds`` sends ``--streams``
   streams to one busy model and a request every ``--light-every`` seconds to the others in turn.
   Reported: each model's load seconds (spawn to hello: the file from the page cache), the busy model's
   tok/s once it is loaded (as a ratio of ``alone``), the number of loads and evictions (thrash), and
   errors (there must be none).

On the GPU machine (after ``. scripts/gpu_env.sh``; the 8B shape is written there first):

    python3 scripts/pool_bench.py --gpu --out OUT --shape 8b --models 8 --streams 64 --seconds 30

On a CPU (the tiny model; a RAM budget stands in for the GPU's memory):

    PYTHONPATH=src python3 scripts/pool_bench.py --out /tmp/o --models 4 --fit 2 --streams 4 --seconds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES = {"tiny": {}, "1b": {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "n_ff": 8192,
                             "n_vocab": 32000, "qtype": "q8_0"},
          "8b": {"n_embd": 4096, "n_layer": 32, "n_head": 32, "n_head_kv": 8, "n_ff": 14336, "n_vocab": 128256,
                 "qtype": "q8_0"}}


def log(msg: str) -> None:
    print(f"[pool_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml(x) for x in v) + "]"
    return repr(v)


def config(out: Path, tag: str, models: list[dict[str, Any]], pool: dict[str, Any], gpu: bool) -> Path:
    run = out / f"run-{tag}"
    lines = ["[server]", f"runtime_dir = {toml(str(run))}", "queue_timeout = 600.0", "drain_timeout = 10.0",
             "[workers]", f"devices = {toml('auto' if gpu else 'cpu')}", "start_timeout = 300.0", "[pool]"]
    lines += [f"{k} = {toml(v)}" for k, v in pool.items()]
    for m in models:
        lines.append("[[models]]")
        lines += [f"{k} = {toml(v)}" for k, v in m.items()]
    path = out / f"{tag}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def serve(cfg: Path, out: Path, tag: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    logf = out / f"{tag}.log"
    with open(logf, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                                stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"ipc://{out / f'run-{tag}' / 'frontend.sock'}", logf


async def wait_up(endpoint: str, proc: subprocess.Popen[bytes], logf: Path, ready: int) -> None:
    from llamapool import AsyncClient, LlamapoolError

    end = time.monotonic() + 300
    async with AsyncClient(endpoint) as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited:\n{logf.read_text()[-3000:]}")
            try:
                st = await c.status(timeout=2)
                if sum(w["state"] == "ready" for w in st["workers"]) >= ready:
                    return
            except LlamapoolError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"not ready:\n{logf.read_text()[-3000:]}")


async def streams(endpoint: str, model: str, n: int, seconds: float, max_tokens: int, stats: dict[str, Any],
                  after: asyncio.Event | None = None) -> None:
    """``n`` greedy streams to ``model`` for ``seconds``; tokens counted once ``after`` is set (the model
    loaded), so that the rate is the loaded model's."""
    from llamapool import AsyncClient, LlamapoolError

    end = time.monotonic() + seconds

    async def one(i: int) -> None:
        async with AsyncClient(endpoint, timeout=600) as c:
            k = 0
            while time.monotonic() < end:
                k += 1
                try:
                    r = await c.generate(f"stream {i} request {k}: the story goes on", model=model,
                                         max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    if after is None or after.is_set():
                        stats["tokens"] += r.usage.completion_tokens
                    stats["requests"] += 1
                except LlamapoolError as e:
                    stats["errors"].append(f"{model}: {e}")

    await asyncio.gather(*(one(i) for i in range(n)))


async def light(endpoint: str, names: list[str], every: float, seconds: float, stats: dict[str, Any],
                skew: float = 0.0, seed: int = 0) -> None:
    """A light request every ``every`` seconds: to ``names`` in turn (``skew`` 0), or to one drawn with
    Zipf weights 1/rank**skew (the first name likeliest)."""
    import random

    from llamapool import AsyncClient, LlamapoolError

    end, k = time.monotonic() + seconds, 0
    rng = random.Random(seed)
    weights = [1 / (r + 1) ** skew for r in range(len(names))]
    tasks = []
    async with AsyncClient(endpoint, timeout=600) as c:
        async def one(model: str) -> None:
            try:
                await c.generate("a light request", model=model, max_tokens=8, temperature=0.0, ignore_eos=True)
                stats["requests"] += 1
            except LlamapoolError as e:
                stats["errors"].append(f"{model}: {e}")

        while time.monotonic() < end:
            pick = names[k % len(names)] if not skew else rng.choices(names, weights)[0]
            tasks.append(asyncio.ensure_future(one(pick)))
            k += 1
            await asyncio.sleep(every)
        await asyncio.gather(*tasks)


async def watch_loaded(endpoint: str, model: str, event: asyncio.Event, seconds: float) -> float:
    """Set ``event`` once ``model`` is loaded; returns when (seconds after the call)."""
    from llamapool import AsyncClient

    t0 = time.monotonic()
    async with AsyncClient(endpoint) as c:
        while time.monotonic() - t0 < seconds:
            st = await c.status(timeout=5)
            row = next(m for m in st["models"] if m["name"] == model)
            if row.get("state") == "loaded":
                event.set()
                return time.monotonic() - t0
            await asyncio.sleep(0.05)
    return -1.0


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model", help="an existing GGUF (else one of --shape is written)")
    ap.add_argument("--models", type=int, default=8, help="on-demand models in the pool")
    ap.add_argument("--fit", type=int, default=2, help="CPU: how many models the RAM budget holds")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1160)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=30.0, help="a phase's length")
    ap.add_argument("--phases", type=int, default=3)
    ap.add_argument("--light-every", type=float, default=2.0)
    ap.add_argument("--min-residency", type=float, default=10.0)
    ap.add_argument("--replicas", action="store_true", help="instead: two models with replicas = [1, GPUs], "
                    "the load moving from one to the other, against the busy one on every GPU by hand")
    ap.add_argument("--skew", type=float, default=0.0, help="light traffic: 0 cycles through the other models "
                    "(least-recently-used eviction's worst case); s > 0 draws them with Zipf weights 1/rank**s")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        from llamapool.modelgen import make_model

        t0 = time.monotonic()
        model = str(make_model(out / f"{a.shape}.gguf", **SHAPES[a.shape]))
        log(f"wrote {model} in {time.monotonic() - t0:.0f} s")
    sizes = {"slots": a.slots, "ctx_per_slot": a.ctx, "threads": 0 if a.gpu else 1}
    if a.replicas:
        await replicas(a, out, model, sizes)
        return
    rows: list[dict[str, Any]] = []

    # 1. alone
    cfg = config(out, "alone", [{"name": "alone", "path": model, **sizes, **({} if a.gpu else {"cpu_workers": 1})}],
                 {}, a.gpu)
    proc, endpoint, logf = serve(cfg, out, "alone")
    try:
        await wait_up(endpoint, proc, logf, 1)
        stats: dict[str, Any] = {"tokens": 0, "requests": 0, "errors": []}
        await streams(endpoint, "alone", a.streams, min(10.0, a.seconds), a.max_tokens, stats)  # warm-up
        stats = {"tokens": 0, "requests": 0, "errors": []}
        t0 = time.monotonic()
        await streams(endpoint, "alone", a.streams, a.seconds, a.max_tokens, stats)
        alone = stats["tokens"] / (time.monotonic() - t0)
        rows.append({"row": "alone", "tok_s": round(alone, 1), "errors": len(stats["errors"])})
        log(f"alone: {alone:.1f} tok/s")
    finally:
        stop(proc)

    # 2. the pool: links to the same file, each its own model
    names = [f"m{i}" for i in range(a.models)]
    for n in names:
        link = out / f"{n}.gguf"
        if not link.exists():
            link.symlink_to(Path(model).resolve())
    pool: dict[str, Any] = {"min_residency": a.min_residency, "scale_up_wait": 600.0}
    if not a.gpu:
        from llamapool.supervisor.memory import estimate

        need = estimate(model, a.slots, a.ctx, 1024, gpu=False).total
        pool["ram_budget"] = f"{int(need * (a.fit + 0.5))}B"
    cfg = config(out, "pool", [{"name": n, "path": str(out / f"{n}.gguf"), "load": "on_demand", **sizes}
                               for n in names], pool, a.gpu)
    proc, endpoint, logf = serve(cfg, out, "pool")
    errors: list[str] = []
    try:
        await wait_up(endpoint, proc, logf, 0)
        for phase in range(a.phases):
            busy = names[phase % len(names)]
            others = [n for n in names if n != busy]
            stats = {"tokens": 0, "requests": 0, "errors": errors}
            lstats = {"requests": 0, "errors": errors}
            loaded = asyncio.Event()
            t0 = time.monotonic()
            watcher = asyncio.ensure_future(watch_loaded(endpoint, busy, loaded, a.seconds))
            await asyncio.gather(streams(endpoint, busy, a.streams, a.seconds, a.max_tokens, stats, loaded),
                                 light(endpoint, others[phase:] + others[:phase], a.light_every, a.seconds, lstats,
                                       a.skew, phase))
            ready_after = await watcher
            served = time.monotonic() - t0 - max(ready_after, 0)
            rate = stats["tokens"] / served if served > 0 else 0.0
            rows.append({"row": f"phase{phase}", "busy": busy, "loaded_after_s": round(ready_after, 2),
                         "tok_s": round(rate, 1), "vs_alone": round(rate / alone, 3) if alone else None,
                         "light_requests": lstats["requests"]})
            log(f"phase {phase}: {busy} loaded after {ready_after:.1f} s, then {rate:.1f} tok/s "
                f"({rate / alone:.2f}x alone)")
        from llamapool import AsyncClient

        async with AsyncClient(endpoint) as c:
            st = await c.status()
        text = logf.read_text()
        load_s = [float(x) for x in re.findall(r"placement: \S+ loaded on \S+ \(.*?\) in ([\d.]+)s", text)]
        rows.append({"row": "pool", "loads": sum(m.get("loads", 0) for m in st["models"]),
                     "evictions": sum(m.get("evictions", 0) for m in st["models"]),
                     "load_seconds": load_s, "errors": len(errors), "error_sample": errors[:3],
                     "need": st["models"][0].get("need")})
        log(f"pool: {rows[-1]}")
    finally:
        stop(proc)
    (out / "pool_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


async def ready_workers(endpoint: str, model: str) -> int:
    from llamapool import AsyncClient

    async with AsyncClient(endpoint) as c:
        st = await c.status(timeout=5)
    return sum(1 for w in st["workers"] if w.get("model") == model and w["state"] == "ready")


async def replicas(a: argparse.Namespace, out: Path, model: str, sizes: dict[str, Any]) -> None:
    """Two models with ``replicas = [1, N]`` (N: the GPUs, or 2 CPU workers), the load on one of them and
    then on the other: when the busy one holds N workers, its tok/s against the same model on N workers
    by hand; and how long the replicas took to follow the load, each way."""
    from llamapool.supervisor import gpus

    n = len(gpus.discover(gpus.load_nvml())) if a.gpu else 2
    rows: list[dict[str, Any]] = [{"row": "devices", "n": n}]
    hand = [{"name": "a", "path": model, **sizes, **({} if a.gpu else {"cpu_workers": n})}]
    cfg = config(out, "hand", hand, {}, a.gpu)
    proc, endpoint, logf = serve(cfg, out, "hand")
    try:
        await wait_up(endpoint, proc, logf, n)
        stats: dict[str, Any] = {"tokens": 0, "requests": 0, "errors": []}
        await streams(endpoint, "a", a.streams, min(10.0, a.seconds), a.max_tokens, stats)  # warm-up
        stats = {"tokens": 0, "requests": 0, "errors": []}
        t0 = time.monotonic()
        await streams(endpoint, "a", a.streams, a.seconds, a.max_tokens, stats)
        by_hand = stats["tokens"] / (time.monotonic() - t0)
        rows.append({"row": "hand", "workers": n, "tok_s": round(by_hand, 1), "errors": len(stats["errors"])})
        log(f"by hand, {n} workers: {by_hand:.1f} tok/s")
    finally:
        stop(proc)
    pool = {"min_residency": a.min_residency, "scale_up_wait": 1.0, "scale_down_idle": a.min_residency}
    two = [{"name": m, "path": model, "replicas": [1, n], **sizes} for m in ("a", "b")]
    cfg = config(out, "replicas", two, pool, a.gpu)
    proc, endpoint, logf = serve(cfg, out, "replicas")
    errors: list[str] = []
    try:
        await wait_up(endpoint, proc, logf, 2)
        for busy, idle in (("a", "b"), ("b", "a")):
            stats = {"tokens": 0, "requests": 0, "errors": errors}
            full = asyncio.Event()
            t0 = time.monotonic()

            async def follow(busy: str = busy, idle: str = idle, full: asyncio.Event = full,
                             t0: float = t0) -> tuple[float, float]:
                """When the busy model holds n workers, and when the idle one is back to one."""
                up = down = -1.0
                while time.monotonic() - t0 < a.seconds * 2 and (up < 0 or down < 0):
                    if up < 0 and await ready_workers(endpoint, busy) >= n:
                        up = time.monotonic() - t0
                        full.set()
                    if down < 0 and await ready_workers(endpoint, idle) <= 1:
                        down = time.monotonic() - t0
                    await asyncio.sleep(0.2)
                return up, down

            watcher = asyncio.ensure_future(follow())
            await streams(endpoint, busy, a.streams, a.seconds * 2, a.max_tokens, stats, full)
            up, down = await watcher
            served = time.monotonic() - t0 - up if up >= 0 else 0.0
            rate = stats["tokens"] / served if served > 0 else 0.0
            rows.append({"row": f"{busy}_busy", "all_workers_after_s": round(up, 1), "other_back_to_one_after_s":
                         round(down, 1), "tok_s": round(rate, 1), "vs_hand": round(rate / by_hand, 3)})
            log(f"{busy} busy: {n} workers after {up:.1f} s, {idle} back to one after {down:.1f} s; then "
                f"{rate:.1f} tok/s ({rate / by_hand:.2f}x by hand)")
        from llamapool import AsyncClient

        async with AsyncClient(endpoint) as c:
            st = await c.status()
        rows.append({"row": "replicas", "loads": sum(m.get("loads", 0) for m in st["models"]),
                     "unloads": sum(m.get("unloads", 0) for m in st["models"]), "errors": len(errors),
                     "error_sample": errors[:3]})
        log(f"replicas: {rows[-1]}")
    finally:
        stop(proc)
    (out / "replicas_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    asyncio.run(main())
