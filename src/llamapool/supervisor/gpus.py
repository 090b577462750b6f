"""GPU inventory and health through NVML only: the supervisor never creates a CUDA context."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from llamapool.config import ConfigError, Device, ModelConfig


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def load_nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None when there is no NVML (no driver, no GPU)."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pynvml's "use nvidia-ml-py" notice
            import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def discover(nvml: Any | None) -> list[Gpu]:
    """All GPUs NVML lists, in NVML (PCI bus) order."""
    if nvml is None:
        return []
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        gpus.append(Gpu(
            index=i,
            uuid=_text(nvml.nvmlDeviceGetUUID(h)),
            name=_text(nvml.nvmlDeviceGetName(h)),
            pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(h).busId),
            memory_total=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
        ))
    return gpus


def select(gpus: list[Gpu], devices: str | list[int | str]) -> list[Gpu]:
    """The GPUs ``workers.devices`` asks for; [] means CPU workers."""
    if devices in ("cpu", "remote"):
        return []
    if devices == "auto":
        return gpus
    chosen = []
    for d in devices:
        match = [g for g in gpus if (g.index == d if isinstance(d, int) else g.uuid == d)]
        if not match:
            raise ConfigError(
                f"workers.devices: no GPU {d!r} (NVML sees {[g.uuid for g in gpus] or 'none'})"
            )
        chosen.append(match[0])
    return chosen


def _find(gpus: list[Gpu], d: Device, key: str) -> Gpu:
    match = [g for g in gpus if (g.index == d if isinstance(d, int) else g.uuid == d)]
    if not match:
        raise ConfigError(f"{key}: no GPU {d!r} (NVML sees {[g.uuid for g in gpus] or 'none'})")
    return match[0]


def plan_groups(gpus: list[Gpu], models: tuple[ModelConfig, ...] | list[ModelConfig],
                keys: list[str] | None = None) -> dict[str, list[tuple[Gpu, ...]]]:
    """Each model's GPU groups, one worker per group ([] means CPU workers).

    Explicit ``devices`` are resolved first; ``"auto"`` takes every GPU no other model lists, one
    worker each. A GPU in two models is a :class:`ConfigError` naming both (``keys`` name each
    model's table in errors). A managed model (``load = "on_demand"`` or ``replicas``) claims no GPU:
    its groups are the GPUs it may be placed on (its ``devices``, or every GPU for ``"auto"``), which
    it shares with others by free memory (supervisor/placement.py).
    """
    keys = keys or [f"models[{i}]" for i in range(len(models))]
    owner: dict[str, str] = {}  # GPU uuid -> model name
    out: dict[str, list[tuple[Gpu, ...]]] = {}

    def claim(m: ModelConfig, key: str, group: tuple[Gpu, ...]) -> None:
        for g in group:
            if g.uuid in owner and owner[g.uuid] != m.name:
                raise ConfigError(f"{key}.devices: GPU {g.index} ({g.uuid}) of model {m.name!r} is also given "
                                  f"to model {owner[g.uuid]!r}: a GPU belongs to at most one worker")
            owner[g.uuid] = m.name

    for m, key in zip(models, keys, strict=True):
        groups = m.groups
        if m.managed:
            out[m.name] = [tuple(_find(gpus, d, f"{key}.devices") for d in group) for group in groups] \
                if groups is not None else [] if m.devices == "cpu" else [(g,) for g in gpus]
        elif groups is not None:
            out[m.name] = [tuple(_find(gpus, d, f"{key}.devices") for d in group) for group in groups]
            for group in out[m.name]:
                claim(m, key, group)
    for m, key in zip(models, keys, strict=True):
        if m.managed:
            continue
        if m.devices == "auto":
            out[m.name] = [(g,) for g in gpus if g.uuid not in owner]
            if gpus and not out[m.name]:
                raise ConfigError(f"{key}.devices: \"auto\" finds no GPU left for model {m.name!r}: models "
                                  f"{sorted(set(owner.values()))} have them all; give each model its devices")
            for group in out[m.name]:
                claim(m, key, group)
        elif m.devices in ("cpu", "remote"):
            out[m.name] = []
    return {m.name: out[m.name] for m in models}


def health(nvml: Any | None, gpus: list[Gpu]) -> list[dict[str, Any]]:
    """Per-GPU memory, utilisation, temperature and error counters; ``lost`` when NVML fails."""
    rows: list[dict[str, Any]] = []
    if nvml is None:
        return rows
    for g in gpus:
        row: dict[str, Any] = {"index": g.index, "uuid": g.uuid, "name": g.name}
        try:
            h = nvml.nvmlDeviceGetHandleByUUID(g.uuid)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            row.update(
                memory_used=int(mem.used), memory_total=int(mem.total), utilization=int(util.gpu),
                temperature=int(nvml.nvmlDeviceGetTemperature(h, 0)), lost=False,
            )
            with contextlib.suppress(Exception):  # ECC counters need ECC-capable boards
                row["ecc_uncorrected"] = int(nvml.nvmlDeviceGetTotalEccErrors(h, 1, 1))
            with contextlib.suppress(Exception):  # not every board reports its power
                row["power_mw"] = int(nvml.nvmlDeviceGetPowerUsage(h))
        except Exception as e:
            row.update(lost=True, error=str(e))
        rows.append(row)
    return rows


class XidWatch:
    """Counts the Xid (critical) error events NVML reports, per GPU UUID, without blocking."""

    def __init__(self, nvml: Any | None, gpus: list[Gpu]):
        self.nvml = nvml
        self.counts: dict[str, int] = {g.uuid: 0 for g in gpus}
        self.events: Any = None
        if nvml is None or not gpus:
            return
        try:
            self.events = nvml.nvmlEventSetCreate()
            for g in gpus:
                with contextlib.suppress(Exception):  # some boards cannot report Xid events
                    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByUUID(g.uuid),
                                                  nvml.nvmlEventTypeXidCriticalError, self.events)
        except Exception:
            self.events = None

    def poll(self) -> dict[str, int]:
        """Take every waiting event (timeout 0) and return the counts so far."""
        nvml = self.nvml
        if self.events is None or nvml is None:
            return self.counts
        for _ in range(1000):
            try:
                data = nvml.nvmlEventSetWait_v2(self.events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: nothing waiting
                break
            with contextlib.suppress(Exception):
                uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
                self.counts[uuid] = self.counts.get(uuid, 0) + 1
        return self.counts
