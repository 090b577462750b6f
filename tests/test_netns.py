"""A router and a node across a real network boundary on one machine (``make test-netns``).

Two network namespaces joined by a veth pair (the addresses exist only inside them): the router
daemon (one local CPU worker, a tcp:// CURVE backend on its veth address) in one, ``llamapool node``
(two CPU workers) in the other. The test process reaches the router through its ipc:// frontend (a
file, which no network namespace hides). The scenarios run in order, on the same processes:

1. the node joins and serves;
2. partition (``ip link set ... down``): the node's workers are declared lost within 3 heartbeats,
   requests they had not started go to the local worker, streams in flight end with ``worker_lost``,
   every request gets exactly one final reply;
3. the link comes back up: the node rejoins (the same worker processes) and serves;
4. the router is killed and started again: the node reconnects, its workers untouched.

Opt-in: needs root and ``ip`` (iproute2); skipped unless LLAMAPOOL_NETNS=1. Prints each figure, and
appends them as JSON lines to $LLAMAPOOL_NETNS_REPORT when set. scripts/test-netns.sh runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamapool.security import write_key_pair
from tests.conftest import Daemon, write_config
from tests.loadgen import Load

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.environ.get("LLAMAPOOL_NETNS") != "1" or os.geteuid() != 0 or not shutil.which("ip"),
                       reason="opt-in (LLAMAPOOL_NETNS=1, root, iproute2): make test-netns"),
]

TAG = f"lp{os.getpid() % 100000}"
NS_R, NS_N = f"{TAG}-r", f"{TAG}-n"  # the router's and the node's namespaces
VETH_R, VETH_N = f"{TAG}r", f"{TAG}n"
ADDR_R, ADDR_N = "10.231.7.1", "10.231.7.2"
PORT = 5556
HEARTBEAT, LIVENESS = 1.0, 3
FIGURES: dict[str, float] = {}


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def figure(name: str, seconds: float, **extra: Any) -> None:
    FIGURES[name] = round(seconds, 3)
    print(f"\nFIGURE {name}: {seconds:.2f} s {json.dumps(extra) if extra else ''}", flush=True)
    path = os.environ.get("LLAMAPOOL_NETNS_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"figure": name, "seconds": round(seconds, 3), **extra}) + "\n")


def cleanup_netns() -> None:
    for ns in (NS_R, NS_N):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Net:
    def __init__(self, tmp: Path, model: str):
        self.tmp, self.model = tmp, model
        keys, allowed = tmp / "keys", tmp / "authorized"
        allowed.mkdir(parents=True)
        for name in ("router", "nodeb"):
            write_key_pair(keys, name)
        (allowed / "nodeb.pub").write_bytes((keys / "nodeb.pub").read_bytes())
        self.router_cfg = write_config(
            tmp / "router.toml", model, tmp / "router-run", model={"ctx_per_slot": 2048},
            server={"backend": f"tcp://{ADDR_R}:{PORT}", "queue_timeout": 120.0},
            workers={"cpu_workers": 1, "heartbeat_interval": HEARTBEAT, "heartbeat_liveness": LIVENESS},
            security={"server_key": str(keys / "router.key"), "authorized_keys": str(allowed)})
        self.node_cfg = write_config(
            tmp / "node.toml", model, tmp / "node-run", model={"ctx_per_slot": 2048},
            node={"join": f"tcp://{ADDR_R}:{PORT}", "name": "nodeB", "server_public_key": str(keys / "router.pub"),
                  "key": str(keys / "nodeb.key")},
            workers={"cpu_workers": 2, "heartbeat_interval": HEARTBEAT, "heartbeat_liveness": LIVENESS})
        self.endpoint = f"ipc://{tmp / 'router-run' / 'frontend.sock'}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.router: Daemon | None = None
        self.node: subprocess.Popen[bytes] | None = None
        self.node_log = tmp / "node.log"
        self.routers = 0

    def spawn(self, ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as fh:
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "llamapool.cli", *args],
                                 stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(p)
        return p

    def start_router(self) -> Daemon:
        self.routers += 1
        log = self.tmp / f"router{self.routers}.log"
        p = self.spawn(NS_R, ["serve", "--config", str(self.router_cfg)], log)
        self.router = Daemon(p, self.router_cfg, self.endpoint, log)
        return self.router

    def start_node(self) -> subprocess.Popen[bytes]:
        self.node = self.spawn(NS_N, ["node", "--config", str(self.node_cfg)], self.node_log)
        return self.node

    def link(self, up: bool) -> None:
        sh("ip", "-n", NS_N, "link", "set", VETH_N, "up" if up else "down")

    def node_rows(self) -> list[dict[str, Any]]:
        assert self.router is not None
        return [w for w in self.router.status()["workers"] if w.get("node") == "nodeB"]

    def wait_node(self, pred: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while time.monotonic() < end:
            try:
                rows = self.node_rows()
                if pred(rows):
                    return rows
            except Exception:  # the router is not answering yet
                pass
            time.sleep(0.02)
        raise AssertionError(f"node workers: {rows}\n{self.logs()}")

    def serve_on_node(self, timeout: float = 60.0) -> str:
        assert self.router is not None
        end = time.monotonic() + timeout
        with self.router.client() as c:
            while time.monotonic() < end:
                for done in c.generate_many(["across the veth"] * 12, max_tokens=2, ignore_eos=True):
                    if done.worker.startswith("nodeB/"):
                        return done.worker
        raise AssertionError(f"the node served nothing within {timeout}s\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for p in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Net]:
    cleanup_netns()
    sh("ip", "netns", "add", NS_R)
    sh("ip", "netns", "add", NS_N)
    n = None
    try:
        sh("ip", "link", "add", VETH_R, "netns", NS_R, "type", "veth", "peer", "name", VETH_N, "netns", NS_N)
        for ns, dev, addr in ((NS_R, VETH_R, ADDR_R), (NS_N, VETH_N, ADDR_N)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        n = Net(tmp_path_factory.mktemp("netns"), model_path)
        yield n
    finally:
        if n is not None:
            for p in n.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGQUIT)
            for p in n.procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        time.sleep(1.5)  # orphaned workers notice their supervisor is gone within a heartbeat
        cleanup_netns()
        print(f"\nFIGURES {json.dumps(FIGURES)}", flush=True)


def test_1_the_node_joins_and_serves(net: Net) -> None:
    d = net.start_router()
    d.wait_ready(1, timeout=60)
    t0 = time.monotonic()
    net.start_node()
    rows = net.wait_node(lambda rows: sum(w["state"] == "ready" for w in rows) == 2)
    figure("node_join", time.monotonic() - t0, what="node process start -> its 2 workers ready at the router")
    assert sorted(w["id"] for w in rows) == ["nodeB/cpu0", "nodeB/cpu1"]
    assert net.serve_on_node().startswith("nodeB/")
    net.pids = {w["pid"] for w in rows}  # type: ignore[attr-defined]


def test_2_partition_loses_the_node_and_keeps_every_promise(net: Net) -> None:
    d = net.router
    assert d is not None
    streams = Load(net.endpoint, 8, max_tokens=1500, timeout=180)  # spread over the 3 workers
    t_streams = streams.start()
    end = time.monotonic() + 30
    while time.monotonic() < end and not (
            sum(w["active"] for w in net.node_rows()) >= 2 and streams.chunks_seen >= 40):
        time.sleep(0.02)
    on_node = sum(w["active"] for w in net.node_rows())
    assert on_node >= 2, "the node runs some of the streams"
    net.link(False)
    t0 = time.monotonic()
    # sent after the link went down: the router still counts the node's free slots (it does not know
    # yet), so most of these go to the node and never start; found lost, they go to the local worker
    unstarted = Load(net.endpoint, 6, max_tokens=20, timeout=180, prefix="late")
    t_unstarted = unstarted.start()
    rows = net.wait_node(lambda rows: all(w["state"] != "ready" for w in rows), timeout=30)
    detect = time.monotonic() - t0
    figure("partition_detect", detect, what="link down -> the node's workers out of routing (lost)",
           limit=HEARTBEAT * LIVENESS, states=[w["state"] for w in rows], reasons=sorted({w["reason"] for w in rows}))
    assert detect <= HEARTBEAT * LIVENESS + 0.5, f"lost after {detect:.2f}s, more than {LIVENESS} heartbeats"
    assert all(w["state"] == "lost" and "heartbeats" in w["reason"] for w in rows), rows
    t_streams.join(180)
    t_unstarted.join(180)
    for load in (streams, unstarted):
        load.check_every_request_answered_once()
    lost = streams.failed()
    assert lost, "streams in flight on the node end with worker_lost"
    for rid, o in lost.items():
        f = o.finals[0]
        assert f["code"] == "worker_lost" and o.chunks > 0 and f["tokens_delivered"] == o.tokens, (rid, f)
    for o in streams.outcomes.values():  # the rest finished: on cpu0, or on the node before the link went down
        assert o.finals[0]["type"] == "result" or o.finals[0]["code"] == "worker_lost", o.finals[0]
    assert all(o.finals[0]["type"] == "result" and o.finals[0]["worker"] == "cpu0"
               for o in unstarted.outcomes.values()), unstarted.summary()
    summary = {"streams": streams.summary(), "sent_after_partition": unstarted.summary()}
    log = d.log.read_text(errors="replace")
    assert "worker nodeB/cpu0 of node nodeB lost: missed 3 heartbeats" in log
    # the late requests the node's workers had taken (never started) went back to the queue, then to cpu0
    taken = [rid for ln in log.splitlines() if "lost (missed 3 heartbeats) with" in ln
             for rid in ln.split("requests=")[-1].split(",") if rid.startswith("late-")]
    print(f"\nRESULT partition: {json.dumps(summary)}; late requests the node had taken, re-dispatched to cpu0: "
          f"{len(taken)} of {unstarted.n}", flush=True)
    assert taken, "some late requests went to the lost node first (the test would not show re-dispatch)"


def test_3_link_up_the_node_rejoins_and_serves(net: Net) -> None:
    net.link(True)
    t0 = time.monotonic()
    rows = net.wait_node(lambda rows: sum(w["state"] == "ready" for w in rows) == 2, timeout=60)
    rejoin = time.monotonic() - t0
    net.serve_on_node()
    serve = time.monotonic() - t0
    figure("link_up_rejoin", rejoin, what="link up -> the node's workers ready at the router again")
    figure("link_up_serve", serve, what="link up -> a request served by a node worker")
    assert {w["pid"] for w in rows} == net.pids, "the node kept its worker processes"  # type: ignore[attr-defined]
    node_log = net.node_log.read_text(errors="replace")
    assert "lost the connection to the router" in node_log and "connected to the router at" in node_log


def test_4_router_restart_the_node_reconnects(net: Net) -> None:
    old = net.router
    assert old is not None
    old.proc.kill()
    old.proc.wait()
    time.sleep(1.5)  # its local worker notices and exits
    t0 = time.monotonic()
    d = net.start_router()
    d.wait_ready(1, timeout=60)
    t_up = time.monotonic() - t0
    rows = net.wait_node(lambda rows: sum(w["state"] == "ready" for w in rows) == 2, timeout=60)
    back = time.monotonic() - t0
    net.serve_on_node()
    serve = time.monotonic() - t0
    figure("router_restart_up", t_up, what="new router process -> its own local worker ready")
    figure("router_restart_reconnect", back, what="new router process -> the node's 2 workers ready at it")
    figure("router_restart_serve", serve, what="new router process -> a request served by a node worker")
    assert {w["pid"] for w in rows} == net.pids, "the node's workers were not restarted"  # type: ignore[attr-defined]
    assert net.node is not None and net.node.poll() is None
    assert "restarting" not in net.node_log.read_text(errors="replace")
