#!/usr/bin/env python3
"""Issue 31's rows, in one run: what logprobs and constrained neighbours cost, for one or more source
trees side by side (``--src before=/tmp/old/src --src after=src``), repeated.

Each source tree gets a daemon of its own (one worker of C slots: a CPU worker, or with ``--gpu`` one on
GPU 0 and a random model of the 1B shape; the HTTP gateway), started with that tree first on
``PYTHONPATH`` (the client side is this tree's, the same for all). All the daemons are up at once, and
each row runs on each in turn (the first one alternating between repeats):

- over ``POST /v1/completions`` (C streams, greedy, EOS ignored): ``plain``; ``logprobs1`` and
  ``logprobs5`` (that many alternatives); ``json`` (each request constrained by the bench schema);
- over the SDK (the completions API takes at most 5 alternatives): ``sdk_plain``, ``sdk_logprobs20``
  (and, named in ``--rows``, ``sdk_logprobs1``/``sdk_logprobs5``);
- neighbours: C/2 plain streams beside C/2 plain ones, then beside C/2 constrained ones (HTTP).

Each row reports tok/s, the worker's steps and host and decode time a step, and the CPU time each of
the daemon's processes used a token (from ``/proc``: on a shared machine steadier than tok/s). Ratios
are taken within one source tree's daemon in one repeat.

    .venv/bin/python scripts/bench_sampling.py --src before=/tmp/before/src --src after=src --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def start(src: str, tmp: Path, tag: str, model: str, slots: int, ctx: int, port: int,
          threads: int, gpu: bool, speculative: str = "") -> subprocess.Popen[bytes]:
    cfg = tmp / f"{tag}.toml"
    devices = "devices = [0]" if gpu else 'devices = "cpu"'
    cfg.write_text(f'[server]\nruntime_dir = "{tmp / ("run-" + tag)}"\nqueue_timeout = 600.0\n'
                   f'[model]\npath = "{model}"\nctx_per_slot = {ctx}\n'
                   + (f'speculative = "{speculative}"\n' if speculative else "") +
                   f'[workers]\n{devices}\ncpu_workers = 1\nslots = {slots}\n'
                   f'threads = {threads}\n'
                   f'[http]\nlisten = "127.0.0.1:{port}"\nprocesses = 1\n'
                   f'[metrics]\nlisten = "127.0.0.1:{_free_port()}"\n')  # a port: older trees refuse ""
    rest = os.environ.get("PYTHONPATH", "")  # the tree first; what else the path had after it
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()) + (":" + rest if rest else "")}
    log = open(tmp / f"{tag}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(ep: str, url: str, proc: subprocess.Popen[bytes]) -> None:
    import urllib.error
    import urllib.request

    from llamapool import Client, LlamapoolError

    end = time.monotonic() + 180
    with Client(ep) as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                log = Path(str(proc.args[-1])).with_suffix(".log")  # type: ignore[index]
                print(log.read_text(errors="replace")[-3000:] if log.exists() else "", file=sys.stderr)
                raise SystemExit(f"daemon exited {proc.returncode}")
            try:
                if any(w["state"] == "ready" for w in c.status()["workers"]):
                    for probe in ("/ready", "/health"):  # an older tree has no /ready
                        try:
                            with urllib.request.urlopen(url + probe, timeout=2) as r:
                                if r.status == 200:
                                    return
                        except urllib.error.HTTPError as e:
                            if e.code != 404:
                                break
            except (LlamapoolError, OSError):
                pass
            time.sleep(0.3)
    raise SystemExit("daemon not ready")


def counters(ep: str) -> dict[str, float]:
    from llamapool import Client

    with Client(ep) as cl:
        workers = cl.status()["workers"]
    return {k: sum(float(w.get(k) or 0) for w in workers) for k in ("steps", "decode_s", "step_s")}


GPU_1B = {"n_embd": 2048, "n_layer": 16, "n_head": 32, "n_head_kv": 8, "n_ff": 8192, "n_vocab": 32000, "qtype": "q8_0"}
ROWS = [("plain", "http", "short", None), ("logprobs1", "http", "logprobs", 1), ("logprobs5", "http", "logprobs", 5),
        ("json", "http", "json", None), ("sdk_plain", "sdk", "short", None), ("sdk_logprobs20", "sdk", "logprobs", 20),
        ("sdk_logprobs1", "sdk", "logprobs", 1), ("sdk_logprobs5", "sdk", "logprobs", 5),
        ("plain_beside_short", "http", "short", "short"), ("plain_beside_json", "http", "short", "json")]


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``pid``'s children, by name: the worker, the gateway, and
    the router (the daemon's own process)."""
    tick = os.sysconf("SC_CLK_TCK")

    def used(p: int) -> float:
        with open(f"/proc/{p}/stat") as fh:
            f = fh.read().rpartition(")")[2].split()
        return (int(f[11]) + int(f[12])) / tick

    out = {"router": used(pid)}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    if int(fh.read().rpartition(")")[2].split()[1]) != pid:
                        continue
                with open(f"/proc/{d}/cmdline", "rb") as raw:
                    cmd = raw.read().split(b"\0")
                name = "worker" if b"llamapool.worker" in cmd else "gateway" if b"llamapool.gateway" in cmd else d
                out[name] = out.get(name, 0.0) + used(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def one_row(daemon: tuple[str, str, int], row: tuple[str, str, str, Any], args: argparse.Namespace,
            n_vocab: int) -> dict[str, Any]:
    """One row on one daemon: its tok/s, the worker's steps, host and decode time a step meanwhile, and the
    CPU time each of the daemon's processes used a token (on a shared machine, a steadier figure than tok/s:
    what the row costs, not what it got)."""
    from llamapool.bench import drivers
    from llamapool.bench.workloads import make_workload

    ep, url, pid = daemon
    label, transport, name, extra = row
    c, n = args.concurrency, args.requests or 4 * args.concurrency
    lengths = {"prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
               "ctx": args.prompt_tokens + args.gen_tokens}
    target = drivers.Target("http-openai", url) if transport == "http" else drivers.Target("sdk", ep)
    before, cpu0 = counters(ep), cpu_seconds(pid)
    if label.startswith("plain_beside"):  # C/2 measured beside C/2 of ``extra``, one wave more than them
        half = c // 2
        work = make_workload(name, n // 2, n_vocab, seed=args.seed, **lengths)
        other = make_workload(extra, n // 2 + half, n_vocab, seed=args.seed + 1, **lengths)
        t = threading.Thread(target=drivers.run, args=(target, other, half))
        t.start()
        time.sleep(0.5)
        r = drivers.run(target, work, half)
        t.join()
    else:
        work = make_workload(name, n, n_vocab, seed=args.seed, top_logprobs=extra, **lengths)
        r = drivers.run(target, work, c)
    time.sleep(1.1)  # one heartbeat: the counters include the run
    after, cpu1 = counters(ep), cpu_seconds(pid)
    eng = {k: after[k] - before[k] for k in after}
    steps = max(1.0, eng["steps"])
    cpu_us = {k: round(1e6 * (cpu1[k] - cpu0.get(k, 0.0)) / max(1, r.gen_tokens), 1) for k in ("router", "worker",
                                                                                                  "gateway")}
    return {"tok_s": round(r.tok_s, 1), "errors": r.errors, "itl_p50_ms": round(r.itl_p50_ms, 3),
            "cpu_us_token": {**cpu_us, "all": round(sum(cpu_us.values()), 1)},
            "steps": int(eng["steps"]), "host_ms_step": round(1e3 * (eng["step_s"] - eng["decode_s"]) / steps, 3),
            "decode_ms_step": round(1e3 * eng["decode_s"] / steps, 3)}


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """Each row's tok/s against its plain row's; ``cpu_*``: the plain row's CPU time a token against the row's."""
    pairs = {"logprobs1": ("logprobs1", "plain"), "logprobs5": ("logprobs5", "plain"), "json": ("json", "plain"),
             "logprobs20_sdk": ("sdk_logprobs20", "sdk_plain"), "logprobs1_sdk": ("sdk_logprobs1", "sdk_plain"),
             "logprobs5_sdk": ("sdk_logprobs5", "sdk_plain"),
             "neighbours": ("plain_beside_json", "plain_beside_short")}
    got = {k: (a, b) for k, (a, b) in pairs.items() if a in out and b in out}
    res = {k: round(out[a]["tok_s"] / out[b]["tok_s"], 3) for k, (a, b) in got.items()}
    res.update({f"cpu_{k}": round(out[b]["cpu_us_token"]["all"] / max(0.1, out[a]["cpu_us_token"]["all"]), 3)
                for k, (a, b) in got.items() if k != "neighbours"})  # the neighbours' CPU is not theirs alone
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", required=True, metavar="LABEL=PATH",
                    help="a source tree (its src/ directory) to run the daemon from; repeatable")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=0, help="per row (default 4 x C)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", default="", choices=["", "auto", "ngram", "off"],
                    help="model.speculative for every daemon (default: the config's default)")
    ap.add_argument("--threads", type=int, default=1,
                    help="the worker's llama.cpp threads (1: on a loaded 2-core machine, two threads spinning at "
                         "each barrier made a step 20-50x slower and the figures noise)")
    ap.add_argument("--model", default="", help="a GGUF (default: the tiny random test model)")
    ap.add_argument("--gpu", action="store_true", help="the worker on GPU 0, a random model of the 1B shape")
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS if r[0] not in ("sdk_logprobs1", "sdk_logprobs5")),
                    help="the rows to run (comma-separated)")
    ap.add_argument("--out", default="", help="append each result as a JSON line")
    args = ap.parse_args()

    from llamapool.modelgen import make_model

    tmp = Path(tempfile.mkdtemp(prefix="lp-sampling-"))
    model = args.model or str(make_model(tmp / "m.gguf", **(GPU_1B if args.gpu else {})))
    import llama_cpp

    n_vocab = llama_cpp.Llama(model, n_ctx=64, verbose=False, vocab_only=True).n_vocab()
    srcs = [s.partition("=")[::2] for s in args.src]
    daemons: dict[str, tuple[str, str, int]] = {}
    procs = []
    results: list[dict[str, Any]] = []
    try:
        for label, src in srcs:  # every tree's daemon up at once: each row runs on each, one after another
            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            procs.append(start(src, tmp, label, model, args.concurrency, args.prompt_tokens + args.gen_tokens + 16,
                               port, args.threads, args.gpu, args.speculative))
            daemons[label] = (f"ipc://{tmp / ('run-' + label) / 'frontend.sock'}", f"http://127.0.0.1:{port}",
                              procs[-1].pid)
            wait_ready(*daemons[label][:2], procs[-1])
        for rep in range(args.repeats):
            rows: dict[str, dict[str, Any]] = {label: {} for label in daemons}
            for row in [r for r in ROWS if r[0] in args.rows.split(",")]:
                for label in daemons if rep % 2 == 0 else reversed(daemons):  # alternate who goes first
                    rows[label][row[0]] = one_row(daemons[label], row, args, n_vocab)
            for label, out in rows.items():
                res = {"src": label, "repeat": rep, "cores": len(os.sched_getaffinity(0)),
                       "load_avg": os.getloadavg()[0], "threads": args.threads, "requests": args.requests,
                       **out, "ratios": ratios(out)}
                results.append(res)
                print(json.dumps(res), flush=True)
                if args.out:
                    with open(args.out, "a") as fh:
                        fh.write(json.dumps(res) + "\n")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    for r in results:
        print(r["src"], r["repeat"], " ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()))
    return 1 if any(v.get("errors") for r in results for v in r.values() if isinstance(v, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
