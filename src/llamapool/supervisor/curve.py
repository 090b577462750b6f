"""The daemon's CURVE set-up (docs/security.md): the router's key pair, the allow-list of client and node
keys with its ZAP handler, and the internal key that the supervisor's own workers and gateways use."""

from __future__ import annotations

from typing import Any

import zmq

from llamapool import log as logmod
from llamapool import security
from llamapool.config import Config, needs_curve

LOG = logmod.Logger("supervisor")


class Curve:
    """CURVE on the router's tcp:// sockets; no key at all when the config asks for none."""

    def __init__(self, cfg: Config):
        """Read the router's key and the allow-list now: a bad key file is a start-up error naming it."""
        self.key: security.KeyPair | None = None
        self.allow: security.AllowList | None = None
        self.internal_key_file = ""  # made in the runtime dir by start()
        self.auth: Any = None
        if cfg.curve:
            self.key = security.load_key_file(cfg.security.server_key, secret=True)
            self.allow = security.AllowList(cfg.security.authorized_keys)

    def start(self, zctx: zmq.Context, cfg: Config) -> None:
        """The ZAP handler and the internal key, or a warning naming the tcp:// sockets left plain."""
        security.log_to_stderr()
        plain = [e for e in (cfg.frontend, cfg.backend) if needs_curve(e)]
        if self.allow is None:
            if plain:
                LOG.warning(f"WARNING: security.insecure_tcp = true: {', '.join(plain)} use(s) no CURVE: no "
                            f"encryption, and anyone who can connect can use the pool (see docs/security.md)")
            return
        key, _ = security.write_key_pair(cfg.runtime_dir, "internal", force=True)
        internal = security.load_key_file(key, secret=True)
        self.internal_key_file = str(key)
        self.allow.extra[internal.public] = "(the supervisor's internal key)"
        self.auth = security.start_authenticator(zctx, self.allow)
        LOG.info(f"CURVE on {', '.join(plain)}: router key {self.key.fingerprint if self.key else '?'}, "
                 f"{len(self.allow.keys)} authorized key(s) in {self.allow.directory}")

    def local_public(self) -> bytes:
        """The internal public key (Z85) that marks the supervisor's own workers to the router."""
        return security.load_key_file(self.internal_key_file, secret=False).public if self.internal_key_file else b""

    def child_fields(self, endpoint: str) -> dict[str, str]:
        """The spec fields a local worker or gateway needs to connect to ``endpoint`` with CURVE."""
        if self.key is None or not needs_curve(endpoint):
            return {}
        return {"server_key": self.key.public.decode(), "key_file": self.internal_key_file}

    def client_keys(self, endpoint: str) -> dict[str, Any] | None:
        """The keys a client inside the supervisor (the ``[metrics]`` listener's) connects to ``endpoint``
        with: the internal key on tcp:// with CURVE, else None."""
        fields = self.child_fields(endpoint)
        return {"server_public_key": fields["server_key"].encode(), "client_key": fields["key_file"]} \
            if fields else None

    def read_allowed(self, new: Config) -> dict[bytes, str] | None:
        """The new config's authorized keys (raises ConfigError), or None when nothing is to change."""
        if self.allow is None or not new.security.authorized_keys:
            return None
        return security.load_authorized_keys(new.security.authorized_keys)

    def apply_allowed(self, new: Config, allowed: dict[bytes, str] | None) -> None:
        """A reload's allow-list: it applies to new connections from now on."""
        if self.allow is not None and allowed is not None:
            self.allow.directory, self.allow.keys = new.security.authorized_keys, allowed
            LOG.info(f"authorized_keys: {len(allowed)} key(s) in {self.allow.directory}")

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
