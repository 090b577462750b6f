#!/usr/bin/env python3
"""llamapool, llama-server and the engine ceiling side by side, in one job, on one GPU and model.

For each workload (``llamapool.bench.workloads``: short, rag, long, mixed), one after another:

1. llamapool: the daemon with ``slots = C`` and ``ctx_per_slot`` fitting the workload's longest
   request, driven through the SDK;
2. llama-server (``--llama-server PATH``): ``-ngl 99 -np C -c C*CTX -fa on -t 8 --cache-ram 0`` (per-slot
   KV, its fastest setting), driven over HTTP with exactly the same requests;
3. the engine ceiling: llama.cpp alone, the workload's first C requests in one context, per-sequence
   KV streams, GPU sampling.

Both services get the same client: C streams over ``--procs`` client processes that start together.
Each daemon or server is stopped before the next starts. Writes JSON lines to OUT/gpu_bench.jsonl and
a side-by-side table to OUT/summary.md (also printed).

On the GPU machine (after ``. scripts/gpu_env.sh``, which also unpacks the llama-server add-on):

    python3 scripts/gpu_bench.py --out OUT --llama-server /tmp/lsa/llama-server
    python3 scripts/gpu_bench.py --out OUT --workloads rag --sweep max_batch_tokens=1024,2048,4096,8192

On a CPU (a tiny model, ``devices = "cpu"``; llama-server is skipped unless given):

    PYTHONPATH=src python3 scripts/gpu_bench.py --cpu --out /tmp/o --workloads short --concurrency 4 --requests 8

The llama-server binary finds its libraries through LD_LIBRARY_PATH: the binary's own folder and the
``llama_cpp`` package's ``lib`` folder are put in front of the caller's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import llama_cpp  # first: CUDA model loads segfaulted after numpy/pyzmq imports

GPU_SHAPE = {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "n_ff": 8192, "n_vocab": 32000,
             "qtype": "q8_0"}
# Llama-3.1-8B's dimensions (8.5 GB in q8_0; make-model writes it in well under a minute)
SHAPE_8B = {"n_embd": 4096, "n_layer": 32, "n_head": 32, "n_head_kv": 8, "n_ff": 14336, "n_vocab": 128256,
            "qtype": "q8_0"}
CPU_SHAPE: dict[str, Any] = {}  # make_model's defaults: the tiny test model


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def section(name: str, timings: list[tuple[str, float]]) -> Iterator[None]:
    t0 = time.monotonic()
    log(f"--- {name}")
    try:
        yield
    finally:
        timings.append((name, time.monotonic() - t0))
        log(f"--- {name}: {time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------- llamapool

def start_daemon(cfg_text: str, tmp: Path, tag: str, logs: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    cfg = logs / f"{tag}.toml"
    cfg.write_text(cfg_text)
    logf = logs / f"{tag}.log"
    with open(logf, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                                stdout=fh, stderr=subprocess.STDOUT)
    return proc, f"ipc://{tmp / ('run-' + tag) / 'frontend.sock'}", logf


def wait_ready(endpoint: str, n: int, proc: subprocess.Popen[bytes], logf: Path,
               timeout: float = 180) -> dict[str, Any]:
    from llamapool import Client, LlamapoolError

    end = time.monotonic() + timeout
    with Client(endpoint) as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                print(logf.read_text(errors="replace")[-4000:])
                raise SystemExit(f"daemon exited {proc.returncode}")
            try:
                st = c.status()
                if sum(w["state"] == "ready" for w in st["workers"]) >= n:
                    return st
            except LlamapoolError:
                pass
            time.sleep(0.5)
    print(logf.read_text(errors="replace")[-4000:])
    raise SystemExit("workers not ready")


def daemon_config(tmp: Path, tag: str, model: str, devices: str, slots: int, ctx: int, extra: str,
                  cpu: bool) -> str:
    workers = 'devices = "cpu"\ncpu_workers = 1\n' if cpu else f"devices = {devices}\n"
    return (f'[server]\nruntime_dir = "{tmp / ("run-" + tag)}"\nqueue_timeout = 600.0\nmax_queue = 100000\n'
            f'[model]\npath = "{model}"\nctx_per_slot = {ctx}\n{extra}'
            f'[workers]\n{workers}slots = {slots}\n')


def stop_daemon(proc: subprocess.Popen[bytes], logf: Path) -> list[str]:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return [ln for ln in logf.read_text(errors="replace").splitlines() if "CUDA error" in ln][:5]


def engine_counters(ep: str) -> dict[str, float]:
    from llamapool import Client

    with Client(ep) as cl:
        workers = cl.status()["workers"]
    return {k: sum(float(w.get(k) or 0) for w in workers)
            for k in ("steps", "decode_s", "step_s", "draft_tokens", "accepted_tokens")}


def vocab_size(model: str) -> int:
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    m = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    if not m:
        raise SystemExit(f"cannot load {model}")
    n = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m)))
    llama_cpp.llama_model_free(m)
    return n


# ---------------------------------------------------------------- llama-server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    def __init__(self, binary: str, model: str, slots: int, ctx_per_slot: int, logs: Path, tag: str, cpu: bool,
                 threads: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [binary, "-m", model, "-ngl", "0" if cpu else "99", "-np", str(slots),
                     "-c", str(slots * ctx_per_slot), "-fa", "on", "-t", str(threads), "--cache-ram", "0",
                     "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)]
        libs = [str(Path(binary).resolve().parent), str(Path(llama_cpp.__file__).parent / "lib")]
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(":")}
        self.log = logs / f"{tag}.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(self.args, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                print(self.log.read_text(errors="replace")[-4000:])
                raise SystemExit(f"llama-server exited {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        print(self.log.read_text(errors="replace")[-4000:])
        raise SystemExit("llama-server not healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- main

def main() -> int:
    from llamapool.bench.workloads import DEFAULT_CTX, NAMES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_bench.jsonl, summary.md and logs/")
    ap.add_argument("--workloads", nargs="*", choices=NAMES, default=list(NAMES),
                    help="the workloads side by side (none: only --scenarios / --scaling)")
    ap.add_argument("--concurrency", type=int, default=64, help="streams (and slots) per workload")
    ap.add_argument("--long-concurrency", type=int, default=32, help="at most this many streams for 'long'")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default 4 x C; 2 x C for 'long')")
    ap.add_argument("--procs", type=int, default=4, help="client processes the streams are spread over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (default greedy)")
    ap.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="prompt + output budget of 'mixed'")
    ap.add_argument("--model", default="", help="a GGUF (default: a random one of --shape, made here)")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b", help="the random model's shape")
    ap.add_argument("--cpu", action="store_true", help="tiny model, devices = \"cpu\" (checks the script)")
    ap.add_argument("--llama-server", default="", metavar="PATH", help="the peer's binary (else skipped)")
    ap.add_argument("--peer-api", choices=("llama", "completions"), default="llama",
                    help="drive llama-server through POST /completion or POST /v1/completions")
    ap.add_argument("--peer-threads", type=int, default=8, help="llama-server -t")
    ap.add_argument("--extra", default="", metavar="TOML",
                    help="lines added to the daemon's [model] table, e.g. 'max_batch_tokens = 4096' "
                         "(';' separates lines)")
    ap.add_argument("--sweep", default="", metavar="KEY=V1,V2,...",
                    help="instead of the side by side: llamapool alone at each value of this [model] key")
    ap.add_argument("--no-peer", action="store_true", help="skip llama-server")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the engine ceiling")
    ap.add_argument("--ceiling-ubatch", type=int, default=512, help="the ceiling's n_ubatch")
    ap.add_argument("--scenarios", action="store_true",
                    help="also: an 8,000-token prompt among 63 streams; 64 prompts sharing 1,000 tokens")
    ap.add_argument("--scenario-extra", action="append", default=None, metavar="TOML",
                    help="run the long-prompt scenario at this [model] setting (repeatable; default: --extra)")
    ap.add_argument("--gateway", type=int, default=0, metavar="PROCS",
                    help="also drive llamapool through its HTTP gateway (this many gateway processes), "
                         "with the same requests over POST /v1/completions")
    ap.add_argument("--rates", default="", metavar="R1,R2,...",
                    help="also: open loop, --open-workload at Poisson arrivals of each rate (ascending) for "
                         "llamapool and llama-server (C slots each); a service stops at its first rate whose "
                         "TTFT p99 passes --ttft-slo")
    ap.add_argument("--open-workload", choices=NAMES, default="rag")
    ap.add_argument("--open-seconds", type=float, default=12.0, help="seconds of arrivals per rate")
    ap.add_argument("--ttft-slo", type=float, default=500.0, metavar="MS", help="the open loop's TTFT p99 target")
    ap.add_argument("--streams", default="", metavar="C1,C2,...",
                    help="also: 'short' at each stream count (slots = C) for llamapool, with the ceiling at C")
    ap.add_argument("--neighbours", action="store_true",
                    help="short at C/2 streams alone, then beside C/2 json streams in the same daemon: the "
                         "unconstrained streams' speed with constrained neighbours (issue 21)")
    ap.add_argument("--scaling-workload", choices=NAMES, default="short", help="the workload of --scaling")
    ap.add_argument("--scaling", action="store_true",
                    help="also: 'short' on one GPU, then on every GPU (C streams each), with isolation checks")
    args = ap.parse_args()

    from llamapool.bench import drivers
    from llamapool.bench.ceiling import measure as ceiling
    from llamapool.bench.scenarios import run as scenario
    from llamapool.bench.workloads import CHOICES, FIXED, make_workload
    from llamapool.modelgen import make_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "gpu_bench.jsonl"
    logs = out / "logs"  # configs and the daemons' and servers' logs
    logs.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lp-gpu-"))  # the model and the runtime dirs
    timings: list[tuple[str, float]] = []
    t_start = time.monotonic()
    extra = "".join(ln.strip() + "\n" for ln in args.extra.split(";") if ln.strip())

    def record(row: dict[str, Any]) -> None:
        log(json.dumps(row))
        with open(results, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    inventory: list[Any] = []
    if not args.cpu:
        from llamapool.supervisor import gpus as gpumod

        inventory = gpumod.discover(gpumod.load_nvml())
        record({"mode": "inventory", "gpus": [asdict(g) for g in inventory]})
    model = args.model
    if not model:
        with section("model", timings):
            t0 = time.monotonic()
            shape = CPU_SHAPE if args.cpu else SHAPE_8B if args.shape == "8b" else GPU_SHAPE
            model = str(make_model(tmp / "m.gguf", **shape))
            record({"mode": "model", "path": model, "bytes": os.path.getsize(model), "shape": shape,
                    "gen_s": round(time.monotonic() - t0, 1)})
    n_vocab = vocab_size(model)
    peer = args.llama_server if not args.no_peer else ""
    if peer and not Path(peer).is_file():
        raise SystemExit(f"--llama-server {peer}: no such file")
    if not peer and not args.no_peer and not args.sweep:
        log("NOTE: no --llama-server binary given: llama-server is skipped (no peer figures in this run)")
        record({"mode": "note", "peer": "llama-server", "skipped": "no --llama-server binary"})
    devices = "[0]"

    def daemon(tag: str, slots: int, ctx_slot: int, more: str = "", devs: str = devices,
               n: int = 1, http: str = "") -> tuple[subprocess.Popen[bytes], str, Path, dict[str, Any]]:
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)[:40]
        proc, ep, logf = start_daemon(daemon_config(tmp, tag, model, devs, slots, ctx_slot, extra + more, args.cpu)
                                      + http, tmp, tag, logs)
        st = wait_ready(ep, n, proc, logf)
        return proc, ep, logf, st

    def drive_llamapool(ep: str, work: Any, c: int) -> tuple[Any, dict[str, float]]:
        before = engine_counters(ep)
        r = drivers.run(drivers.Target("sdk", ep), work, c, args.procs)
        time.sleep(1.2)  # one heartbeat, so the counters include the whole run
        after = engine_counters(ep)
        return r, {k: round(after[k] - before[k], 3) for k in after}

    def workload(name: str, k: int = 1) -> tuple[Any, int]:
        """``name``'s requests (``k`` times as many) and its concurrency."""
        c = min(args.concurrency, args.long_concurrency) if name == "long" else args.concurrency
        n = k * (args.requests or (2 * c if name == "long" else 4 * c)) // CHOICES.get(name, 1)  # n4: 4 choices each
        ctx = args.ctx if name == "mixed" else sum(FIXED[name])
        return make_workload(name, n, n_vocab, seed=args.seed, ctx=ctx, temperature=args.temperature), c

    summary: list[dict[str, Any]] = []
    if args.sweep:
        key, _, values = args.sweep.partition("=")
        for name in args.workloads:
            work, c = workload(name)
            for v in [x.strip() for x in values.split(",") if x.strip()]:
                with section(f"sweep {name} {key}={v}", timings):
                    proc, ep, logf, _ = daemon(f"sweep-{name}-{v}", c, work.longest + 16, f"{key} = {v}\n")
                    r, eng = drive_llamapool(ep, work, c)
                    cuda = stop_daemon(proc, logf)
                    record({**r.as_dict(), "service": "llamapool", "sweep_key": key, "sweep_value": v,
                            "extra": extra, "engine": eng, "cuda_errors": cuda})
                    summary.append({"workload": name, "C": c, "value": v, "row": r})
    else:
        for name in args.workloads:
            work, c = workload(name)
            ctx_slot = work.longest + 16
            line: dict[str, Any] = {"workload": name, "C": c, "requests": len(work.requests)}
            with section(f"{name}: llamapool (C={c}, {len(work.requests)} requests)", timings):
                http = ""
                if args.gateway:
                    port = free_port()
                    http = f'[http]\nlisten = "127.0.0.1:{port}"\nprocesses = {args.gateway}\n'
                proc, ep, logf, _ = daemon(f"{name}-llamapool", c, ctx_slot, http=http)
                r, eng = drive_llamapool(ep, work, c // CHOICES.get(name, 1))  # c sequences in all
                if args.gateway:  # the same requests through the gateway, same daemon
                    time.sleep(1.0)
                    g = drivers.run(drivers.Target("http-openai", f"http://127.0.0.1:{port}"), work, c, args.procs)
                    record({**g.as_dict(), "service": "llamapool-gateway", "gateway_processes": args.gateway,
                            "gateway_over_sdk": round(g.tok_s / r.tok_s, 3)})
                    line["gateway"] = g
                cuda = stop_daemon(proc, logf)
                record({**r.as_dict(), "service": "llamapool", "extra": extra, "ctx_per_slot": ctx_slot,
                        "engine": eng, "cuda_errors": cuda})
                line["llamapool"] = r
            if peer:
                with section(f"{name}: llama-server", timings):
                    srv = LlamaServer(peer, model, c, ctx_slot, logs, f"{name}-llama-server", args.cpu,
                                      args.peer_threads)
                    try:
                        srv.wait_healthy()
                        transport = "http-llama" if args.peer_api == "llama" else "http-openai"
                        r = drivers.run(drivers.Target(transport, srv.url), work, c // CHOICES.get(name, 1), args.procs)
                    finally:
                        srv.stop()
                    record({**r.as_dict(), "service": "llama-server", "server_args": srv.args[1:]})
                    line["llama-server"] = r
            if not args.no_ceiling:
                with section(f"{name}: ceiling", timings):
                    ceil = ceiling(model, c, gpu=not args.cpu, gpu_sampling=not args.cpu, kv_unified=False,
                                   n_ubatch=args.ceiling_ubatch, requests=work.requests[:c])
                    record({**ceil, "workload": name})
                    line["ceiling"] = ceil
            summary.append(line)

    if args.scenarios:
        big = not args.cpu
        for sx in args.scenario_extra or [""]:
            more = "".join(ln.strip() + "\n" for ln in sx.split(";") if ln.strip())
            with section(f"scenario long-prompt {sx}", timings):
                proc, ep, logf, _ = daemon("long-prompt", 64 if big else 4, 8448 if big else 1024, more)
                kw = {"n_vocab": n_vocab} if big else {"others": 3, "long_tokens": 900, "gen_tokens": 32,
                                                       "n_vocab": n_vocab}
                record({**scenario("long-prompt", ep, **kw), "extra": extra + more})
                stop_daemon(proc, logf)
        for on in (False, True):
            with section(f"scenario shared-prefix, prefix_cache={on}", timings):
                proc, ep, logf, _ = daemon(f"prefix-{on}", 64 if big else 4, 1100,
                                           f"prefix_cache = {str(on).lower()}\n")
                kw = {"n_vocab": n_vocab} if big else {"requests": 8, "concurrency": 4, "n_vocab": n_vocab}
                record({**scenario("shared-prefix", ep, **kw), "prefix_cache": on, "extra": extra})
                stop_daemon(proc, logf)

    if args.rates:
        rates = sorted(float(x) for x in args.rates.split(",") if x.strip())
        open_loop(args, rates, model, n_vocab, peer, daemon, record, logs, timings)
    if args.neighbours:
        neighbours(args, n_vocab, daemon, record, timings)
    if args.streams:
        for c in [int(x) for x in args.streams.split(",") if x.strip()]:
            with section(f"streams C={c}", timings):
                work = make_workload("short", args.requests or 4 * c, n_vocab, seed=args.seed, ctx=sum(FIXED["short"]))
                proc, ep, logf, _ = daemon(f"streams-{c}", c, work.longest + 16)
                r, eng = drive_llamapool(ep, work, c)
                stop_daemon(proc, logf)
                row = {**r.as_dict(), "service": "llamapool", "streams": c, "engine": eng, "extra": extra}
                if not args.no_ceiling:
                    ceil = ceiling(model, c, gpu=not args.cpu, gpu_sampling=not args.cpu, kv_unified=False,
                                   n_ubatch=args.ceiling_ubatch, requests=work.requests[:c])
                    row.update(ceiling_e2e_tok_s=round(ceil["e2e_tok_s"], 1),
                               over_ceiling=round(r.tok_s / ceil["e2e_tok_s"], 3))
                record(row)

    if args.scaling:
        if len(inventory) < 2:
            log("NOTE: --scaling needs 2 or more GPUs; skipped")
        else:
            with section("scaling", timings):
                scaling(args, inventory, daemon, drive_llamapool, workload, record)

    total = time.monotonic() - t_start
    record({"mode": "timing", "total_s": round(total, 1), "sections": {k: round(v, 1) for k, v in timings}})
    table = "" if not summary else sweep_table(summary, args.sweep) if args.sweep else side_by_side(summary)
    if table:
        (out / "summary.md").write_text(table + "\n")
        print(table)
    errors = sum(r.errors for s in summary for r in (s.get("llamapool"), s.get("llama-server"), s.get("row"))
                 if r is not None)
    if errors:
        log(f"{errors} request(s) failed or came back short: those rows are not figures")
    log(f"done in {total:.1f} s; rows in {results}")
    return 1 if errors else 0


def neighbours(args: argparse.Namespace, n_vocab: int, daemon: Any, record: Any,
               timings: list[tuple[str, float]]) -> None:
    """Unconstrained streams beside as many unconstrained ones, then beside as many constrained ones (the
    same batch size both times), in one daemon of C slots: what constrained neighbours cost them."""
    import threading

    from llamapool.bench import drivers
    from llamapool.bench.workloads import FIXED, make_workload

    half = args.concurrency // 2
    n = args.requests or 4 * half
    plain = make_workload("short", n, n_vocab, seed=args.seed, ctx=sum(FIXED["short"]))
    rows: dict[str, Any] = {}
    with section(f"neighbours: short C={half} beside short, then beside json C={half}", timings):
        proc, ep, logf, _ = daemon("neighbours", args.concurrency, plain.longest + 16)
        target = drivers.Target("sdk", ep)
        for kind in ("short", "json"):
            other = make_workload(kind, 2 * n, n_vocab, seed=args.seed + 1, ctx=sum(FIXED[kind]))
            side = threading.Thread(target=lambda o=other, k=kind: rows.update({k: drivers.run(target, o, half,
                                                                                                args.procs)}))
            side.start()
            time.sleep(2.0)  # the neighbours are running: the measured streams start among them
            rows[f"plain_beside_{kind}"] = drivers.run(target, plain, half, args.procs)
            side.join()
            time.sleep(1.0)
        stop_daemon(proc, logf)
    base, mixed = rows["plain_beside_short"], rows["plain_beside_json"]
    row = {"mode": "neighbours", "C_each": half, "beside_short_tok_s": round(base.tok_s, 1),
           "beside_json_tok_s": round(mixed.tok_s, 1), "ratio": round(mixed.tok_s / base.tok_s, 3),
           "beside_short_itl_p50_ms": base.itl_p50_ms, "beside_json_itl_p50_ms": mixed.itl_p50_ms,
           "errors": sum(r.errors for r in rows.values())}
    record(row)
    log(f"neighbours: short beside short {base.tok_s:,.0f} tok/s, beside json {mixed.tok_s:,.0f} tok/s "
        f"({row['ratio']:.3f}x)")


def open_loop(args: argparse.Namespace, rates: list[float], model: str, n_vocab: int, peer: str, daemon: Any,
              record: Any, logs: Path, timings: list[tuple[str, float]]) -> None:
    """--rates: each service at ascending Poisson rates until one misses the TTFT p99 target; the
    highest rate that met it, per service."""
    import asyncio

    from llamapool.bench import drivers
    from llamapool.bench.workloads import FIXED, make_workload

    name, c = args.open_workload, args.concurrency
    best: dict[str, float] = {}
    for service in ("llamapool", "llama-server") if peer else ("llamapool",):
        with section(f"open loop {name}: {service}", timings):
            ctx_slot = (args.ctx if name == "mixed" else sum(FIXED[name])) + 16
            if service == "llamapool":
                proc, ep, logf, _ = daemon(f"open-{name}", c, ctx_slot)
                target = drivers.Target("sdk", ep)
            else:
                srv = LlamaServer(peer, model, c, ctx_slot, logs, f"open-{name}-llama-server", args.cpu,
                                  args.peer_threads)
                srv.wait_healthy()
                target = drivers.Target("http-llama" if args.peer_api == "llama" else "http-openai", srv.url)
            best[service] = 0.0
            try:
                for rate in rates:
                    n = max(32, int(args.open_seconds * rate))
                    work = make_workload(name, n, n_vocab, seed=args.seed, ctx=ctx_slot - 16)
                    r = asyncio.run(drivers.measure_open(target, work, rate))
                    met = r.ttft_p99_ms <= args.ttft_slo and not r.errors
                    record({**r.as_dict(), "service": service, "open_loop": True, "ttft_slo_ms": args.ttft_slo,
                            "met": met})
                    if not met:
                        break
                    best[service] = rate
            finally:
                if service == "llamapool":
                    stop_daemon(proc, logf)
                else:
                    srv.stop()
    row: dict[str, Any] = {"mode": "open-loop-best", "workload": name, "ttft_slo_ms": args.ttft_slo, "best": best}
    if best.get("llama-server"):
        row["ratio"] = round(best["llamapool"] / best["llama-server"], 2)
    record(row)


def scaling(args: argparse.Namespace, inventory: list[Any], daemon: Any, drive_llamapool: Any, workload: Any,
            record: Any) -> None:
    """``--scaling-workload`` ('short') at C streams on one GPU, then C streams per GPU on all of them;
    isolation checks."""
    n_gpu = len(inventory)
    name = args.scaling_workload
    work1, c = workload(name)
    proc, ep, logf, _ = daemon("scale-1", c, work1.longest + 16)
    r1, _ = drive_llamapool(ep, work1, c)
    record({**r1.as_dict(), "service": "llamapool", "gpus": 1, "scaling_baseline": True})
    stop_daemon(proc, logf)
    work_n, _ = workload(name, n_gpu)  # C streams per GPU, 4 x C requests per GPU
    proc, ep, logf, st = daemon("scale-n", c, work1.longest + 16, devs='"auto"', n=n_gpu)
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    checks = []
    for w in st["workers"]:
        g = next(g for g in inventory if g.uuid == w["device"])
        env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        checks.append({
            "worker": w["id"], "pid": w["pid"], "uuid": w["device"], "visible_devices": w["visible_devices"],
            "sees_exactly_its_gpu": len(w["visible_devices"]) == 1
            and g.pci_bus_id.lower()[-12:] in w["visible_devices"][0].lower(),
            "env_cuda_visible": [e.decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")],
            "nvml_processes_on_gpu": [ln for ln in smi.splitlines() if g.uuid in ln],
        })
    record({"mode": f"isolation-{n_gpu}gpu", "checks": checks, "nvidia_smi": smi})
    rn, _ = drive_llamapool(ep, work_n, c * n_gpu)
    record({**rn.as_dict(), "service": "llamapool", "gpus": n_gpu, "scaling_vs_one_gpu": round(rn.tok_s / r1.tok_s, 3)})
    record({"mode": "cuda-errors-in-logs", "lines": stop_daemon(proc, logf)})


def side_by_side(summary: list[dict[str, Any]]) -> str:
    head = ("| workload | C | requests | llamapool tok/s | llama-server tok/s | ratio | TTFT p50 ms llamapool / "
            "llama-server | ITL p50 ms llamapool / llama-server | ITL p99 ms llamapool / llama-server | "
            "ceiling e2e tok/s | llamapool / ceiling | errors |")
    lines = [head, "|" + "---|" * 12]
    for s in summary:
        lp, ls, ce = s.get("llamapool"), s.get("llama-server"), s.get("ceiling")

        def f(x: float | None, fmt: str = "{:,.0f}") -> str:
            return "-" if x is None else fmt.format(x)

        lines.append(
            f"| {s['workload']} | {s['C']} | {s['requests']} | {f(lp and lp.tok_s)} | {f(ls and ls.tok_s)} | "
            f"{f(lp.tok_s / ls.tok_s if lp and ls else None, '{:.2f}')} | "
            f"{f(lp and lp.ttft_p50_ms)} / {f(ls and ls.ttft_p50_ms)} | "
            f"{f(lp and lp.itl_p50_ms, '{:.2f}')} / {f(ls and ls.itl_p50_ms, '{:.2f}')} | "
            f"{f(lp and lp.itl_p99_ms, '{:.1f}')} / {f(ls and ls.itl_p99_ms, '{:.1f}')} | "
            f"{f(ce and ce['e2e_tok_s'])} | {f(lp.tok_s / ce['e2e_tok_s'] if lp and ce else None, '{:.2f}')} | "
            f"{(lp.errors if lp else 0)} / {(ls.errors if ls else 0)} |")
    gateway = [s for s in summary if s.get("gateway")]
    if gateway:
        lines += ["", "| workload | C | SDK tok/s | gateway tok/s | gateway / SDK | llama-server tok/s | "
                      "gateway / llama-server | TTFT p50 ms SDK / gateway | errors |", "|" + "---|" * 9]
        for s in gateway:
            lp, gw, ls = s["llamapool"], s["gateway"], s.get("llama-server")
            peer = f"{ls.tok_s:,.0f} | {gw.tok_s / ls.tok_s:.2f}" if ls else "- | -"
            lines.append(f"| {s['workload']} | {s['C']} | {lp.tok_s:,.0f} | {gw.tok_s:,.0f} | "
                         f"{gw.tok_s / lp.tok_s:.2f} | {peer} | "
                         f"{lp.ttft_p50_ms:,.0f} / {gw.ttft_p50_ms:,.0f} | {gw.errors} |")
    return "\n".join(lines)


def sweep_table(summary: list[dict[str, Any]], sweep: str) -> str:
    key = sweep.partition("=")[0]
    lines = [f"| workload | C | {key} | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | decode tok/s | errors |",
             "|" + "---|" * 8]
    for s in summary:
        r = s["row"]
        lines.append(f"| {s['workload']} | {s['C']} | {s['value']} | {r.tok_s:,.0f} | {r.ttft_p50_ms:,.0f} / "
                     f"{r.ttft_p99_ms:,.0f} | {r.itl_p50_ms:.2f} / {r.itl_p99_ms:.2f} | {r.decode_tok_s:,.0f} | "
                     f"{r.errors} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
