"""How work leaves the pool without being lost: a worker's drain, and the whole pool's at SIGTERM.

A worker leaves in one of two ways, both through :meth:`Drainer.let_go`: it is **retired** (its model
left the config at a reload, the policy evicts or scales it down, an operator unloads it: it finishes
its requests and what is queued for its model, exits, and is forgotten) or **replaced** (a reload's
new settings for a model that stays: it finishes what it runs, exits, and a successor starts on the
same device). ``let_go`` is the one place where a step before a ready worker's exit belongs (e.g. handing
its sessions' KV cache to a sibling): it runs while the worker is ``retiring``, routed nothing new, and
is bounded by the worker's grace.

At SIGTERM the router drains the pool (:meth:`Drainer.pool`): it refuses new requests and lets those in
flight finish within ``server.drain_timeout``, then cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib

from llamapool import log as logmod
from llamapool.protocol.control import CancelAll, ForgetWorker, RetireWorker, StartDrain
from llamapool.supervisor.children import WorkerSlot, until_reaped
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.processes import Processes
from llamapool.supervisor.runstate import RunState

LOG = logmod.Logger("supervisor")


class Drainer:
    def __init__(self, state: RunState, processes: Processes) -> None:
        self.state = state
        self.processes = processes
        self.drained = asyncio.Event()  # the router has no request left in flight (its Drained event)

    # ------------------------------------------------------------ one worker

    async def let_go(self, slot: WorkerSlot, grace: float) -> None:
        """End the slot's process: a ready worker is told to finish what it runs (RetireWorker) and has
        ``grace`` seconds before SIGKILL; one not ready yet is killed now. Returns once it is reaped."""
        proc = slot.proc
        if proc is None:
            return
        if slot.state == State.READY:
            slot.state = State.RETIRING
            self.state.publish(slot)
            self.state.command(RetireWorker(slot.name))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        else:
            slot.state = State.STOPPED
        with contextlib.suppress(ProcessLookupError):
            if proc.returncode is None:
                proc.kill()
        await proc.wait()
        await until_reaped(slot)

    async def retire(self, slot: WorkerSlot) -> None:
        """A worker that leaves the pool: it finishes its requests (and, when its model left, what is
        queued for that model), then exits; then it is forgotten."""
        server = self.state.cfg.server
        await self.let_go(slot, server.drain_timeout + server.queue_timeout)
        slot.state = State.STOPPED
        if slot in self.state.slots:
            self.state.slots.remove(slot)
        self.state.command(ForgetWorker(slot.name))
        LOG.info(f"{slot.name}: retired")

    async def replace(self, slot: WorkerSlot) -> None:
        """A worker of a model that stays: its process finishes what it runs and exits, then a new
        one starts on the same device with the model's new settings (``slot``'s, as the reload set them)."""
        await self.let_go(slot, self.state.cfg.server.drain_timeout)
        slot.streak, slot.reason = 0, None
        slot.deaths.clear()
        self.processes.start(slot)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(slot.ready_event.wait(), self.state.cfg.workers.start_timeout)

    # ------------------------------------------------------------ the whole pool (SIGTERM)

    async def pool(self) -> None:
        """The router refuses new work and lets what is in flight finish within ``server.drain_timeout``;
        then what is left is cancelled. The gateways keep listening meanwhile: their /ready says 503 at
        once, /health 200, and a new request gets the router's refusal."""
        self.state.command(StartDrain())
        try:
            await asyncio.wait_for(self.drained.wait(), self.state.cfg.server.drain_timeout)
        except TimeoutError:
            LOG.warning("drain timeout: cancelling what is left")
            self.state.command(CancelAll())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained.wait(), 5)
