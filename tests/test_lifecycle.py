"""The lifecycle table of supervised processes: every state change goes through it."""

from __future__ import annotations

import pytest

from llamapool.protocol import codec
from llamapool.protocol.control import COMMANDS, GpuRows, WorkerExited, WorkerInfo
from llamapool.supervisor.arbiter import WorkerSlot
from llamapool.supervisor.lifecycle import MOVES, IllegalMove, State


def test_a_worker_lives_through_the_allowed_moves() -> None:
    slot = WorkerSlot("cpu0")
    assert slot.state is State.STARTING
    for to in (State.READY, State.BACKOFF, State.STARTING, State.JOINING, State.READY, State.RETIRING, State.STOPPED):
        slot.state = to
        assert slot.state is to
    slot.state = "stopped"  # a string is taken as its state
    assert slot.state is State.STOPPED


@pytest.mark.parametrize("old, new", [(State.STOPPED, State.READY), (State.FAILED, State.READY),
                                      (State.BACKOFF, State.READY), (State.READY, State.STARTING)])
def test_a_move_outside_the_table_is_refused(old: State, new: State) -> None:
    slot = WorkerSlot("cpu0")
    slot.__dict__["state"] = old
    with pytest.raises(IllegalMove, match=f"cpu0: {old} -> {new}"):
        slot.state = new
    assert slot.state is old


def test_every_state_has_its_moves_and_an_unknown_state_is_refused() -> None:
    assert set(MOVES) == set(State)
    with pytest.raises(ValueError):
        WorkerSlot("cpu0").state = "sleeping"


def test_supervisor_commands_go_through_the_codec_typed() -> None:
    for cmd in (WorkerInfo("cpu0", {"state": "ready", "pid": 7}), WorkerExited("cpu0", 7, "signal SIGKILL"),
                GpuRows([{"index": 0, "uuid": "GPU-x"}])):
        assert codec.decode([codec.encode(cmd)], codec.COMMAND_TYPES) == cmd
    assert {c.TYPE for c in COMMANDS} == set(codec.COMMAND_TYPES)  # type: ignore[attr-defined]


def test_the_metrics_know_every_state() -> None:
    from llamapool.router.metrics import WORKER_STATES

    assert {s.value for s in State} <= set(WORKER_STATES)


def test_a_childs_report_is_a_typed_line_apart_from_its_log() -> None:
    from llamapool.protocol.control import ChildReport

    line = codec.report_line(ChildReport("live", 1.5))
    assert "\n" not in line
    assert codec.read_report(f"<3>{line}\n".encode()) == ChildReport("live", 1.5)
    for not_a_report in (b"llamapool gateway http0: listening on http://127.0.0.1:8000",
                         b"\x1ellamapool-report not-base64!", codec.report_line(ChildReport("dancing")).encode()):
        assert codec.read_report(not_a_report) is None
