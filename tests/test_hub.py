"""Models by name (hf:OWNER/REPO:QUANT): huggingface_hub against a local server that answers the Hub's
API for a repo holding the tiny GGUF; HF_ENDPOINT points at it, HF_HOME is a temporary folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llamapool import hub
from tests.conftest import free_port, launch, write_config

REPO, SHA = "llamapool-test/tiny-GGUF", "0123456789abcdef0123456789abcdef01234567"
FILE = "tiny-F32.gguf"
REF = f"hf:{REPO}:F32"


@dataclass
class FakeHub:
    """One repo at one commit: ``FILE`` (the tiny GGUF) and decoys. ``mode``: "ok"; "cut" (the first
    transfer stops halfway, then Range requests are served); "short" (a body shorter than the size
    announced); "corrupt" (the right size, other bytes); "silent" (the repo's listing is answered, its
    file never: the connection is held open)."""

    data: bytes
    mode: str = "ok"
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range)
    server: ThreadingHTTPServer | None = None
    hang: threading.Event = field(default_factory=threading.Event)  # "silent": set to let go

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeHub:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:
                pass

            def _file(self, head: bool) -> None:
                fake.seen.append((self.command, self.path, self.headers.get("Range", "")))
                if fake.mode == "silent":
                    fake.hang.wait(60)
                    return
                if not self.path.endswith(f"/{REPO}/resolve/main/{FILE}"):
                    self.send_error(404)
                    return
                body = fake.data
                if fake.mode == "corrupt":  # one bit flipped in the last byte
                    body = body[:-1] + bytes([body[-1] ^ 1])
                start = 0
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes=") and not head:
                    start = int(rng[6:].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", SHA)
                self.send_header("ETag", '"' + hashlib.sha256(fake.data).hexdigest() + '"')
                self.send_header("X-Linked-Etag", '"' + hashlib.sha256(fake.data).hexdigest() + '"')
                self.send_header("X-Linked-Size", str(len(fake.data)))
                part = body[start:]
                if fake.mode == "short":
                    part = part[: len(part) // 2]
                self.send_header("Content-Length", str(len(part)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.end_headers()
                if head:
                    return
                gets = sum(1 for m, p, _r in fake.seen if m == "GET" and "/resolve/" in p)
                if fake.mode == "cut" and gets == 1:  # half the file, then the connection drops
                    self.wfile.write(part[: len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(part)

            def do_HEAD(self) -> None:
                self._file(head=True)

            def do_GET(self) -> None:
                if self.path.split("?")[0] == f"/api/models/{REPO}/revision/main":
                    fake.seen.append(("GET", self.path, ""))
                    siblings = [FILE, "tiny-Q8_0-extra.bin", "mmproj-tiny-F32.gguf", "README.md"]
                    body = json.dumps({"id": REPO, "sha": SHA, "siblings": [
                        {"rfilename": f, **({"size": len(fake.data)} if f == FILE else {})} for f in siblings]})
                    raw = body.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                self._file(head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.hang.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def fake_hub(model_path: str) -> Iterator[FakeHub]:
    h = FakeHub(Path(model_path).read_bytes()).start()
    yield h
    h.stop()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A black-holed Hub: a TCP server that accepts connections and never answers."""
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(srv.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()
    for s in held:
        s.close()


def _env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"}


def _fetch(env: dict[str, str], ref: str = REF) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamapool.cli", "fetch-model", ref], env=env,
                          capture_output=True, text=True, timeout=60)


def test_references_parse_pick_and_name() -> None:
    ref = hub.parse("hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert (ref.repo, ref.quant, ref.file, ref.name) == ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M", "",
                                                         "Llama-3.2-1B-Instruct-Q4_K_M")
    assert ref.pick(["a-Q4_K_M.gguf", "a-Q8_0.gguf", "mmproj-a-Q4_K_M.gguf"]) == ["a-Q4_K_M.gguf"]
    assert ref.pick(["a-Q4_K_M-00002-of-00002.gguf", "a-Q4_K_M-00001-of-00002.gguf"]) == [
        "a-Q4_K_M-00001-of-00002.gguf", "a-Q4_K_M-00002-of-00002.gguf"]
    with pytest.raises(hub.HubError, match=r"a-Q8_0\.gguf"):
        ref.pick(["a-Q8_0.gguf"])
    with pytest.raises(hub.HubError, match="2 files match"):
        ref.pick(["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"])
    f = hub.parse("hf:o/r/sub/m.gguf")
    assert (f.repo, f.file, f.name) == ("o/r", "sub/m.gguf", "m")
    for bad in ("hf:o", "hf:o/r/m.bin", "hf:o/r:Q4 K", "hf:o/r/m.gguf:Q4"):
        with pytest.raises(ValueError):
            hub.parse(bad)
    assert hub.template_family("{{ '<|im_start|>' }}") == "chatml" and hub.template_family("") == "none"
    assert hub.template_family("<start_of_turn>user") == "gemma"


def test_download_once_then_from_the_cache_with_the_endpoint_gone(fake_hub: FakeHub, tmp_path: Path,
                                                                  model_path: str) -> None:
    env = _env(tmp_path, fake_hub.url)
    r = _fetch(env)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.read_bytes() == fake_hub.data and str(tmp_path / "hf" / "hub") in str(path)
    assert f"downloading {FILE} (571 kB) from {fake_hub.url}" in r.stderr, r.stderr
    assert [p for m, p, _ in fake_hub.seen if m == "GET" and "/resolve/" in p], fake_hub.seen
    # a config naming the reference resolves to the cached file without the network; `models` reads it
    cfg = write_config(tmp_path / "c.toml", REF, tmp_path / "run")
    m = subprocess.run([sys.executable, "-m", "llamapool.cli", "models", "--config", str(cfg)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert m.returncode == 0, m.stderr
    row = m.stdout.splitlines()[1].split()
    assert row[:2] == ["tiny-F32", str(path)] and row[4:] == ["llama", "32,768", "chatml", "text"], m.stdout
    fake_hub.stop()
    again = _fetch(env, f"hf:{REPO}/{FILE}")
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip()) == path and "unreachable" in again.stderr, again.stderr


def test_an_interrupted_transfer_resumes(fake_hub: FakeHub, tmp_path: Path) -> None:
    """huggingface_hub writes 10 MiB chunks: a file of 24 MiB whose transfer drops at 12 MiB resumes
    from the end of the first chunk."""
    fake_hub.mode = "cut"
    fake_hub.data = b"GGUF" + os.urandom(24 << 20)
    r = _fetch(_env(tmp_path, fake_hub.url))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == fake_hub.data
    ranges = [rng for m, p, rng in fake_hub.seen if m == "GET" and "/resolve/" in p]
    assert ranges == ["", f"bytes={10 << 20}-"], ranges  # the second request asked for the rest only


@pytest.mark.parametrize("mode", ["short", "corrupt"])
def test_a_truncated_or_corrupt_file_is_refused(fake_hub: FakeHub, tmp_path: Path, mode: str) -> None:
    fake_hub.mode = mode
    env = _env(tmp_path, fake_hub.url)
    r = _fetch(env)
    assert r.returncode == 1 and REF in r.stderr, r.stderr
    assert ("size" in r.stderr) if mode == "short" else ("sha256" in r.stderr), r.stderr
    blobs = tmp_path / "hf" / "hub" / "models--llamapool-test--tiny-GGUF" / "blobs"
    assert not [p for p in blobs.glob("*") if p.is_file()], list(blobs.iterdir())  # nothing kept


def test_serve_without_network_exits_78_naming_the_reference(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", REF, tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                       env=_env(tmp_path, f"http://127.0.0.1:{free_port()}"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 78, r.stderr
    assert REF in r.stderr and "cannot reach" in r.stderr and "not in the cache" in r.stderr, r.stderr


def test_a_daemon_serves_a_model_by_its_hf_reference(fake_hub: FakeHub, tmp_path: Path) -> None:
    d = launch(tmp_path / "d", REF, _env(tmp_path, fake_hub.url))
    try:
        d.wait_ready(2)
        with d.client() as c:
            reply = c.generate("Once upon a time", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.model == "tiny-F32"
        log = d.log.read_text()
        assert f"{REF}: downloading {FILE}" in log and f"{REF}: downloaded" in log, log
        assert log.index("downloaded") < log.index("started pid"), log  # before any worker
    finally:
        assert d.stop() == 0


# ------------------------------------------------------------ a Hub that never answers (issue 29, item 8)

QUICK = {"LLAMAPOOL_HUB_TIMEOUT": "2"}  # the timeout lowered, so that each test takes seconds


def test_serve_with_a_silent_hub_exits_78_naming_the_reference(tmp_path: Path, silent_endpoint: str) -> None:
    """Before: `serve` waited past 120 s without a word. Now: within the timeout, the reference named."""
    cfg = write_config(tmp_path / "c.toml", REF, tmp_path / "run")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                       env={**_env(tmp_path, silent_endpoint), **QUICK}, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 78, r.stderr
    assert REF in r.stderr and "no answer within 2 s, LLAMAPOOL_HUB_TIMEOUT" in r.stderr, r.stderr
    assert took < 20, f"{took:.1f}s"


def test_a_download_that_never_starts_fails_naming_the_reference(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.mode = "silent"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "fetch-model", REF],
                       env={**_env(tmp_path, fake_hub.url), **QUICK}, capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 1 and REF in r.stderr, r.stderr
    assert [p for m, p, _ in fake_hub.seen if "/resolve/" in p], fake_hub.seen  # it got as far as the file
    assert took < 45, f"{took:.1f}s"


def test_the_cache_answers_when_the_hub_is_silent(fake_hub: FakeHub, tmp_path: Path, silent_endpoint: str) -> None:
    first = _fetch(_env(tmp_path, fake_hub.url))
    assert first.returncode == 0, first.stderr
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "fetch-model", REF],
                       env={**_env(tmp_path, silent_endpoint), **QUICK}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == first.stdout.strip() and "using the cached" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20


def test_a_bad_timeout_setting_is_named(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "fetch-model", REF],
                       env={**_env(tmp_path, "http://127.0.0.1:9"), "LLAMAPOOL_HUB_TIMEOUT": "soon"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "LLAMAPOOL_HUB_TIMEOUT='soon'" in r.stderr, r.stderr
