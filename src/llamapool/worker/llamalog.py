"""llama.cpp's own log (and ggml's) through llamapool's logger, tagged with the worker.

llama.cpp writes its log through one callback (``llama_log_set``), in pieces: a line may come in
several calls, and ``GGML_LOG_LEVEL_CONT`` continues the previous piece's level. :class:`LlamaLog`
joins the pieces into lines and logs each one as ``llama.cpp: ...`` from the worker's logger:

- errors as errors;
- warnings (the loader's ``control-looking token``, ``using full-size SWA cache``: notes about the
  model file, not faults) only with ``log.level = "debug"``, where they show as warnings;
- info chatter at debug level (``log.level = "debug"`` shows the loader's report); llama.cpp's own
  debug lines (each tensor as it loads) never.

A line at a level the process does not log costs one comparison (the callback runs on the engine
thread). The ctypes callback must outlive every llama.cpp call: :func:`route_llama_logs` installs one
per process and keeps it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from llamapool import log as logmod

# ggml.h enum ggml_log_level
NONE, DEBUG, INFO, WARN, ERROR, CONT = range(6)
NEVER = 8  # below debug: not logged


def worker_name(argv: list[str] | None = None) -> str:
    """The worker's name from its command line (``python -m llamapool.worker SPEC_JSON``); "llama.cpp"
    in any other process (tests, ``llamapool bench --ceiling``)."""
    args = sys.argv if argv is None else argv
    try:
        name = json.loads(args[1]).get("name") if len(args) == 2 and args[1].startswith("{") else None
    except (ValueError, AttributeError):
        name = None
    return str(name) if name else "llama.cpp"


@dataclass
class LlamaLog:
    """Joins llama.cpp's log pieces into lines and logs them through ``log``."""

    log: logmod.Logger
    _pending: list[str] = field(default_factory=list)
    _level: int = INFO  # of the line being joined
    _lock: threading.Lock = field(default_factory=threading.Lock)
    callback: Any = None  # the ctypes function pointer llama.cpp holds

    def __post_init__(self) -> None:
        import llama_cpp as L

        self.callback = L.llama_log_callback(self._on_piece)

    def level_of(self, ggml_level: int) -> int:
        """The llamapool level (journal priority) of a llama.cpp line."""
        if ggml_level == ERROR:
            return logmod.LEVELS["error"]
        if ggml_level == WARN and self.log.enabled("debug"):
            return logmod.LEVELS["warning"]
        return logmod.LEVELS["debug"] if ggml_level != DEBUG else NEVER

    def _on_piece(self, level: int, text: bytes | None, _user: Any) -> None:
        try:
            self.piece(level, (text or b"").decode(errors="replace"))
        except Exception:  # an exception must not cross into C
            pass

    def piece(self, level: int, text: str) -> None:
        """One call of llama.cpp's callback: log each line it completes."""
        with self._lock:
            if level != CONT:
                if self._pending and level != self._level:  # a new line before the last one ended
                    self._flush()
                self._level = level
            if self.level_of(self._level) > logmod.settings.level:  # not logged: keep nothing
                self._pending.clear()
                return
            self._pending.append(text)
            if "\n" in text:
                self._flush()

    def _flush(self) -> None:
        lines = "".join(self._pending).split("\n")
        self._pending.clear()
        if lines[-1]:  # the start of the next line
            self._pending.append(lines[-1])
        for line in lines[:-1]:
            if line.strip():
                self.log.log(self.level_of(self._level), f"llama.cpp: {line.rstrip()}")


@functools.cache
def route_llama_logs(name: str = "") -> LlamaLog:
    """Send this process's llama.cpp log to llamapool's logger, as the worker ``name`` (default: from
    the command line); once per process (the cache keeps the callback alive)."""
    import llama_cpp as L

    who = name or worker_name()
    router = LlamaLog(logmod.Logger(who, prefix=f"llamapool worker {who}") if who != "llama.cpp" else
                      logmod.Logger("llama.cpp"))
    L.llama_log_set(router.callback, ctypes.c_void_p(0))
    return router
