"""CURVE keys and the router's allow-list (ZeroMQ CURVE + ZAP) for ``tcp://`` sockets.

Key files (``llamapool keygen NAME``) use ZeroMQ's certificate format (ZPL, what czmq and
``zmq.auth.load_certificate`` read) with one more line, a fingerprint that makes a tampered or
truncated file an error rather than a different key::

    #   llamapool CURVE secret key "NAME": keep it secret (mode 0600)
    metadata
        name = "NAME"
        fingerprint = "SHA256:0123456789abcdef"
    curve
        public-key = "<40 Z85 characters>"
        secret-key = "<40 Z85 characters>"      # NAME.key only

``NAME.pub`` holds the same without the secret key; it is what goes into the router's
``authorized_keys`` directory (or, for the router's own key, to its clients).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from llamapool.errors import ConfigError
from llamapool.protocol.endpoints import needs_curve as needs_curve

log = logging.getLogger("llamapool.security")


class KeyFileError(ConfigError):
    """A key file that cannot be used; the message names the file (a ConfigError: exit 2 at start-up)."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes | None  # Z85, 40 bytes; None for a public key file
    source: str = ""

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)


def fingerprint(public: bytes) -> str:
    """A short, stable name for a public key (Z85 or raw 32 bytes): ``SHA256:<16 hex>``."""
    raw = zmq.utils.z85.decode(public) if len(public) == 40 else public
    return "SHA256:" + hashlib.sha256(raw).hexdigest()[:16]


def _z85(value: bytes, what: str, path: str) -> bytes:
    if len(value) != 40:
        raise KeyFileError(f"{path}: {what} must be 40 Z85 characters, got {len(value)} (truncated or edited?)")
    try:
        raw = zmq.utils.z85.decode(value)
    except (ValueError, KeyError, IndexError) as e:
        raise KeyFileError(f"{path}: {what} is not valid Z85 ({e}; edited?)") from None
    if len(raw) != 32:
        raise KeyFileError(f"{path}: {what} does not decode to 32 bytes")
    return value


def _render(name: str, public: bytes, secret: bytes | None) -> str:
    kind = f'secret key "{name}": keep it secret (mode 0600)' if secret else f'public key "{name}"'
    lines = [
        f"#   llamapool CURVE {kind}",
        "#   written by `llamapool keygen`; any edit makes it unusable (see docs/security.md)",
        "metadata",
        f'    name = "{name}"',
        f'    fingerprint = "{fingerprint(public)}"',
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_key_pair(directory: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public + secret, mode 0600) and ``NAME.pub``; return (key, pub) paths."""
    if not re.fullmatch(r"[A-Za-z0-9._@-]+", name) or name.startswith("."):
        raise ValueError(f"key name {name!r}: use letters, digits, '.', '_', '-', '@'")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key, pub = d / f"{name}.key", d / f"{name}.pub"
    for p in (key, pub):
        if p.exists() and not force:
            raise FileExistsError(f"{p} exists (remove it first, or pass --force)")
    public, secret = zmq.curve_keypair()
    with contextlib.suppress(FileNotFoundError):
        key.unlink()
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(_render(name, public, secret))
    os.chmod(key, 0o600)
    pub.write_text(_render(name, public, None))
    return key, pub


def load_key_file(path: str | os.PathLike[str], *, secret: bool) -> KeyPair:
    """Read and check a key file; ``secret``: it must hold the secret key too. Errors name the file."""
    p = str(path)
    try:
        text = Path(p).read_text(encoding="ascii")
    except FileNotFoundError:
        raise KeyFileError(f"{p}: key file does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{p}: cannot read key file: {e}") from None
    fields: dict[str, bytes] = {}
    for line in text.splitlines():
        m = re.fullmatch(r'\s*(public-key|secret-key|fingerprint)\s*=\s*"([^"]*)"\s*', line)
        if m:
            fields[m.group(1)] = m.group(2).encode("ascii")
    if "public-key" not in fields:
        raise KeyFileError(f"{p}: not a llamapool key file, or truncated (no public-key line)")
    public = _z85(fields["public-key"], "public-key", p)
    if "fingerprint" not in fields:
        raise KeyFileError(f"{p}: no fingerprint line (truncated, or not written by `llamapool keygen`)")
    if fields["fingerprint"].decode() != fingerprint(public):
        raise KeyFileError(f"{p}: fingerprint does not match the public key: the file was edited or damaged")
    sec: bytes | None = None
    if "secret-key" in fields:
        sec = _z85(fields["secret-key"], "secret-key", p)
        if zmq.curve_public(sec) != public:
            raise KeyFileError(f"{p}: secret-key does not belong to the public-key: the file was edited or damaged")
    elif secret:
        raise KeyFileError(f"{p}: holds no secret-key (a .pub file where a .key file is needed, or truncated)")
    return KeyPair(public, sec, p)


def load_authorized_keys(directory: str | os.PathLike[str]) -> dict[bytes, str]:
    """Every ``*.pub`` file in the allow-list directory: {Z85 public key: file name}."""
    d = Path(directory)
    if not d.is_dir():
        raise KeyFileError(f"{d}: the authorized_keys directory does not exist")
    keys: dict[bytes, str] = {}
    for p in sorted(d.iterdir()):
        if p.suffix == ".pub" and p.is_file():
            keys[load_key_file(p, secret=False).public] = p.name
    return keys


def public_key_of(value: bytes | str | os.PathLike[str]) -> bytes:
    """A server public key given as Z85 (40 bytes), raw (32 bytes), or a path to a .pub/.key file."""
    if isinstance(value, bytes):
        if len(value) == 32:
            return zmq.utils.z85.encode(value)
        return _z85(value, "server public key", "server_public_key")
    return load_key_file(value, secret=False).public


def client_pair_of(value: bytes | str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """A client key pair (public, secret) from a secret key (Z85 or raw bytes) or a path to a .key file."""
    if isinstance(value, bytes):
        sec = zmq.utils.z85.encode(value) if len(value) == 32 else _z85(value, "client secret key", "client_key")
        return zmq.curve_public(sec), sec
    pair = load_key_file(value, secret=True)
    assert pair.secret is not None
    return pair.public, pair.secret


def set_client_keys(sock: zmq.Socket[Any], server_public: bytes, public: bytes, secret: bytes) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public`` (call before connect)."""
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def set_server_keys(sock: zmq.Socket[Any], pair: KeyPair) -> None:
    """Make ``sock`` a CURVE server (call before bind); clients are checked by the ZAP handler."""
    assert pair.secret is not None
    sock.curve_server = True
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret


# ---------------------------------------------------------------- the router's side


class AllowList:
    """The ZAP credentials provider: keys from the ``authorized_keys`` directory plus extra keys
    (the supervisor's internal key for its local workers and gateways). Refusals are logged on the
    ``zmq.auth`` logger, at most once per key per ``quiet`` seconds."""

    def __init__(self, directory: str, extra: dict[bytes, str] | None = None, quiet: float = 10.0):
        self.directory = directory
        self.extra = dict(extra or {})
        self.keys = load_authorized_keys(directory) if directory else {}
        self.quiet = quiet
        self._last: dict[bytes, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def reload(self) -> int:
        """Re-read the directory (SIGHUP); a bad file keeps the old set and raises :class:`KeyFileError`."""
        keys = load_authorized_keys(self.directory) if self.directory else {}
        with self._lock:
            self.keys = keys
        return len(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            if key in self.keys or key in self.extra:
                return True
            now = time.monotonic()
            last, quiet_count = self._last.get(key, (0.0, 0))
            if now - last < self.quiet:
                self._last[key] = (last, quiet_count + 1)
                return False
            self._last[key] = (now, 0)
        more = f" ({quiet_count} more attempts since the last line)" if quiet_count else ""
        logging.getLogger("zmq.auth").warning(
            "refused a CURVE client: key %s (public key %s) is not in authorized_keys %s%s",
            fingerprint(key), key.decode(errors="replace"), self.directory or "(none set)", more)
        return False


def start_authenticator(zctx: zmq.Context[Any], allow: AllowList) -> ThreadAuthenticator:
    """pyzmq's ZAP handler thread on ``zctx``: every CURVE socket of this context asks it."""
    auth = ThreadAuthenticator(zctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=allow)
    return auth


# FAILED_AUTH is logged by AllowList (with the key). A peer without CURVE shows up as a mechanism
# mismatch, or, when it noticed first and hung up, as FAILED_NO_DETAIL with an errno.
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class HandshakeLog:
    """Turns a CURVE server socket's monitor events into (rate-limited) log lines: a peer that
    speaks no CURVE (a client without keys) is never seen by ZAP, only by the handshake."""

    def __init__(self, quiet: float = 10.0):
        self.quiet = quiet
        self._last: dict[tuple[str, int], tuple[float, int]] = {}

    def event(self, msg: dict[str, Any]) -> None:
        ev, value, endpoint = int(msg["event"]), int(msg["value"]), msg["endpoint"].decode(errors="replace")
        if ev == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = "the peer does not use CURVE (a client without --key/--server-key, or a plain-TCP client)"
        elif ev == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = f"handshake failed: ZMTP protocol error {value:#x} (a wrong server public key, or not a ZeroMQ peer)"
        else:
            why = (f"the peer hung up during the CURVE handshake ({os.strerror(value) if 0 < value < 256 else value}): "
                   f"a client without keys, a refused key, or a client expecting another server key")
        now = time.monotonic()
        last, count = self._last.get((endpoint, value), (0.0, 0))
        if now - last < self.quiet:
            self._last[(endpoint, value)] = (last, count + 1)
            return
        self._last[(endpoint, value)] = (now, 0)
        more = f" ({count} more since the last line)" if count else ""
        log.warning("refused a connection on %s: %s%s", endpoint, why, more)


def log_to_stderr() -> None:
    """Send the ``zmq.auth`` and ``llamapool.security`` loggers' warnings to stderr, the daemon's log."""
    fmt = logging.Formatter("llamapool: %(message)s")
    for name in ("zmq.auth", "llamapool.security"):
        lg = logging.getLogger(name)
        if not any(getattr(h, "_llamapool", False) for h in lg.handlers):
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(fmt)
            h._llamapool = True  # type: ignore[attr-defined]
            lg.addHandler(h)
        lg.setLevel(logging.WARNING)
        lg.propagate = False
