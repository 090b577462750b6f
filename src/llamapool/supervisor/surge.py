"""A rolling reload's surge: the successor of a replaced worker starts beside it when its device has room
for both, so the model keeps serving while the successor loads (the old one then drains, handing its host KV
tier to the successor, a live sibling, and exits); without room, the old one exits first and the successor
starts on the freed device (``server.reload_surge = false``: always so).

A successor's name is the planned name and a generation (``gpu0~1``, ``gpu0~2``): the plan's name
(:func:`plan_name`) is what a later reload matches the config against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamapool.config import ModelConfig
from llamapool.supervisor import memory
from llamapool.supervisor.children import WorkerSlot
from llamapool.supervisor.pool import host_kv_share, worker_need

SEP = "~"  # between a worker's planned name and its generation (no model or worker name holds one)
MARGIN = 1.1  # the estimate's error: the successor must fit 10 % over it, and SLACK besides
SLACK = 512 << 20


def plan_name(name: str) -> str:
    """``gpu0~2`` -> ``gpu0``: the name the plan gave the worker's slot."""
    return name.split(SEP, 1)[0]


def successor(name: str, taken: set[str]) -> str:
    """The next generation's name of worker ``name`` not in ``taken``."""
    base = plan_name(name)
    return next(n for n in (f"{base}{SEP}{k}" for k in range(1, len(taken) + 2)) if n not in taken)


def free_memory(nvml: Any | None, slot: WorkerSlot) -> int | None:
    """The bytes free on the slot's device now: the least of its GPUs' (NVML), or the RAM's (MemAvailable);
    None when it cannot be read."""
    try:
        if slot.gpus:
            if nvml is None:
                return None
            return min(int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(g.uuid)).free)
                       for g in slot.gpus)
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except Exception:  # NVML lost the GPU, no /proc: no surge
        return None
    return None


def room(nvml: Any | None, slot: WorkerSlot, model: ModelConfig) -> tuple[bool, str]:
    """Whether a worker of ``model`` fits on ``slot``'s device beside what runs there now, and why."""
    need, _ = worker_need(model, gpu=bool(slot.gpus))
    if need <= 0:
        return False, "its memory need is unknown"
    need //= max(1, len(slot.gpus))  # a group's weights and KV are split across its GPUs
    free = free_memory(nvml, slot)
    if free is None:
        return False, "its device's free memory cannot be read"
    if free < need * MARGIN + SLACK:
        return False, f"it needs about {memory.fmt_bytes(need)}, {memory.fmt_bytes(free)} free"
    why = f"it needs about {memory.fmt_bytes(need)}, {memory.fmt_bytes(free)} free"
    if slot.gpus and (tier := host_kv_share(model, 1, gpu=True)):  # its page-locked host KV tier, in RAM
        ram = free_memory(None, WorkerSlot(slot.name))
        if ram is None or ram < tier * MARGIN + SLACK:
            return False, f"its host KV tier takes {memory.fmt_bytes(tier)} of RAM, " \
                          f"{memory.fmt_bytes(ram or 0)} available"
        why += f"; its host KV tier {memory.fmt_bytes(tier)}, {memory.fmt_bytes(ram)} of RAM available"
    return True, why
