"""The lifecycle of a supervised process (a worker, a node's worker, a gateway): one table of states
and the moves allowed between them. ``WorkerSlot.state`` goes through ``move``, which refuses any
other move, so the table is what the code does (docs/architecture.md draws it).

    starting --loaded (node)--> joining --joined--> ready
    starting --hello / listening--> ready --retire (reload)--> retiring --exit--> stopped
    starting | joining | ready | retiring --exit--> backoff --delay--> starting
    any --permanent error, flapping, GPU lost--> failed
    any --stop--> stopped
    stopped | failed --reload (a successor on the same device)--> starting
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    STARTING = "starting"  # spawned, loading its model (start_timeout runs)
    JOINING = "joining"  # a node's worker: loaded, waiting for the remote router to accept it
    READY = "ready"  # serving (a worker said hello; a gateway is listening)
    BACKOFF = "backoff"  # died; restarts after a delay that doubles with each death in a row
    RETIRING = "retiring"  # replaced by a reload: finishes what it runs, then exits
    FAILED = "failed"  # for good: a permanent error, flapping, its GPU lost; not restarted
    STOPPED = "stopped"  # the daemon stops, or a reload removed it


_ALIVE = frozenset({State.STARTING, State.JOINING, State.READY, State.RETIRING})
MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.STARTING, State.JOINING, State.READY, State.RETIRING, State.BACKOFF,
                               State.FAILED, State.STOPPED}),
    State.JOINING: frozenset({State.READY, State.RETIRING, State.BACKOFF, State.FAILED, State.STOPPED}),
    State.READY: frozenset({State.RETIRING, State.BACKOFF, State.FAILED, State.STOPPED}),
    State.RETIRING: frozenset({State.STOPPED, State.BACKOFF, State.FAILED}),
    State.BACKOFF: frozenset({State.STARTING, State.FAILED, State.STOPPED}),
    State.FAILED: frozenset({State.FAILED, State.STOPPED, State.STARTING}),  # a reload tries it again
    State.STOPPED: frozenset({State.STOPPED, State.STARTING}),  # a reload's successor on the same device
}


class IllegalMove(RuntimeError):
    """A move the table does not allow: a bug in the supervisor."""


def move(name: str, old: State | None, new: str) -> State:
    """The state ``new`` for the process ``name`` in state ``old`` (None: just created), checked."""
    to = State(new)
    if old is not None and to not in MOVES[old]:
        raise IllegalMove(f"{name}: {old} -> {to} is not an allowed move (allowed: "
                          f"{', '.join(sorted(MOVES[old])) or 'none'})")
    return to


def alive(state: State) -> bool:
    """Whether a process in ``state`` is running (or about to)."""
    return state in _ALIVE


def restart_reason(code: int, kill_reason: str | None) -> str:
    """The fixed label of a worker's unexpected exit (``llamapool_worker_restarts_total{reason}``, one of
    router.metrics.RESTART_REASONS): why the supervisor killed it, else how it ended."""
    k = (kill_reason or "").lower()
    if "heartbeat" in k:
        return "heartbeat"
    if "step" in k:
        return "step_timeout"
    if "start_timeout" in k:
        return "start_timeout"
    if "gpu lost" in k:
        return "gpu_lost"
    return "signal" if code < 0 else "exit"
