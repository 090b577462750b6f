#!/usr/bin/env python3
"""GPU figures in one run (issue 4): service vs engine ceiling at several concurrencies on one GPU,
then the 2-GPU scaling, plus the per-GPU isolation checks. Writes JSON lines to --out.

    PYTHONPATH=src python3 scripts/gpu_bench.py --out /tmp/out [--concurrency 1 16 64 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import llama_cpp  # noqa: F401 - first: CUDA model loads segfaulted after numpy/pyzmq imports


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start(cfg_text: str, tmp: Path, tag: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(cfg_text)
    logf = tmp / f"{tag}.log"
    proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                            stdout=open(logf, "wb"), stderr=subprocess.STDOUT)
    return proc, f"ipc://{tmp / ('run-' + tag) / 'frontend.sock'}", logf


def wait_ready(endpoint: str, n: int, proc: subprocess.Popen[bytes], logf: Path,
               timeout: float = 120) -> dict[str, Any]:
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
        try:
            print(json.dumps(c.status(), indent=1)[-3000:])
        except LlamapoolError:
            pass
    print(logf.read_text(errors="replace")[-4000:])
    raise SystemExit("workers not ready")


def config(tmp: Path, tag: str, model: str, devices: str, slots: int, ctx: int) -> str:
    return (f'[server]\nruntime_dir = "{tmp / ("run-" + tag)}"\nqueue_timeout = 600.0\n'
            f'[model]\npath = "{model}"\nctx_per_slot = {ctx}\n'
            f'[workers]\ndevices = {devices}\nslots = {slots}\n')


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="requests = waves x C")
    ap.add_argument("--model", default="")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 4], help="client processes to try")
    ap.add_argument("--skip-two", action="store_true")
    ap.add_argument("--skip-one", action="store_true")
    ap.add_argument("--skip-scenarios", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--scenario-budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=TOML",
                    help="also run C=max at this [model] setting, e.g. nochunk='prefill_chunk = 2048'")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "gpu_bench.jsonl"

    def record(row: dict[str, Any]) -> None:
        log(json.dumps(row))
        with open(results, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    from llamapool.bench import run_service
    from llamapool.ceiling import measure
    from llamapool.modelgen import make_model
    from llamapool.supervisor import gpus as gpumod

    nvml = gpumod.load_nvml()
    inventory = gpumod.discover(nvml)
    record({"mode": "inventory", "gpus": [asdict(g) for g in inventory]})
    tmp = Path(tempfile.mkdtemp(prefix="lp-gpu-"))
    model = args.model
    if not model:
        t0 = time.monotonic()
        model = str(make_model(tmp / "m.gguf", n_embd=2048, n_layer=16, n_head=32, n_head_kv=8,
                               n_ff=8192, n_vocab=32000, qtype="q8_0"))
        record({"mode": "model", "path": model, "bytes": os.path.getsize(model),
                "gen_s": round(time.monotonic() - t0, 1)})
    P, G = args.prompt_tokens, args.gen_tokens
    ctx = P + G + 16

    from llamapool import Client
    from llamapool.bench_scenarios import run as scenario

    def engine_counters(ep: str) -> dict[str, Any]:
        with Client(ep) as cl:
            w = cl.status()["workers"][0]
        return {"steps": w.get("steps"), "decode_s": w.get("decode_s"), "step_s": w.get("step_s")}

    def daemon(tag: str, extra: str = "", slots: int = 64, ctx_slot: int = ctx, devices: str = "[0]",
               n: int = 1) -> tuple[subprocess.Popen[bytes], str, Path]:
        proc, ep, logf = start(config(tmp, tag, model, devices, slots, ctx_slot).replace(
            "[model]\n", "[model]\n" + extra), tmp, tag)
        wait_ready(ep, n, proc, logf)
        return proc, ep, logf

    def stop(proc: subprocess.Popen[bytes], logf: Path) -> None:
        proc.terminate()
        proc.wait(120)
        errs = [ln for ln in logf.read_text(errors="replace").splitlines() if "CUDA error" in ln]
        if errs:
            record({"mode": "cuda-errors", "log": str(logf), "lines": errs[:5]})

    if not args.skip_one:
        # ---- one GPU: service (slots = C, as a user would size it) and the ceilings, per C
        for c in args.concurrency:
            proc, ep, logf = daemon(f"c{c}", slots=c)
            for procs in args.procs:
                before = engine_counters(ep)
                r = asyncio.run(run_service(ep, c, args.waves * c, P, G, progress=False, procs=procs))
                time.sleep(1.2)  # one heartbeat, so the counters include the whole run
                after = engine_counters(ep)
                eng = {k: round((after[k] or 0) - (before[k] or 0), 3) for k in after}
                record({**asdict(r), "gpus": 1, "procs": procs, "engine": eng})
            stop(proc, logf)
            for gs in (True, False):
                record({**measure(model, c, P, G, gpu=True, gpu_sampling=gs), "gpus": 1})
    for v in args.variant:
        name, _, extra = v.partition("=")
        c = max(args.concurrency)
        proc, ep, logf = daemon(f"v-{name}", extra.replace(";", "\n") + "\n", slots=c)
        before = engine_counters(ep)
        r = asyncio.run(run_service(ep, c, args.waves * c, P, G, progress=False, procs=max(args.procs)))
        time.sleep(1.2)
        after = engine_counters(ep)
        record({**asdict(r), "variant": name, "extra": extra,
                "engine": {k: round((after[k] or 0) - (before[k] or 0), 3) for k in after}})
        stop(proc, logf)
    if not args.skip_scenarios:
        # ---- chunked prefill: an 8000-token prompt while 63 others stream
        for budget in args.scenario_budgets:
            proc, ep, logf = daemon(f"long{budget}", f"max_batch_tokens = {budget}\n", slots=64, ctx_slot=8448)
            record({**scenario("long-prompt", ep), "max_batch_tokens": budget})
            stop(proc, logf)
        # ---- prefix reuse: 64 requests sharing a 1000-token system prompt
        for on in (() if args.skip_prefix else (False, True)):
            proc, ep, logf = daemon(f"prefix{on}", f"prefix_cache = {str(on).lower()}\n", slots=64,
                                    ctx_slot=1100)
            record({**scenario("shared-prefix", ep), "prefix_cache": on})
            stop(proc, logf)

    # ---- two GPUs: scaling, isolation checks
    if len(inventory) >= 2 and not args.skip_two:
        half = 64
        proc, ep, logf = daemon("scale1", slots=half)
        r1 = asyncio.run(run_service(ep, half, args.waves * half, P, G, progress=False,
                                     procs=max(args.procs)))
        record({**asdict(r1), "gpus": 1, "scaling_baseline": True})
        stop(proc, logf)
        proc, ep, logf = start(config(tmp, "two", model, '"auto"', half, ctx), tmp, "two")
        st = wait_ready(ep, 2, proc, logf)
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout
        checks = []
        for w in st["workers"]:
            g = next(g for g in inventory if g.uuid == w["device"])
            env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
            checks.append({
                "worker": w["id"], "pid": w["pid"], "uuid": w["device"],
                "visible_devices": w["visible_devices"],
                "sees_exactly_its_gpu": len(w["visible_devices"]) == 1
                and g.pci_bus_id.lower()[-12:] in w["visible_devices"][0].lower(),
                "env_cuda_visible": [e.decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")],
                "nvml_processes_on_gpu": [ln for ln in smi.splitlines() if g.uuid in ln],
            })
        record({"mode": "isolation-2gpu", "checks": checks, "nvidia_smi": smi})
        r2 = asyncio.run(run_service(ep, 2 * half, args.waves * 2 * half, P, G, progress=False,
                                     procs=max(args.procs)))
        record({**asdict(r2), "gpus": 2, "scaling_vs_one_gpu": round(r2.tok_s / r1.tok_s, 3)})
        proc.terminate()
        proc.wait(120)
        errs = [ln for ln in logf.read_text(errors="replace").splitlines() if "CUDA error" in ln]
        record({"mode": "cuda-errors-in-logs", "count": len(errs), "lines": errs[:5]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
