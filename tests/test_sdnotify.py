"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamapool.supervisor.sdnotify import Notifier, scrub_env


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket bound in tmp_path, and the NOTIFY_SOCKET value that reaches it."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    yield str(path), sock
    sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def assert_nothing_sent(sock: socket.socket) -> None:
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda n: n.ready(), "READY=1"),
        (lambda n: n.ready(status="2 workers ready"), "READY=1\nSTATUS=2 workers ready"),
        (lambda n: n.status("1 workers ready, 3 queued"), "STATUS=1 workers ready, 3 queued"),
        (lambda n: n.status("two\nlines"), "STATUS=two lines"),
        (lambda n: n.stopping(), "STOPPING=1"),
        (lambda n: n.extend_timeout(10), "EXTEND_TIMEOUT_USEC=10000000"),
        (lambda n: n.extend_timeout(0.5), "EXTEND_TIMEOUT_USEC=500000"),
        (lambda n: n.notify(READY=1, STATUS="up"), "READY=1\nSTATUS=up"),
        (lambda n: n.send("FDSTORE=1", "FDNAME=x"), "FDSTORE=1\nFDNAME=x"),
    ],
)
def test_datagram_content(listener: tuple[str, socket.socket], call, expected: str) -> None:
    path, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert call(n) is True
    assert recv(sock) == expected
    n.close()


def test_reloading_carries_monotonic_usec(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = recv(sock).split("\n")
    assert lines[0] == "RELOADING=1"
    assert len(lines) == 2 and lines[1].startswith("MONOTONIC_USEC=")
    value = lines[1].removeprefix("MONOTONIC_USEC=")
    assert value.isdigit()
    assert before <= int(value) <= after


def test_abstract_namespace_socket() -> None:
    name = f"llamapool-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.enabled
        assert n.ready()
        assert recv(sock) == "READY=1"
    finally:
        sock.close()


def test_watchdog(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"})
    assert n.watchdog_interval == pytest.approx(15.0)
    assert n.watchdog()
    assert recv(sock) == "WATCHDOG=1"


def test_watchdog_for_this_pid(listener: tuple[str, socket.socket]) -> None:
    path, _ = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(env).watchdog_interval == pytest.approx(0.5)


def test_watchdog_of_another_pid_is_off(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    n = Notifier.from_env(env)
    assert n.enabled
    assert n.watchdog_interval is None
    assert n.watchdog() is False
    assert_nothing_sent(sock)


@pytest.mark.parametrize("usec", [None, "", "0", "-5", "soon"])
def test_no_or_bad_watchdog_usec(listener: tuple[str, socket.socket], usec: str | None) -> None:
    path, _ = listener
    env = {"NOTIFY_SOCKET": path} if usec is None else {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": usec}
    n = Notifier.from_env(env)
    assert n.watchdog_interval is None
    assert n.watchdog() is False


@pytest.mark.parametrize("value", [None, "", "relative/path", "@", "vsock:2:1234"])
def test_disabled_is_a_no_op(value: str | None) -> None:
    env = {"WATCHDOG_USEC": "30000000"} if value is None else {"NOTIFY_SOCKET": value}
    n = Notifier.from_env(env)
    assert not n.enabled
    assert n.watchdog_interval is None
    assert n.ready() is False
    assert n.status("x") is False
    assert n.reloading() is False
    assert n.stopping() is False
    assert n.extend_timeout(1) is False
    assert n.watchdog() is False
    n.close()


def test_missing_socket_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock"), "WATCHDOG_USEC": "2000000"})
    assert n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    assert n.stopping() is False


def test_socket_gone_after_first_send(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.ready()
    sock.close()
    os.unlink(path)
    assert n.status("still here") is False


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch,
                                         listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert Notifier.from_env().stopping()
    assert recv(sock) == "STOPPING=1"


def test_scrub_env() -> None:
    env = {
        "PATH": "/usr/bin", "HOME": "/var/lib/llamapool", "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1", "LISTEN_FDS": "1", "LISTEN_PID": "1",
        "LISTEN_FDNAMES": "frontend",
    }
    out = scrub_env(env)
    assert out == {"PATH": "/usr/bin", "HOME": "/var/lib/llamapool"}
    assert out is not env and "NOTIFY_SOCKET" in env  # a copy; the input is untouched
    assert not Notifier.from_env(out).enabled


def test_systemd_unit_passes_systemd_analyze_verify() -> None:
    """configs/systemd/llamapool.service is accepted by ``systemd-analyze verify``."""
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    script = Path(__file__).resolve().parent.parent / "scripts" / "verify-systemd-unit.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    unit = (script.parent.parent / "configs" / "systemd" / "llamapool.service").read_text()
    for line in ("Type=notify", "KillMode=mixed", "Restart=on-failure", "RuntimeDirectory=llamapool",
                 "ExecReload=/bin/kill -HUP $MAINPID"):
        assert line in unit
    assert "PrivateDevices=yes" not in unit and "MemoryDenyWriteExecute=yes" not in unit
