"""The supervisor's child processes, workers and gateways alike: the slot that a succession of processes
serves, how one is spawned, how its output is relayed, how it is stopped and reaped.

What differs between a worker and a gateway is only what :class:`Launch` runs (``launch.py``);
``processes.py`` spawns, reads, reaps and restarts both the same way (gunicorn's ``spawn_worker`` /
``reap_workers``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from llamapool import log as logmod
from llamapool.config import ModelConfig
from llamapool.protocol import codec, control
from llamapool.supervisor import gpus as gpumod
from llamapool.supervisor import lifecycle
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.listener import Listener

LOG_LINES = 40
KILL_GRACE = 2.0  # seconds between SIGABRT and SIGKILL for a hung child
LOG = logmod.Logger("supervisor")


@dataclass(eq=False)
class WorkerSlot:
    """A worker's device (a GPU, a group of GPUs, or a CPU share) of one model, or a gateway (no
    model), and the succession of processes that serve it."""

    name: str
    gpus: tuple[gpumod.Gpu, ...] = ()
    model: ModelConfig | None = None  # None for a gateway process
    state: State = State.STARTING  # every change goes through lifecycle.move (see __setattr__)
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    ready_at: float = 0.0
    restarts: int = 0
    streak: int = 0  # deaths in a row, for the backoff
    deaths: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=64))
    last_exit: str | None = None
    reason: str | None = None
    kill_reason: str | None = None
    log: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=LOG_LINES))
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    exits: dict[str, int] = field(default_factory=dict)  # unexpected exits by reason (metrics)
    live_at: float = 0.0  # a node's worker: when its last liveness report came (llamapool node)
    busy_for: float = 0.0  # ... and how long its running engine step had taken then
    listener: Listener | None = None  # a gateway: the supervisor's listening socket it accepts from

    def __setattr__(self, key: str, value: object) -> None:
        if key == "state":  # the one transition check (supervisor/lifecycle.py)
            value = lifecycle.move(self.name, self.__dict__.get("state"), str(value))
        object.__setattr__(self, key, value)

    @property
    def is_worker(self) -> bool:
        return self.model is not None

    @property
    def gpu(self) -> gpumod.Gpu | None:
        """The (first) GPU, None for a CPU worker."""
        return self.gpus[0] if self.gpus else None

    @property
    def device(self) -> str:
        """"cpu", or the GPUs' UUIDs joined by "," (the worker's CUDA_VISIBLE_DEVICES)."""
        return ",".join(g.uuid for g in self.gpus) if self.gpus else "cpu"

    def info(self) -> dict[str, Any]:
        return {
            "id": self.name, "pid": self.proc.pid if self.proc else None, "device": self.device,
            "state": self.state.value, "restarts": self.restarts, "last_exit": self.last_exit,
            "reason": self.reason, "log_tail": list(self.log)[-10:],
            "gpu_index": self.gpu.index if self.gpu else None, "exits": dict(self.exits),
            "gpu_indices": [g.index for g in self.gpus], "model": self.model.name if self.model else None,
        }


@dataclass(frozen=True, slots=True)
class Launch:
    """What one child process runs: ``python -m module spec`` in ``env``, with ``pass_fds`` open."""

    module: str  # llamapool.worker | llamapool.gateway
    spec: str  # its spec, as JSON
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()  # a gateway: the listening socket, at the same number (its spec names it)


async def spawn(launch: Launch) -> asyncio.subprocess.Process:
    """Start a child in a session of its own, its stdout and stderr one pipe to the supervisor."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", launch.module, launch.spec, env=launch.env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        pass_fds=launch.pass_fds,
    )


def exit_text(code: int, kill_reason: str | None = None) -> str:
    """How a child ended, for the log and ``status``: ``exit code 1``, ``signal SIGKILL (killed: ...)``."""
    how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    return f"{how} (killed: {kill_reason})" if kill_reason else how


def read_line(slot: WorkerSlot, raw: bytes, json_format: bool) -> control.ChildReport | str:
    """One line of a child's output: its report (protocol/control.py ChildReport), or else the line
    re-emitted at its level and kept in the slot's log tail (the message is returned)."""
    report = codec.read_report(raw)
    if report is not None:
        return report
    line = raw.decode(errors="replace").rstrip()
    # a line without the <N> prefix: a library's own (uvicorn's "ERROR: ...", llama.cpp, a traceback)
    if "FATAL" in line or "Traceback" in line or line.startswith(("ERROR:", "CRITICAL:")):
        unprefixed = logmod.LEVELS["error"]
    elif line.startswith("WARNING:"):
        unprefixed = logmod.LEVELS["warning"]
    else:
        unprefixed = logmod.LEVELS["info"]
    level, body = logmod.split_priority(line, unprefixed)
    if json_format:
        obj = logmod.parse_json_line(body)
        if obj is None:  # native output (llama.cpp, a Python traceback): wrap it
            msg, out = body, logmod.format_line(level, slot.name, "", body, {})
        else:
            msg, out = str(obj.get("msg", body)), body
    else:
        msg, out = body, f"[{slot.name}] {body}"
    slot.log.append(msg)
    logmod.emit(level, out)
    return msg


def signal_all(slots: list[WorkerSlot], sig: signal.Signals) -> None:
    for slot in slots:
        if slot.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                slot.proc.send_signal(sig)


async def reap_by(slots: list[WorkerSlot], deadline: float) -> None:
    """Wait for the slots' processes to exit until ``deadline``; SIGKILL those that do not."""
    for slot in slots:
        proc = slot.proc
        if proc is None:
            continue
        try:
            await asyncio.wait_for(proc.wait(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def stop(slots: list[WorkerSlot], grace: float) -> None:
    """Each child is ``stopped`` for good and gets SIGTERM (it finishes what it has and exits); those
    still running after ``grace`` seconds get SIGKILL."""
    for slot in slots:
        slot.state = State.STOPPED
    signal_all(slots, signal.SIGTERM)
    await reap_by(slots, time.monotonic() + grace)


async def kill(slot: WorkerSlot, pid: int, why: str) -> None:
    """SIGABRT (a core and a stack for the evidence), then SIGKILL after :data:`KILL_GRACE`."""
    proc = slot.proc
    if proc is None or proc.pid != pid or proc.returncode is not None:
        return
    slot.kill_reason = why
    LOG.warning(f"{slot.name}: killing pid {pid}: {why}")
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGABRT)
        proc.send_signal(signal.SIGCONT)
    try:
        await asyncio.wait_for(proc.wait(), KILL_GRACE)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


async def until_reaped(slot: WorkerSlot) -> None:
    """Wait until the slot's reaper has run (its ``proc`` is cleared)."""
    while slot.proc is not None:
        await asyncio.sleep(0.05)
