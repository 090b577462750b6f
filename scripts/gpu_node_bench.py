#!/usr/bin/env python3
"""A node's GPU worker through CURVE over TCP against the same GPU(s) served locally, in one job.

On one GPU, alternately (local, node, local, node), with the same model, requests and client:

- ``local``: ``llamapool serve`` with the GPU's worker (``devices = [0]``), backend over ipc://;
- ``node``: ``llamapool serve`` with ``devices = "remote"`` (no local worker) and a ``tcp://``
  CURVE backend on loopback, plus ``llamapool node`` whose worker on the same GPU joins it with its
  own key: every prompt and token crosses CURVE-encrypted TCP between router and worker.

Then two checks on the GPU: a ``[[models]]`` pool (a GPU model and a CPU model: each request is
answered by its model's worker, and NVML lists only the GPU model's worker on the GPU), and a
worker over a GPU group (``devices = [[0]]``: layer split mode, the worker's N-GPU check).

With ``--gpus 2`` (``nvidia-h200-x2``), issue 10's two-GPU form: ``local`` is one pool on GPUs 0
and 1, ``node`` the router's own worker on GPU 0 plus a node's worker on GPU 1 (C/2 slots each);
the two models go one per GPU (NVML's per-GPU compute processes), and a worker over both GPUs
(``devices = [[0, 1]]``) runs ``short`` beside a worker on one.

Writes JSON lines to OUT/node_bench.jsonl and a table to OUT/summary.md. On the GPU machine, after
``. scripts/gpu_env.sh``:

    python3 scripts/gpu_node_bench.py --out OUT --concurrency 128             # nvidia-h200
    python3 scripts/gpu_node_bench.py --out OUT --concurrency 128 --gpus 2    # nvidia-h200-x2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # imports llama_cpp first, as CUDA loads need


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--workloads", nargs="*", default=["short", "rag"])
    ap.add_argument("--rounds", type=int, default=2, help="local/node pairs per workload")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--cpu", action="store_true", help="tiny model on CPU workers (checks the script)")
    ap.add_argument("--checks-only", action="store_true", help="skip the local/node runs")
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                    help="2 (nvidia-h200-x2): local = one pool on GPUs 0 and 1; node = the router's worker on "
                         "GPU 0 plus a node's on GPU 1 (C/2 slots each); checks: a model per GPU, a worker "
                         "over both GPUs beside one GPU")
    args = ap.parse_args()

    from llamapool import Client
    from llamapool.bench import drivers
    from llamapool.bench.workloads import FIXED, make_workload
    from llamapool.modelgen import make_model
    from llamapool.security import write_key_pair

    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lp-node-"))
    results = out / "node_bench.jsonl"

    def record(row: dict[str, Any]) -> None:
        gb.log(json.dumps(row))
        with open(results, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    model = str(make_model(tmp / "m.gguf", **(gb.CPU_SHAPE if args.cpu else gb.GPU_SHAPE)))
    n_vocab = gb.vocab_size(model)
    keys = tmp / "keys"
    allowed = tmp / "authorized"
    allowed.mkdir()
    for name in ("router", "nodeb", "bench"):
        write_key_pair(keys, name, force=True)
    for name in ("nodeb", "bench"):
        (allowed / f"{name}.pub").write_bytes((keys / f"{name}.pub").read_bytes())
    two = args.gpus == 2
    if args.cpu:  # CPU workers stand in for the GPUs (checks the script)
        devices = local_devs = node_devs = 'devices = "cpu"\ncpu_workers = 1\n'
        if two:
            local_devs = 'devices = "cpu"\ncpu_workers = 2\n'
    else:
        devices = "devices = [0]\n"
        local_devs, node_devs = ("devices = [0, 1]\n", "devices = [1]\n") if two else (devices, devices)
    port = gb.free_port()

    def serve(tag: str, text: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        cfg, logf = logs / f"{tag}.toml", logs / f"{tag}.log"
        cfg.write_text(text)
        with open(logf, "wb") as fh:
            cmd = "node" if "[node]" in text else "serve"
            proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", cmd, "--config", str(cfg)],
                                    stdout=fh, stderr=subprocess.STDOUT)
        return proc, cfg, logf

    def one(mode: str, name: str, c: int, ctx: int, work: Any, i: int) -> dict[str, Any]:
        tag = f"{name}-{mode}-{i}"
        run = tmp / f"run-{tag}"
        head = (f'[server]\nruntime_dir = "{run}"\nqueue_timeout = 600.0\nmax_queue = 100000\n'
                f'[model]\npath = "{model}"\nctx_per_slot = {ctx}\n')
        procs = []
        slots = c // 2 if two else c  # per worker
        if mode == "local":
            procs.append(serve(tag, head + f"[workers]\n{local_devs}slots = {slots}\n"))
        else:
            router_devs = (devices if two else 'devices = "remote"\n')
            procs.append(serve(tag, head.replace("[model]", f'backend = "tcp://127.0.0.1:{port}"\n[model]')
                               + f'[workers]\n{router_devs}slots = {slots}\n'
                               + f'[security]\nserver_key = "{keys / "router.key"}"\n'
                               + f'authorized_keys = "{allowed}"\n'))
            time.sleep(1.0)
            procs.append(serve(tag + "-node",
                               f'[server]\nruntime_dir = "{run}-node"\n[model]\npath = "{model}"\n'
                               f'ctx_per_slot = {ctx}\n[workers]\n{node_devs}slots = {slots}\n'
                               f'[node]\njoin = "tcp://127.0.0.1:{port}"\nname = "nodeB"\n'
                               f'server_public_key = "{keys / "router.pub"}"\nkey = "{keys / "nodeb.key"}"\n'))
        ep = f"ipc://{run / 'frontend.sock'}"
        st = gb.wait_ready(ep, 2 if two else 1, procs[0][0], procs[0][2])
        r = drivers.run(drivers.Target("sdk", ep), work, c, args.procs)
        with Client(ep) as cl:
            workers = [(w["id"], w.get("node", "")) for w in cl.status()["workers"]]
        cuda: list[str] = []
        for proc, _cfg, logf in reversed(procs):
            cuda += gb.stop_daemon(proc, logf)
        row = {**r.as_dict(), "mode": mode, "round": i, "workers": workers, "cuda_errors": cuda,
               "ready_workers": [w["id"] for w in st["workers"] if w["state"] == "ready"]}
        record(row)
        return row

    table = []
    for name in [] if args.checks_only else args.workloads:
        c = args.concurrency
        work = make_workload(name, 4 * c, n_vocab, seed=0, ctx=sum(FIXED[name]))
        ctx = work.longest + 16
        rows: dict[str, list[float]] = {"local": [], "node": []}
        for i in range(args.rounds):
            for mode in ("local", "node"):
                row = one(mode, name, c, ctx, work, i)
                if row["errors"]:
                    raise SystemExit(f"{name} {mode}: {row['errors']} errors: not a figure")
                rows[mode].append(row["tok_s"])
        loc, nod = sum(rows["local"]) / len(rows["local"]), sum(rows["node"]) / len(rows["node"])
        table.append(f"| {name} | {c} | {' / '.join(f'{x:,.0f}' for x in rows['local'])} | "
                     f"{' / '.join(f'{x:,.0f}' for x in rows['node'])} | {nod / loc:.3f} |")

    # --- two models: on the GPU and the CPU (one GPU), or one per GPU (two): the right worker, the right device
    tiny = str(make_model(tmp / "tiny.gguf", **gb.CPU_SHAPE))
    small_dev = "devices = [1]\n" if two and not args.cpu else 'devices = "cpu"\ncpu_workers = 1\n'
    big_w = "big-cpu0" if args.cpu else "big-gpu0"
    small_w = "small-gpu1" if two and not args.cpu else "small-cpu0"
    run = tmp / "run-models"
    proc, _cfg, logf = serve("models", f'[server]\nruntime_dir = "{run}"\n'
                             f'[[models]]\nname = "big"\npath = "{model}"\nctx_per_slot = 512\n{devices}slots = 8\n'
                             f'[[models]]\nname = "small"\npath = "{tiny}"\nctx_per_slot = 512\n{small_dev}slots = 4\n')
    ep = f"ipc://{run / 'frontend.sock'}"
    st = gb.wait_ready(ep, 2, proc, logf)
    with Client(ep) as cl:
        big = [cl.generate("to the big model", max_tokens=8, model="big").worker for _ in range(4)]
        small = [cl.generate("to the small one", max_tokens=8, model="small").worker for _ in range(4)]
        rows_ = cl.status()["workers"]
    pids = {w["id"]: w["pid"] for w in rows_}
    on_gpu: dict[int, list[int]] = {}  # GPU index -> compute pids (NVML)
    if not args.cpu:
        from llamapool.supervisor import gpus as gpumod

        nvml = gpumod.load_nvml()
        for i in range(2 if two else 1):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            on_gpu[i] = sorted(p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h))
    # this process may be on GPU 0's list too: it read the model's vocabulary through llama.cpp
    me = os.getpid()
    models_row = {"mode": "two-models", "big_served_by": sorted(set(big)), "small_served_by": sorted(set(small)),
                  "worker_pids": pids, "compute_pids": on_gpu, "bench_pid": me,
                  "models": [m["name"] for m in st.get("models", [])]}
    placed = args.cpu or (set(on_gpu[0]) - {me} == {pids[big_w]} and (
        set(on_gpu[1]) - {me} == {pids[small_w]} if two else pids[small_w] not in on_gpu[0]))
    models_row["ok"] = set(big) == {big_w} and set(small) == {small_w} and placed
    gb.stop_daemon(proc, logf)
    record(models_row)

    # --- a worker over a GPU group: layer split, its N-GPU check; with two GPUs, beside one GPU
    group_rows: list[dict[str, Any]] = []
    if not args.cpu:
        n_vocab_work = make_workload("short", 2 * args.concurrency, n_vocab, seed=0, ctx=sum(FIXED["short"]))
        for label, devs in ([("one GPU", "[0]"), ("group of two", "[[0, 1]]")] if two else [("group of one", "[[0]]")]):
            run = tmp / f"run-group-{len(group_rows)}"
            proc, _cfg, logf = serve(f"group{len(group_rows)}",
                                     f'[server]\nruntime_dir = "{run}"\nqueue_timeout = 600.0\n[model]\n'
                                     f'path = "{model}"\nctx_per_slot = {n_vocab_work.longest + 16}\n'
                                     f'[workers]\ndevices = {devs}\nslots = {args.concurrency // 2}\n')
            ep = f"ipc://{run / 'frontend.sock'}"
            st = gb.wait_ready(ep, 1, proc, logf)
            r = drivers.run(drivers.Target("sdk", ep), n_vocab_work, args.concurrency // 2, args.procs)
            row = next(w for w in st["workers"] if w["state"] == "ready")
            group_rows.append({"mode": "gpu-group", "label": label, "devices": devs, "worker": row["id"],
                               "visible_devices": row.get("visible_devices"), "tok_s": r.tok_s,
                               "errors": r.errors, "cuda_errors": gb.stop_daemon(proc, logf)})
            record(group_rows[-1])

    what = ("one pool on GPUs 0+1 | router's worker on GPU 0 + a node's on GPU 1 over CURVE TCP" if two
            else "local worker | node worker over CURVE TCP")
    left, right = what.split(" | ")
    summary = [f"| workload | streams | {left} tok/s | {right} tok/s | node / local |",
               "|---|---|---|---|---|", *table, "",
               f"two models: big -> {models_row['big_served_by']}, small -> {models_row['small_served_by']}; "
               f"compute pids per GPU {models_row['compute_pids']} ({big_w} pid {pids.get(big_w)}, {small_w} pid "
               f"{pids.get(small_w)}, this script {me}): {'OK' if models_row['ok'] else 'WRONG'}",
               *(f"gpu group: {json.dumps(g)}" for g in group_rows)]
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0 if models_row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
