"""The process lifecycle of every child, a worker or a gateway alike (gunicorn's ``spawn_worker`` /
``reap_workers``): start, read its output, reap it, and restart one that died after a back-off that
doubles with each death in a row, or fail it for good (a permanent error, flapping).

:class:`Processes` knows nothing of what a child runs or means: the arbiter gives it ``launch`` (what
a slot's process runs), ``on_line`` (one line of its output) and ``on_death`` (an exit nobody asked
for, which the arbiter hands to the placement of a managed model or back to :meth:`Processes.after_death`).
Every change of a slot's state is checked against ``lifecycle.py``'s table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from llamapool import log as logmod
from llamapool.protocol.control import WorkerExited
from llamapool.supervisor import lifecycle
from llamapool.supervisor.children import Launch, WorkerSlot, exit_text, spawn
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.runstate import RunState
from llamapool.worker.server import EXIT_PERMANENT

LOG = logmod.Logger("supervisor")


class Processes:
    def __init__(self, state: RunState, launch: Callable[[WorkerSlot], Launch],
                 on_line: Callable[[WorkerSlot, bytes], object],
                 on_death: Callable[[WorkerSlot, int, int, str], None]) -> None:
        self.state = state
        self.launch = launch
        self.on_line = on_line
        self.on_death = on_death  # (slot, pid, exit code, how it ended)

    def start(self, slot: WorkerSlot) -> None:
        """Spawn a process for ``slot``, a worker or a gateway: the one way a child starts."""
        if not slot.is_worker and self.state.cfg.http is None:  # a reload removed [http]
            return
        slot.state, slot.kill_reason = State.STARTING, None
        slot.live_at = slot.busy_for = 0.0
        slot.ready_event.clear()
        self.state.spawn(self._run(slot))

    async def _run(self, slot: WorkerSlot) -> None:
        """One child process from spawn to reap: its output line by line, then its exit."""
        proc = await spawn(self.launch(slot))
        slot.proc, slot.started_at = proc, time.monotonic()
        self.state.publish(slot)
        LOG.info(f"{slot.name}: started pid {proc.pid}" + (f" on {slot.device}" if slot.is_worker else ""))
        assert proc.stdout is not None
        async for raw in proc.stdout:
            self.on_line(slot, raw)
        self._reaped(slot, proc, await proc.wait())

    def _reaped(self, slot: WorkerSlot, proc: asyncio.subprocess.Process, code: int) -> None:
        """A child exited: the router hears of a worker's exit; a child that was to stop is stopped,
        any other goes to ``on_death``."""
        how = exit_text(code, slot.kill_reason)
        slot.last_exit, slot.proc = how, None
        if slot.is_worker:
            self.state.command(WorkerExited(slot.name, proc.pid, how))
            if self.state.kv_events is not None:  # its KV is gone: its blocks are removed
                self.state.kv_events.worker_gone(f"{slot.name}:{proc.pid}")
        if slot.state in (State.RETIRING, State.STOPPED) or self.state.stopping:
            LOG.info(f"{slot.name}: pid {proc.pid} exited ({how})")
            if slot.state == State.RETIRING:
                slot.state = State.STOPPED
            self.state.publish(slot)
            return
        self.on_death(slot, proc.pid, code, how)

    def after_death(self, slot: WorkerSlot, pid: int, code: int, how: str) -> bool:
        """An unexpected exit of a worker or a gateway: FAILED for good (a permanent error, or flapping:
        True), else BACKOFF and a restart after a delay that doubles with each death in a row."""
        now = time.monotonic()
        reason = lifecycle.restart_reason(code, slot.kill_reason)
        slot.exits[reason] = slot.exits.get(reason, 0) + 1
        slot.deaths.append(now)
        w = self.state.cfg.workers
        if code == EXIT_PERMANENT:
            fatal = [ln for ln in slot.log if "FATAL" in ln]
            slot.state, slot.reason = State.FAILED, (fatal[-1] if fatal else how)
        elif sum(1 for t in slot.deaths if now - t < w.flap_window) > w.flap_limit:
            slot.state = State.FAILED
            slot.reason = f"flapping: died more than {w.flap_limit} times in {w.flap_window:g}s; last: {how}"
        else:
            if slot.ready_at and now - slot.ready_at > w.restart_backoff_max:
                slot.streak = 0
            delay = min(w.restart_backoff * 2**slot.streak, w.restart_backoff_max)
            slot.streak += 1
            slot.state = State.BACKOFF
            LOG.warning(f"{slot.name}: pid {pid} died ({how}); restarting in {delay:g}s")
            self.state.spawn(self._restart_later(slot, delay))
            return False
        LOG.error(f"{slot.name}: FAILED, not restarting: {slot.reason}")
        return True

    async def _restart_later(self, slot: WorkerSlot, delay: float) -> None:
        await asyncio.sleep(delay)
        if slot.state == State.BACKOFF and not self.state.stopping:
            slot.restarts += 1
            self.start(slot)
