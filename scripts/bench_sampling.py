#!/usr/bin/env python3
"""Issue 31's CPU rows, in one run: what logprobs and constrained neighbours cost on a CPU worker, for
one or more source trees side by side (``--src before=/tmp/old/src --src after=src``), repeated.

Each source tree gets a daemon of its own (one CPU worker, C slots, the HTTP gateway), started with that
tree first on ``PYTHONPATH`` (the client side is this tree's, the same for all), and these rows:

- over ``POST /v1/completions`` (C streams, greedy, EOS ignored): ``plain``; ``logprobs`` with 1 and 5
  alternatives; ``json`` (each request constrained by the bench schema);
- over the SDK (the completions API takes at most 5 alternatives): ``plain`` and ``logprobs`` with 20;
- neighbours: C/2 plain streams beside C/2 plain ones, then beside C/2 constrained ones (HTTP).

Ratios are taken within one source tree's daemon in one repeat (the machine is shared: absolute
figures drift between minutes; ratios measured a few seconds apart much less).

    .venv/bin/python scripts/bench_sampling.py --src before=/tmp/before/src --src after=src --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def start(src: str, tmp: Path, tag: str, model: str, slots: int, ctx: int, port: int,
          threads: int) -> subprocess.Popen[bytes]:
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(f'[server]\nruntime_dir = "{tmp / ("run-" + tag)}"\nqueue_timeout = 600.0\n'
                   f'[model]\npath = "{model}"\nctx_per_slot = {ctx}\n'
                   f'[workers]\ndevices = "cpu"\ncpu_workers = 1\nslots = {slots}\nthreads = {threads}\n'
                   f'[http]\nlisten = "127.0.0.1:{port}"\nprocesses = 1\n[metrics]\nlisten = ""\n')
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    log = open(tmp / f"{tag}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(ep: str, url: str, proc: subprocess.Popen[bytes]) -> None:
    import urllib.request

    from llamapool import Client, LlamapoolError

    end = time.monotonic() + 180
    with Client(ep) as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited {proc.returncode}")
            try:
                if any(w["state"] == "ready" for w in c.status()["workers"]):
                    with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                        if r.status == 200:
                            return
            except (LlamapoolError, OSError):
                pass
            time.sleep(0.3)
    raise SystemExit("daemon not ready")


def counters(ep: str) -> dict[str, float]:
    from llamapool import Client

    with Client(ep) as cl:
        workers = cl.status()["workers"]
    return {k: sum(float(w.get(k) or 0) for w in workers) for k in ("steps", "decode_s", "step_s")}


def rows_for(ep: str, url: str, args: argparse.Namespace, n_vocab: int) -> dict[str, Any]:
    from llamapool.bench import drivers
    from llamapool.bench.workloads import make_workload

    c, n = args.concurrency, args.requests or 4 * args.concurrency
    lengths = {"prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
               "ctx": args.prompt_tokens + args.gen_tokens}
    http, sdk = drivers.Target("http-openai", url), drivers.Target("sdk", ep)
    plan = [("plain", http, "short", None), ("logprobs1", http, "logprobs", 1), ("logprobs5", http, "logprobs", 5),
            ("json", http, "json", None), ("sdk_plain", sdk, "short", None), ("sdk_logprobs20", sdk, "logprobs", 20)]
    out: dict[str, Any] = {}
    for label, target, name, top in plan:
        work = make_workload(name, n, n_vocab, seed=args.seed, top_logprobs=top, **lengths)
        before = counters(ep)
        r = drivers.run(target, work, c)
        time.sleep(1.1)  # one heartbeat: the counters include the run
        after = counters(ep)
        eng = {k: after[k] - before[k] for k in after}
        host_ms = 1e3 * (eng["step_s"] - eng["decode_s"]) / max(1.0, eng["steps"])
        out[label] = {"tok_s": round(r.tok_s, 1), "errors": r.errors, "itl_p50_ms": round(r.itl_p50_ms, 3),
                      "steps": int(eng["steps"]), "host_ms_step": round(host_ms, 3),
                      "decode_ms_step": round(1e3 * eng["decode_s"] / max(1.0, eng["steps"]), 3)}
    half = c // 2
    plain = make_workload("short", 4 * half, n_vocab, seed=args.seed, **lengths)
    for kind in ("short", "json"):  # one wave more than the measured streams' four: neighbours throughout
        other = make_workload(kind, 5 * half, n_vocab, seed=args.seed + 1, **lengths)
        t = threading.Thread(target=drivers.run, args=(http, other, half))
        t.start()
        time.sleep(1.0)
        r = drivers.run(http, plain, half)
        t.join()
        out[f"plain_beside_{kind}"] = {"tok_s": round(r.tok_s, 1), "errors": r.errors,
                                       "itl_p50_ms": round(r.itl_p50_ms, 3)}
    p = out["plain"]["tok_s"]
    out["ratios"] = {"logprobs1": round(out["logprobs1"]["tok_s"] / p, 3),
                     "logprobs5": round(out["logprobs5"]["tok_s"] / p, 3),
                     "json": round(out["json"]["tok_s"] / p, 3),
                     "logprobs20_sdk": round(out["sdk_logprobs20"]["tok_s"] / out["sdk_plain"]["tok_s"], 3),
                     "neighbours": round(out["plain_beside_json"]["tok_s"] / out["plain_beside_short"]["tok_s"], 3)}
    return out


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
    ap.add_argument("--threads", type=int, default=1,
                    help="the worker's llama.cpp threads (1: on a loaded 2-core machine, two threads spinning at "
                         "each barrier made a step 20-50x slower and the figures noise)")
    ap.add_argument("--model", default="", help="a GGUF (default: the tiny random test model)")
    ap.add_argument("--out", default="", help="append each result as a JSON line")
    args = ap.parse_args()

    from llamapool.modelgen import make_model

    tmp = Path(tempfile.mkdtemp(prefix="lp-sampling-"))
    model = args.model or str(make_model(tmp / "tiny.gguf"))
    import llama_cpp

    n_vocab = llama_cpp.Llama(model, n_ctx=64, verbose=False, vocab_only=True).n_vocab()
    srcs = [s.partition("=")[::2] for s in args.src]
    results: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for label, src in srcs:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            tag = f"{label}-{rep}"
            proc = start(src, tmp, tag, model, args.concurrency, args.prompt_tokens + args.gen_tokens + 16, port,
                         args.threads)
            ep, url = f"ipc://{tmp / ('run-' + tag) / 'frontend.sock'}", f"http://127.0.0.1:{port}"
            try:
                wait_ready(ep, url, proc)
                res = {"src": label, "repeat": rep, "cores": len(os.sched_getaffinity(0)),
                       "load_avg": os.getloadavg()[0], **rows_for(ep, url, args, n_vocab)}
            finally:
                proc.terminate()
                proc.wait(60)
            results.append(res)
            print(json.dumps(res), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(res) + "\n")
    print("\nsrc     repeat  plain tok/s  lp1    lp5    lp20(sdk)  json   neighbours")
    for r in results:
        q = r["ratios"]
        print(f"{r['src']:8s}{r['repeat']:6d}  {r['plain']['tok_s']:11.1f}  {q['logprobs1']:.3f}  "
              f"{q['logprobs5']:.3f}  {q['logprobs20_sdk']:.3f}      {q['json']:.3f}  {q['neighbours']:.3f}")
    return 1 if any(v.get("errors") for r in results for v in r.values() if isinstance(v, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
