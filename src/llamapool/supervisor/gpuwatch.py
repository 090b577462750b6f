"""NVML polling for the supervisor: every few seconds each GPU's figures (memory, utilization,
temperature, power, ECC) with its Xid error count, for ``status`` and ``/metrics``, and the GPUs NVML
can no longer read (their workers are failed for good)."""

from __future__ import annotations

import contextlib
from typing import Any

from llamapool.supervisor import gpus as gpumod

POLL_EVERY = 5.0  # seconds between two readings


class GpuWatch:
    """The daemon's NVML handle and GPU inventory, read at start; :meth:`poll` when :meth:`due`."""

    def __init__(self, nvml: Any | None, gpus: list[gpumod.Gpu]):
        self.nvml = nvml
        self.gpus = gpus
        self.xids = gpumod.XidWatch(nvml, gpus)
        self._last = 0.0

    def due(self, now: float) -> bool:
        """Whether a reading is due at ``now`` (never without NVML)."""
        if self.nvml is None or now - self._last <= POLL_EVERY:
            return False
        self._last = now
        return True

    def poll(self) -> list[dict[str, Any]]:
        """Each GPU's row (``gpus.health``) with its Xid errors since the daemon started."""
        rows = gpumod.health(self.nvml, self.gpus)
        xids = self.xids.poll()
        for row in rows:
            row["xid_errors"] = xids.get(row["uuid"], 0)
        return rows

    def shutdown(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
