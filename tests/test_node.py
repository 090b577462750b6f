"""``llamapool node``: a host's workers joining a remote router's tcp:// CURVE backend.

A router daemon (one local worker, CURVE frontend and backend on loopback) and ``llamapool node``
processes, all real processes on real sockets: the node's workers show in status with their node
and serve; a node key not in the allow-list, and a node name already held by another key, are
refused and logged on both sides (a refused key: the node says what to do, stops at once on
SIGTERM, and joins once the key is allowed and the router reloaded; a name clash on every worker:
the node exits 78); the node is ready (its log, sd_notify READY=1) only once a worker has joined;
a router killed and started again on the same ports gets the node's workers back without the node
restarting them; SIGTERM on a node drains its workers, and stops at once one that lost its router.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamapool.security import load_key_file, write_key_pair
from tests.conftest import Daemon, LoggedProcess, curve_setup, launch, write_config
from tests.loadgen import Load


class Node(LoggedProcess):
    """A ``llamapool node`` process with its config and log in ``folder``."""

    label = "node"

    def __init__(self, folder: Path, model_path: str, join: str, keys: Path, key: str, name: str,
                 cpu_workers: int = 2, env: dict[str, str] | None = None, **sections: dict[str, Any]):
        folder.mkdir(parents=True, exist_ok=True)
        self.name = name
        node = {"join": join, "name": name, "server_public_key": str(keys / "router.pub"),
                "key": str(keys / f"{key}.key")}
        self.config = write_config(folder / "node.toml", model_path, folder / "run", node=node,
                                   workers={"cpu_workers": cpu_workers}, **sections)
        self.log = folder / "node.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "node", "--config",
                                          str(self.config)], stdout=fh, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


class Notifications:
    """A datagram socket standing for systemd's NOTIFY_SOCKET: what the node sends it."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.got: list[str] = []

    def read(self) -> list[str]:
        with contextlib.suppress(OSError):
            while True:
                self.got.append(self.sock.recv(4096).decode())
        return self.got

    def ready(self) -> bool:
        return any("READY=1" in m for m in self.read())

    def close(self) -> None:
        self.sock.close()




def node_rows(d: Daemon, node: str) -> list[dict[str, Any]]:
    return [w for w in d.status()["workers"] if w.get("node") == node]


def wait_node_ready(d: Daemon, node: str, n: int, timeout: float = 60.0,
                    pids: set[int] | None = None) -> list[dict[str, Any]]:
    end = time.monotonic() + timeout
    rows: list[dict[str, Any]] = []
    while time.monotonic() < end:
        try:
            rows = [w for w in node_rows(d, node) if w["state"] == "ready"]
        except Exception:  # the router is (re)starting
            rows = []
        if len(rows) >= n and (pids is None or {w["pid"] for w in rows} == pids):
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{n} workers of node {node} not ready in {timeout}s: {rows}\n{d.log_text()}")


def served_by(d: Daemon, prefix: str, tries: int = 20) -> str:
    """Send micro-batches until one prompt is answered by a worker whose name starts with ``prefix``."""
    with d.client() as c:
        for _ in range(tries):
            for done in c.generate_many(["hello node"] * 12, max_tokens=2, ignore_eos=True):
                if done.worker.startswith(prefix):
                    return done.worker
    raise AssertionError(f"no request was served by {prefix}*")


@pytest.fixture
def pool(tmp_path: Path, model_path: str) -> Iterator[dict[str, Any]]:
    """A router daemon with a CURVE tcp:// frontend and backend, one local worker, and keys for nodes:
    "nodeb" and "nodec" allowed, "mallory" not."""
    sections, client_kw = curve_setup(tmp_path)
    keys, allowed = tmp_path / "keys", Path(sections["security"]["authorized_keys"])
    for name in ("nodeb", "nodec"):
        write_key_pair(keys, name, force=True)
        (allowed / f"{name}.pub").write_bytes((keys / f"{name}.pub").read_bytes())
    env: dict[str, Any] = {"tmp": tmp_path, "model": model_path, "keys": keys, "sections": sections,
                           "client_kw": client_kw, "nodes": [], "routers": []}

    def router() -> Daemon:
        d = launch(tmp_path / "router", model_path, workers={"cpu_workers": 1}, **sections)
        d.endpoint, d.client_kw = sections["server"]["frontend"], client_kw
        env["routers"].append(d)
        d.wait_ready(1)
        return d

    def node(name: str = "nodeB", key: str = "nodeb", folder: str = "", **kw: Any) -> Node:
        n = Node(tmp_path / (folder or name), model_path, sections["server"]["backend"], keys, key, name, **kw)
        env["nodes"].append(n)
        return n

    env["router"], env["node"] = router, node
    yield env
    for n in env["nodes"]:
        n.stop(signal.SIGQUIT, timeout=30)
    for d in env["routers"]:
        if d.proc.poll() is None:
            d.stop(signal.SIGQUIT, timeout=30)
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", f"llamapool.worker.*{tmp_path}"], capture_output=True, text=True)
    assert not left.stdout.strip(), f"worker processes left behind: {left.stdout}"


def test_a_node_joins_shows_its_node_and_serves(pool: dict[str, Any]) -> None:
    d = pool["router"]()
    node = pool["node"]("nodeB")
    rows = wait_node_ready(d, "nodeB", 2)
    assert sorted(w["id"] for w in rows) == ["nodeB/cpu0", "nodeB/cpu1"]
    local = next(w for w in d.status()["workers"] if w["id"] == "cpu0")
    assert local["node"] == "" and local["state"] == "ready"
    assert served_by(d, "nodeB/").startswith("nodeB/cpu")
    with d.client() as c:
        text = c.metrics()
    assert 'node="nodeB"' in text and 'worker="nodeB/cpu0"' in text
    assert 'llamapool_worker_state{device="cpu",node="nodeB",state="ready",worker="nodeB/cpu1"} 1.0' in text
    assert "worker nodeB/cpu0 of node nodeB joined" in d.log_text()
    assert "connected to the router at tcp://" in node.log_text()
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "status", "--endpoint", d.endpoint,
                        "--key", str(pool["keys"] / "alice.key"), "--server-key", str(pool["keys"] / "router.pub")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "NODE" in r.stdout and "nodeB/cpu1" in r.stdout, r.stdout + r.stderr


def test_a_node_key_not_in_the_allow_list_is_refused_and_logged(pool: dict[str, Any]) -> None:
    d = pool["router"]()
    mallory = load_key_file(pool["keys"] / "mallory.pub", secret=False)
    node = pool["node"]("nodeM", key="mallory", cpu_workers=1)
    log = d.wait_log(mallory.fingerprint)
    line = next(ln for ln in log.splitlines() if mallory.fingerprint in ln)
    assert "refused a CURVE client" in line and "not in authorized_keys" in line
    node_log = node.wait_log("cannot join")
    assert "refused this worker's key " + mallory.fingerprint in node_log, node_log
    assert node_rows(d, "nodeM") == [] and node.proc.poll() is None, "refused, it keeps trying"


def test_a_refused_node_says_what_to_do_and_stops_at_once_on_sigterm(pool: dict[str, Any]) -> None:
    """Workers that never joined have nothing to drain: SIGTERM stops the node in moments, not after
    server.drain_timeout (60 s) and a SIGKILL. The node says what to do about its key, once for all
    its workers (then every 30 s)."""
    pool["router"]()
    node = pool["node"]("nodeM", key="mallory")
    end = time.monotonic() + 30
    while node.log_text().count("cannot join") < 2 and time.monotonic() < end:
        time.sleep(0.1)
    log = node.wait_log("refuses this node's key")
    hint = next(ln for ln in log.splitlines() if "refuses this node's key" in ln)
    mallory = load_key_file(pool["keys"] / "mallory.pub", secret=False)
    assert mallory.fingerprint in hint and f"copy {pool['keys'] / 'mallory.pub'} into the router's" in hint, hint
    assert "authorized_keys" in hint and "SIGHUP" in hint, hint
    assert log.count("cannot join") == 2 and log.count("refuses this node's key") == 1, log
    assert "ready (READY=1)" not in log and node.proc.poll() is None
    t0 = time.monotonic()
    assert node.stop(timeout=30) == 0
    took = time.monotonic() - t0
    assert took < 5, f"SIGTERM took {took:.1f}s:\n{node.log_text()}"
    assert "SIGKILL" not in node.log_text() and "stopped" in node.log_text()


def test_a_node_is_ready_only_once_a_worker_joined(pool: dict[str, Any]) -> None:
    """Loaded is not ready: with its key refused, the node's worker has its model but the node logs no
    `ready` and sends no READY=1. Once the key is in the router's allow-list and the router reloaded,
    the same worker (no restart) joins, and only then the node is ready."""
    d = pool["router"]()
    notes = Notifications(pool["tmp"] / "notify.sock")
    try:
        node = pool["node"]("nodeM", key="mallory", cpu_workers=1, env={"NOTIFY_SOCKET": str(notes.path)})
        node.wait_log("joining the router at")
        node.wait_log("cannot join")
        time.sleep(2.0)  # loaded, refused, dialling again
        assert not notes.ready() and "ready (READY=1)" not in node.log_text(), (notes.got, node.log_text())
        assert any(m.startswith("STATUS=0 workers ready") for m in notes.got), notes.got
        allowed = Path(pool["sections"]["security"]["authorized_keys"])
        (allowed / "mallory.pub").write_bytes((pool["keys"] / "mallory.pub").read_bytes())
        d.proc.send_signal(signal.SIGHUP)  # the router reads its allow-list again
        wait_node_ready(d, "nodeM", 1, timeout=30)
        log = node.wait_log("ready (READY=1): 1 of")
        assert log.index("joined the router at") < log.index("ready (READY=1): 1 of"), log
        end = time.monotonic() + 10
        while not notes.ready() and time.monotonic() < end:
            time.sleep(0.1)
        assert notes.ready(), notes.got
        assert log.count("started pid") == 1 and "died" not in log, "it joined without a restart"
        assert served_by(d, "nodeM/") == "nodeM/cpu0"
    finally:
        notes.close()


def test_a_node_name_held_by_another_key_is_refused_on_both_sides(pool: dict[str, Any]) -> None:
    d = pool["router"]()
    pool["node"]("nodeB", cpu_workers=1)
    first = wait_node_ready(d, "nodeB", 1)
    notes = Notifications(pool["tmp"] / "notify.sock")
    try:
        impostor = pool["node"]("nodeB", key="nodec", folder="impostor", cpu_workers=2,
                                env={"NOTIFY_SOCKET": str(notes.path)})
        log = d.wait_log("refused worker nodeB/cpu0")
        assert "name clash" in log
        node_log = impostor.wait_log("FATAL: the router refused this worker: name clash")
        assert "FAILED, not restarting" in impostor.wait_log("FAILED, not restarting"), node_log
        # every worker of the impostor failed for good: like `serve`, the node exits 78 and says why
        try:
            code = impostor.proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the node runs on with every worker failed:\n{impostor.log_text()}") from None
        node_log = impostor.log_text()
        assert code == 78, node_log
        line = next(ln for ln in node_log.splitlines() if "every worker failed" in ln)
        assert "every worker failed at start-up, exiting with status 78: " in line and "name clash" in line, line
        assert "ready (READY=1)" not in node_log and not notes.ready(), notes.got
        status = [m for m in notes.read() if m.startswith("STATUS=every worker failed")]
        assert status and "name clash" in status[-1], notes.got
    finally:
        notes.close()
    assert [w["pid"] for w in wait_node_ready(d, "nodeB", 1)] == [first[0]["pid"]], "the first one keeps its name"


def test_a_restarted_router_gets_the_node_back_untouched(pool: dict[str, Any]) -> None:
    d = pool["router"]()
    node = pool["node"]("nodeB")
    pids = {w["pid"] for w in wait_node_ready(d, "nodeB", 2)}
    for w in ("cpu0", "cpu1"):  # the workers saw their welcome (the router counts them ready before)
        node.wait_log(f"nodeB/{w}: joined the router at {pool['sections']['server']['backend']}")
    d.proc.kill()  # the router daemon dies: no goodbye to anyone
    d.proc.wait()
    t0 = time.monotonic()
    d2 = pool["router"]()  # the same config: the same ports and keys, a new process
    rows = wait_node_ready(d2, "nodeB", 2, pids=pids)
    back = time.monotonic() - t0
    assert {w["pid"] for w in rows} == pids, "the node's workers were not restarted"
    assert served_by(d2, "nodeB/").startswith("nodeB/")
    assert "restarting" not in node.log_text() and "started pid" in node.log_text()
    assert node.log_text().count("started pid") == 2
    assert "connected to the router at" in node.wait_log("again")
    node.wait_log(f"joined the router at {pool['sections']['server']['backend']} again")
    assert node.log_text().count("ready (READY=1)") == 1, "ready once: READY is not withdrawn while the router is away"
    print(f"router restart: node workers back {back:.2f}s after the new router was started")


def test_node_sigterm_drains_its_workers(pool: dict[str, Any]) -> None:
    d = pool["router"]()
    node = pool["node"]("nodeB")
    wait_node_ready(d, "nodeB", 2)
    router_pub = load_key_file(pool["keys"] / "router.pub", secret=False).public
    alice = load_key_file(pool["keys"] / "alice.key", secret=True)
    assert alice.secret is not None
    # 4 waves of the pool's 12 slots: the node is busy when SIGTERM comes (the tiny model is fast)
    load = Load(d.endpoint, 48, max_tokens=400, curve=(router_pub, alice.public, alice.secret))
    thread = load.start()
    end, running = time.monotonic() + 30, 0
    while time.monotonic() < end and not running:
        running = sum(w["active"] for w in node_rows(d, "nodeB"))
    assert running > 0, "the node runs some of the streams"
    node.proc.send_signal(signal.SIGTERM)
    thread.join(120)
    load.check_every_request_answered_once()
    assert load.summary() == {"sent": 48, "finals": 48, "result": 48}, load.summary()
    assert node.stop() == 0
    assert all(w["state"] == "stopped" and w["model"] for w in node_rows(d, "nodeB")), node_rows(d, "nodeB")
    assert not [w for m in d.status()["models"] for w in m["workers"] if w.startswith("nodeB/")], \
        "a model lists the workers that can serve it"
    with d.client() as c:
        assert c.generate("after", max_tokens=2, ignore_eos=True).worker == "cpu0"
    assert "draining" in node.log_text()


def test_a_node_that_lost_its_router_stops_at_once_on_sigterm(pool: dict[str, Any]) -> None:
    d = pool["router"]()
    node = pool["node"]("nodeB")
    wait_node_ready(d, "nodeB", 2)
    d.proc.kill()  # no router: nothing is in flight, and no one to say goodbye to
    d.proc.wait()
    node.wait_log("lost the connection to the router")
    assert node.proc.poll() is None, "a node that lost its router keeps its workers"
    t0 = time.monotonic()
    assert node.stop(timeout=30) == 0
    took = time.monotonic() - t0
    assert took < 5, f"SIGTERM took {took:.1f}s:\n{node.log_text()}"
    assert "SIGKILL" not in node.log_text()


def test_node_config_is_checked(tmp_path: Path) -> None:
    from llamapool.config import ConfigError, from_dict

    base = {"model": {"path": "m"}}
    with pytest.raises(ConfigError, match=r"node\.join: is required"):
        from_dict({**base, "node": {"name": "a"}})
    with pytest.raises(ConfigError, match=r"node\.name"):
        from_dict({**base, "node": {"join": "tcp://h:1", "name": "a/b", "key": "k", "server_public_key": "p"}})
    with pytest.raises(ConfigError, match=r"node\.join: tcp://h:1 .*server_public_key"):
        from_dict({**base, "node": {"join": "tcp://h:1", "name": "a"}})
    cfg = from_dict({**base, "node": {"join": "tcp://h:1", "key": "k/n.key", "server_public_key": "k/r.pub"}},
                    tmp_path)
    assert cfg.node is not None and cfg.node.name and "/" not in cfg.node.name  # the host name
    assert cfg.node.key == str(tmp_path / "k" / "n.key")
    assert from_dict(base).node is None
    write_key_pair(tmp_path, "r")
    cfg_file = write_config(tmp_path / "n.toml", "m", tmp_path / "run",
                            node={"join": "tcp://127.0.0.1:1", "key": str(tmp_path / "r.pub"),
                                  "server_public_key": str(tmp_path / "r.pub")})
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "node", "--config", str(cfg_file)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "r.pub" in r.stderr and "no secret-key" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg_file)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "llamapool node" in r.stderr, r.stderr


def test_a_router_without_local_workers_serves_through_its_nodes(pool: dict[str, Any]) -> None:
    """``devices = "remote"``: a router host with no GPU runs no worker; its nodes serve the model."""
    d = launch(pool["tmp"] / "head", pool["model"], workers={"devices": "remote"}, **pool["sections"])
    d.endpoint, d.client_kw = pool["sections"]["server"]["frontend"], pool["client_kw"]
    pool["routers"].append(d)
    d.wait_log('devices = "remote": no local worker')
    pool["node"]("nodeB")
    wait_node_ready(d, "nodeB", 2)
    assert all(w.get("node") == "nodeB" for w in d.status()["workers"])
    with d.client() as c:
        done = list(c.generate_many(["through a node"] * 8, max_tokens=4, ignore_eos=True))
    assert len(done) == 8 and all(r.worker.startswith("nodeB/") for r in done)


def test_remote_devices_belong_to_a_router_config(tmp_path: Path, model_path: str) -> None:
    from llamapool.config import ConfigError, load_config
    cfg = write_config(tmp_path / "n.toml", model_path, tmp_path / "run", workers={"devices": "remote"},
                       node={"join": "ipc:///tmp/nowhere.sock", "name": "n1"})
    with pytest.raises(ConfigError, match='"remote"'):
        load_config(cfg)


def test_a_frozen_node_worker_is_killed_by_its_node_and_comes_back(pool: dict[str, Any]) -> None:
    """The router can only declare a remote worker lost; the node, which owns the process, kills a
    worker whose liveness lines stopped (SIGSTOP here) and starts a new one, which joins again."""
    d = pool["router"]()
    node = pool["node"]("nodeB", cpu_workers=1)
    old = wait_node_ready(d, "nodeB", 1)[0]["pid"]
    os.kill(old, signal.SIGSTOP)
    try:
        log = node.wait_log(f"killing pid {old}: no liveness line", timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGCONT)
    end, new = time.monotonic() + 60, None  # the new worker's pid (the router may list the old one a while)
    while new is None:
        assert time.monotonic() < end, node.log_text()
        new = next((int(p) for p in re.findall(r"nodeB/cpu0: started pid (\d+)", node.log_text()) if int(p) != old),
                   None)
        time.sleep(0.1)
    rows = wait_node_ready(d, "nodeB", 1, timeout=60, pids={new})
    assert rows[0]["pid"] != old, rows
    assert served_by(d, "nodeB/").startswith("nodeB/")
    assert "restarting" in node.log_text(), log
