"""The supervisor <-> router channel, inside the daemon: typed commands one way, typed events the other.

Commands travel over an inproc ZeroMQ PAIR socket, encoded by ``protocol.codec`` like every other
message (``codec.COMMAND_TYPES`` decodes them); events are handed to the supervisor's event loop as
these objects. Each class is one thing that can happen; the router and the supervisor handle each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

# ---------------------------------------------------------------- supervisor -> router


@dataclass(slots=True)
class WorkerInfo:
    """The supervisor's view of one of its workers (state, device, restarts...): shown by ``status``."""

    TYPE: ClassVar[str] = "worker_info"
    name: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ForgetWorker:
    """A worker that left the pool (its model was removed by a reload): drop it from ``status``."""

    TYPE: ClassVar[str] = "forget_worker"
    name: str


@dataclass(slots=True)
class GpuRows:
    """NVML's latest reading of the GPUs (for ``status`` and the metrics)."""

    TYPE: ClassVar[str] = "gpu_rows"
    rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class WorkerExited:
    """A worker process exited (the supervisor reaped it): its requests are retried or failed now."""

    TYPE: ClassVar[str] = "worker_exited"
    name: str
    pid: int
    how: str


@dataclass(slots=True)
class RetireWorker:
    """Route nothing more to the worker and let it finish and exit (a reload replaces it)."""

    TYPE: ClassVar[str] = "retire_worker"
    name: str


@dataclass(slots=True)
class PoolModels:
    """The pool's models after a reload; the first is the default."""

    TYPE: ClassVar[str] = "pool_models"
    names: list[str] = field(default_factory=list)
    adapters: list[tuple[str, str, float]] = field(default_factory=list)  # (adapter, model, scale): Config.adapters


@dataclass(slots=True)
class StartDrain:
    """Refuse new requests; those accepted (queued too) still run. ``Drained`` follows when none is left."""

    TYPE: ClassVar[str] = "start_drain"


@dataclass(slots=True)
class CancelAll:
    """The drain timed out: end every request now with ``unavailable``."""

    TYPE: ClassVar[str] = "cancel_all"


@dataclass(slots=True)
class StopRouter:
    """Answer every request left with ``unavailable``, close the sockets and end the router thread."""

    TYPE: ClassVar[str] = "stop_router"


@dataclass(slots=True)
class ModelRows:
    """Each model's state as the supervisor's pool sees it (``loaded``, ``loading``, ``unloaded``,
    ``failed``; its load mode, pin, memory need, workers, failure and counters): for ``status``,
    ``/v1/models`` and the metrics, and a ``failed`` model's waiting requests end with its reason."""

    TYPE: ClassVar[str] = "model_rows"
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class ModelLoaded:
    """A model's worker became ready ``seconds`` after its spawn (``llamapool_model_load_seconds``)."""

    TYPE: ClassVar[str] = "model_loaded"
    model: str
    seconds: float


@dataclass(slots=True)
class ModelReply:
    """The supervisor's answer to a client's :class:`ModelCommand`: the router sends it on."""

    TYPE: ClassVar[str] = "model_reply"
    client: bytes
    id: str
    model: str
    action: str
    ok: bool
    state: str
    message: str


@dataclass(slots=True)
class TenantTable:
    """The keys file's tenants after a reload (``keys.TenantSettings`` rows; ``defaults``: the ``*``
    line's): the router's limits and weights from now on."""

    TYPE: ClassVar[str] = "tenant_table"
    tenants: list[dict[str, Any]] = field(default_factory=list)
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StoreFailed:
    """A gateway could not store a response (it served it all the same): ``reason`` is ``full`` or
    ``unwritable`` (``llamapool_responses_store_failures_total``)."""

    TYPE: ClassVar[str] = "store_failed"
    reason: str


Command = (WorkerInfo | ForgetWorker | GpuRows | WorkerExited | RetireWorker | PoolModels | StartDrain
           | CancelAll | StopRouter | ModelRows | ModelLoaded | ModelReply | TenantTable | StoreFailed)
COMMANDS: tuple[type, ...] = (WorkerInfo, ForgetWorker, GpuRows, WorkerExited, RetireWorker, PoolModels,
                              StartDrain, CancelAll, StopRouter, ModelRows, ModelLoaded, ModelReply, TenantTable,
                              StoreFailed)

# ---------------------------------------------------------------- child process -> supervisor


@dataclass(slots=True)
class ChildReport:
    """What a worker or a gateway tells its supervisor about itself, on its output pipe as one marked
    line (``codec.report_line``), never as log text: ``listening`` (a gateway serves), ``joining`` (a
    node's worker loaded its model), ``joined`` (the router accepted it), ``key_refused`` (the router
    refuses the node's CURVE key), ``live`` (a node's worker's heartbeat, with its step's ``busy_for``),
    ``store_failed`` (a gateway could not store a response; ``detail``: why, :class:`StoreFailed`)."""

    TYPE: ClassVar[str] = "child_report"
    event: str
    busy_for: float = 0.0
    detail: str = ""


REPORT_EVENTS = ("listening", "joining", "joined", "key_refused", "live", "store_failed")
STORE_FAILURES = ("full", "unwritable")  # StoreFailed.reason

# ---------------------------------------------------------------- router -> supervisor


@dataclass(frozen=True, slots=True)
class WorkerJoined:
    """A worker said hello and was accepted: it is ready."""

    name: str
    pid: int


@dataclass(frozen=True, slots=True)
class KillWorker:
    """The router gave up on a worker (missed heartbeats, a step past ``step_timeout``): kill it."""

    name: str
    pid: int
    why: str


@dataclass(frozen=True, slots=True)
class ReadyCount:
    """How many workers are routable now, and how many prompts wait (for sd_notify READY and STATUS)."""

    ready: int
    queued: int


@dataclass(frozen=True, slots=True)
class Drained:
    """The drain is done: no request is left."""


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model's demand as the router sees it: prompts waiting, how long the oldest has waited, and
    when a request for it last arrived or ended (``time.monotonic``)."""

    queued: int
    oldest_wait: float
    last_used: float


@dataclass(frozen=True, slots=True)
class Demand:
    """What the placement policy reads from the router (every tick, and at once when a request waits for
    a model with no worker): each model's demand and each connected worker's running prompts."""

    models: dict[str, ModelDemand]
    active: dict[str, int]


@dataclass(frozen=True, slots=True)
class ModelCommand:
    """An operator's ``load``, ``unload``, ``pin`` or ``unpin`` of a model (SDK, CLI, HTTP): the supervisor
    carries it out and answers with :class:`ModelReply`."""

    client: bytes
    id: str
    action: str
    model: str


Event = WorkerJoined | KillWorker | ReadyCount | Drained | Demand | ModelCommand
