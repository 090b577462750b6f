"""The API keys file (``http.api_keys_file``): who may call, under which tenant, with which limits.

One key a line; blank lines and ``#`` comments are skipped. A line is the key alone (the tenant is then
named ``key-`` and 8 hex digits of the key's SHA-256) or the key followed by ``name=value`` settings::

    # key                      settings
    sk-batch-7f3a9c            name=batch weight=1 priority=flex concurrency=64 rpm=600 tpm=200000
    sk-chat-0b12e4             name=chat  weight=3 priority=priority
    *                          rpm=120 tpm=50000

The line ``*`` sets the defaults of every tenant without a line of its own (no keys at all, a name a
trusted header or an SDK client gives). The router reads the same file (it counts the limits); the
gateway reads it to authenticate. A bad line fails the start, or a reload (which keeps the old keys),
naming the line.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

CLASSES = ("priority", "default", "flex")  # priority classes, the first served first (docs/http.md)
DEFAULT_TENANT = "default"  # the tenant of a request without a key or a name
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
SETTINGS = ("name", "weight", "priority", "concurrency", "rpm", "tpm", "queue_share")


class KeysFileError(ValueError):
    """A keys file that cannot be used: the message names the file and the line."""


@dataclass(frozen=True)
class TenantSettings:
    """One tenant's share and limits (0: no limit)."""

    name: str = DEFAULT_TENANT
    weight: float = 1.0  # its share of a model's slots and of the queue's turns, against the others' weights
    priority: str = "priority"  # the highest class it may ask for
    concurrency: int = 0  # requests (prompts) waiting or running at once
    rpm: int = 0  # requests a minute
    tpm: int = 0  # tokens a minute: prompt and generated
    queue_share: float = 0.0  # the most of server.max_queue its waiting prompts may take (0 < share <= 1)

    def to_row(self) -> dict[str, object]:
        return {"name": self.name, "weight": self.weight, "priority": self.priority,
                "concurrency": self.concurrency, "rpm": self.rpm, "tpm": self.tpm, "queue_share": self.queue_share}

    @classmethod
    def from_row(cls, row: dict[str, object]) -> TenantSettings:
        return cls(**row)  # type: ignore[arg-type]


@dataclass(frozen=True)
class KeysFile:
    """The keys (key -> tenant name), every named tenant's settings, and the defaults (``*``)."""

    keys: dict[bytes, str] = field(default_factory=dict)
    tenants: dict[str, TenantSettings] = field(default_factory=dict)
    defaults: TenantSettings = field(default_factory=TenantSettings)

    @classmethod
    def from_rows(cls, tenants: list[dict[str, object]], defaults: dict[str, object]) -> KeysFile:
        """The router's table from a :class:`~llamapool.protocol.control.TenantTable` (no keys)."""
        return cls({}, {r["name"]: TenantSettings.from_row(r) for r in tenants},  # type: ignore[misc]
                   TenantSettings.from_row(defaults) if defaults else TenantSettings())

    def settings(self, name: str) -> TenantSettings:
        """The settings of tenant ``name``: its own line's, else the defaults under its name."""
        own = self.tenants.get(name)
        return own if own is not None else replace(self.defaults, name=name)


def key_name(key: bytes) -> str:
    """The tenant name of a key given without ``name=``: never the key itself."""
    return "key-" + hashlib.sha256(key).hexdigest()[:8]


def _setting(where: str, s: TenantSettings, item: str) -> TenantSettings:
    name, sep, value = item.partition("=")
    if not sep or not value:
        raise KeysFileError(f"{where}: {item!r} is not a setting (name=value): the key is the line's first word, "
                            f"settings follow it")
    try:
        if name == "name":
            if not NAME.fullmatch(value):
                raise ValueError("1 to 64 of A-Z a-z 0-9 _ . : -")
            return replace(s, name=value)
        if name == "weight":
            w = float(value)
            if not 0.01 <= w <= 1000:
                raise ValueError("a number from 0.01 to 1000")
            return replace(s, weight=w)
        if name == "priority":
            if value not in CLASSES:
                raise ValueError("one of " + ", ".join(CLASSES))
            return replace(s, priority=value)
        if name in ("concurrency", "rpm", "tpm"):
            n = int(value)
            if n < 0:
                raise ValueError("a whole number >= 0 (0: no limit)")
            return replace(s, concurrency=n) if name == "concurrency" else (
                replace(s, rpm=n) if name == "rpm" else replace(s, tpm=n))
        if name == "queue_share":
            f = float(value)
            if not 0 <= f <= 1:
                raise ValueError("a fraction from 0 to 1 (0: no limit)")
            return replace(s, queue_share=f)
    except ValueError as e:
        why = str(e) if " " in str(e) and "invalid literal" not in str(e) else "a number"
        raise KeysFileError(f"{where}: {name} must be {why}, got {value!r}") from None
    raise KeysFileError(f"{where}: unknown setting {name!r} (known: {', '.join(SETTINGS)})")


def parse(text: str, source: str = "the keys file") -> KeysFile:
    """Read a keys file's text; a bad line raises :class:`KeysFileError` naming it."""
    keys: dict[bytes, str] = {}
    tenants: dict[str, TenantSettings] = {}
    defaults: TenantSettings | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}, line {n}"
        key, *items = line.split()
        if key == "*":
            if defaults is not None:
                raise KeysFileError(f"{where}: a second '*' line (the defaults are set once)")
            s = TenantSettings()
            for item in items:
                s = _setting(where, s, item)
            if s.name != DEFAULT_TENANT:
                raise KeysFileError(f"{where}: the '*' line sets defaults; it takes no name=")
            defaults = s
            continue
        if key.partition("=")[0] in SETTINGS:  # a key may hold '=' (base64), not a setting's name before it
            raise KeysFileError(f"{where}: the line starts with a setting; it must start with the key")
        s = TenantSettings(name=key_name(key.encode()))
        for item in items:
            s = _setting(where, s, item)
        if key.encode() in keys:
            raise KeysFileError(f"{where}: this key is on an earlier line too")
        named_only = all(i.startswith("name=") for i in items)
        if s.name in tenants and not named_only:
            raise KeysFileError(f"{where}: the tenant {s.name!r} has its settings on an earlier line (a tenant's "
                                f"other keys give name= alone)")
        keys[key.encode()] = s.name
        if s.name not in tenants:
            tenants[s.name] = s
    if not keys:
        raise KeysFileError(f"{source} holds no key (one per line)")
    return KeysFile(keys, tenants, defaults or TenantSettings())


def load(path: str) -> KeysFile:
    """Read the keys file at ``path`` (:func:`parse`)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KeysFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    return parse(text, path)
