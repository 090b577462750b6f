"""Where models run: the placement policy, a pure function of the pool's state and the clock.

:func:`plan` takes the models (memory need, replica bounds, demand, last use), their replicas, the
devices (free memory) and the time, and returns actions: :class:`Start` a replica on a device,
:class:`Drain` a replica (it finishes what it runs, then exits), :class:`Refuse` a model that can never
fit. It starts, stops and remembers nothing: the supervisor carries the actions out through its one
spawn path and calls it again when anything changes (a request waits, a worker is ready or gone, a
timer). Every action's ``why`` names the model, the device and the memory numbers, for the log line.

Terms. A model's **replicas** are its workers loading or ready (a draining one no longer counts: its
memory is the device's ``draining``). Its **floor** is ``min_replicas``, at least 1 for
``load = "always"``: nothing drains a model below its floor. A replica is **idle** when it runs no
request (``active == 0``). A device **fits** a model when its ``free`` memory (net of every replica on
it, loading ones included) is at least the model's ``need``.

The rules, each with table rows in tests/test_placement.py:

1. **Demand.** A model below its floor, or with requests queued and no replica at all, gets a Start
   on an allowed device that fits it: preferably one that holds no replica of the same model (replicas
   spread over devices), then the best fit (the device left with the least free memory). Only to reach
   the floor does one call start several replicas of a model.
2. **No device fits.** If memory that draining replicas free will make an allowed device fit, the
   model waits for it. Else idle replicas of other models are **evicted** (:class:`Drain` with
   ``evict``), least recently used model first, until a device would fit; the Start comes on a later
   call, once they are gone. A replica is evictable only if it is ready and idle, its model has no
   request queued, is not pinned and stays at or above its floor, and it has been resident for
   ``min_residency`` seconds (since it started loading). A busy replica is never drained. When
   nothing can be evicted yet there is no action: the requests wait in the router (``queue_timeout``).
   **Hysteresis:** a model that was loaded again within ``min_residency`` of its own eviction (it was
   asked for again at once: thrash) is a victim only when the other models' idle replicas are not
   enough, so the pool does not evict it again next.
3. **Scale up.** A model with a ready replica, none loading and fewer than ``max_replicas``, whose
   oldest queued request has waited ``scale_up_wait`` seconds (or, when ``scale_up_queue`` is set, whose
   queue holds ``scale_up_queue`` requests per ready replica) gets one more Start, placed as in 1 and 2.
   Eviction cannot take a model with requests queued or within ``min_residency``, so a model swapped
   in serves its waiting queue first, and two busy models swap at most once per ``min_residency``.
4. **Scale down.** A model with more ready replicas than ``max(floor, 1)``, no request queued, and a
   replica idle for ``scale_down_idle`` seconds has its most recently started such replica drained
   (one per model per call).
5. **Idle unload.** An ``on_demand`` model, not pinned, no request queued, every replica idle, unused
   for its ``idle_unload`` seconds (0: never) has its replicas drained down to its floor.
6. **Back-off.** A model whose ``retry_at`` is later than now (its last load failed) gets no Start.
7. **No double booking.** Each Start (and each wait for draining memory) books the model's need on
   its device before the next model is placed. Models are placed in this order: floors (``always``
   models first), then models with no replica (longest wait first), then scale-ups (longest wait
   first).

A model whose need exceeds the ``total`` of every allowed device is refused (rule 1's check), with
both numbers, each time it would need a replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from llamapool.supervisor.memory import fmt_bytes

Load = Literal["always", "on_demand"]
ReplicaState = Literal["loading", "ready", "draining"]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class ModelView:
    """A model as the policy sees it. Times are clock seconds (the ``now`` of :func:`plan`)."""

    name: str
    need: int  # bytes one replica takes (memory.estimate)
    load: Load = "on_demand"
    min_replicas: int = 0
    max_replicas: int = 1
    idle_unload: float = 0.0  # seconds unused before an on_demand model is unloaded; 0: never
    pinned: bool = False  # the operator's: never evicted nor unloaded for idleness
    queued: int = 0  # requests waiting in the router for a worker of this model
    oldest_wait: float = 0.0  # seconds the oldest of them has waited
    last_used: float = 0.0  # clock time of its last request
    retry_at: float = 0.0  # no Start before this clock time (back-off after a failed load)
    devices: tuple[str, ...] | None = None  # the device ids it may use; None: any
    evicted_at: float = float("-inf")  # clock time of its last eviction

    def __post_init__(self) -> None:
        _check(self.need >= 0, f"model {self.name!r}: need must be >= 0 bytes (got {self.need})")
        _check(self.load in ("always", "on_demand"),
               f"model {self.name!r}: load must be \"always\" or \"on_demand\" (got {self.load!r})")
        _check(0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1,
               f"model {self.name!r}: replicas must satisfy 0 <= min_replicas <= max_replicas, max_replicas >= 1 "
               f"(got {self.min_replicas}, {self.max_replicas})")
        _check(self.idle_unload >= 0, f"model {self.name!r}: idle_unload must be >= 0 (got {self.idle_unload})")
        _check(self.queued >= 0, f"model {self.name!r}: queued must be >= 0 (got {self.queued})")

    @property
    def floor(self) -> int:
        """Replicas nothing drains it below: ``min_replicas``, at least 1 for ``load = "always"``."""
        return max(self.min_replicas, 1 if self.load == "always" else 0)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One worker of a model on a device."""

    worker: str
    model: str
    device: str
    state: ReplicaState
    active: int = 0  # requests it runs now
    since: float = 0.0  # clock time it started loading
    idle_since: float | None = None  # clock time ``active`` last became 0; None while busy


@dataclass(frozen=True, slots=True)
class DeviceView:
    """A GPU (or the CPU workers' RAM budget): ``free`` is net of every replica on it, loading ones
    included, but not of draining ones, whose bytes are ``draining``."""

    id: str
    free: int
    total: int
    draining: int = 0


@dataclass(frozen=True, slots=True)
class Settings:
    """The pool's thresholds, in seconds (``scale_up_queue``: requests per ready replica, 0: off)."""

    scale_up_wait: float = 2.0
    scale_up_queue: int = 0
    scale_down_idle: float = 60.0
    min_residency: float = 30.0

    def __post_init__(self) -> None:
        for name in ("scale_up_wait", "scale_up_queue", "scale_down_idle", "min_residency"):
            _check(getattr(self, name) >= 0, f"placement setting {name} must be >= 0 (got {getattr(self, name)})")


@dataclass(frozen=True, slots=True)
class Start:
    """Start a worker of ``model`` on ``device``."""

    model: str
    device: str
    why: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Drain ``worker`` (a replica of ``model``): it finishes its requests, then exits. ``evict``: to
    make room for another model (rule 2), else for scale down or idle unload."""

    worker: str
    model: str
    why: str
    evict: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    """``model`` can never fit on any device it may use."""

    model: str
    why: str


Action = Start | Drain | Refuse


@dataclass(slots=True)
class _Device:
    """A device's memory as this call books it."""

    id: str
    free: int
    total: int
    draining: int


@dataclass(slots=True)
class _Pool:
    """The working state of one :func:`plan` call: what it has drained and booked so far."""

    models: dict[str, ModelView]
    devices: dict[str, _Device]
    replicas: list[ReplicaView]  # loading and ready ones of known models
    now: float
    settings: Settings
    gone: set[str] = field(default_factory=set)  # workers drained by this call
    starting: list[tuple[str, str]] = field(default_factory=list)  # (model, device) of this call's Starts
    placed: set[str] = field(default_factory=set)  # models this call started, booked or evicted for
    actions: list[Action] = field(default_factory=list)

    def of(self, model: str) -> list[ReplicaView]:
        return [r for r in self.replicas if r.model == model and r.worker not in self.gone]

    def count(self, model: str) -> int:
        """Its replicas, with this call's Starts."""
        return len(self.of(model)) + sum(m == model for m, _ in self.starting)

    def drain(self, r: ReplicaView, why: str, evict: bool = False) -> None:
        self.gone.add(r.worker)
        if r.device in self.devices:
            self.devices[r.device].draining += self.models[r.model].need
        self.actions.append(Drain(r.worker, r.model, why, evict))

    def allowed(self, m: ModelView) -> list[_Device]:
        return [d for i, d in self.devices.items() if m.devices is None or i in m.devices]


def plan(models: Iterable[ModelView], replicas: Iterable[ReplicaView], devices: Iterable[DeviceView], now: float,
         settings: Settings | None = None) -> list[Action]:
    """The actions the pool's state calls for at ``now`` (the module docstring's rules)."""
    by_name = {m.name: m for m in models}
    pool = _Pool(by_name, {d.id: _Device(d.id, d.free, d.total, d.draining) for d in devices},
                 [r for r in replicas if r.state != "draining" and r.model in by_name], now, settings or Settings())
    for m in by_name.values():  # rules 5 and 4 first: what they drain, a placement below may wait for
        if not _idle_unload(pool, m):
            _scale_down(pool, m)
    floors = sorted((m for m in by_name.values() if pool.count(m.name) < m.floor),
                    key=lambda m: (m.load != "always", m.name))
    for m in floors:
        while pool.count(m.name) < m.floor:
            if not _place(pool, m, f"below its floor of {m.floor} replica(s) ({pool.count(m.name)} running)"):
                break
    cold = [m for m in by_name.values() if m.queued > 0 and not pool.count(m.name) and m.name not in pool.placed]
    for m in sorted(cold, key=lambda m: (-m.oldest_wait, m.name)):
        _place(pool, m, f"{m.queued} request(s) waiting (oldest {m.oldest_wait:.1f} s), no replica")
    more = [m for m in by_name.values() if m.name not in pool.placed and _wants_more(pool, m)]
    for m in sorted(more, key=lambda m: (-m.oldest_wait, m.name)):
        ready = sum(r.state == "ready" for r in pool.of(m.name))
        _place(pool, m, f"scale up: {m.queued} request(s) waiting (oldest {m.oldest_wait:.1f} s) "
                        f"on {ready} ready replica(s)")
    return pool.actions


def _idle(r: ReplicaView) -> bool:
    return r.state == "ready" and r.active == 0


def _idle_unload(pool: _Pool, m: ModelView) -> bool:
    """Rule 5; True when it drained anything."""
    mine = pool.of(m.name)
    unused = pool.now - m.last_used
    if (m.load != "on_demand" or m.pinned or m.queued or m.idle_unload <= 0 or unused < m.idle_unload
            or len(mine) <= m.floor or not all(_idle(r) for r in mine)):
        return False
    for r in sorted(mine, key=lambda r: -r.since)[:len(mine) - m.floor]:
        pool.drain(r, f"unload {m.name} (worker {r.worker} on {r.device}, frees {fmt_bytes(m.need)}): unused for "
                      f"{unused:.0f} s >= idle_unload {m.idle_unload:g} s")
    return True


def _scale_down(pool: _Pool, m: ModelView) -> None:
    """Rule 4."""
    ready = [r for r in pool.of(m.name) if r.state == "ready"]
    if m.queued or len(ready) <= max(m.floor, 1):
        return
    wait = pool.settings.scale_down_idle
    idle = [r for r in ready if _idle(r) and r.idle_since is not None and pool.now - r.idle_since >= wait]
    if idle:
        r = max(idle, key=lambda r: r.since)
        pool.drain(r, f"retire a replica of {m.name} (worker {r.worker} on {r.device}, frees {fmt_bytes(m.need)}): "
                      f"idle {pool.now - (r.idle_since or pool.now):.0f} s >= scale_down_idle {wait:g} s, "
                      f"{len(ready)} ready, none waiting")


def _wants_more(pool: _Pool, m: ModelView) -> bool:
    """Rule 3's trigger."""
    mine = pool.of(m.name)
    ready = sum(r.state == "ready" for r in mine)
    if not m.queued or not ready or len(mine) > ready or len(mine) >= m.max_replicas:
        return False
    s = pool.settings
    return m.oldest_wait >= s.scale_up_wait or (s.scale_up_queue > 0 and m.queued >= s.scale_up_queue * ready)


def _refused(pool: _Pool, m: ModelView) -> bool:
    """The model's Refuse when no allowed device could ever hold it; True then."""
    allowed = pool.allowed(m)
    if not allowed:
        pool.actions.append(Refuse(m.name, f"model {m.name} can run on none of the pool's devices "
                                           f"(it may use {', '.join(m.devices or ())}; the pool has "
                                           f"{', '.join(pool.devices) or 'none'})"))
        return True
    largest = max(allowed, key=lambda d: d.total)
    if m.need > largest.total:
        pool.actions.append(Refuse(m.name, f"model {m.name} needs {fmt_bytes(m.need)}, more than any device it may "
                                           f"use holds (the largest, {largest.id}, has {fmt_bytes(largest.total)})"))
        return True
    return False


def _place(pool: _Pool, m: ModelView, reason: str) -> bool:
    """Rules 1, 2, 6 and 7 for one replica of ``m``; True when it was started."""
    pool.placed.add(m.name)
    if _refused(pool, m) or m.retry_at > pool.now:
        return False
    allowed = [d for d in pool.allowed(m) if d.total >= m.need]
    holding = {r.device for r in pool.of(m.name)} | {dev for name, dev in pool.starting if name == m.name}
    fits = [d for d in allowed if d.free >= m.need]
    if fits:
        d = min(fits, key=lambda d: (d.id in holding, d.free - m.need, d.id))
        pool.actions.append(Start(m.name, d.id, f"start {m.name} on {d.id}: {reason}; needs {fmt_bytes(m.need)}, "
                                                f"{fmt_bytes(d.free)} free of {fmt_bytes(d.total)}"))
        d.free -= m.need
        pool.starting.append((m.name, d.id))
        return True
    soon = [d for d in allowed if d.free + d.draining >= m.need]
    if soon:  # wait for draining memory, booked so no other model counts on it too
        min(soon, key=lambda d: (d.id in holding, d.free + d.draining - m.need, d.id)).free -= m.need
        return False
    best: tuple[tuple[int, float, int, int, str], _Device, list[ReplicaView]] | None = None
    for d in allowed:
        victims = _victims(pool, m, d)
        if victims is not None:
            key = (sum(_rebound(pool, v) for v in victims), max(pool.models[v.model].last_used for v in victims),
                   len(victims),
                   d.free + d.draining + sum(pool.models[v.model].need for v in victims) - m.need, d.id)
            if best is None or key < best[0]:
                best = (key, d, victims)
    if best is not None:
        _, d, victims = best
        short = f"{m.name} needs {fmt_bytes(m.need)}, {fmt_bytes(d.free)} free + {fmt_bytes(d.draining)} draining"
        for v in victims:
            vm = pool.models[v.model]
            pool.drain(v, f"evict {v.model} (worker {v.worker} on {d.id}, frees {fmt_bytes(vm.need)}, idle, last used "
                          f"{pool.now - vm.last_used:.0f} s ago) for {m.name} ({reason}): {short}", evict=True)
        d.free -= m.need
    return False


def _victims(pool: _Pool, m: ModelView, d: _Device) -> list[ReplicaView] | None:
    """The replicas on ``d`` to evict so that it fits ``m``: least recently used model first, a model back
    from its own eviction within ``min_residency`` (:func:`_rebound`) last; None when the evictable ones
    are not enough."""
    s = pool.settings
    left = {name: len(pool.of(name)) for name in pool.models}
    room = d.free + d.draining
    chosen: list[ReplicaView] = []
    for r in sorted(_evictable(pool, m, d),
                    key=lambda r: (_rebound(pool, r), pool.models[r.model].last_used, r.since, r.worker)):
        if room >= m.need:
            break
        vm = pool.models[r.model]
        if left[vm.name] > vm.floor and pool.now - r.since >= s.min_residency:
            chosen.append(r)
            left[vm.name] -= 1
            room += vm.need
    return chosen if room >= m.need and chosen else None


def _rebound(pool: _Pool, r: ReplicaView) -> bool:
    """``r`` was started within ``min_residency`` of its model's last eviction: the model was asked for
    again at once, and evicting it next would be thrash (the hysteresis of rule 2)."""
    return r.since - pool.models[r.model].evicted_at < pool.settings.min_residency


def _evictable(pool: _Pool, m: ModelView, d: _Device) -> Sequence[ReplicaView]:
    """Idle ready replicas on ``d`` of other models with nothing queued, not pinned."""
    return [r for r in pool.replicas if r.device == d.id and r.worker not in pool.gone and r.model != m.name
            and _idle(r) and not pool.models[r.model].queued and not pool.models[r.model].pinned]
