"""The fleet: every worker as ``status`` and ``/metrics`` show it, one view built from plain rows.

Three sources describe a worker: the supervisor's row (its lifecycle state, restarts, log tail), the
router's figures of a connected worker (:class:`LiveWorker`), and the last row of a node's worker that
left or was lost. :meth:`Fleet.build` merges them by one rule; ``Router._status`` and
``RouterMetrics.render`` both read the result, and neither this module nor the metrics import the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llamapool.protocol.messages import StatusReply

Schedule = tuple[str, int, list[float]]  # a worker's step target, last budget and fitted step cost (s)


def schedule_view(schedule: Schedule) -> dict[str, Any]:
    """A worker's step scheduling for ``status``: its target, last budget and fitted step cost (ms)."""
    target, budget, cost = schedule
    view: dict[str, Any] = {"step_target": target, "step_budget": budget}
    if len(cost) >= 4:
        view["step_cost_ms"] = {"base": round(cost[0] * 1e3, 4), "per_row": round(cost[1] * 1e3, 5),
                                "per_prompt_token": round(cost[2] * 1e3, 6), "prompt_step": round(cost[3] * 1e3, 4)}
        if len(cost) > 4:
            view["step_cost_ms"]["per_draft_token"] = round(cost[4] * 1e3, 6)
    return view


SPECULATION = ("draft_tokens", "accepted_tokens", "sampled_tokens", "sampling_steps")
# the host KV tier's cumulative counters (worker/engine/hostkv.py TierStats) and their help texts; its
# other figures (bytes, entries, capacity) are what it holds now
HOST_COUNTERS = {
    "hits": "Prompts whose longest prefix was restored from the host KV tier",
    "misses": "Prompts of at least a block that found nothing in the host KV tier",
    "skipped": "Prompts that found an entry in the host KV tier but were cheaper to recompute",
    "restores": "Host KV tier entries copied back into a slot",
    "restored_tokens": "Prompt tokens restored from the host KV tier instead of computed",
    "bytes_restored": "Bytes copied from the host KV tier into the KV cache",
    "restore_seconds": "Seconds spent copying host KV tier entries into the KV cache",
    "saves": "Sequences' KV copied into the host KV tier before their slot was overwritten",
    "unsaved": "Slots' KV not copied into the host KV tier: it lately found few prompts (saves sampled)",
    "bytes_saved": "Bytes copied from the KV cache into the host KV tier",
    "save_seconds": "Seconds spent copying KV into the host KV tier",
    "save_wait_seconds": "Of the save seconds: waiting for the GPU's queued work before copying",
    "save_alloc_seconds": "Of the save seconds: sizing the state and finding its host memory",
    "saves_pageable": "Saves into pageable memory on a GPU worker (no page-locked slab fit: a slower copy)",
    "evictions": "Host KV tier entries dropped for room (least recently used) or superseded by a longer one",
    "failed": "Host KV tier entries llama.cpp would not restore (dropped; the prompt was recomputed)",
    "handed_out": "Host KV tier entries handed to a sibling worker when this one drained",
    "handed_in": "Host KV tier entries received from a draining sibling worker",
    "refused": "Host KV tier entries received and dropped (another model or build, a bad checksum, no room)",
}


def speculation_view(counts: list[int]) -> dict[str, Any]:
    """A worker's speculative decoding for ``status``: draft tokens verified and accepted, the acceptance
    rate, and the tokens a decoding sequence gained a step (1 without speculation)."""
    if len(counts) != len(SPECULATION):
        return {}
    drafted, accepted, sampled, steps = counts
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_step": round(sampled / steps, 4) if steps else None}


@dataclass(frozen=True, slots=True)
class LiveWorker:
    """The router's figures of one connected worker: its hello, its heartbeats, its running prompts."""

    name: str
    pid: int
    device: str
    state: str  # the router's: ready | retiring
    slots: int
    active: int
    model: str
    model_desc: str = ""
    visible_devices: list[str] = field(default_factory=list)
    n_vocab: int = 0
    ctx_per_slot: int = 0
    node: str = ""
    steps: int = 0
    decode_s: float = 0.0
    step_s: float = 0.0
    reused_tokens: int = 0
    kv_used: int = 0
    kv_total: int = 0
    schedule: Schedule = ("", 0, [])
    speculation: list[int] = field(default_factory=list)  # SPECULATION's counts ([] without speculation)
    kv_host: dict[str, float] = field(default_factory=dict)  # the host KV tier's counters ({}: no tier)

    @property
    def draft_tokens(self) -> int:
        return self.speculation[0] if self.speculation else 0

    @property
    def accepted_tokens(self) -> int:
        return self.speculation[1] if self.speculation else 0

    def status_fields(self) -> dict[str, Any]:
        return dict(id=self.name, pid=self.pid, device=self.device, state=self.state, slots=self.slots,
                    active=self.active, model=self.model, model_desc=self.model_desc,
                    visible_devices=self.visible_devices, steps=self.steps, n_vocab=self.n_vocab,
                    ctx_per_slot=self.ctx_per_slot, decode_s=round(self.decode_s, 3), step_s=round(self.step_s, 3),
                    reused_tokens=self.reused_tokens, node=self.node, **schedule_view(self.schedule),
                    kv_host=dict(self.kv_host), **speculation_view(self.speculation))


@dataclass(frozen=True, slots=True)
class FleetWorker:
    """One worker of the fleet. ``state`` is the supervisor's lifecycle state (the router's own for a
    node's worker), except that a worker the router retires is ``retiring``; ``info`` is the
    supervisor's row (``local``) or a node's lost worker's last row."""

    name: str
    model: str  # "" when no source names it
    device: str
    state: str
    slots: int
    active: int
    live: LiveWorker | None = None
    info: dict[str, Any] = field(default_factory=dict)
    local: bool = False

    @classmethod
    def merge(cls, name: str, info: dict[str, Any], live: LiveWorker | None, local: bool) -> FleetWorker:
        state = "retiring" if live is not None and live.state == "retiring" else \
            str(info.get("state") or (live.state if live else "starting"))
        if live is not None:
            return cls(name, live.model, live.device, state, live.slots, live.active, live, info, local)
        return cls(name, str(info.get("model") or ""), str(info.get("device", "")), state,
                   int(info.get("slots", 0)), 0, None, info, local)

    @property
    def exits(self) -> dict[str, int]:
        """Unexpected exits by reason (the supervisor counts them)."""
        return dict(self.info.get("exits", {}))

    def status_row(self) -> dict[str, Any]:
        row = dict(self.info)
        if self.live is not None:
            row.update(self.live.status_fields())
        elif not self.local:
            row.setdefault("id", self.name)
        else:
            row.update(id=self.name, active=0)
            row.setdefault("slots", 0)
        row["state"] = self.state
        row.setdefault("node", "")
        return row


@dataclass(frozen=True, slots=True)
class Fleet:
    """Every worker (sorted by name), the pool's models (the first is the default), the prompts waiting
    per model, the drain flag and NVML's GPU rows."""

    models: list[str]
    workers: list[FleetWorker]
    queued: dict[str, int] = field(default_factory=dict)
    draining: bool = False
    gpus: list[dict[str, Any]] = field(default_factory=list)
    model_rows: dict[str, dict[str, Any]] = field(default_factory=dict)  # the supervisor's (ModelRows)

    @classmethod
    def build(cls, models: list[str], supervised: dict[str, dict[str, Any]], live: list[LiveWorker],
              lost: dict[str, dict[str, Any]], queued: dict[str, int] | None = None, draining: bool = False,
              gpus: list[dict[str, Any]] | None = None,
              model_rows: dict[str, dict[str, Any]] | None = None) -> Fleet:
        """The fleet from the supervisor's rows, the connected workers and the nodes' lost workers."""
        by_name = {w.name: w for w in live}
        workers = []
        for name in sorted(set(supervised) | set(by_name) | set(lost)):
            w = by_name.get(name)
            info = supervised.get(name) if name in supervised else lost.get(name, {}) if w is None else {}
            workers.append(FleetWorker.merge(name, dict(info or {}), w, name in supervised))
        return cls(list(models) or [""], workers, dict(queued or {}), draining, list(gpus or []),
                   dict(model_rows or {}))

    @property
    def queued_total(self) -> int:
        return sum(self.queued.values())

    def running(self, model: str | None = None) -> int:
        """Prompts running on workers (of ``model``; all models for None)."""
        return sum(w.active for w in self.workers if w.live is not None and (model is None or w.model == model))

    def gpu_workers(self) -> dict[str, str]:
        """The supervisor's worker on each GPU (by UUID)."""
        return {uuid: w.name for w in self.workers if w.local for uuid in str(w.info.get("device")).split(",")}

    def status(self, rid: str) -> StatusReply:
        rows = [w.status_row() for w in self.workers]
        models = [{**self.model_rows.get(m, {}),
                   "name": m, "workers": [r["id"] for r in rows if r.get("model", self.models[0]) == m
                                          and r.get("state") not in ("lost", "stopped")],
                   "queued": self.queued.get(m, 0), "running": self.running(m)}
                  for m in self.models]
        return StatusReply(rid, rows, self.queued_total, self.running(), self.draining, self.gpus, models)
