"""Daemon configuration: TOML -> typed, validated dataclasses. Every error names its key.

Each key is declared once, with its type, default and constraints (``Annotated``: msgspec checks them, and
errors quote them: llamapool.tables); the functions below check what depends on several keys or on files.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta

from llamapool import keys as keysfile
from llamapool.errors import ConfigError as ConfigError
from llamapool.protocol.endpoints import default_frontend as default_frontend
from llamapool.protocol.endpoints import default_runtime_dir as default_runtime_dir
from llamapool.protocol.endpoints import ipc_path as ipc_path
from llamapool.protocol.endpoints import needs_curve as needs_curve
from llamapool.tables import DURATION, Duration, Env, Names, Parse, Timeout, Wait, table
from llamapool.worker.settings import (
    MAX_LORA_SCALE,
    EngineSettings,
    NonNegative,
    Positive,
    host_kv_bytes,
    parse_size,
    size_bytes,
)
from llamapool.worker.settings import step_budget as step_budget


def ram_budget(text: str, total: int) -> int:
    """``[pool] ram_budget`` in bytes, given the machine's RAM: "16GiB", "12000MB", "75%"; "" -> 80 %."""
    if not text:
        return int(total * 0.8)
    size = parse_size(text)
    if size is None:
        raise ConfigError(f"pool.ram_budget: must be a size such as \"16GiB\" or \"12000MB\", or a share of "
                          f"the RAM such as \"75%\", got {text!r}")
    number, unit = size
    if unit == "%":
        if not 0 < number <= 100:
            raise ConfigError(f"pool.ram_budget: a share of the RAM must be > 0% and <= 100%, got {text!r}")
        return int(total * number / 100)
    return size_bytes(number, unit)


def _ram_budget(value: Any) -> Any:
    if isinstance(value, str):
        ram_budget(value, 1 << 30)  # its form (the machine's RAM is read at start)
    return value


def _listen(value: Any, empty: bool = False) -> Any:
    """A listen address, "host:port" (or "" for none, with ``empty``), as it is."""
    if isinstance(value, str) and (value or not empty):
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(value)
    return value


def _kv_host(value: Any) -> Any:
    if isinstance(value, str):
        host_kv_bytes(value, ram=1 << 30)  # its form (the machine's RAM is read at start)
    return value


KVHost = Annotated[str, Parse(_kv_host, '"auto", "0" or a size such as "16GiB"')]
Listen = Annotated[str, Parse(_listen, '"host:port"')]
ListenOrNone = Annotated[str, Parse(functools.partial(_listen, empty=True), '"host:port" (or "" for none)')]
RAMBudget = Annotated[str, Parse(_ram_budget)]


@dataclass(frozen=True)
class ServerConfig:
    frontend: str = ""  # "" -> ipc://<runtime_dir>/frontend.sock
    backend: str = ""  # "" -> ipc://<runtime_dir>/backend.sock
    runtime_dir: str = ""  # "" -> default_runtime_dir()
    max_queue: Positive = 4096  # queued prompts; beyond this a request gets 'overloaded'
    queue_timeout: Timeout = 60.0  # seconds a prompt may wait for a slot -> 'unavailable'
    drain_timeout: Timeout = 60.0  # SIGTERM: seconds in-flight requests get to finish
    reload_surge: bool = True  # a reload starts a replaced worker's successor beside it where the device has room
    max_message_bytes: Positive = 4 * 1024 * 1024
    min_ready_workers: int = 1  # systemd READY=1 once this many workers are ready
    affinity_slack: NonNegative = 4  # prefer a worker holding the prompt's prefix unless it has this many
    # fewer free slots than the least-loaded worker
    # tenants (http.api_keys_file, docs/http.md): the seconds of a rate-limit window (rpm and tpm are
    # scaled to it), the flex class's queue_timeout, and how long a tenant keeps its share of a model's
    # slots after its last request
    rate_window: Duration = 60.0
    flex_queue_timeout: Duration = 240.0
    tenant_idle: Duration = 5.0


Device = int | str  # a GPU index or a "GPU-<uuid>" / "MIG-<uuid>" string
GPU = Annotated[int, Meta(ge=0)] | Annotated[str, Meta(pattern=r"\A(GPU|MIG)-")]
# "auto" | "cpu" | "remote" | [0, 1] | [[0, 1], [2, 3]]
GPUs = Annotated[list[GPU], Meta(min_length=1)]
Devices = Annotated[
    Literal["auto", "cpu", "remote"] | Annotated[list[GPU | GPUs], Meta(min_length=1)],
    Meta(description='"auto", "cpu", "remote", a non-empty list of GPU indices or "GPU-<uuid>" strings, or a list '
                     'of such lists (one worker per group)')]
POOL_KEYS = ("devices", "cpu_workers", "slots", "threads", "kv_host")  # [workers] keys a model may override
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,63}")
NAMES = "1 to 64 letters, digits, '.', '_', '-' or '/', starting with a letter or digit"
REPLICAS = "[at least, at most] workers, 0 <= at least <= at most, at most >= 1, e.g. [1, 4]"
Pooling = Annotated[Literal["", "mean", "cls", "last"],
                    Meta(description='"mean", "cls" or "last" (or "": the GGUF\'s own)')]
Task = Annotated[Literal["", "generate", "embed", "rerank"], Meta(description='"generate", "embed" or "rerank"')]
Load = Annotated[Literal["always", "on_demand"], Meta(description='"always" (loaded at start, never evicted) or '
                                                                  '"on_demand" (loaded at its first request)')]
Replicas = Annotated[tuple[NonNegative, ...], Meta(max_length=2, description=REPLICAS)]  # or []
MOVED = {  # model keys renamed or removed
    "n_batch": "renamed to model.max_batch_tokens (the per-step token budget)",
    "prefill_chunk": "replaced by model.max_batch_tokens: one token budget per step, shared by decoding sequences "
                     "and prompt chunks (see docs/benchmarks.md); remove it",
}


@dataclass(frozen=True)
class LoraTable:
    """A ``[[models.lora]]`` table: a LoRA adapter of the model, named as a model is."""

    name: Annotated[str, Meta(pattern=rf"\A{MODEL_NAME.pattern}\Z",
                              description=f"{NAMES}; requests name the adapter by it")]
    path: Annotated[str, Meta(min_length=1, description="a LoRA adapter GGUF, or hf:OWNER/REPO/FILE.gguf")]
    scale: Annotated[float, Meta(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE,
                                 description=f"a number from -{MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g}")] = 1.0


@dataclass(frozen=True)
class ModelConfig(EngineSettings):
    """One model of the pool: a ``[[models]]`` table (or the legacy ``[model]``); its engine's keys are
    :class:`EngineSettings`' (declared there once).

    ``devices``, ``cpu_workers``, ``slots`` and ``threads`` default to the ``[workers]`` keys of the
    same name; a model's own key overrides them.
    """

    path: str = ""
    name: str = ""  # "" -> the model file's stem; requests name the model by it
    # CUDA: quantised matrix products of at least this many rows (prompt batches) run in cuBLAS, smaller
    # ones (decode steps) in llama.cpp's MMQ kernels; needs patches/llama.cpp (make install CUDA=1).
    # 0 = llama.cpp's own choice. Measured: docs/benchmarks.md (issue 30).
    prefill_cublas_min_rows: NonNegative = 128
    engine: Literal["llama", "echo"] = "llama"  # "echo": a no-model engine for router benchmarks only
    devices: Devices = "auto"  # "auto" | "cpu" | [0, 1] (a worker per GPU) | [[0, 1], [2, 3]] (per group)
    # | "remote": no local worker, `llamapool node` hosts serve it (a router host without GPUs)
    cpu_workers: Positive = 2  # CPU workers when devices = "cpu" or no GPU is found
    embedding: bool = False  # an embedding model: its workers answer /v1/embeddings (and embed), not generation
    pooling: Pooling = ""  # with embedding: "mean" | "cls" | "last"; "" -> the GGUF's own (mean if it has none)
    # what its workers do: "generate", "embed" (= embedding = true) or "rerank" (a cross-encoder scoring
    # query-document pairs with llama.cpp's rank pooling: /v1/rerank, /v2/rerank, Client.rerank);
    # "" -> "embed" with embedding = true, else "generate"
    task: Task = ""
    # When its workers run (docs/configuration.md, "A pool that follows demand"): "always" (at start, never
    # evicted: the plan of `devices`) or "on_demand" (at its first request, placed by free memory, evicted
    # when idle and another model needs the room, unloaded after idle_unload)
    load: Load = "always"
    # [min, max] workers, placed by free memory and following the load; [] -> "always": one worker per
    # device of `devices` (a fixed plan), "on_demand": [0, 1]
    replicas: Replicas = ()
    # seconds unused before an on_demand model is unloaded; -1 -> [pool] idle_unload
    idle_unload: Annotated[float, DURATION] = -1.0

    @property
    def managed(self) -> bool:
        """Whether the placement policy starts and stops its workers (supervisor/placement.py), rather
        than the fixed plan of its ``devices``."""
        return self.load == "on_demand" or bool(self.replicas)

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(at least, at most) workers of a managed model."""
        if self.replicas:
            return self.replicas[0], self.replicas[1]
        return (0, 1) if self.load == "on_demand" else (1, 1)

    @property
    def groups(self) -> list[list[Device]] | None:
        """The explicit GPU groups (one worker each), or None for "auto", "cpu" and "remote"."""
        if isinstance(self.devices, str):
            return None
        return [d if isinstance(d, list) else [d] for d in self.devices]


@dataclass(frozen=True)
class WorkersConfig:
    """Pool-wide worker settings. ``devices``, ``cpu_workers``, ``slots`` and ``threads`` are the
    defaults of every model (a model's own key overrides them)."""

    devices: Devices = "auto"  # "auto" | "cpu" | [0, 1] | ["GPU-<uuid>", ...] | [[0, 1], [2, 3]]
    cpu_workers: Positive = 2
    slots: Positive = EngineSettings.slots
    threads: NonNegative = EngineSettings.threads  # CPU threads per worker; 0 -> split the cores between CPU workers
    kv_host: KVHost = EngineSettings.kv_host  # the host-RAM KV tier of each worker: "auto", "16GiB" or "0" (off)
    env: Env = field(default_factory=dict)
    heartbeat_interval: Timeout = 1.0
    heartbeat_liveness: Positive = 3  # missed heartbeats before a worker is dead
    step_timeout: Timeout = 60.0  # an engine step running longer than this is a hung worker
    start_timeout: Timeout = 600.0  # loading a model may take this long
    restart_backoff: Timeout = 1.0  # first restart delay, doubling up to restart_backoff_max
    restart_backoff_max: Timeout = 30.0
    flap_window: Timeout = 60.0  # more than flap_limit deaths within this window -> failed
    flap_limit: Positive = 5


@dataclass(frozen=True)
class PoolConfig:
    """``[pool]``: how models marked ``load = "on_demand"`` or given ``replicas`` are loaded, placed,
    scaled and unloaded (supervisor/placement.py; docs/configuration.md, "A pool that follows demand")."""

    ram_budget: RAMBudget = ""  # what CPU workers' models may take: "16GiB", "12000MB", "75%"; "" -> 80% of the RAM
    idle_unload: Wait = 0.0  # seconds unused before an on_demand model is unloaded; 0 -> never
    scale_up_wait: Wait = 2.0  # a model's oldest waiting request waited this long: start another replica
    scale_down_idle: Wait = 60.0  # a replica idle this long (and more than its minimum): retire it
    min_residency: Wait = 30.0  # a worker serves at least this long before it can be evicted or retired
    load_backoff: Wait = 30.0  # a failed load: no new try for this long (doubling with each failure, to 10 min)


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP gateway; no ``[http]`` table, no gateway."""

    listen: Listen = "127.0.0.1:8000"  # host:port ([::1]:8000 for IPv6)
    processes: Positive = 1  # gateway processes accepting on the supervisor's one listening socket
    api_keys_file: str = ""  # one key per line, with its tenant's settings (keys.py); "" -> no authentication
    # a header a proxy in front sets to name the tenant (trusted: docs/security.md)
    tenant_header: Annotated[str, Meta(pattern=r"\A[A-Za-z0-9-]{0,64}\Z",
                                       description="a header name (letters, digits, '-')")] = ""
    request_timeout: Timeout = 600.0  # seconds a request may take in all -> 504
    # cross-site protection (gateway/origins.py, docs/security.md)
    allowed_hosts: Names = ()  # Host names besides localhost and the listen address; ["*"]: any
    cors_origins: Names = ()  # web origins allowed to call the API (CORS); others' requests: 403
    # connection hygiene (gateway/connections.py, docs/security.md)
    idle_timeout: Timeout = 30.0  # seconds a connection may hold no request (before its first, between two)
    read_timeout: Timeout = 30.0  # seconds a request's head and body may take to arrive, from its first byte
    # per gateway process; 0: the fd limit less 64, at most 4096. Past it the oldest idle goes
    max_connections: NonNegative = 0
    send_timeout: Timeout = 30.0  # seconds a client may read nothing of its reply; then: cut, request cancelled
    send_buffer_bytes: Positive = 256 * 1024  # a reply's unread bytes held for a client; past it: cut, cancelled
    # stored responses (POST /v1/responses with store, previous_response_id, GET/DELETE /v1/responses/{id}):
    # an SQLite file in the state directory (Config.responses_path), every gateway process sharing it
    responses_store: bool = True  # false: nothing is stored (store acts as false), previous_response_id is a 400
    responses_ttl: Duration = 30 * 86400.0  # seconds a stored response is kept (OpenAI's 30 days); "720h"
    # MiB the stored responses (their JSON) take at most: past it, the oldest go
    responses_max_mb: Annotated[float, Meta(gt=0)] = 1024.0
    # http(s) image URLs (gateway/fetch.py): fetched only with fetch_media = true, from the listed hosts (none:
    # any), at most max_bytes and timeout seconds each, never from a private address unless fetch_media_private
    fetch_media: bool = False
    fetch_media_hosts: Names = ()
    fetch_media_max_bytes: int = 8 << 20
    fetch_media_timeout: float = 10.0
    fetch_media_private: bool = False

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class MetricsConfig:
    """A Prometheus endpoint served by the supervisor; no ``[metrics]`` table, none (the gateway's
    ``GET /metrics`` is there either way)."""

    listen: ListenOrNone = "127.0.0.1:9464"  # host:port; "" -> none (the table only sets the options below)
    # also export the pod's gauges under vLLM's names (vllm:num_requests_waiting, ...), so that an
    # inference gateway's endpoint picker configured for vLLM reads llamapool unchanged (docs/metrics.md)
    vllm_compatible_names: bool = False

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class KVEventsConfig:
    """``[kv_events]``: KV-cache events for llm-d's precise prefix-cache scorer (supervisor/kvevents.py,
    docs/kubernetes.md), as vLLM's ``--kv-events-config``. No table (or ``enable = false``): none."""

    enable: bool = False
    endpoint: str = "tcp://*:5557"  # the pod's PUB socket: bound with a wildcard (or ipc://), else connected
    replay_endpoint: str = ""  # a ROUTER socket replaying buffered batches (e.g. "tcp://*:5558"); "": none
    buffer_steps: Positive = 10_000  # batches kept for replay
    hwm: Positive = 100_000  # the PUB socket's high-water mark (batches); past it a batch is dropped and counted
    topic: str = "kv@{pod}@{model}"  # llm-d's "kv@<pod>@<model>"; {pod} and {model} are filled in
    pod: str = ""  # {pod}: "" -> "$POD_IP:<http port>" (else the host name), the address the picker knows
    block_size: Positive = 16  # tokens a block (the EPP's tokenProcessorConfig.blockSize should match)


@dataclass(frozen=True)
class SecurityConfig:
    """CURVE for tcp:// sockets (docs/security.md). Paths are relative to the config file."""

    server_key: str = ""  # the router's secret key file (llamapool keygen NAME -> NAME.key)
    authorized_keys: str = ""  # directory of the public keys (*.pub) of clients and remote workers
    insecure_tcp: bool = False  # allow tcp:// without CURVE (a warning at start-up)


@dataclass(frozen=True)
class NodeConfig:
    """``[node]``: ``llamapool node`` runs this host's workers for a router on another host (no router
    here). Paths are relative to the config file. See README "Two hosts"."""

    join: str = ""  # the router's backend, e.g. "tcp://10.0.0.1:5556"
    name: str = ""  # "" -> the host name; workers are named "<name>/cpu0", "<name>/gpu1", ...
    server_public_key: str = ""  # the router's public key file (router.pub)
    key: str = ""  # this node's secret key file (llamapool keygen NAME); its .pub is in the router's allow-list


@dataclass(frozen=True)
class LogConfig:
    """``[log]``: how every process of the daemon logs (see llamapool.log)."""

    format: Literal["text", "json"] = "text"  # "text" (llamapool: ...) | "json" (one object a line)
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    models: tuple[ModelConfig, ...] = (ModelConfig(name="llamapool"),)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    http: HttpConfig | None = None
    metrics: MetricsConfig | None = None
    security: SecurityConfig = field(default_factory=SecurityConfig)
    log: LogConfig = field(default_factory=LogConfig)
    node: NodeConfig | None = None  # [node]: this config is for `llamapool node`
    kv_events: KVEventsConfig | None = None  # [kv_events]: KV-cache events (None or enable = false: none)
    source: str = ""
    models_table: bool = False  # the models came from [[models]] (worker names carry the model's name)

    @property
    def model(self) -> ModelConfig:
        """The first model: the one a request without ``model`` gets."""
        return self.models[0]

    @property
    def model_name(self) -> str:
        """The first model's name (the default model)."""
        return self.models[0].name

    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.models]

    @property
    def adapters(self) -> list[tuple[str, str, float]]:
        """Every model's LoRA adapters as (adapter name, model name, scale): a request naming the adapter as
        its model is the model's with the adapter at that scale."""
        return [(a[0], m.name, a[2]) for m in self.models for a in m.lora]

    @property
    def runtime_dir(self) -> Path:
        return Path(self.server.runtime_dir) if self.server.runtime_dir else default_runtime_dir()

    @property
    def state_dir(self) -> Path:
        """What outlives a restart (the stored responses): systemd's STATE_DIRECTORY (the unit's
        StateDirectory=, /var/lib/llamapool; its RuntimeDirectory= goes when the service stops), else
        the runtime dir."""
        given = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        return Path(given) if given else self.runtime_dir

    @property
    def responses_path(self) -> str:
        """The stored responses' SQLite file ("" when ``[http] responses_store`` is off or there is no gateway)."""
        if self.http is None or not self.http.responses_store:
            return ""
        return str(self.state_dir / "responses.sqlite")

    @property
    def frontend(self) -> str:
        return self.server.frontend or f"ipc://{self.runtime_dir / 'frontend.sock'}"

    @property
    def backend(self) -> str:
        return self.server.backend or f"ipc://{self.runtime_dir / 'backend.sock'}"

    @property
    def curve(self) -> bool:
        """Whether the router runs CURVE on its network (tcp://) sockets."""
        return bool(self.security.server_key) and (needs_curve(self.frontend) or needs_curve(self.backend))

    @property
    def server_public_key_file(self) -> str:
        """The router's public key file for clients: ``server_key``'s ``.pub`` sibling ("" if none)."""
        if not self.security.server_key:
            return ""
        pub = Path(self.security.server_key).with_suffix(".pub")
        return str(pub) if pub.is_file() else ""


def _lora_tables(key: str, value: Any) -> tuple[tuple[str, str, float], ...]:
    """``[[models.lora]]`` tables as (name, path, scale), names unique in the model."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{key}: must be [[{key}]] tables of name, path and scale")
    out: list[tuple[str, str, float]] = []
    for i, t in enumerate(value):
        lora = table(f"{key}[{i}]", LoraTable, t)
        if lora.name in [a[0] for a in out]:
            raise ConfigError(f"{key}[{i}].name: {lora.name!r} is also the name of another adapter of the model")
        out.append((lora.name, lora.path, lora.scale))
    return tuple(out)


def _distinct(key: str, devices: Devices) -> None:
    """A GPU listed twice in one ``devices`` is an error."""
    flat = [x for d in ([] if isinstance(devices, str) else devices) for x in (d if isinstance(d, list) else [d])]
    twice = sorted({repr(x) for x in flat if flat.count(x) > 1})
    if twice:
        raise ConfigError(f"{key}: GPU {', '.join(twice)} is listed twice: a GPU belongs to one worker")


def _lora_paths(key: str, m: ModelConfig, base_dir: Path | None) -> ModelConfig:
    """The model's adapter paths resolved as its own ``path`` is: relative to the config file, or an ``hf:``
    reference's cached file (else the reference, which ``serve`` downloads)."""
    if not m.lora:
        return m
    if m.engine != "llama" or m.embedding or m.task in ("embed", "rerank"):
        raise ConfigError(f"{key}.lora: adapters apply to a generative llama model (not an embedding model, a "
                          f"reranker or the echo engine)")
    from llamapool import hub

    resolved = []
    for i, (name, path, scale) in enumerate(m.lora):
        if hub.is_ref(path):
            try:
                ref = hub.parse(path)
            except ValueError as e:
                raise ConfigError(f"{key}.lora[{i}].path: {e}") from None
            local = hub.cached(ref)
            path = str(local) if local else str(ref)
        elif base_dir is not None and not Path(path).is_absolute():
            path = str((base_dir / path).resolve())
        resolved.append((name, path, scale))
    return dataclasses.replace(m, lora=tuple(resolved))


def _models(raw: dict[str, Any], workers: WorkersConfig, base_dir: Path | None) -> tuple[ModelConfig, ...]:
    """``[[models]]`` (or the legacy ``[model]``, a pool of one), each over the ``[workers]`` defaults."""
    if "model" in raw and "models" in raw:
        raise ConfigError("models: give either [model] (one model) or [[models]] tables, not both")
    if "models" in raw:
        tables = raw["models"]
        if not isinstance(tables, list) or not tables:
            raise ConfigError("models: must be one or more [[models]] tables")
        named = [(f"models[{i}]", t) for i, t in enumerate(tables)]
    else:
        named = [("model", raw.get("model", {}))]
    pool = {k: getattr(workers, k) for k in POOL_KEYS}
    models: list[ModelConfig] = []
    for key, keys in named:
        if not isinstance(keys, dict):
            raise ConfigError(f"{key}: must be a table")
        lora = _lora_tables(f"{key}.lora", keys["lora"]) if "lora" in keys else ()
        m = table(key, ModelConfig, {k: v for k, v in keys.items() if k != "lora"}, {**pool, "lora": lora}, MOVED)
        models.append(_model(key, m, base_dir, explicit="name" in keys, listed=key != "model"))
    seen: dict[str, str] = {}
    for (key, _), m in zip(named, models, strict=True):
        if m.name in seen:
            raise ConfigError(f"{key}.name: {m.name!r} is also the name of {seen[m.name]}: names must be unique")
        seen[m.name] = key
    for (key, _), m in zip(named, models, strict=True):  # an adapter is named as a model is (vLLM's way)
        for i, (name, _path, _scale) in enumerate(m.lora):
            if name in seen:
                raise ConfigError(f"{key}.lora[{i}].name: {name!r} is also the name of {seen[name]}: model and "
                                  f"adapter names must be unique")
            seen[name] = f"{key}.lora[{i}]"
    _check_overlap(named, models)
    return tuple(models)


def _model_task(m: ModelConfig, key: str) -> ModelConfig:
    """``m`` with its ``task`` resolved ("generate", "embed" or "rerank"); "embed" is ``embedding = true``."""
    if m.task in ("generate", "rerank") and m.embedding:
        raise ConfigError(f"{key}.embedding: an embedding model's task is \"embed\", not {m.task!r}")
    if m.task == "rerank" and m.engine != "llama":
        raise ConfigError(f"{key}.task: \"rerank\" needs engine = \"llama\" (the echo engine computes nothing)")
    if m.task == "rerank" and m.pooling:
        raise ConfigError(f"{key}.pooling: a reranker pools by rank (llama.cpp's classification head); "
                          f"leave pooling unset with task = \"rerank\"")
    task = m.task or ("embed" if m.embedding else "generate")
    return dataclasses.replace(m, task=task, embedding=task == "embed")


def _mmproj(key: str, m: ModelConfig, base_dir: Path | None) -> str:
    """The model's projector: its cached file for an hf: reference (else the reference: `serve` downloads
    it), a path resolved against ``base_dir``."""
    if m.embedding or m.task in ("embed", "rerank") or m.engine != "llama":
        raise ConfigError(f"{key}.mmproj: applies to a generation model (engine = \"llama\", no embedding, "
                          f"no rerank)")
    if not m.mmproj.startswith("hf:"):
        return str((base_dir / m.mmproj).resolve()) if base_dir is not None and not Path(m.mmproj).is_absolute() \
            else m.mmproj
    from llamapool import hub

    try:
        ref = hub.parse(m.mmproj, mmproj=True)
    except ValueError as e:
        raise ConfigError(f"{key}.mmproj: {e}") from None
    local = hub.cached(ref)
    return str(local) if local else m.mmproj


def _model(key: str, m: ModelConfig, base_dir: Path | None, explicit: bool, listed: bool) -> ModelConfig:
    """Resolve one model's paths and name, and check the keys that depend on each other."""
    if not m.path and m.engine == "llama":
        raise ConfigError(f"{key}.path: is required")
    if m.path.startswith("hf:"):  # a Hugging Face reference: its cached file, else `serve` downloads it (hub.py)
        from llamapool import hub

        try:
            ref = hub.parse(m.path)
        except ValueError as e:
            raise ConfigError(f"{key}.path: {e}") from None
        local = hub.cached(ref)
        m = dataclasses.replace(m, name=m.name or ref.name, path=str(local) if local else str(ref))
    elif base_dir is not None and m.path and not Path(m.path).is_absolute():
        m = dataclasses.replace(m, path=str((base_dir / m.path).resolve()))
    if not m.name:
        m = dataclasses.replace(m, name=Path(m.path).stem or "llamapool")
    if m.mmproj:
        m = dataclasses.replace(m, mmproj=_mmproj(key, m, base_dir))
    if (listed or explicit) and not MODEL_NAME.fullmatch(m.name):
        raise ConfigError(f"{key}.name: {m.name!r} must be {NAMES}" + ("" if explicit else " (set name = \"...\")"))
    m = _lora_paths(key, m, base_dir)
    if m.chat_template:
        from llamapool.worker.chat import check_template_file  # Jinja2 only, no llama.cpp

        if base_dir is not None and not Path(m.chat_template).is_absolute():
            m = dataclasses.replace(m, chat_template=str((base_dir / m.chat_template).resolve()))
        try:
            check_template_file(m.chat_template)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    m = _model_task(m, key)
    _check_model(key, m)
    return m


def _check_model(key: str, m: ModelConfig) -> None:
    """The model's keys that depend on each other, and the engine's own forms (kv_host, target_step)."""
    if m.embedding and m.engine != "llama":
        raise ConfigError(f"{key}.embedding: needs engine = \"llama\" (the echo engine computes nothing)")
    if m.pooling and not m.embedding:
        raise ConfigError(f"{key}.pooling: applies to an embedding model only; set {key}.embedding = true")
    try:
        host_kv_bytes(m.kv_host, ram=1 << 30)
    except ValueError as e:
        raise ConfigError(f"{key}.{e}") from None
    from llamapool.worker.scheduler import StepTarget  # pure Python, no llama.cpp

    try:
        StepTarget.parse(m.target_step)
    except ValueError as e:
        raise ConfigError(f"{key}.target_step: {e}") from None
    if m.max_batch_tokens and m.max_batch_tokens <= m.slots:
        raise ConfigError(
            f"{key}.max_batch_tokens: must be > the slots per worker ({m.slots}): every step gives each "
            f"busy slot a token and prompts need the rest, got {m.max_batch_tokens}"
        )
    if m.replicas and not (len(m.replicas) == 2 and m.replicas[0] <= m.replicas[1] >= 1):
        raise ConfigError(f"{key}.replicas: must be {REPLICAS}, got {list(m.replicas)!r}")
    if m.idle_unload < 0 and m.idle_unload != -1:
        raise ConfigError(f"{key}.idle_unload: must be >= 0 seconds (0: never), got {m.idle_unload!r}")
    _distinct(f"{key}.devices", m.devices)
    if m.managed and (m.devices == "remote" or any(len(g) > 1 for g in m.groups or [])):
        what = "load = \"on_demand\"" if m.load == "on_demand" else "replicas"
        raise ConfigError(f"{key}.devices: {what} places each worker on one GPU (or the CPU) by free memory; "
                          f"it cannot be \"remote\" or GPU groups, got {m.devices!r}")
    if m.tensor_split and not sum(m.tensor_split) > 0:
        raise ConfigError(f"{key}.tensor_split: must have a share above 0 (a share per GPU of a group), "
                          f"got {list(m.tensor_split)!r}")
    if m.tensor_split:
        groups = m.groups
        if groups is None or any(len(g) != len(m.tensor_split) for g in groups):
            raise ConfigError(f"{key}.tensor_split: has {len(m.tensor_split)} shares; it needs devices given as "
                              f"groups of as many GPUs (devices = {m.devices!r})")


def _check_overlap(named: list[tuple[str, Any]], models: list[ModelConfig]) -> None:
    """A GPU named (by index or UUID) in two models' ``devices`` is an error naming both. (An index
    and a UUID of one GPU are caught at start, once NVML says which is which.)"""
    owner: dict[Device, tuple[str, str]] = {}
    for (key, _), m in zip(named, models, strict=True):
        for group in [] if m.managed else m.groups or []:  # managed models share GPUs by free memory
            for d in group:
                if d in owner and owner[d][1] != m.name:
                    other_key, other = owner[d]
                    raise ConfigError(
                        f"{key}.devices: GPU {d!r} of model {m.name!r} is also in model {other!r} "
                        f"({other_key}.devices): a GPU belongs to at most one worker")
                owner[d] = (key, m.name)


def from_dict(raw: dict[str, Any], base_dir: Path | None = None, source: str = "") -> Config:
    """Build a validated :class:`Config`; relative model paths resolve against ``base_dir``."""
    sections: dict[str, type] = {
        "server": ServerConfig, "workers": WorkersConfig, "pool": PoolConfig, "http": HttpConfig,
        "metrics": MetricsConfig, "security": SecurityConfig, "log": LogConfig, "node": NodeConfig,
        "kv_events": KVEventsConfig}
    for key in raw:
        if key not in sections and key not in ("model", "models"):
            raise ConfigError(f"{key}: unknown section (known: server, models, model, {', '.join(list(sections)[1:])})")
    parts: dict[str, Any] = {name: table(name, cls, raw.get(name, {})) for name, cls in sections.items()
                             if name in raw or name not in ("http", "metrics", "node", "kv_events")}
    _distinct("workers.devices", parts["workers"].devices)
    if "http" in parts:
        parts["http"] = _http(parts["http"], base_dir)
    if "kv_events" in parts:
        parts["kv_events"] = _kv_events(parts["kv_events"])
    models = _models(raw, parts["workers"], base_dir)
    parts["security"] = _security(parts["security"], parts["server"], base_dir)
    if "node" in parts:
        parts["node"] = _node(parts["node"], parts["security"], base_dir)
        remote = [m.name for m in models if m.devices == "remote"]
        if remote:
            raise ConfigError(f"devices: \"remote\" (model {remote[0]!r}) is for a router's config; "
                              f"a node runs the workers of its models itself")
    return Config(source=source, models=models, models_table="models" in raw, **parts)


def _kv_events(kv: KVEventsConfig) -> KVEventsConfig | None:
    """``[kv_events]``: None unless enabled; endpoints ZeroMQ can take; a topic naming the model."""
    if not kv.enable:
        return None
    for key, value in (("endpoint", kv.endpoint), ("replay_endpoint", kv.replay_endpoint)):
        if (value or key == "endpoint") and not re.fullmatch(r"(tcp|ipc|inproc)://\S+", value):
            raise ConfigError(f"kv_events.{key}: must be a ZeroMQ endpoint such as \"tcp://*:5557\", got {value!r}")
    if kv.replay_endpoint and kv.replay_endpoint == kv.endpoint:
        raise ConfigError("kv_events.replay_endpoint: must differ from kv_events.endpoint")
    if "{model}" not in kv.topic:
        raise ConfigError(f"kv_events.topic: must contain {{model}} (each model has its own topic), got {kv.topic!r}")
    return kv


def _node(node: NodeConfig, sec: SecurityConfig, base_dir: Path | None) -> NodeConfig:
    """``[node]``: a name usable in worker names, and CURVE keys for a network endpoint."""
    import re
    import socket

    name = node.name or socket.gethostname().split(".")[0]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ConfigError(f"node.name: {name!r} must be letters, digits, '.', '_', '-' (no '/' or ':'); "
                          f"it prefixes the node's worker names")
    if not node.join:
        raise ConfigError("node.join: is required: the router's backend endpoint, e.g. \"tcp://10.0.0.1:5556\"")
    paths = {}
    for key in ("server_public_key", "key"):
        value = getattr(node, key)
        if value and base_dir is not None and not Path(value).is_absolute():
            value = str((base_dir / value).resolve())
        paths[key] = value
    node = dataclasses.replace(node, name=name, **paths)
    if needs_curve(node.join) and not (node.server_public_key and node.key) and not sec.insecure_tcp:
        raise ConfigError(f"node.join: {node.join} is a network endpoint: set node.server_public_key (the router's "
                          f".pub) and node.key (this node's .key, `llamapool keygen NAME`), or [security] "
                          f"insecure_tcp = true for a router without CURVE (see docs/security.md)")
    if bool(node.server_public_key) != bool(node.key):
        raise ConfigError("node.server_public_key and node.key: set both or neither")
    return node


def _security(sec: SecurityConfig, server: ServerConfig, base_dir: Path | None) -> SecurityConfig:
    """Resolve the key paths; a network endpoint needs a server key or ``insecure_tcp = true``.
    The key files themselves are read and checked at start-up (llamapool.security)."""
    paths = {}
    for key in ("server_key", "authorized_keys"):
        value = getattr(sec, key)
        if value and base_dir is not None and not Path(value).is_absolute():
            value = str((base_dir / value).resolve())
        paths[key] = value
    sec = dataclasses.replace(sec, **paths)
    for name in ("frontend", "backend"):
        endpoint = getattr(server, name)
        if endpoint and needs_curve(endpoint) and not sec.server_key and not sec.insecure_tcp:
            raise ConfigError(
                f"server.{name}: {endpoint} is reachable over the network: set [security] server_key "
                f"(the router's key, `llamapool keygen router`) and authorized_keys (a directory of client "
                f"public keys), or insecure_tcp = true to accept anyone who can connect (see docs/security.md)")
    if sec.server_key and not sec.authorized_keys:
        raise ConfigError("security.authorized_keys: required with security.server_key: a directory of the "
                          "public keys (*.pub) of the clients and remote workers to accept (may be empty)")
    if sec.authorized_keys and not Path(sec.authorized_keys).is_dir():
        raise ConfigError(f"security.authorized_keys: {sec.authorized_keys} is not a directory")
    return sec


ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://([^/\s:?#\[\]]+|\[[0-9a-fA-F:.]+\])(:\d{1,5})?/?|null")
HOST = re.compile(r"(\*\.)?[a-zA-Z0-9_.-]+|\[[0-9a-fA-F:.]+\]|[0-9a-fA-F:]+")


def _http(http: HttpConfig, base_dir: Path | None) -> HttpConfig:
    for origin in http.cors_origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise ConfigError(f"http.cors_origins: {origin!r} is not an origin: \"*\" or scheme://host[:port], "
                              f"e.g. \"http://localhost:3000\" (no path)")
    for host in http.allowed_hosts:
        if host != "*" and not HOST.fullmatch(host):
            raise ConfigError(f"http.allowed_hosts: {host!r} is not a host name: \"*\", NAME or \"*.DOMAIN\" "
                              f"(no scheme, port or path)")
    keys = http.api_keys_file
    if keys:
        if base_dir is not None and not Path(keys).is_absolute():
            keys = str((base_dir / keys).resolve())
        if not Path(keys).is_file():
            raise ConfigError(f"http.api_keys_file: {keys} does not exist")
        try:
            keysfile.load(keys)
        except keysfile.KeysFileError as e:
            raise ConfigError(f"http.api_keys_file: {e}") from None
    return dataclasses.replace(http, api_keys_file=keys, tenant_header=http.tenant_header.lower())


def tenants_of(cfg: Config) -> keysfile.KeysFile | None:
    """The keys file's tenants, for the router (None: no keys file)."""
    if cfg.http is None or not cfg.http.api_keys_file:
        return None
    return keysfile.load(cfg.http.api_keys_file)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    return from_dict(raw, p.parent.resolve(), str(p))
