"""The HTTP gateway processes (``[http] processes`` of them) and the listening socket they all accept on
(``listener.py``): bound at start, handed to each gateway, switched at a reload without losing a queued
connection, closed when no gateway serves it any more.

A gateway is a child like a worker: :class:`~llamapool.supervisor.processes.Processes` spawns, reaps
and restarts it; what is the gateways' own is their set, the socket, and the reload's switch from the
old processes to the new ones.
"""

from __future__ import annotations

import asyncio
import time

from llamapool import log as logmod
from llamapool.supervisor.children import WorkerSlot, stop
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.listener import Listener
from llamapool.supervisor.processes import Processes
from llamapool.supervisor.runstate import RunState

LOG = logmod.Logger("supervisor")


class Gateways:
    def __init__(self, state: RunState, processes: Processes, enabled: bool = True) -> None:
        self.state = state
        self.processes = processes
        self.enabled = enabled  # llamapool node runs none (the router's host serves HTTP)
        self.slots: list[WorkerSlot] = []  # the gateway processes, old ones a reload retires included
        self.listener: Listener | None = None  # the socket that [http] listen names; new gateways accept on it
        self.listeners: list[Listener] = []  # it, and an old one that gateways a reload retires still accept on

    def bind(self) -> bool:
        """At start: the ``[http] listen`` socket, bound before anything else starts (False: it cannot be)."""
        http = self.state.cfg.http
        if http is None:
            return True
        try:
            self._listen(self._listener_for(http.listen))
        except OSError as e:
            LOG.error(f"FATAL: http.listen: cannot listen on {http.listen}: {e}")
            return False
        return True

    def start(self) -> None:
        """``[http] processes`` gateways, accepting on the current socket."""
        if not self.enabled or self.state.cfg.http is None or self.listener is None:
            return
        LOG.info(f"HTTP gateway: http://{self.listener.listen} ({self.state.cfg.http.processes} process(es))")
        self.slots = [WorkerSlot(f"http{i}", listener=self.listener) for i in range(self.state.cfg.http.processes)]
        for gw in self.slots:
            self.processes.start(gw)

    def failed(self) -> None:
        """A gateway failed for good: when every one that accepts on the socket has, close it, so that
        a client is refused at once rather than wait in its queue for ever (a reload binds it again)."""
        serving = [gw for gw in self.slots if gw.listener is self.listener and gw.state != State.STOPPED]
        if self.listener is not None and all(gw.state == State.FAILED for gw in serving):
            LOG.error(f"HTTP gateway: every gateway process failed: no longer listening on {self.listener.listen} "
                      f"until a reload")
            self.listener = None
            self._release_listeners()

    async def reload(self) -> None:
        """SIGHUP: start gateway processes with the new ``[http]`` next to the old ones, accepting on
        the same listening socket (a new one if ``[http] listen`` names another address), then let the
        old ones stop accepting and finish what they have: a connection the kernel has queued is
        accepted by a new one, never reset. If the new ones do not start, the old ones keep serving."""
        if not self.enabled:
            return
        was = self.listener
        http = self.state.cfg.http
        if http is None:  # [http] removed: the old gateways stop, and the socket with them
            self.listener = None
        else:
            try:
                listener = await asyncio.to_thread(self._listener_for, http.listen)
            except OSError as e:
                kept = f"the HTTP gateways keep serving on http://{was.listen} as they are" if was else \
                    "no HTTP gateway starts"
                LOG.error(f"reload: http.listen: cannot listen on {http.listen}: {e}; {kept}")
                return
            if self.state.stopping:  # a stop came meanwhile: it stops the gateways there are
                if listener is not was:
                    listener.close()
                return
            self._listen(listener)
        before = self.slots
        old = [gw for gw in before if gw.state != State.STOPPED]  # not those an earlier reload stops
        self.start()
        new = [gw for gw in self.slots if gw not in before]
        self.slots = new + before  # a stop during the switch reaches them all
        if not await self._started(new):
            return
        ok = all(gw.state == State.READY for gw in new)
        if not ok:
            LOG.info("reload: the new HTTP gateway processes did not start listening; the old ones keep serving")
            self.listener = was
        retired = old if ok else new
        for gw in retired:
            gw.state = State.STOPPED
        for closed in self._release_listeners():  # an old address: it closes as its last gateway stops accepting
            LOG.info(f"HTTP gateway: {closed.listen} closes as its old gateways stop accepting (they finish "
                     f"their requests)")
        await stop(retired, self.state.cfg.server.drain_timeout + 5)
        self.slots = [gw for gw in self.slots if gw not in retired]

    async def _started(self, new: list[WorkerSlot]) -> bool:
        """Wait up to 15 s for the new gateways to listen (or one to fail); False when a stop came meanwhile."""
        end = time.monotonic() + 15
        while time.monotonic() < end and not self.state.stopping and any(gw.state != State.READY for gw in new) \
                and not any(gw.state == State.FAILED for gw in new):
            await asyncio.sleep(0.05)
        return not self.state.stopping

    async def stop(self, grace: float) -> None:
        """The stop: stop accepting, finish what is in flight (within ``grace`` seconds); then SIGKILL.
        The listening socket closes as the last gateway stops accepting: new connections are refused."""
        self.listener = None
        for gw in self.slots:
            gw.state = State.STOPPED
        self._release_listeners()
        await stop(self.slots, grace)

    def _listener_for(self, listen: str) -> Listener:
        """The socket that ``listen`` names: the current one when it names its address, else one bound
        now (OSError if that fails). It may resolve a host name: a reload calls it in a thread."""
        if self.listener is not None and self.listener.serves(listen):
            return self.listener
        return Listener.bind(listen)

    def _listen(self, listener: Listener) -> None:
        """Make ``listener`` the socket new gateways accept on."""
        if listener not in self.listeners:
            self.listeners.append(listener)
        self.listener = listener

    def _release_listeners(self) -> list[Listener]:
        """Close the supervisor's copy of each socket that [http] no longer names and that no gateway
        is to accept on any more (the socket itself closes with the last gateway that holds it)."""
        keep = {id(gw.listener) for gw in self.slots if gw.state not in (State.STOPPED, State.FAILED)} | \
            {id(self.listener)}
        closed = [s for s in self.listeners if id(s) not in keep]
        for old in closed:
            self.listeners.remove(old)
            old.close()
        return closed
