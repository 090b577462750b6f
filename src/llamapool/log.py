"""One log line per event, as text (``llamapool: ...``) or JSON, with journald priorities.

Every process of the daemon logs through :class:`Logger`. The supervisor's stderr is the
service's log; workers and gateways write to a pipe that the supervisor reads and re-emits.

- ``[log] format = "text"`` (default): ``llamapool: msg key=value ...`` (a worker's lines:
  ``llamapool worker cpu0: ...``, forwarded by the supervisor as ``[cpu0] llamapool worker cpu0: ...``).
- ``format = "json"``: one JSON object a line: ``ts`` (ISO 8601 UTC), ``level``, ``component``
  (``supervisor``, ``router``, a worker's or gateway's name), ``msg``, then the event's fields.
- When stderr is the journal (systemd sets ``JOURNAL_STREAM`` to its device:inode), each line
  starts with its syslog priority, ``<3>`` error ... ``<7>`` debug, which journald's default
  ``SyslogLevelPrefix=yes`` turns into the entry's PRIORITY.
- Child processes always write the ``<N>`` prefix (``LLAMAPOOL_LOG_CHILD=1``); the supervisor
  strips it and re-emits the line at the child's level (:func:`split_priority`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

LEVELS = {"debug": 7, "info": 6, "warning": 4, "error": 3}
NAMES = {v: k for k, v in LEVELS.items()}
FORMATS = ("text", "json")
ENV_FORMAT, ENV_LEVEL, ENV_CHILD = "LLAMAPOOL_LOG_FORMAT", "LLAMAPOOL_LOG_LEVEL", "LLAMAPOOL_LOG_CHILD"


def journald_stream(env: Mapping[str, str] = os.environ, fd: int = 2) -> bool:
    """True when ``fd`` is the journal stream systemd connected (``JOURNAL_STREAM=dev:ino``)."""
    value = env.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(fd)
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (ValueError, OSError):
        return False


class _Settings:
    def __init__(self) -> None:
        self.configure_from_env(os.environ)

    def configure_from_env(self, env: Mapping[str, str]) -> None:
        self.format = env.get(ENV_FORMAT, "text") if env.get(ENV_FORMAT) in FORMATS else "text"
        self.level = LEVELS.get(env.get(ENV_LEVEL, "info"), LEVELS["info"])
        self.prefix = env.get(ENV_CHILD) == "1" or journald_stream(env)


settings = _Settings()


def configure(format: str = "text", level: str = "info", env: Mapping[str, str] = os.environ) -> None:
    """Set this process's format and level; the journal prefix follows ``JOURNAL_STREAM``."""
    settings.format = format if format in FORMATS else "text"
    settings.level = LEVELS.get(level, LEVELS["info"])
    settings.prefix = env.get(ENV_CHILD) == "1" or journald_stream(env)


def child_env(format: str, level: str) -> dict[str, str]:
    """The variables that make a child process log like this one, for the supervisor to read."""
    return {ENV_FORMAT: format, ENV_LEVEL: level, ENV_CHILD: "1"}


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".") if v == v else "nan"
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


def format_line(level: int, component: str, prefix: str, msg: str, fields: Mapping[str, Any],
                fmt: str | None = None) -> str:
    """One line without the journal prefix: text ``{prefix}: msg k=v`` or a JSON object."""
    if (fmt or settings.format) == "json":
        now = time.time()
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        obj: dict[str, Any] = {"ts": ts, "level": NAMES.get(level, "info"), "component": component, "msg": msg}
        for k, v in fields.items():
            obj.setdefault(k, v)
        return json.dumps(obj, default=str, ensure_ascii=False)
    tail = "".join(f" {k}={_value(v)}" for k, v in fields.items() if v is not None)
    return f"{prefix}: {msg}{tail}"


def emit(level: int, body: str, stream: TextIO | None = None) -> None:
    """Write one already formatted line, with ``<N>`` when stderr is the journal or a supervisor pipe."""
    if level > settings.level:
        return
    line = body.replace("\n", " ")
    if settings.prefix:
        line = f"<{level}>{line}"
    out = stream or sys.stderr
    try:
        out.write(line + "\n")
        out.flush()
    except (OSError, ValueError):
        pass


def split_priority(line: str, default: int = LEVELS["info"]) -> tuple[int, str]:
    """``"<4>text"`` -> ``(4, "text")``; a line without the prefix gets ``default``."""
    if len(line) >= 3 and line[0] == "<" and line[2] == ">" and line[1].isdigit():
        return int(line[1]), line[3:]
    return default, line


def parse_json_line(body: str) -> dict[str, Any] | None:
    """A child's JSON log line as a dict, or None when the line is not one."""
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class Logger:
    """``Logger("router").info("access", id=..., outcome="ok")``: one line per call."""

    __slots__ = ("component", "prefix")

    def __init__(self, component: str, prefix: str = "llamapool") -> None:
        self.component = component
        self.prefix = prefix

    def enabled(self, level: str) -> bool:
        return LEVELS[level] <= settings.level

    def log(self, level: int, msg: str, **fields: Any) -> None:
        if level <= settings.level:
            emit(level, format_line(level, self.component, self.prefix, msg, fields))

    def debug(self, msg: str, **fields: Any) -> None:
        self.log(7, msg, **fields)

    def info(self, msg: str, **fields: Any) -> None:
        self.log(6, msg, **fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self.log(4, msg, **fields)

    def error(self, msg: str, **fields: Any) -> None:
        self.log(3, msg, **fields)
