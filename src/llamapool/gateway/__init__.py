"""The HTTP gateway: OpenAI's API in front of the router, one process per ``[http] processes``.

Each gateway process is an ordinary client of the router (one :class:`llamapool.AsyncClient`), so a
request travels HTTP -> gateway -> router -> worker and back. The supervisor starts, restarts and
drains the gateway processes like workers; it binds the listening socket and every gateway process
inherits it, so they all accept from one kernel queue (``supervisor/listener.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GatewaySpec:
    """What one gateway process needs, passed by the supervisor as JSON in argv."""

    name: str
    frontend: str  # the router's frontend endpoint
    host: str  # the address the socket is bound to, as [http] listen names it (the Host check: origins.py)
    port: int
    listen_fd: int  # the supervisor's listening socket, inherited at this descriptor number
    model: str  # the pool's first model: a request without ``model`` gets it (/v1/models asks the router)
    api_keys_file: str = ""  # "" -> no authentication (llamapool/keys.py)
    tenant_header: str = ""  # a trusted header naming the tenant (a proxy in front sets it); "" -> none
    drain_timeout: float = 60.0
    request_timeout: float = 600.0  # a request's deadline at the router (-> 504)
    server_key: str = ""  # the router's public key (Z85) when the frontend uses CURVE
    key_file: str = ""  # with server_key: the gateway's secret key file
    # the router's server.max_message_bytes: a larger HTTP body gets 413 before it is read, and a
    # request that encodes larger is refused before it is sent (the router would refuse it)
    max_message_bytes: int = 4 * 1024 * 1024
    allowed_hosts: list[str] = field(default_factory=list)  # [http] allowed_hosts (gateway/origins.py)
    cors_origins: list[str] = field(default_factory=list)  # [http] cors_origins
    # [http] connection limits (gateway/connections.py)
    idle_timeout: float = 30.0
    read_timeout: float = 30.0
    max_connections: int = 0
    send_timeout: float = 30.0
    send_buffer_bytes: int = 256 * 1024
    min_ready_workers: int = 1  # /ready is 200 with this many workers serving (gateway/pod.py)
    vllm_metric_names: bool = False  # /metrics also names the pod's gauges as vLLM does ([metrics])
    # the stored responses' SQLite file ("" -> none: [http] responses_store = false), how long one is kept
    # and the most bytes they take ([http] responses_ttl, responses_max_mb; gateway/openai/store.py)
    responses_store: str = ""
    responses_ttl: float = 30 * 86400.0
    responses_max_bytes: int = 1 << 30
    # the pool's models as configured: {"name", "path", "embedding", "task", "ctx_per_slot", "chat_template",
    # "vision"} each (/v1/embeddings without a model takes the first embedding model, /v1/rerank the first
    # reranker; "vision": it has an mmproj, it takes images; /tokenizer_info reads the GGUF)
    models: list[dict[str, Any]] = field(default_factory=list)
    # [http] fetch_media and its bounds: {"enabled", "hosts", "max_bytes", "timeout", "private"} (gateway/fetch.py)
    fetch_media: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "hosts": [],
                                                                 "max_bytes": 8 << 20, "timeout": 10.0,
                                                                 "private": False})

    def takes_images(self, model: str | None) -> bool | None:
        """Whether the model (None: the default one) takes images; None when the gateway does not know it."""
        name = model or self.model
        found = next((m for m in self.models if m.get("name") == name), None)
        return None if found is None or "vision" not in found else bool(found["vision"])

    def embedding_model(self) -> str | None:
        """The pool's first embedding model, None when it has none."""
        return next((m["name"] for m in self.models if m.get("embedding")), None)

    def rerank_model(self) -> str | None:
        """The pool's first reranker (``task = "rerank"``), None when it has none."""
        return next((m["name"] for m in self.models if m.get("task") == "rerank"), None)

    def model_info(self, name: str | None) -> dict[str, Any] | None:
        """A model's configuration (None: the pool's first)."""
        return next((m for m in self.models if m["name"] == (name or self.model)), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GatewaySpec:
        return cls(**json.loads(text))
