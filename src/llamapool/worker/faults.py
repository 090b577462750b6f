"""A request's own failure: what ends one request (not its worker), and a test-only fault injector.

The engine runs each sequence's own work (picking its token, detokenizing, stop strings, its matcher,
parsing tool calls) under :func:`request_failure`'s guard: an exception there ends that request with
``internal`` and a message naming the exception and where it was raised; the engine thread and every
other sequence go on.

``LLAMAPOOL_INJECT_FAULT`` (tests only; unset in production, where :meth:`FaultInjector.from_env` is
None and costs nothing) makes a worker fail the requests whose prompt text contains a marker:
``raise=MARK`` raises in the request's emit path (the guard must end only that request), and
``exit=MARK`` ends the worker process with exit 70 there, as a crash in native code would (the router
must not send that request to worker after worker); ``handover=N`` ends a draining worker with exit
70 once it has sent N parts of its host KV tier's handover (killed midway: the sibling must lose
nothing but those entries); ``load=SECONDS`` makes the worker wait that long before it loads its model (a
slow load, as an 8B model's on a GPU: a rolling reload must keep serving meanwhile). Several may be given,
separated by ``;``. Set it through ``[workers] env``
in a test's config.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llamapool.protocol.messages import ErrorCode, Failed

ENV = "LLAMAPOOL_INJECT_FAULT"
EXIT_CODE = 70  # as the engine thread's fail-stop (worker/server.py EXIT_ENGINE)


class InjectedFault(RuntimeError):
    """The fault ``raise=MARK`` injects."""


def request_failure(rid: int, e: BaseException) -> Failed:
    """The ``Failed`` that ends request ``rid`` after its own work raised ``e``: the exception and the
    innermost llamapool frame it came from (file and line), never the whole traceback."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "llamapool" in f.filename] or \
        traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        f = frames[-1]
        path = f.filename.split("llamapool/", 1)[-1]
        where = f" (at {path}:{f.lineno} in {f.name})"
    return Failed(rid, ErrorCode.INTERNAL, f"the worker failed on this request: {type(e).__name__}: {e}{where}; "
                                           f"the worker and its other requests go on", None)


@dataclass(frozen=True)
class FaultInjector:
    """The markers of ``LLAMAPOOL_INJECT_FAULT`` (see the module's docstring)."""

    raise_marker: str = ""
    exit_marker: str = ""
    handover_marker: str = ""  # N: the handover parts sent before the worker ends
    load_marker: str = ""  # SECONDS: the wait before the model loads

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FaultInjector | None:
        spec = env.get(ENV, "")
        if not spec:
            return None
        kw: dict[str, str] = {}
        for part in spec.split(";"):
            kind, _, marker = part.partition("=")
            if kind.strip() not in ("raise", "exit", "handover", "load") or not marker:
                raise ValueError(f"{ENV}: {part!r} is not raise=MARKER, exit=MARKER, handover=N or load=SECONDS")
            kw[f"{kind.strip()}_marker"] = marker
        return cls(**kw)

    def kind(self, prompt: Any) -> str:
        """``"raise"``, ``"exit"`` or ``""``: what a request with this prompt is made to do."""
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list):  # chat messages (a token prompt has no text)
            text = " ".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
        else:
            text = ""
        if self.exit_marker and self.exit_marker in text:
            return "exit"
        if self.raise_marker and self.raise_marker in text:
            return "raise"
        return ""

    def in_handover(self, sent: int) -> None:
        """After the ``sent``-th part of a handover: end the worker there if ``handover=N`` says so."""
        if self.handover_marker and sent >= int(self.handover_marker):
            os._exit(EXIT_CODE)

    @staticmethod
    def trigger(kind: str) -> None:
        """Do what ``kind`` says, in the request's emit path."""
        if kind == "exit":
            os._exit(EXIT_CODE)
        if kind == "raise":
            raise InjectedFault("fault injected into this request (LLAMAPOOL_INJECT_FAULT)")
