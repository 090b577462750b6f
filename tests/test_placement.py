"""The placement policy (supervisor/placement.py), without processes: tables of pool states and the
actions they call for, one block per rule of the module docstring, then properties and a simulation."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamapool.supervisor.placement import (
    Action,
    DeviceView,
    Drain,
    ModelView,
    Refuse,
    ReplicaView,
    Settings,
    Start,
    plan,
)

GB = 1 << 30
NOW = 1000.0
OLD = NOW - 600  # a replica started long ago: past min_residency


def M(name: str, need: float = 4, **kw: Any) -> ModelView:
    """A model needing ``need`` GiB."""
    return ModelView(name, int(need * GB), **kw)


def R(worker: str, model: str, device: str = "d0", state: str = "ready", active: int = 0, since: float = OLD,
      idle_since: float | None = OLD) -> ReplicaView:
    return ReplicaView(worker, model, device, state, active, since, None if active else idle_since)  # type: ignore[arg-type]


def D(id: str, free: float, total: float = 10, draining: float = 0) -> DeviceView:
    return DeviceView(id, int(free * GB), int(total * GB), int(draining * GB))


def brief(actions: list[Action]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for a in actions:
        if isinstance(a, Start):
            out.append(("start", a.model, a.device))
        elif isinstance(a, Drain):
            out.append(("evict" if a.evict else "drain", a.worker))
        else:
            out.append(("refuse", a.model))
    return out


Row = tuple[str, list[ModelView], list[ReplicaView], list[DeviceView], list[tuple[str, ...]]]

DEMAND: list[Row] = [  # rule 1
    ("a queued model with no replica starts", [M("a", queued=1)], [], [D("d0", 10)], [("start", "a", "d0")]),
    ("best fit: the device left with the least free", [M("a", queued=1)], [], [D("d0", 10), D("d1", 5)],
     [("start", "a", "d1")]),
    ("a device that cannot fit it now is skipped", [M("a", queued=1)], [], [D("d0", 3), D("d1", 9)],
     [("start", "a", "d1")]),
    ("an idle model with no floor is not started", [M("a")], [], [D("d0", 10)], []),
    ("a loading replica counts: no second start", [M("a", queued=3, oldest_wait=9)],
     [R("w1", "a", state="loading", since=NOW - 1)], [D("d0", 10)], []),
    ("always: a floor of 1 even with min_replicas 0", [M("a", load="always")], [], [D("d0", 10)],
     [("start", "a", "d0")]),
    ("the floor is reached in one call, spread first, then best fit",
     [M("a", load="always", min_replicas=3, max_replicas=3)], [], [D("d0", 10), D("d1", 10)],
     [("start", "a", "d0"), ("start", "a", "d1"), ("start", "a", "d0")]),
    ("spread: a device without a replica of the model beats a tighter fit",
     [M("a", min_replicas=2, max_replicas=2)], [R("w1", "a", "d1", active=1)], [D("d0", 10), D("d1", 5)],
     [("start", "a", "d0")]),
    ("only its allowed devices", [M("a", queued=1, devices=("d1",))], [], [D("d0", 10), D("d1", 9)],
     [("start", "a", "d1")]),
    ("a draining replica does not count", [M("a", queued=1)], [R("w1", "a", state="draining")], [D("d0", 10)],
     [("start", "a", "d0")]),
]

NO_FIT: list[Row] = [  # rule 2 and refusals
    ("draining memory will fit it: wait, evict nothing", [M("a", queued=1), M("b", last_used=1)],
     [R("w1", "b")], [D("d0", 2, draining=3)], []),
    ("evict the least recently used idle model, only as much as needed",
     [M("a", queued=1), M("b", last_used=100), M("c", last_used=500)], [R("wb", "b"), R("wc", "c")],
     [D("d0", 2)], [("evict", "wb")]),
    ("evict two when one is not enough",
     [M("a", 8, queued=1), M("b", last_used=100), M("c", last_used=500)], [R("wb", "b"), R("wc", "c")],
     [D("d0", 2)], [("evict", "wb"), ("evict", "wc")]),
    ("not enough evictable memory: evict nothing",
     [M("a", 9, queued=1), M("b", last_used=100), M("c", last_used=500)], [R("wb", "b"), R("wc", "c", active=1)],
     [D("d0", 2)], []),
    ("never a busy replica", [M("a", queued=1), M("b")], [R("wb", "b", active=1)], [D("d0", 2)], []),
    ("never a model with requests queued", [M("a", queued=1), M("b", queued=1)], [R("wb", "b")], [D("d0", 2)], []),
    ("never a pinned model", [M("a", queued=1), M("b", pinned=True)], [R("wb", "b")], [D("d0", 2)], []),
    ("never an always model at its floor", [M("a", queued=1), M("b", load="always", min_replicas=1)],
     [R("wb", "b")], [D("d0", 2)], []),
    ("never an on_demand model at its min_replicas", [M("a", queued=1), M("b", min_replicas=1)],
     [R("wb", "b")], [D("d0", 2)], []),
    ("an always model above its floor gives up a replica",
     [M("a", queued=1), M("b", load="always", min_replicas=1, max_replicas=2)],
     [R("wb1", "b", idle_since=NOW - 10), R("wb2", "b", since=OLD + 1, idle_since=NOW - 10)], [D("d0", 2)],
     [("evict", "wb1")]),
    ("never within min_residency", [M("a", queued=1), M("b")], [R("wb", "b", since=NOW - 10)], [D("d0", 2)], []),
    ("a model loaded again within min_residency of its eviction is evicted last (hysteresis)",
     [M("a", queued=1), M("b", last_used=100, evicted_at=OLD - 5), M("c", last_used=500)],
     [R("wb", "b"), R("wc", "c")], [D("d0", 2)], [("evict", "wc")]),
    ("... on whichever device: the other device's victim, though used later",
     [M("a", queued=1), M("b", last_used=100, evicted_at=OLD - 5), M("c", last_used=500)],
     [R("wb", "b", "d0"), R("wc", "c", "d1")], [D("d0", 2), D("d1", 2)], [("evict", "wc")]),
    ("... but evicted when no other will do",
     [M("a", 8, queued=1), M("b", last_used=100, evicted_at=OLD - 5), M("c", last_used=500)],
     [R("wb", "b"), R("wc", "c")], [D("d0", 2)], [("evict", "wc"), ("evict", "wb")]),
    ("an eviction longer ago than min_residency before its load is no rebound: LRU",
     [M("a", queued=1), M("b", last_used=100, evicted_at=OLD - 31), M("c", last_used=500)],
     [R("wb", "b"), R("wc", "c")], [D("d0", 2)], [("evict", "wb")]),
    ("never a loading replica", [M("a", queued=1), M("b")], [R("wb", "b", state="loading")], [D("d0", 2)], []),
    ("the device whose victims were used longest ago",
     [M("a", queued=1), M("b", last_used=100), M("c", last_used=50)], [R("wb", "b", "d0"), R("wc", "c", "d1")],
     [D("d0", 2), D("d1", 2)], [("evict", "wc")]),
    ("only on an allowed device",
     [M("a", queued=1, devices=("d0",)), M("b", last_used=100), M("c", last_used=50)],
     [R("wb", "b", "d0"), R("wc", "c", "d1")], [D("d0", 2), D("d1", 2)], [("evict", "wb")]),
    ("more than any device holds: refused", [M("a", 20, queued=1)], [], [D("d0", 10), D("d1", 10)],
     [("refuse", "a")]),
    ("more than its allowed devices hold: refused", [M("a", 12, queued=1, devices=("d1",))], [],
     [D("d0", 20, total=20), D("d1", 10)], [("refuse", "a")]),
    ("a device not in the pool: refused", [M("a", queued=1, devices=("gpu9",))], [], [D("d0", 10)],
     [("refuse", "a")]),
    ("a model too large is refused only when it needs a replica", [M("a", 20)], [], [D("d0", 10)], []),
]

SCALE_UP: list[Row] = [  # rule 3
    ("a wait past scale_up_wait adds a replica on another device", [M("a", queued=3, oldest_wait=2.5, max_replicas=2)],
     [R("w1", "a", "d0", active=8)], [D("d0", 6), D("d1", 10)], [("start", "a", "d1")]),
    ("a shorter wait does not", [M("a", queued=3, oldest_wait=1.0, max_replicas=2)],
     [R("w1", "a", "d0", active=8)], [D("d0", 6), D("d1", 10)], []),
    ("not past max_replicas", [M("a", queued=3, oldest_wait=9)], [R("w1", "a", "d0", active=8)],
     [D("d0", 6), D("d1", 10)], []),
    ("not while one is loading", [M("a", queued=3, oldest_wait=9, max_replicas=3)],
     [R("w1", "a", "d0", active=8), R("w2", "a", "d1", state="loading", since=NOW - 1)],
     [D("d0", 6), D("d1", 6), D("d2", 10)], []),
    ("evicts an idle model for it", [M("a", queued=3, oldest_wait=5, max_replicas=2), M("b", last_used=10)],
     [R("w1", "a", "d0", active=8), R("wb", "b", "d1")], [D("d0", 2), D("d1", 2)], [("evict", "wb")]),
    ("but not a model with requests waiting", [M("a", queued=3, oldest_wait=5, max_replicas=2), M("b", queued=1)],
     [R("w1", "a", "d0", active=8), R("wb", "b", "d1")], [D("d0", 2), D("d1", 2)], []),
    ("nor one within min_residency", [M("a", queued=3, oldest_wait=5, max_replicas=2), M("b")],
     [R("w1", "a", "d0", active=8), R("wb", "b", "d1", since=NOW - 5)], [D("d0", 2), D("d1", 2)], []),
]

SCALE_DOWN: list[Row] = [  # rule 4
    ("the most recently started replica idle past scale_down_idle",
     [M("a", max_replicas=3)], [R("w1", "a", "d0", active=2), R("w2", "a", "d1", since=OLD + 1, idle_since=NOW - 70),
                                R("w3", "a", "d2", since=OLD + 2, idle_since=NOW - 70)],
     [D("d0", 6), D("d1", 6), D("d2", 6)], [("drain", "w3")]),
    ("one a call", [M("a", max_replicas=3)], [R("w1", "a", "d0"), R("w2", "a", "d1"), R("w3", "a", "d2")],
     [D("d0", 6), D("d1", 6), D("d2", 6)], [("drain", "w1")]),
    ("not idle long enough", [M("a", max_replicas=2)], [R("w1", "a", "d0", active=2),
                                                        R("w2", "a", "d1", idle_since=NOW - 30)],
     [D("d0", 6), D("d1", 6)], []),
    ("not below min_replicas", [M("a", min_replicas=2, max_replicas=2)], [R("w1", "a", "d0"), R("w2", "a", "d1")],
     [D("d0", 6), D("d1", 6)], []),
    ("not below one", [M("a", last_used=NOW)], [R("w1", "a", "d0")], [D("d0", 6)], []),
    ("not while requests wait", [M("a", queued=1, max_replicas=2)], [R("w1", "a", "d0", active=8),
                                                                     R("w2", "a", "d1")],
     [D("d0", 6), D("d1", 6)], []),
]

IDLE_UNLOAD: list[Row] = [  # rule 5
    ("unused past idle_unload: unloaded", [M("a", idle_unload=300, last_used=NOW - 400)], [R("w1", "a")],
     [D("d0", 6)], [("drain", "w1")]),
    ("down to min_replicas, the newest first", [M("a", idle_unload=300, last_used=NOW - 400, min_replicas=1,
                                                  max_replicas=2)],
     [R("w1", "a", "d0"), R("w2", "a", "d1", since=OLD + 1)], [D("d0", 6), D("d1", 6)], [("drain", "w2")]),
    ("not before", [M("a", idle_unload=300, last_used=NOW - 100)], [R("w1", "a")], [D("d0", 6)], []),
    ("0 is never", [M("a", idle_unload=0, last_used=0)], [R("w1", "a")], [D("d0", 6)], []),
    ("not pinned", [M("a", idle_unload=300, last_used=NOW - 400, pinned=True)], [R("w1", "a")], [D("d0", 6)], []),
    ("not always", [M("a", load="always", idle_unload=300, last_used=NOW - 400)], [R("w1", "a")], [D("d0", 6)], []),
    ("not while a replica is busy", [M("a", idle_unload=300, last_used=NOW - 400, max_replicas=2)],
     [R("w1", "a", "d0", idle_since=NOW - 10), R("w2", "a", "d1", active=1)], [D("d0", 6), D("d1", 6)], []),
    ("not while requests wait", [M("a", idle_unload=300, last_used=NOW - 400, queued=1)], [R("w1", "a")],
     [D("d0", 6)], []),
]

BACKOFF_AND_BOOKING: list[Row] = [  # rules 6 and 7
    ("a failed load backs off: no start before retry_at", [M("a", queued=1, retry_at=NOW + 5)], [], [D("d0", 10)],
     []),
    ("after retry_at it starts", [M("a", queued=1, retry_at=NOW - 1)], [], [D("d0", 10)], [("start", "a", "d0")]),
    ("two models, room for one: the longest wait goes", [M("a", 6, queued=1, oldest_wait=1),
                                                         M("b", 6, queued=1, oldest_wait=5)], [], [D("d0", 10)],
     [("start", "b", "d0")]),
    ("room for both: both", [M("a", 6, queued=1), M("b", 6, queued=1)], [], [D("d0", 12, total=12)],
     [("start", "a", "d0"), ("start", "b", "d0")]),
    ("draining memory is booked once: the second model evicts",
     [M("a", 6, queued=1, oldest_wait=5), M("b", 6, queued=1), M("c", 6)], [R("wc", "c")], [D("d0", 1, total=13,
                                                                                              draining=6)],
     [("evict", "wc")]),
    ("a floor before demand", [M("a", 6, queued=1, oldest_wait=50), M("b", 6, load="always")], [], [D("d0", 10)],
     [("start", "b", "d0")]),
    ("one start a model a call", [M("a", queued=10, oldest_wait=50, max_replicas=4)], [],
     [D("d0", 10), D("d1", 10)], [("start", "a", "d0")]),
    ("an idle unload's memory is waited for, not evicted around",
     [M("a", 6, queued=1), M("b", 6, idle_unload=60, last_used=NOW - 100), M("c", 4, last_used=0)],
     [R("wb", "b"), R("wc", "c")], [D("d0", 0)], [("drain", "wb")]),
]


@pytest.mark.parametrize("row", DEMAND + NO_FIT + SCALE_UP + SCALE_DOWN + IDLE_UNLOAD + BACKOFF_AND_BOOKING,
                         ids=lambda row: row[0])
def test_table(row: Row) -> None:
    _, models, replicas, devices, expected = row
    assert brief(plan(models, replicas, devices, NOW, Settings())) == expected


def test_scale_up_by_queue_depth() -> None:
    models = [M("a", queued=8, oldest_wait=0.1, max_replicas=3)]
    replicas = [R("w1", "a", "d0", active=8), R("w2", "a", "d1", active=8)]
    devices = [D("d0", 6), D("d1", 6), D("d2", 10)]
    assert brief(plan(models, replicas, devices, NOW, Settings(scale_up_queue=4))) == [("start", "a", "d2")]
    assert brief(plan(models, replicas, devices, NOW, Settings(scale_up_queue=5))) == []  # 8 < 5 x 2
    assert brief(plan(models, replicas, devices, NOW, Settings())) == []  # off: only the wait counts


def test_every_why_names_the_model_the_device_and_the_memory() -> None:
    start = plan([M("gemma", 1.5, queued=2, oldest_wait=0.4)], [], [D("cuda:1", 70, total=80)], NOW)
    assert start == [Start("gemma", "cuda:1", "start gemma on cuda:1: 2 request(s) waiting (oldest 0.4 s), no "
                                              "replica; needs 1.5 GiB, 70.0 GiB free of 80.0 GiB")]
    evict = plan([M("gemma", 6, queued=1), M("smol", 0.25, last_used=NOW - 42)], [R("w7", "smol", "cuda:1")],
                 [D("cuda:1", 5.9)], NOW)
    assert evict == [Drain("w7", "smol", "evict smol (worker w7 on cuda:1, frees 256 MiB, idle, last used 42 s ago) "
                                         "for gemma (1 request(s) waiting (oldest 0.0 s), no replica): gemma needs "
                                         "6.0 GiB, 5.9 GiB free + 0 B draining", evict=True)]
    refuse = plan([M("big", 90, queued=1)], [], [D("cuda:0", 70, total=80)], NOW)
    assert refuse == [Refuse("big", "model big needs 90.0 GiB, more than any device it may use holds (the largest, "
                                    "cuda:0, has 80.0 GiB)")]


@pytest.mark.parametrize(("kw", "message"), [
    ({"need": -1}, "need must be >= 0"),
    ({"load": "sometimes"}, "load must be"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
    ({"max_replicas": 0}, "max_replicas >= 1"),
    ({"idle_unload": -5}, "idle_unload must be >= 0"),
])
def test_bad_model_views_name_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelView("a", **{"need": 1, **kw})


def test_bad_settings_name_the_setting() -> None:
    with pytest.raises(ValueError, match="min_residency"):
        Settings(min_residency=-1)


# ---------------------------------------------------------------- properties over random pools

NAMES = ("a", "b", "c", "d")
DEVS = ("d0", "d1", "d2")

models_st = st.lists(st.builds(
    lambda name, need, load, lo, extra, idle, pinned, queued, wait, used, retry: ModelView(
        name, need * GB // 2, load, lo, max(1, lo + extra), idle, pinned, queued, wait if queued else 0.0, used, retry),
    st.sampled_from(NAMES), st.integers(1, 12), st.sampled_from(("always", "on_demand")), st.integers(0, 2),
    st.integers(0, 2), st.sampled_from((0.0, 60.0)), st.booleans(), st.integers(0, 3), st.floats(0, 10),
    st.floats(0, NOW), st.sampled_from((0.0, NOW + 1))), max_size=4, unique_by=lambda m: m.name)
replicas_st = st.lists(st.builds(
    lambda model, device, state, active, age, idle: ReplicaView(
        "", model, device, state, active, NOW - age, None if active else NOW - min(idle, age)),
    st.sampled_from(NAMES), st.sampled_from(DEVS), st.sampled_from(("loading", "ready", "ready", "draining")),
    st.integers(0, 2), st.floats(0, 300), st.floats(0, 300)), max_size=8)


@st.composite
def pools(draw: st.DrawFn) -> tuple[list[ModelView], list[ReplicaView], list[DeviceView]]:
    models = draw(models_st)
    replicas = [replace(r, worker=f"w{i}") for i, r in enumerate(draw(replicas_st))]
    devices = []
    for d in DEVS:
        total = draw(st.integers(2, 16)) * GB
        used = sum(next((m.need for m in models if m.name == r.model), 0) for r in replicas if r.device == d)
        draining = sum(next((m.need for m in models if m.name == r.model), 0) for r in replicas
                       if r.device == d and r.state == "draining")
        devices.append(DeviceView(d, max(0, total - used), max(total, used), draining))
    return models, replicas, devices


@settings(max_examples=500, deadline=None)
@given(pools())
def test_a_drained_replica_is_idle_and_an_evicted_one_was_evictable(
        pool: tuple[list[ModelView], list[ReplicaView], list[DeviceView]]) -> None:
    models, replicas, devices = pool
    s = Settings()
    by_model = {m.name: m for m in models}
    by_worker = {r.worker: r for r in replicas}
    for a in plan(models, replicas, devices, NOW, s):
        if isinstance(a, Drain):
            r, m = by_worker[a.worker], by_model[a.model]
            assert r.state == "ready" and r.active == 0 and m.queued == 0, a
            if a.evict:
                assert not m.pinned and NOW - r.since >= s.min_residency, a
            live = [x for x in replicas if x.model == m.name and x.state != "draining"]
            drained = sum(isinstance(b, Drain) and b.model == m.name for b in plan(models, replicas, devices, NOW, s))
            assert len(live) - drained >= m.floor, a


@settings(max_examples=500, deadline=None)
@given(pools())
def test_starts_fit_the_free_memory_of_allowed_devices_and_respect_back_off(
        pool: tuple[list[ModelView], list[ReplicaView], list[DeviceView]]) -> None:
    models, replicas, devices = pool
    by_model = {m.name: m for m in models}
    free = {d.id: d.free for d in devices}
    starts: dict[str, int] = {}
    for a in plan(models, replicas, devices, NOW):
        if isinstance(a, Start):
            m = by_model[a.model]
            free[a.device] -= m.need
            starts[a.model] = starts.get(a.model, 0) + 1
            assert free[a.device] >= 0 and m.retry_at <= NOW and (m.devices is None or a.device in m.devices), a
    for name, n in starts.items():  # one a call, but for reaching the floor
        live = sum(r.model == name and r.state != "draining" for r in replicas)
        assert n == 1 or live + n <= by_model[name].floor


# ---------------------------------------------------------------- hysteresis: two busy models, one device


@dataclass
class _Replica:
    worker: str
    model: str
    state: str
    since: float
    active: int = 0
    idle_since: float | None = None


def _swap_trace(s: Settings, seconds: int = 600, flip: int = 5, load_time: int = 2) -> list[tuple[int, str]]:
    """Two models of 6 GiB on one 10 GiB device; the demand moves from one to the other every ``flip``
    seconds (the busy one has a request running or waiting at every tick). Returns the loads
    (tick, model). Asserts every drain the policy asks for is of an idle replica."""
    reps: dict[str, _Replica] = {"w0": _Replica("w0", "a", "ready", 0.0)}
    last_used = {"a": 0.0, "b": 0.0}
    waiting_since: dict[str, float] = {}
    loads: list[tuple[int, str]] = []
    for t in range(1, seconds):
        hot = "a" if (t // flip) % 2 == 0 else "b"
        for k, r in list(reps.items()):
            if r.state == "draining":
                del reps[k]
            elif r.state == "loading" and t - r.since >= load_time:
                r.state = "ready"
        for r in reps.values():
            busy = r.model == hot and r.state == "ready"
            if busy:
                r.active, r.idle_since, last_used[r.model] = 1, None, t
            elif r.active:
                r.active, r.idle_since = 0, t
        served = any(r.model == hot and r.state == "ready" for r in reps.values())
        waiting_since = {hot: waiting_since.get(hot, t)} if not served else {}
        models = [M(n, 6, queued=int(n in waiting_since), oldest_wait=t - waiting_since.get(n, t),
                    last_used=last_used[n]) for n in ("a", "b")]
        used = sum(6 * GB for r in reps.values() if r.state != "draining")
        draining = sum(6 * GB for r in reps.values() if r.state == "draining")
        views = [ReplicaView(r.worker, r.model, "d0", r.state, r.active, r.since, r.idle_since)  # type: ignore[arg-type]
                 for r in reps.values()]
        for a in plan(models, views, [DeviceView("d0", 10 * GB - used, 10 * GB, draining)], t, s):
            if isinstance(a, Start):
                reps[f"w{t}"] = _Replica(f"w{t}", a.model, "loading", t)
                loads.append((t, a.model))
            elif isinstance(a, Drain):
                assert reps[a.worker].active == 0, (t, a)
                reps[a.worker].state = "draining"
    return loads


def test_two_busy_models_swap_no_faster_than_min_residency() -> None:
    s = Settings(min_residency=30)
    loads = _swap_trace(s)
    assert {m for _, m in loads} == {"a", "b"}  # both are served
    gaps = [t2 - t1 for (t1, _), (t2, _) in itertools.pairwise(loads)]
    assert all(g >= s.min_residency for g in gaps), loads
    assert len(loads) <= 600 // 30 + 1
    # without the residency the same demand swaps at every flip: the rule is what holds it back
    assert len(_swap_trace(Settings(min_residency=0))) > 2 * len(loads)
