"""What the supervisor starts runs, from the config in force: a child process's
:class:`~llamapool.supervisor.children.Launch` (a worker's spec and environment for ``llamapool.worker``,
a gateway's spec and its inherited listening socket for ``llamapool.gateway``), and the router thread's
:class:`~llamapool.router.RouterConfig`.
"""

from __future__ import annotations

import os
from typing import Any

from llamapool import lifeline
from llamapool.config import Config, step_budget, tenants_of
from llamapool.router import RouterConfig
from llamapool.supervisor.children import Launch, WorkerSlot
from llamapool.supervisor.curve import Curve
from llamapool.supervisor.env import cpu_threads, worker_env
from llamapool.supervisor.lifecycle import State
from llamapool.supervisor.pool import host_kv_share
from llamapool.supervisor.sdnotify import scrub_env
from llamapool.worker.server import WorkerSpec


def worker_spec(cfg: Config, slot: WorkerSlot, slots: list[WorkerSlot], curve: Curve, boot_id: str,
                kv_events: str = "") -> WorkerSpec:
    """The spec of ``slot``'s worker; its threads share the machine's cores with the other live ``slots``;
    ``kv_events``: the pod publisher's inbox its KV-cache events go to ("" : none)."""
    m, w = slot.model or cfg.model, cfg.workers
    live = [s for s in slots if s.state not in (State.STOPPED, State.RETIRING)] or [slot]
    # the cores are split between every CPU worker of every model (a model's threads overrides)
    n_cpu = sum(1 for s in live if not s.gpus) or 1
    threads = cpu_threads(n_cpu, m.threads) if not slot.gpus else min(8, cpu_threads(len(live), m.threads))
    budget = step_budget(m.max_batch_tokens, m.slots, bool(slot.gpus))
    fields: dict[str, Any] = curve.child_fields(cfg.backend)
    return WorkerSpec(
        name=slot.name, backend=cfg.backend, device=slot.device, model_path=m.path,
        heartbeat_interval=w.heartbeat_interval, heartbeat_liveness=w.heartbeat_liveness,
        engine=m.engine, model_name=m.name, boot_id=boot_id, embedding=m.embedding or m.task == "rerank",
        pooling="rank" if m.task == "rerank" else m.pooling,
        kv_events=kv_events, kv_events_block=cfg.kv_events.block_size if cfg.kv_events is not None else 16,
        **m.engine_settings(threads=threads, max_batch_tokens=budget,
                            kv_host=str(host_kv_share(m, len(live), bool(slot.gpus)))),
        **fields,
    )


def worker(cfg: Config, slot: WorkerSlot, spec: WorkerSpec, log_env: dict[str, str]) -> Launch:
    """A worker process: its spec, pinned to its GPUs (or given its CPU threads)."""
    model = slot.model or cfg.model
    env = worker_env(os.environ, slot.gpus, cfg.workers.env, spec.threads,
                     model.prefill_cublas_min_rows, model.deterministic)
    return Launch("llamapool.worker", spec.to_json(), {**env, **log_env, **lifeline.parent_env()})


def gateway(cfg: Config, slot: WorkerSlot, curve: Curve, min_ready: int, log_env: dict[str, str]) -> Launch:
    """A gateway process, accepting on its slot's listening socket; its /ready wants ``min_ready`` workers."""
    from llamapool.gateway import GatewaySpec

    http, listener = cfg.http, slot.listener
    assert http is not None and listener is not None
    spec = GatewaySpec(name=slot.name, frontend=cfg.frontend, host=listener.host, port=listener.port,
                       listen_fd=listener.fd,
                       model=cfg.model_name, api_keys_file=http.api_keys_file,
                       tenant_header=http.tenant_header,
                       drain_timeout=cfg.server.drain_timeout, request_timeout=http.request_timeout,
                       max_message_bytes=cfg.server.max_message_bytes,
                       allowed_hosts=list(http.allowed_hosts), cors_origins=list(http.cors_origins),
                       min_ready_workers=max(1, min_ready),
                       vllm_metric_names=cfg.metrics is not None and cfg.metrics.vllm_compatible_names,
                       models=[{"name": m.name, "path": m.path, "embedding": m.embedding, "task": m.task,
                                "ctx_per_slot": m.ctx_per_slot, "chat_template": m.chat_template,
                                "vision": bool(m.mmproj)}
                               for m in cfg.models],
                       fetch_media={"enabled": http.fetch_media, "hosts": list(http.fetch_media_hosts),
                                    "max_bytes": http.fetch_media_max_bytes, "timeout": http.fetch_media_timeout,
                                    "private": http.fetch_media_private},
                       idle_timeout=http.idle_timeout, read_timeout=http.read_timeout,
                       max_connections=http.max_connections, send_timeout=http.send_timeout,
                       send_buffer_bytes=http.send_buffer_bytes,
                       responses_store=cfg.responses_path, responses_ttl=http.responses_ttl,
                       responses_max_bytes=int(http.responses_max_mb * (1 << 20)),
                       **curve.child_fields(cfg.frontend))
    return Launch("llamapool.gateway", spec.to_json(),
                  {**scrub_env(os.environ), **log_env, **lifeline.parent_env()}, pass_fds=(listener.fd,))


def router_config(cfg: Config) -> RouterConfig:
    """The router's settings (its CURVE keys and the boot id are the arbiter's to add)."""
    s, w = cfg.server, cfg.workers
    return RouterConfig(
        frontend=cfg.frontend, backend=cfg.backend, max_queue=s.max_queue,
        queue_timeout=s.queue_timeout, max_message_bytes=s.max_message_bytes,
        heartbeat_interval=w.heartbeat_interval, heartbeat_liveness=w.heartbeat_liveness,
        step_timeout=w.step_timeout, affinity_slack=s.affinity_slack, models=tuple(cfg.model_names),
        adapters=tuple(cfg.adapters),
        tenants=tenants_of(cfg), rate_window=s.rate_window, flex_queue_timeout=s.flex_queue_timeout,
        tenant_idle=s.tenant_idle,
    )
