"""What the supervisor's parts share for one run of the daemon: the config in force, the worker slots,
whether the daemon is stopping, the one channel of commands to the router, and the background tasks
that a stop waits for.

The arbiter makes one :class:`RunState` and hands it to each part (processes, placement, drain, reload,
gateways); the parts read it as they act, so a reload that replaces the config or the slots is seen by
all of them at once, and none of them holds the arbiter itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from llamapool.config import Config
from llamapool.protocol import control
from llamapool.protocol.control import WorkerInfo
from llamapool.supervisor.children import WorkerSlot


class RunState:
    def __init__(self, cfg: Config, command: Callable[[control.Command], None]) -> None:
        self.cfg = cfg  # a reload replaces it
        self.slots: list[WorkerSlot] = []  # the workers (gateways are the Gateways' own)
        self.stopping = False  # a drain or a fast stop is under way: nothing new starts
        self.command = command  # to the router thread (llamapool node: handled in the process)
        self.kv_events: Any = None  # [kv_events]: the pod's KV-cache event publisher (supervisor/kvevents.py)
        self._tasks: set[asyncio.Task[Any]] = set()

    def publish(self, slot: WorkerSlot) -> None:
        """A worker's row to the router's ``status`` (a gateway has none)."""
        if slot.is_worker:
            self.command(WorkerInfo(slot.name, slot.info()))

    def slot(self, name: str) -> WorkerSlot | None:
        return next((s for s in self.slots if s.name == name), None)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background; :meth:`settle` waits for what is left of it at the stop."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout: float) -> None:
        """Give each background task still running up to ``timeout`` seconds to end."""
        for task in list(self._tasks):
            if not task.done():
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), timeout)
