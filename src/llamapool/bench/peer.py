"""``llamapool bench --peer-server PATH --config TOML``: llamapool and llama-server side by side, one call.

One after the other, on the same device and model, with the same requests:

1. **llamapool**: the bench starts ``llamapool serve --config TOML`` itself, waits for its workers, runs
   the workload at each ``-c`` through the SDK, and stops it;
2. **llama-server** (``PATH``, the binary): started on the config's first model with that model's
   ``slots`` and ``ctx_per_slot``: ``-m MODEL -ngl 99 -np SLOTS -c SLOTS*CTX -fa on -t 8 --cache-ram 0``
   (per-slot KV, its fastest setting for these runs; ``-ngl 0`` and the config's threads when the model's
   devices are ``"cpu"``), driven through its streaming ``POST /completion`` with token prompts; stopped.

A row per service and concurrency (``"service"``: llamapool or llama-server), then a ``side-by-side`` row per
concurrency: the two tok/s and their ratio. llama-server finds its libraries through ``LD_LIBRARY_PATH``:
the binary's own folder and the ``llama_cpp`` package's ``lib`` folder are put in front of the caller's
(the GPU machine's add-on uses the bundle's ``libllama``). The logs go to ``--peer-logs`` (default: a
temporary folder, named on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from llamapool.bench.drivers import MEDIA_MARKER

START_TIMEOUT = 600.0  # seconds a service may take to come up (an 8B model on a GPU: about a minute)
PEER_THREADS = 8  # llama-server -t on a GPU


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer-server", metavar="PATH", help="llama-server's binary: start the daemon from --config "
                   "and then llama-server on its first model, and run the workload against each in turn")
    p.add_argument("--peer-logs", metavar="DIR", help="--peer-server: where the two services' logs go")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def _wait_daemon(endpoint: str, keys: dict[str, str], proc: subprocess.Popen[bytes], log: Path) -> None:
    from llamapool import Client, LlamapoolError

    end = time.monotonic() + START_TIMEOUT
    with Client(endpoint, **keys) as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited {proc.returncode}:\n{_tail(log)}")
            try:
                if any(w["state"] == "ready" for w in c.status(timeout=2)["workers"]):
                    return
            except LlamapoolError:
                pass
            time.sleep(0.3)
    raise RuntimeError(f"the daemon's workers were not ready in {START_TIMEOUT:g} s:\n{_tail(log)}")


class LlamaServer:
    """llama-server on ``model``: ``slots`` slots of ``ctx_per_slot`` tokens (per-slot KV), no host cache."""

    def __init__(self, binary: str, model: str, slots: int, ctx_per_slot: int, log: Path, cpu: bool = False,
                 threads: int = PEER_THREADS, mmproj: str = ""):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [binary, "-m", model, "-ngl", "0" if cpu else "99", "-np", str(slots),
                     "-c", str(slots * ctx_per_slot), "-fa", "on", "-t", str(threads), "--cache-ram", "0",
                     "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)]
        if mmproj:  # the model's projector: the image workload's requests carry an image each
            self.args += ["--mmproj", mmproj] + (["--no-mmproj-offload"] if cpu else [])
        libs = [str(Path(binary).resolve().parent)]
        spec = importlib.util.find_spec("llama_cpp")
        if spec and spec.origin:
            libs.append(str(Path(spec.origin).parent / "lib"))
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(":"),
               "LLAMA_MEDIA_MARKER": MEDIA_MARKER}  # its marker is random otherwise
        self.log = log
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(self.args, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}:\n{_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"llama-server was not healthy in {timeout:g} s:\n{_tail(self.log)}")

    def stop(self) -> None:
        _stop(self.proc, 60)


def _runs(target: Any, service: str, args: argparse.Namespace, n_vocab: int) -> list[dict[str, Any]]:
    """The workload at each concurrency against ``target`` (a warm-up of one request a stream first)."""
    from llamapool.bench.drivers import measure
    from llamapool.bench.workloads import make_workload

    rows = []
    for c in args.concurrency or [8]:
        kw = {"seed": args.seed, "ctx": args.ctx, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
              "image_px": args.image_px}
        asyncio.run(measure(target, make_workload(args.workload, c, n_vocab, **{**kw, "gen_tokens": 8}), c))
        res = asyncio.run(measure(target, make_workload(args.workload, args.requests or 4 * c, n_vocab, **kw), c,
                                  args.procs, not args.no_progress))
        rows.append({**res.as_dict(), "service": service})
        print(f"{service:<12} {res.line()}", file=sys.stderr, flush=True)
    return rows


def run(args: argparse.Namespace, endpoint: str, keys: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    """``--peer-server``: (exit status, rows)."""
    from llamapool.bench.drivers import Target
    from llamapool.config import ConfigError, load_config

    if not args.config or args.http or args.scenario or args.rate:
        print("llamapool bench: --peer-server needs --config (the daemon it starts), and no --http, --scenario "
              "or --rate", file=sys.stderr)
        return 2, []
    if not os.access(args.peer_server, os.X_OK):
        print(f"llamapool bench: --peer-server: {args.peer_server} is not an executable file", file=sys.stderr)
        return 2, []
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"llamapool bench: {e}", file=sys.stderr)
        return 2, []
    model = cfg.models[0]
    logs = Path(args.peer_logs or tempfile.mkdtemp(prefix="llamapool-peer-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"llamapool bench: the services' logs are in {logs}", file=sys.stderr)
    log = logs / "llamapool.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", args.config],
                                stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_daemon(endpoint, keys, proc, log)
        n_vocab = args.n_vocab or _n_vocab(endpoint, keys)
        rows = _runs(Target("sdk", endpoint, args.timeout, keys.get("server_public_key", ""),
                            keys.get("client_key", "")), "llamapool", args, n_vocab)
    finally:
        _stop(proc)
    cpu = model.devices == "cpu"
    srv = LlamaServer(args.peer_server, model.path, model.slots, model.ctx_per_slot, logs / "llama-server.log", cpu,
                      (model.threads or PEER_THREADS) if cpu else PEER_THREADS, model.mmproj)
    try:
        srv.wait_healthy()
        rows += _runs(Target("http-llama", srv.url, args.timeout), "llama-server", args, n_vocab)
    finally:
        srv.stop()
    for c in args.concurrency or [8]:
        a, b = (next(r["tok_s"] for r in rows if r.get("service") == s and r["concurrency"] == c)
                for s in ("llamapool", "llama-server"))
        rows.append({"mode": "side-by-side", "workload": args.workload, "concurrency": c, "llamapool_tok_s": a,
                     "llama_server_tok_s": b, "llamapool_over_llama_server": round(a / b, 3) if b else None,
                     "llama_server_args": srv.args[1:]})
    return (1 if any(r.get("errors") for r in rows) else 0), rows


def _n_vocab(endpoint: str, keys: dict[str, str]) -> int:
    from llamapool.bench.drivers import Target, server_info

    info = asyncio.run(server_info(Target("sdk", endpoint, 60.0, keys.get("server_public_key", ""),
                                          keys.get("client_key", ""))))
    if not info.get("n_vocab"):
        raise RuntimeError("the daemon did not say its vocabulary size; pass --n-vocab")
    return int(info["n_vocab"])
