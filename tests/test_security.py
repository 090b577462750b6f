"""CURVE on tcp:// sockets: keys, the allow-list, refusals in the log, and the start-up errors.

The daemon runs as a real process tree on real TCP sockets (frontend and backend both CURVE, the
local worker and the HTTP gateway on the supervisor's internal key)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.auth

from llamapool import AsyncClient, Client, RequestTimeoutError, UnavailableError
from llamapool.config import ConfigError, from_dict
from llamapool.security import KeyFileError, fingerprint, load_authorized_keys, load_key_file, write_key_pair
from tests.conftest import curve_setup, free_port, launch

CLI = [sys.executable, "-m", "llamapool.cli"]


# ---------------------------------------------------------------- keys


def test_keygen_writes_a_0600_secret_and_a_public_key(tmp_path: Path) -> None:
    r = subprocess.run([*CLI, "keygen", "alice", "--dir", str(tmp_path / "k")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    key, pub = tmp_path / "k" / "alice.key", tmp_path / "k" / "alice.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "secret-key" not in pub.read_text()
    pair, public = load_key_file(key, secret=True), load_key_file(pub, secret=False)
    assert pair.public == public.public and pair.secret is not None and zmq.curve_public(pair.secret) == pair.public
    assert public.fingerprint in r.stdout
    assert zmq.auth.load_certificate(key) == (pair.public, pair.secret)  # ZeroMQ's own format
    again = subprocess.run([*CLI, "keygen", "alice", "--dir", str(tmp_path / "k")], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr
    assert load_key_file(key, secret=True) == pair, "an existing key is never overwritten without --force"


def _edit(text: str, how: str) -> str:
    lines = text.splitlines(keepends=True)
    if how == "truncated":
        return text[: len(text) // 2]
    if how == "empty":
        return ""
    if how == "public-key edited":
        i = next(i for i, ln in enumerate(lines) if "public-key" in ln)
        value = lines[i].split('"')[1]
        lines[i] = lines[i].replace(value, ("A" if value[0] != "A" else "B") + value[1:])
    if how == "secret-key edited":
        i = next(i for i, ln in enumerate(lines) if "secret-key" in ln)
        value = lines[i].split('"')[1]
        lines[i] = lines[i].replace(value, value[:-1] + ("A" if value[-1] != "A" else "B"))
    if how == "secret-key cut":
        i = next(i for i, ln in enumerate(lines) if "secret-key" in ln)
        lines[i] = lines[i].replace('"', "", 1)[:-10] + '"\n'
    if how == "fingerprint removed":
        lines = [ln for ln in lines if "fingerprint" not in ln]
    return "".join(lines)


@pytest.mark.parametrize("how", ["truncated", "empty", "public-key edited", "secret-key edited", "secret-key cut",
                                 "fingerprint removed"])
def test_a_damaged_key_file_is_an_error_naming_it(tmp_path: Path, how: str) -> None:
    key, pub = write_key_pair(tmp_path, "k")
    key.write_text(_edit(key.read_text(), how))
    with pytest.raises(KeyFileError, match=re.escape(str(key))):
        load_key_file(key, secret=True)
    if how in ("truncated", "public-key edited", "fingerprint removed"):
        pub.write_text(_edit(pub.read_text(), how))
        with pytest.raises(KeyFileError, match=re.escape(str(pub))):
            load_authorized_keys(tmp_path)
    with pytest.raises(KeyFileError, match="no secret-key"):
        load_key_file(write_key_pair(tmp_path, "other")[1], secret=True)


def test_tcp_needs_a_server_key_or_insecure_tcp(tmp_path: Path) -> None:
    base = {"model": {"path": "m"}}
    with pytest.raises(ConfigError, match=r"server\.frontend: tcp://.*server_key.*insecure_tcp"):
        from_dict({**base, "server": {"frontend": "tcp://127.0.0.1:5555"}})
    with pytest.raises(ConfigError, match=r"server\.backend"):
        from_dict({**base, "server": {"backend": "tcp://0.0.0.0:5556"}})
    cfg = from_dict({**base, "server": {"frontend": "tcp://*:5555"}, "security": {"insecure_tcp": True}})
    assert not cfg.curve
    with pytest.raises(ConfigError, match=r"security\.authorized_keys: required"):
        from_dict({**base, "server": {"frontend": "tcp://*:5555"}, "security": {"server_key": "r.key"}})
    (tmp_path / "conf" / "auth").mkdir(parents=True)
    cfg = from_dict({**base, "server": {"frontend": "tcp://*:5555"},
                     "security": {"server_key": "keys/r.key", "authorized_keys": "auth"}}, tmp_path / "conf")
    assert cfg.curve and cfg.security.server_key == str(tmp_path / "conf" / "keys" / "r.key")
    assert not from_dict({**base, "security": {"server_key": "r.key", "authorized_keys": "."}}).curve  # ipc only
    with pytest.raises(ConfigError, match=r"security\.bogus"):
        from_dict({**base, "security": {"bogus": 1}})


@pytest.mark.parametrize("which", ["server_key", "authorized_keys"])
def test_serve_with_a_damaged_key_file_exits_2_naming_it(tmp_path: Path, model_path: str, which: str) -> None:
    from tests.conftest import write_config

    sections, _ = curve_setup(tmp_path)
    victim = (Path(sections["security"]["server_key"]) if which == "server_key"
              else Path(sections["security"]["authorized_keys"]) / "alice.pub")
    victim.write_text(_edit(victim.read_text(), "truncated"))
    cfg = write_config(tmp_path / "c.toml", model_path, tmp_path / "run", **sections)
    r = subprocess.run([*CLI, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert str(victim) in r.stderr and "config error" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "internal.key").exists(), "nothing was started"


# ---------------------------------------------------------------- the daemon on CURVE sockets


@pytest.fixture(scope="module")
def curve_daemon(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Any:
    folder = tmp_path_factory.mktemp("curve")
    sections, client_kw = curve_setup(folder)
    port = free_port()
    d = launch(folder, model_path, workers={"cpu_workers": 1}, http={"listen": f"127.0.0.1:{port}"},
               metrics={"listen": f"127.0.0.1:{free_port()}"}, **sections)
    d.endpoint, d.client_kw = sections["server"]["frontend"], client_kw
    d.wait_ready(1)
    yield d, folder / "keys", port, sections
    assert d.stop() == 0




def test_an_allowed_key_is_served_over_curve(curve_daemon: Any) -> None:
    d, keys, _, sections = curve_daemon
    with d.client() as c:
        done = c.generate("over CURVE", max_tokens=4, ignore_eos=True)
        assert done.usage.completion_tokens == 4 and done.worker == "cpu0"
        assert [w["state"] for w in c.status()["workers"]] == ["ready"], "the local worker joined over CURVE"
    assert sections["server"]["backend"].startswith("tcp://")
    log = d.log_text()
    assert "CURVE on tcp://" in log and "1 authorized key(s)" in log

    async def with_bytes() -> int:  # keys as bytes (Z85), with the async client
        server = load_key_file(keys / "router.pub", secret=False).public
        secret = load_key_file(keys / "alice.key", secret=True).secret
        async with AsyncClient(d.endpoint, server_public_key=server, client_key=secret) as ac:
            return (await ac.generate("async", max_tokens=2, ignore_eos=True)).usage.completion_tokens

    import asyncio

    assert asyncio.run(with_bytes()) == 2

    # the CLI: endpoint from --config, the router's .pub found beside its security.server_key
    r = subprocess.run([*CLI, "generate", "cli", "--max-tokens", "3", "--ignore-eos", "--config", str(d.config),
                        "--key", str(keys / "alice.key")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "3 completion tokens" in r.stderr, r.stderr
    r = subprocess.run([*CLI, "status", "--endpoint", d.endpoint, "--key", str(keys / "alice.key")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--server-key" in r.stderr, r.stderr


def test_a_client_without_a_key_gets_no_reply_and_is_logged(curve_daemon: Any) -> None:
    d, _, _, _ = curve_daemon
    with Client(d.endpoint, timeout=0.5) as c:
        with pytest.raises(UnavailableError, match="no answer"):
            c.status(timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises((RequestTimeoutError, UnavailableError)):  # no reply, or not even a connection
            c.generate("let me in", max_tokens=2)
        assert time.monotonic() - t0 < 3
    log = d.wait_log("refused a connection on tcp://", timeout=10.0)
    assert "does not use CURVE" in log or "hung up during the CURVE handshake" in log


def test_an_unknown_key_is_refused_and_logged_by_fingerprint(curve_daemon: Any) -> None:
    d, keys, _, _ = curve_daemon
    mallory = load_key_file(keys / "mallory.pub", secret=False)
    with Client(d.endpoint, server_public_key=keys / "router.pub", client_key=keys / "mallory.key") as c:
        with pytest.raises(UnavailableError):
            c.status(timeout=1.0)
    line = next(ln for ln in d.wait_log(mallory.fingerprint, timeout=10.0).splitlines() if mallory.fingerprint in ln)
    assert "refused a CURVE client" in line and "not in authorized_keys" in line
    r = subprocess.run([*CLI, "status", "--endpoint", d.endpoint, "--key", str(keys / "mallory.key"),
                        "--server-key", str(keys / "router.pub"), "--timeout", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no answer" in r.stderr
    r = subprocess.run([*CLI, "status", "--json", "--endpoint", d.endpoint, "--key", str(keys / "alice.key"),
                        "--server-key", str(keys / "router.pub")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["workers"][0]["state"] == "ready", r.stderr


def test_a_client_expecting_another_server_key_gets_nothing(curve_daemon: Any) -> None:
    d, keys, _, _ = curve_daemon
    with Client(d.endpoint, server_public_key=keys / "mallory.pub", client_key=keys / "alice.key") as c:
        with pytest.raises(UnavailableError):
            c.status(timeout=1.0)


def test_the_gateway_reaches_a_curve_frontend(curve_daemon: Any) -> None:
    d, _, port, _ = curve_daemon
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                   json={"prompt": "via http", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    # the [metrics] listener's client (in the supervisor) and the gateway's /metrics use the internal key too
    listen = next(ln.split("http://")[1].split("/")[0] for ln in d.log_text().splitlines() if "metrics: http://" in ln)
    for url in (f"http://{listen}/metrics", f"http://127.0.0.1:{port}/metrics"):
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200 and "llamapool_" in r.text, (url, r.status_code, r.text[:200])


def _remote_worker(keys: Path, key: str, sections: dict[str, Any], model_path: str) -> subprocess.Popen[bytes]:
    from llamapool.worker.server import WorkerSpec

    spec = WorkerSpec(name="remote0", backend=sections["server"]["backend"], device="cpu", model_path=model_path,
                      slots=2, ctx_per_slot=512, max_batch_tokens=512, n_ubatch=512, threads=1,
                      flash_attn=True, heartbeat_interval=1.0, heartbeat_liveness=3,
                      server_key=load_key_file(keys / "router.pub", secret=False).public.decode(),
                      key_file=str(keys / key))
    return subprocess.Popen([sys.executable, "-m", "llamapool.worker", spec.to_json()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_remote_workers_join_with_an_allowed_key_only(curve_daemon: Any, model_path: str) -> None:
    d, keys, _, sections = curve_daemon
    write_key_pair(keys, "eve")  # not allowed (a fresh key: refusals are logged once per key per 10 s)
    eve = load_key_file(keys / "eve.pub", secret=False)
    bad = _remote_worker(keys, "eve.key", sections, model_path)
    good = _remote_worker(keys, "alice.key", sections, model_path)
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if any(w["id"] == "remote0" and w["state"] == "ready" for w in d.status()["workers"]):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the remote worker never joined: {d.status()}\n{d.log_text()}")
        row = next(w for w in d.status()["workers"] if w["id"] == "remote0")
        assert row["pid"] == good.pid, "the worker with eve's key was not let in"
        assert "refused a CURVE client" in d.wait_log(eve.fingerprint, timeout=10.0)
    finally:
        good.send_signal(signal.SIGTERM)
        bad.kill()  # refused, it never connected: a drain would wait on its unsendable goodbye
        for p in (good, bad):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_sighup_rereads_the_authorized_keys(curve_daemon: Any) -> None:
    d, keys, _, sections = curve_daemon
    allowed = Path(sections["security"]["authorized_keys"])
    (allowed / "mallory.pub").write_bytes((keys / "mallory.pub").read_bytes())
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("authorized_keys: 2 key(s)", timeout=10.0)
    with Client(d.endpoint, server_public_key=keys / "router.pub", client_key=keys / "mallory.key") as c:
        assert c.status(timeout=5)["workers"]
    os.unlink(allowed / "mallory.pub")
    d.wait_log("reload done", timeout=60)


def test_insecure_tcp_serves_plain_clients_with_a_warning(start_daemon: Any) -> None:
    port = free_port()
    d = start_daemon(wait_workers=None, server={"frontend": f"tcp://127.0.0.1:{port}"},
                     workers={"cpu_workers": 1}, security={"insecure_tcp": True})
    d.endpoint = f"tcp://127.0.0.1:{port}"
    d.wait_ready(1)
    assert "WARNING: security.insecure_tcp = true" in d.log_text()
    with d.client() as c:
        assert c.generate("plain", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_fingerprint_is_the_same_for_z85_and_raw_keys() -> None:
    public, _ = zmq.curve_keypair()
    assert fingerprint(public) == fingerprint(zmq.utils.z85.decode(public))
