"""Lifecycle and faults: every request gets exactly one final reply, whatever happens to workers.

Set LLAMAPOOL_FAULT_REPORT=path.jsonl to record each fault test's figures (requests sent, final
replies, errors by kind, time to detect, time until the replacement served).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamapool import OverloadedError, RequestTimeoutError, UnavailableError
from llamapool.protocol import PROTOCOL_VERSION
from llamapool.supervisor.surge import plan_name
from tests.loadgen import Load

LONG_CTX = {"ctx_per_slot": 4096}  # room for requests long enough to keep a slot busy for seconds


def report(name: str, **figures: Any) -> None:
    path = os.environ.get("LLAMAPOOL_FAULT_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": name, **figures}) + "\n")


def watch_replacement(d: Any, name: str, old_pid: int, t0: float) -> tuple[float, float]:
    """Seconds from ``t0`` until the worker is out of routing, and until its successor served."""
    detected = None
    end = t0 + 60
    while time.monotonic() < end:
        row = next(w for w in d.status()["workers"] if w["id"] == name)
        if detected is None and (row["state"] != "ready" or row["pid"] != old_pid):
            detected = time.monotonic() - t0
        if row["state"] == "ready" and row["pid"] not in (None, old_pid):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"{name} was not replaced: {d.status()}\n{d.log_text()}")
    with d.client() as c:
        while time.monotonic() < end:
            many = c.generate_many(["again"] * 8, max_tokens=2, ignore_eos=True)
            if any(m.worker == name for m in many):
                return detected or 0.0, time.monotonic() - t0
    raise AssertionError(f"the new {name} never served")


def check_guarantees(load: Load) -> dict[str, Any]:
    load.check_every_request_answered_once()
    for rid, o in load.failed().items():
        f = o.finals[0]
        assert f["code"] == "worker_lost", (rid, f)
        assert o.chunks > 0, f"{rid} failed although it had not started streaming: {f}"
        assert f["tokens_delivered"] == o.tokens
    return load.summary()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_worker_death_during_64_streams(start_daemon, how: str) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon()
    victim = d.status()["workers"][0]
    load = Load(d.endpoint, 64, max_tokens=80)
    thread = load.start()
    load.wait_chunks(16)
    row = next(w for w in d.status()["workers"] if w["id"] == victim["id"])
    assert row["active"] == 4, "the victim is mid-stream on all its slots"
    t0 = time.monotonic()
    os.kill(victim["pid"], getattr(signal, how))
    detect_s, served_s = watch_replacement(d, victim["id"], victim["pid"], t0)
    thread.join(120)
    summary = check_guarantees(load)
    assert summary["finals"] == 64
    assert summary.get("error:worker_lost", 0) <= 4, "only the victim's streaming requests may fail"
    if how == "SIGSTOP":
        assert detect_s < 3 * 1.0 + 1.0, "a stopped worker is dead after 3 missed 1 s heartbeats"
        row = next(w for w in d.status()["workers"] if w["id"] == victim["id"])
        assert "heartbeats" in (row["last_exit"] or ""), row
    report(f"worker {how} during 64 streams", **summary, detect_s=round(detect_s, 3),
           replacement_served_s=round(served_s, 3))


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon()
    load = Load(d.endpoint, 24, max_tokens=60)
    thread = load.start()
    load.wait_chunks(8)
    d.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    load.check_every_request_answered_once()
    assert load.summary() == {"sent": 24, "finals": 24, "result": 24}
    assert all(o.finals[0]["finish_reason"] == "length" for o in load.outcomes.values())
    assert d.proc.wait(30) == 0
    report("SIGTERM with 24 streams in flight", **load.summary())


def test_new_requests_during_drain_get_unavailable(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon()
    load = Load(d.endpoint, 8, max_tokens=200)
    thread = load.start()
    load.wait_chunks(4)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    with d.client() as c, pytest.raises(UnavailableError):
        c.generate("late", max_tokens=2)
    thread.join(60)
    assert d.proc.wait(30) == 0


def test_sighup_replaces_every_worker_under_load_with_zero_failures(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon()
    old = {w["id"]: w["pid"] for w in d.status()["workers"]}
    loads = [Load(d.endpoint, 32, max_tokens=80)]
    threads = [loads[0].start()]
    loads[0].wait_chunks(8)
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    loads.append(Load(d.endpoint, 32, max_tokens=40))
    threads.append(loads[1].start())
    end = time.monotonic() + 60
    while time.monotonic() < end:
        rows = d.status()["workers"]
        if all(w["state"] == "ready" and w["pid"] != old[plan_name(w["id"])] for w in rows):
            break
        time.sleep(0.05)
    reload_s = time.monotonic() - t0
    for t in threads:
        t.join(120)
    rows = d.status()["workers"]
    assert all(w["pid"] != old[plan_name(w["id"])] and w["state"] == "ready" for w in rows), rows
    assert len(rows) == len(old)  # each replaced by its successor (cpu0 by cpu0~1: supervisor/surge.py)
    for load in loads:
        load.check_every_request_answered_once()
        assert not load.failed(), load.summary()
    report("SIGHUP rolling reload under load", sent=64, finals=64, failed=0,
           reload_s=round(reload_s, 3), old_pids=old, new_pids={w["id"]: w["pid"] for w in rows})


def test_full_queue_answers_overloaded_at_once(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(wait_workers=1, server={"max_queue": 2}, model=LONG_CTX,
                     workers={"cpu_workers": 1, "slots": 1})
    running = Load(d.endpoint, 1, max_tokens=4000)
    threads = [running.start()]
    running.wait_chunks(1)
    waiting = Load(d.endpoint, 2, max_tokens=4)  # the slot is busy: these two fill the queue
    threads.append(waiting.start())
    end = time.monotonic() + 10
    while d.status()["queued"] < 2 and time.monotonic() < end:
        time.sleep(0.005)
    with d.client() as c:
        t0 = time.monotonic()
        with pytest.raises(OverloadedError, match="max_queue"):
            c.generate("one too many", max_tokens=2)
        took = time.monotonic() - t0
    assert took < 1.0
    for t in threads:
        t.join(120)
    assert not running.failed() and not waiting.failed(), "accepted requests still complete"
    report("full queue", overloaded_reply_s=round(took, 4))


def test_queued_request_past_its_deadline_gets_timeout(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1, "slots": 1}, model=LONG_CTX)
    load = Load(d.endpoint, 1, max_tokens=4000)
    thread = load.start()
    load.wait_chunks(1)
    with d.client() as c, pytest.raises(RequestTimeoutError):
        c.generate("wait for me", max_tokens=2, timeout=0.3)
    thread.join(60)


def test_every_worker_failing_at_start_up_exits_78_and_says_why(start_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A missing model: both workers fail for good (exit 78, no restart loop), so the daemon exits 78
    (EX_CONFIG; the unit's RestartPreventExitStatus=78) instead of running on, empty."""
    sock_path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(sock_path))
    srv.settimeout(0.1)
    started = time.monotonic()
    d = start_daemon(wait_workers=None, model={"path": str(tmp_path / "gone.gguf")},
                     env={"NOTIFY_SOCKET": str(sock_path)})
    try:
        code = d.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"daemon still running with every worker failed:\n{d.log_text()}") from None
    took = time.monotonic() - started
    got: list[str] = []
    with contextlib.suppress(OSError):
        while True:
            got.append(srv.recv(4096).decode())
    srv.close()
    log = d.log_text()
    assert code == 78, log
    assert took < 20, f"took {took:.1f}s"
    assert log.count("died") == 0, "a permanent failure must not be restarted:\n" + log
    assert "every worker failed at start-up, exiting with status 78" in log and "does not exist" in log, log
    assert not any("READY=1" in m for m in got), got
    status = [m for m in got if m.startswith("STATUS=every worker failed at start-up")]
    assert status and "gone.gguf" in status[-1], got


def test_systemd_notifications_over_a_real_socket(start_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sock_path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(sock_path))
    srv.settimeout(0.2)
    got: list[str] = []

    def until(pred: Any, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(pred(m) for m in got):
                return
            try:
                got.append(srv.recv(4096).decode())
            except TimeoutError:
                pass
        raise AssertionError(f"not received; got {got}")

    d = start_daemon(wait_workers=None, env={"NOTIFY_SOCKET": str(sock_path),
                                             "WATCHDOG_USEC": "1000000"})
    until(lambda m: "READY=1" in m)
    until(lambda m: m.startswith("STATUS=") and "workers ready" in m)
    until(lambda m: m == "WATCHDOG=1")
    assert any("EXTEND_TIMEOUT_USEC=" in m for m in got) or got.index(
        next(m for m in got if "READY=1" in m)) == 0
    for w in d.status()["workers"]:
        env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        assert not any(e.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=")) for e in env)
        assert b"CUDA_DEVICE_ORDER=PCI_BUS_ID" in env and b"CUDA_VISIBLE_DEVICES=" in env
    got.clear()
    d.proc.send_signal(signal.SIGHUP)
    until(lambda m: m.startswith("RELOADING=1"))
    reloading = next(m for m in got if m.startswith("RELOADING=1"))
    usec = int(reloading.split("MONOTONIC_USEC=")[1])
    assert abs(usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 30
    until(lambda m: "READY=1" in m)
    d.wait_ready(2)
    got.clear()
    d.proc.send_signal(signal.SIGTERM)
    until(lambda m: m == "STOPPING=1")
    assert d.proc.wait(30) == 0
    srv.close()


def test_workers_env_table_reaches_the_worker_before_it_starts(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(workers={"env": {"LLAMAPOOL_TEST_MARK": "42"}})
    for w in d.status()["workers"]:
        env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        assert b"LLAMAPOOL_TEST_MARK=42" in env


# ------------------------------------------------------------ fuzz

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                      st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
envelopes = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 2, "1", None]), "type": st.sampled_from(
        ["generate", "cancel", "status", "hello", "step", "run", "x"])},
    optional={"id": values, "prompt": values, "prompts": values, "params": values, "stream": values,
              "timeout": values, "model": values},
)
frames = st.one_of(
    st.binary(max_size=64),
    values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    envelopes.map(lambda v: msgpack.packb(v, use_bin_type=True)),
)


@pytest.fixture(scope="module", params=["ipc", "curve"])
def fuzz_target(request, tmp_path_factory, model_path):  # type: ignore[no-untyped-def]
    """The daemon on its default ipc:// socket, or on a CURVE tcp:// frontend (an allowed client key)."""
    from llamapool.client.calls import curve_keys
    from tests.conftest import curve_setup, launch

    folder = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    sections, client_kw = curve_setup(folder, backend_tcp=False) if request.param == "curve" else ({}, {})
    d = launch(folder, model_path, model={"ctx_per_slot": 64, "max_batch_tokens": 64, "n_ubatch": 64},
               **sections)
    if sections:
        d.endpoint, d.client_kw = sections["server"]["frontend"], client_kw
    d.wait_ready(2)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = curve_keys(d.endpoint, **client_kw) if client_kw else None
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(d.endpoint)
    yield d, sock
    ctx.destroy(linger=0)
    assert d.stop() == 0


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=frames)
def test_fuzzed_frames_never_break_the_daemon(fuzz_target, frame: bytes) -> None:  # type: ignore[no-untyped-def]
    d, sock = fuzz_target
    sock.send(frame)
    while sock.poll(0):
        sock.recv()
    assert d.proc.poll() is None


def test_daemon_still_serves_after_the_fuzz(fuzz_target) -> None:  # type: ignore[no-untyped-def]
    d, sock = fuzz_target
    # the fuzzing socket itself was connected (past the CURVE handshake): it gets its answer
    sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "id": "after-fuzz"}))
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if sock.poll(100) and msgpack.unpackb(sock.recv()).get("id") == "after-fuzz":
            break
    else:
        raise AssertionError("the fuzzing socket got no answer")
    with d.client() as c:
        assert c.generate("after the storm", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        assert len(c.status()["workers"]) == 2
