"""The pool's readiness as systemd and the log hear it: READY=1 once ``server.min_ready_workers`` workers
are ready (a line for each worker as it comes), a STATUS line on each count, EXTEND_TIMEOUT while the
first ones load, and why every worker failed when all have.
"""

from __future__ import annotations

from llamapool import log as logmod
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.runstate import RunState
from llamapool.supervisor.sdnotify import Notifier

LOG = logmod.Logger("supervisor")


class Readiness:
    def __init__(self, state: RunState, notify: Notifier) -> None:
        self.state = state
        self.notify = notify
        self.announced = False  # READY=1 was sent
        self.ever = False  # a worker was ready at least once since start
        self.workers = 0  # ready workers, as the router last counted them
        self.queued = 0

    @property
    def needed(self) -> int:
        """Ready workers for READY=1 (``server.min_ready_workers``, at most all of them)."""
        return min(self.state.cfg.server.min_ready_workers, len(self.state.slots))

    def counted(self, ready: int, queued: int) -> None:
        """The router's count of ready workers and queued requests: READY=1 when it first reaches
        :attr:`needed`, and a STATUS line."""
        self.workers, self.queued = ready, queued
        if not self.announced and self.workers >= self.needed:
            self.announced = True
            LOG.info(f"ready (READY=1): {self.workers} of {len(self.state.slots)} local worker(s) ready "
                     f"(server.min_ready_workers = {self.state.cfg.server.min_ready_workers})")
            self.notify.ready()  # after the line: in the journal it comes before systemd's "Started"
        self.notify.status(f"{self.workers} workers ready, {self.queued} queued")

    def worker_ready(self) -> None:
        """A worker became ready: said in the log as it comes, except the one that the READY=1 line is
        about to announce."""
        self.ever = True
        n = sum(1 for s in self.state.slots if s.state == State.READY)
        if self.announced or n < self.needed:
            LOG.info(f"ready: {n} of {len(self.state.slots)} local workers")

    def all_failed(self, even_after_ready: bool) -> str | None:
        """Why every worker has failed for good, when every one has (and none was ever ready, unless
        ``even_after_ready``); None otherwise."""
        slots = self.state.slots
        if (self.ever and not even_after_ready) or not slots or not all(s.state == State.FAILED for s in slots):
            return None
        return "; ".join(sorted({str(s.reason) for s in slots}))

    def tick(self) -> None:
        """Each second: while every worker has failed, say why; until READY=1, ask systemd for more time."""
        slots = self.state.slots
        if slots and all(slot.state == State.FAILED for slot in slots):
            self.notify.status("every worker failed: " + "; ".join(sorted({str(s.reason) for s in slots})))
        elif not self.announced:
            self.notify.extend_timeout(10)
