"""Each worker's environment, built before it starts and never changed after."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from llamapool import llama_patches
from llamapool.supervisor.gpus import Gpu
from llamapool.supervisor.sdnotify import scrub_env


def worker_env(
    base: Mapping[str, str], gpus: Gpu | Sequence[Gpu] | None, extra: Mapping[str, str], threads: int,
    prefill_cublas_min_rows: int = 0, deterministic: bool = False,
) -> dict[str, str]:
    """``base`` without systemd's variables, plus ``[workers.env]``, plus the model's llama.cpp settings
    (``prefill_cublas_min_rows``, ``deterministic``: llama_patches), plus the device pinning:
    ``CUDA_VISIBLE_DEVICES`` is the UUIDs of the worker's GPU or group of GPUs ("" for CPU).

    The model's settings and the device variables are applied last, so the model's setting is the one
    llama.cpp reads and no config can point two workers at one GPU.
    """
    group = [] if gpus is None else [gpus] if isinstance(gpus, Gpu) else list(gpus)
    env = scrub_env(base)  # only the main process talks to systemd
    env.update(extra)
    env.update(llama_patches.worker_env(prefill_cublas_min_rows, deterministic))
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in group)
    env["PYTHONUNBUFFERED"] = "1"
    if not group:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def cpu_threads(n_workers: int, configured: int = 0) -> int:
    """Threads per CPU worker: the configured number, else the cores split between workers."""
    if configured > 0:
        return configured
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, n_workers))
