"""Issue 43's target table: prompt lookup on input-grounded prompts, through the HTTP API, against the
same requests without it and against llama-server.

Models: ``make-model --peaked`` (greedy output is a fixed cycle of tokens, whatever the context), q8_0 of
the 1B body and of Llama-3.1-8B's shape (``--shapes``). A prompt holds a passage of that cycle for the
reply to copy (random tokens, the cycle's tokens c0 c1, the passage c2 ... with ``edit`` of its tokens
replaced by random ones, random tokens, then c0 c1 again: the reply is c2 c3 ...), the passage intact
("full copy"), with 10 % or 30 % of its tokens replaced, or absent ("nothing": random tokens instead).

Services, on one GPU, one after the other: a llamapool daemon (HTTP gateway, ``POST /v1/completions`` with
token prompts, ``ignore_eos``, greedy), its requests with the default (``speculative = "auto"``) and with the
request's ``"speculative": false`` ("off"), alternating which goes first a round; llama-server (``POST
/completion``, no speculation). tok/s: completion tokens over the wall time of the run. Each reply's text is
compared on and off (and with llama-server's). The daemon's worker writes each step's shape and seconds
(``LLAMAPOOL_STEP_TRACE``): a run's steps are summarised by draft width (where a step's time goes).

``--draft-1b``: the draft model's targets too (``speculative = "draft:<path>"``), one stream, 8B, on the
"nothing" prompts (no passage: prompt lookup has nothing to find): two ``make-model --peaked`` drafts of the
1B body with the 8B model's vocabulary size, written at the start by ``llamapool make-model``: "right" (the
target's seed, so the same greedy cycle: every draft token kept) and "wrong" (another seed: none kept);
each a daemon of its own, default against ``"speculative": false``, after the 8B one-stream runs.

    . scripts/gpu_env.sh && python3 scripts/spec_copy.py --out OUT --llama-server /tmp/lsa/llama-server --draft-1b
    python3 scripts/spec_copy.py --out /tmp/sc --cpu   # the tiny model on the CPU (checks the script)
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import (  # first (it imports llama_cpp first: CUDA model loads segfaulted after numpy's import)
    CPU_SHAPE,
    GPU_SHAPE,
    SHAPE_8B,
    LlamaServer,
    daemon_config,
    engine_counters,
    free_port,
    start_daemon,
    stop_daemon,
    wait_ready,
)

WORKLOADS = {"full copy": 0.0, "10% edits": 0.1, "30% edits": 0.3, "nothing": None}


def log(msg: str) -> None:
    print(f"[spec_copy {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts(n_vocab: int, n: int, gen: int, edit: float | None, seed: int) -> list[list[int]]:
    """``n`` prompts whose greedy reply copies a passage of the peaked cycle (``edit``: the share of its tokens
    replaced; None: no passage)."""
    import numpy as np

    from llamapool.modelgen import _peaked_cycle

    order = _peaked_cycle(n_vocab, 0)[0]
    where = {int(t): i for i, t in enumerate(order)}
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        at = int(rng.integers(len(order)))
        cyc = [int(order[(at + i) % len(order)]) for i in range(gen + 42)]
        if edit is None:
            passage = [int(t) for t in rng.choice(order, gen + 40)]
        else:
            passage = [t if rng.random() >= edit else int(rng.choice(order)) for t in cyc[2:]]
        noise = [int(t) for t in rng.choice(order, 60)]
        out.append(noise[:40] + cyc[:2] + passage + noise[40:] + cyc[:2])
    assert all(t in where for p in out for t in p)
    return out


async def run(url: str, kind: str, reqs: list[list[int]], gen: int, streams: int, extra: dict[str, Any]
              ) -> dict[str, Any]:
    """All requests, ``streams`` at a time: tokens, seconds, each reply's text (by request)."""
    import aiohttp

    texts: dict[int, str] = {}
    tokens = 0
    queue = list(enumerate(reqs))

    async def client(session: Any) -> None:
        nonlocal tokens
        while queue:
            i, prompt = queue.pop(0)
            if kind == "llamapool":
                body = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True, **extra}
                async with session.post(url + "/v1/completions", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {data}")
                texts[i] = data["choices"][0]["text"]
                tokens += int(data["usage"]["completion_tokens"])
            else:
                body = {"prompt": prompt, "n_predict": gen, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
                async with session.post(url + "/completion", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {data}")
                texts[i] = data["content"]
                tokens += int(data["tokens_predicted"])

    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(streams)))
        seconds = time.perf_counter() - t0
    if tokens != gen * len(reqs):
        raise RuntimeError(f"{tokens} tokens, not {gen * len(reqs)}")
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "texts": texts}


def steps_of(lines: list[str]) -> dict[str, Any]:
    """A run's steps from the step trace (rows, prompt tokens, seconds, budget, drafts, width, settling, a
    draft model's seconds): by width, decode steps' count and mean ms, settling ones apart; prompt steps (a
    gap over 0.5 s, the engine idle between two runs, left out); "draft": the draft model's calls between
    two launches (not in the steps' seconds), where it drafted."""
    by: dict[str, list[float]] = {}
    for ln in lines:
        f = ln.split()
        if len(f) < 7:
            continue
        rows, prompt, sec, k, settling = int(f[0]), int(f[1]), float(f[2]), int(f[5]), f[6] == "1"
        if sec > 0.5:  # the engine idle in between (between two runs): no step's time
            continue
        if len(f) > 7 and float(f[7]) > 0:
            by.setdefault("draft", []).append(float(f[7]))
        key = "prompt" if prompt else f"k{k}" + ("-settling" if settling else "")
        by.setdefault(key, []).append(sec)
        by.setdefault(f"rows{rows}", [])
    return {key: {"n": len(v), "ms": round(1e3 * sum(v) / len(v), 3), "total_ms": round(1e3 * sum(v), 1)}
            for key, v in sorted(by.items()) if v}


DRAFTS = {"right": 0, "wrong": 1}  # a draft's seed: the target's (0, the same greedy cycle) or another


def write_drafts(tmp: Path, logs: Path, dims: dict[str, Any]) -> dict[str, tuple[Path, subprocess.Popen[bytes]]]:
    """The two draft models (``DRAFTS``), written meanwhile by ``llamapool make-model --peaked``: the 1B body
    with the 8B model's vocabulary size (on the CPU: the tiny shape)."""
    out = {}
    for name, seed in DRAFTS.items():
        path = tmp / f"draft-{name}.gguf"
        cmd = [sys.executable, "-m", "llamapool.cli", "make-model", str(path), "--peaked", "--seed", str(seed)]
        for key, val in dims.items():
            cmd += ["--type" if key == "qtype" else "--" + key.replace("_", "-"), str(val)]
        with open(logs / f"make-draft-{name}.log", "wb") as fh:
            out[name] = (path, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=["1b", "8b"], choices=("1b", "8b"))
    ap.add_argument("--cpu", action="store_true", help="the tiny model on the CPU (checks the script)")
    ap.add_argument("--llama-server", default="", metavar="PATH")
    ap.add_argument("--gen", type=int, default=256, help="tokens a reply")
    ap.add_argument("--requests", type=int, default=4, help="requests a run at one stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=64, help="the many-stream runs' streams (8B; 0: none)")
    ap.add_argument("--many-gen", type=int, default=128, help="tokens a reply in the many-stream runs")
    ap.add_argument("--many-rounds", type=int, default=1, help="rounds of the many-stream runs")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after which no run starts")
    ap.add_argument("--logs", default="", help="the daemons' and servers' logs (default OUT/logs)")
    ap.add_argument("--model-8b", default="", metavar="PATH",
                    help="the 8B model, being written by another process meanwhile (waited for; else made here)")
    ap.add_argument("--draft-1b", action="store_true",
                    help="the draft model's runs too: 8B at one stream with a 1B-body draft that is always right "
                         "and one that is never right (on the CPU: the tiny model with tiny drafts)")
    args = ap.parse_args()
    from llamapool.modelgen import make_model

    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs) if args.logs else out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lp-spec-"))
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "steps"}))
        with open(out / "spec_copy.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def late() -> bool:
        return time.monotonic() - t_start > args.deadline

    def measure(shape: str, tag: str, model: str, more: str, work: dict[str, list[list[int]]], streams: int,
                gen: int, rounds: int, ctx: int, label: dict[str, Any]) -> dict[tuple[str, str], dict[int, str]]:
        """One daemon: each workload's requests with the default and with ``"speculative": false``, ``rounds``
        times (alternating which goes first), each run recorded (``label`` added); the texts by (workload,
        mode), round 0's."""
        port = free_port()
        trace = tmp / f"trace-{tag}"
        os.environ["LLAMAPOOL_STEP_TRACE"] = str(trace)
        cfg = daemon_config(tmp, tag, model, "[0]", streams, ctx, more, args.cpu) + \
            f'[http]\nlisten = "127.0.0.1:{port}"\nprocesses = 1\n'
        proc, ep, logf = start_daemon(cfg, tmp, tag, logs)
        del os.environ["LLAMAPOOL_STEP_TRACE"]
        url = f"http://127.0.0.1:{port}"
        texts: dict[tuple[str, str], dict[int, str]] = {}
        try:
            wait_ready(ep, 1, proc, logf)
            first = next(iter(work.values()))
            asyncio.run(run(url, "llamapool", first[:2], 32, 1, {}))  # warm up: graphs, cost model
            asyncio.run(run(url, "llamapool", work.get("nothing", first)[:2], 32, 1, {"speculative": False}))
            for r in range(rounds):
                for name, reqs in work.items():
                    order = ["default", "off"] if r % 2 == 0 else ["off", "default"]
                    for mode in order:
                        if late():
                            break
                        traces = sorted(tmp.glob(f"trace-{tag}.*"))
                        before = [len(p.read_text().splitlines()) for p in traces]
                        c0 = engine_counters(ep)
                        got = asyncio.run(run(url, "llamapool", reqs, gen, streams,
                                              {} if mode == "default" else {"speculative": False}))
                        time.sleep(1.2)  # a heartbeat: the counters include the whole run
                        c1 = engine_counters(ep)
                        lines = [ln for p, b in zip(traces, before, strict=True)
                                 for ln in p.read_text().splitlines()[b:]]
                        prev = texts.setdefault((name, mode), got["texts"])
                        eng = {k: round(c1[k] - c0[k], 4) for k in c1}
                        steps = max(eng["steps"], 1)
                        record({"mode": "run", "shape": shape, "streams": streams, "workload": name,
                                "service": "llamapool", "speculation": mode, "round": r, "gen": gen, **label,
                                "requests": len(reqs), "tok_s": round(got["tok_s"], 1),
                                "seconds": round(got["seconds"], 3), "engine": eng,
                                "acceptance": round(eng["accepted_tokens"] / eng["draft_tokens"], 3)
                                if eng["draft_tokens"] else None,
                                "tokens_per_step": round(got["tokens"] / steps, 2),
                                "host_ms_per_step": round(1e3 * (eng["step_s"] - eng["decode_s"]) / steps, 3),
                                "same_text_as_round0": prev == got["texts"], "steps": steps_of(lines)})
            for name in work:
                a, b = texts.get((name, "default")), texts.get((name, "off"))
                if a is not None and b is not None:
                    record({"mode": "text", "shape": shape, "streams": streams, "workload": name, **label,
                            "same_text_on_and_off": a == b, "replies": len(a)})
        finally:
            stop_daemon(proc, logf)
        return texts

    drafts: dict[str, tuple[Path, subprocess.Popen[bytes]]] = {}
    if args.draft_1b:  # written meanwhile, as the 8B model is
        drafts = write_drafts(tmp, logs, CPU_SHAPE if args.cpu else {**GPU_SHAPE, "n_vocab": SHAPE_8B["n_vocab"]})
    shapes = ["cpu"] if args.cpu else args.shapes
    for shape in shapes:
        if late():
            break
        t0 = time.monotonic()
        dims: dict[str, Any] = CPU_SHAPE if shape == "cpu" else GPU_SHAPE if shape == "1b" else SHAPE_8B
        if shape == "8b" and args.model_8b:
            while not Path(args.model_8b).exists() and not late():
                time.sleep(1)
            model = args.model_8b
        else:
            model = str(make_model(tmp / f"{shape}.gguf", peaked=True, **dims))
        n_vocab = int(dims.get("n_vocab", 512))
        record({"mode": "model", "shape": shape, "gen_s": round(time.monotonic() - t0, 1), "dims": dims})
        plans = [(1, args.gen, args.requests, args.rounds)]
        if shape == "8b" and args.streams:
            plans.append((args.streams, args.many_gen, 2 * args.streams, args.many_rounds))
        if shape == "cpu" and args.streams:
            plans.append((2, 32, 4, args.many_rounds))
        for streams, gen, n, rounds in plans:
            if late():
                break
            work = {name: prompts(n_vocab, n, gen, edit, seed=7) for name, edit in WORKLOADS.items()}
            ctx = max(len(p) for ps in work.values() for p in ps) + gen + 16
            more = 'speculative = "ngram"\n' if args.cpu else ""  # "auto" is off on a CPU
            texts = measure(shape, f"{shape}-c{streams}", model, more, work, streams, gen, rounds, ctx, {})
            if streams == 1 and args.llama_server and not late():
                srv = LlamaServer(args.llama_server, model, 1, ctx, logs, f"{shape}-llama-server", args.cpu, 8)
                try:
                    srv.wait_healthy()
                    asyncio.run(run(srv.url, "llama-server", work["full copy"][:2], 32, 1, {}))
                    for name, reqs in work.items():
                        if late():
                            break
                        got = asyncio.run(run(srv.url, "llama-server", reqs, gen, 1, {}))
                        same = texts.get((name, "off")) == got["texts"]
                        record({"mode": "run", "shape": shape, "streams": 1, "workload": name,
                                "service": "llama-server", "tok_s": round(got["tok_s"], 1), "gen": gen,
                                "requests": len(reqs), "seconds": round(got["seconds"], 3),
                                "same_text_as_llamapool_off": same})
                finally:
                    srv.stop()
            if streams == 1 and drafts and shape in ("8b", "cpu"):  # before the many-stream runs
                for name, (path, writer) in drafts.items():
                    while writer.poll() is None and not late():
                        time.sleep(1)
                    if late():
                        break
                    label = {"draft": name}
                    try:
                        if writer.returncode != 0:
                            raise RuntimeError(f"make-model exited {writer.returncode}")
                        dtexts = measure(shape, f"{shape}-draft-{name}", model, f'speculative = "draft:{path}"\n',
                                         {"nothing": work["nothing"]}, 1, gen, rounds, ctx, label)
                        ref = texts.get(("nothing", "off"))  # the text without any speculation
                        record({"mode": "text", "shape": shape, "streams": 1, "workload": "nothing", **label,
                                "same_text_as_ngram_off": dtexts.get(("nothing", "off")) == ref,
                                "same_text_default_as_ngram_off": dtexts.get(("nothing", "default")) == ref})
                    except (Exception, SystemExit) as e:  # the table's other runs still count
                        record({"mode": "error", "shape": shape, **label, "error": repr(e)})
    (out / "summary.md").write_text(summary(rows))
    print((out / "summary.md").read_text())
    return 0


def summary(rows: list[dict[str, Any]]) -> str:
    """The target table: tok/s (the mean of the rounds) default / off / llama-server, and the ratios; a draft
    model's rows ("8b, draft right") against the same shape's llama-server on the same prompts."""
    runs = [r for r in rows if r.get("mode") == "run"]
    lines = ["| shape | streams | workload | default tok/s | off tok/s | llama-server tok/s | default / off | "
             "default / llama-server | off / llama-server | acceptance | tokens a step | "
             "host ms a step (default, off) |",
             "|---" * 12 + "|"]
    Key = tuple[str, int, str, str]

    def key(r: dict[str, Any]) -> Key:
        return r["shape"], r["streams"], r["workload"], r.get("draft", "")

    keys = sorted({key(r) for r in runs}, key=lambda k: (k[0], k[1], k[3], list(WORKLOADS).index(k[2])))
    for shape, streams, wl, draft in keys:
        def med(service: str, mode: str | None, field: str = "tok_s", k: Key = (shape, streams, wl, draft)
                ) -> float | None:
            xs = [r[field] for r in runs if key(r) == k
                  and r["service"] == service and r.get("speculation") == mode and r.get(field) is not None]
            return round(sum(xs) / len(xs), 3) if xs else None  # the mean of the rounds
        d, o = med("llamapool", "default"), med("llamapool", "off")
        s = med("llama-server", None, k=(shape, streams, wl, ""))

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}" if a and b else "-"

        def num(x: float | None) -> str:
            return f"{x:,.0f}" if x is not None else "-"
        name = f"{shape}, draft {draft}" if draft else shape
        lines.append(f"| {name} | {streams} | {wl} | {num(d)} | {num(o)} | {num(s)} | {ratio(d, o)} | {ratio(d, s)} | "
                     f"{ratio(o, s)} | {med('llamapool', 'default', 'acceptance')} | "
                     f"{med('llamapool', 'default', 'tokens_per_step')} | "
                     f"{med('llamapool', 'default', 'host_ms_per_step')}, "
                     f"{med('llamapool', 'off', 'host_ms_per_step')} |")
    texts = [r for r in rows if r.get("mode") == "text" and "same_text_on_and_off" in r]
    lines.append("")
    lines.append("Greedy text identical on and off: " + ", ".join(
        f"{r['shape']}{' draft ' + r['draft'] if 'draft' in r else ''} C={r['streams']} {r['workload']}: "
        f"{r['same_text_on_and_off']}" for r in texts))
    for r in rows:
        if r.get("mode") == "text" and "same_text_as_ngram_off" in r:
            lines.append(f"\n{r['shape']} draft {r['draft']}: the text off the same as the prompt-lookup daemon's "
                         f"off: {r['same_text_as_ngram_off']}, the default's: {r['same_text_default_as_ngram_off']}")
        elif r.get("mode") == "error":
            lines.append(f"\n{r['shape']} draft {r.get('draft')}: error {r['error']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
