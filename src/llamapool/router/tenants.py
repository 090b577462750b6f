"""Tenants in the router: each model's queue by priority class and fair share, each tenant's share of
a model's slots, and the per-key limits counted here (so every gateway process shares one count).

- :class:`FairQueue` is a model's queue: a sub-queue per (class, tenant); the next prompt is the first
  class's that has one, and within a class the tenants take turns by deficit round robin, each turn
  worth the tenant's ``weight`` prompts (docs/http.md, "Tenants, classes and limits").
- :class:`Tenancy` keeps each tenant's counts: prompts in flight (``concurrency``), requests and tokens
  in the current window (``rpm``, ``tpm``), slots it holds per model (its fair share of them), and the
  per-tenant metrics.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llamapool.keys import CLASSES, DEFAULT_TENANT, KeysFile, TenantSettings
from llamapool.protocol.media import as_text
from llamapool.protocol.messages import ErrorCode, Prompt


class Job(Protocol):
    """What this module reads and writes of a job (router/tables.py's ``Job``)."""

    tenant: str
    rank: int
    model: str
    prompt: Prompt
    queued_at: float
    counted: bool
    on_slot: bool
    reserved: int


J = TypeVar("J", bound=Job)

DEFAULT_RANK = CLASSES.index("default")
FLEX_RANK = CLASSES.index("flex")
FLEX_QUEUE_SHARE = 0.5  # flex prompts are refused once a model's queue holds this share of server.max_queue

Refusal = tuple[str, str, str | None, str]  # error code, message, field, reason (the metrics' label)


class FairQueue(Generic[J]):
    """One model's waiting prompts: by class first, then deficit round robin over the class's tenants
    (``weight(tenant)`` prompts a turn). :meth:`peek` and :meth:`take` hand out the next one; a tenant
    that ``eligible`` refuses (it holds its share of slots) is passed over while it does."""

    def __init__(self, weight: Callable[[str], float]):
        self.weight = weight
        self.subs: list[dict[str, deque[J]]] = [{} for _ in CLASSES]  # per class: tenant -> its prompts
        self.rings: list[deque[str]] = [deque() for _ in CLASSES]  # per class: tenants with prompts, in turn
        self.deficit: list[dict[str, float]] = [{} for _ in CLASSES]
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[J]:
        for subs in self.subs:
            for q in subs.values():
                yield from q

    def __contains__(self, job: J) -> bool:
        q = self.subs[job.rank].get(job.tenant)
        return q is not None and job in q

    def _sub(self, job: J) -> deque[J]:
        subs = self.subs[job.rank]
        q = subs.get(job.tenant)
        if q is None:
            q = subs[job.tenant] = deque()
            self.rings[job.rank].append(job.tenant)
            self.deficit[job.rank][job.tenant] = 0.0
        return q

    def append(self, job: J) -> None:
        self._sub(job).append(job)
        self.n += 1

    def appendleft(self, job: J) -> None:
        """Back at the head of its tenant's line (a retry after its worker was lost)."""
        self._sub(job).appendleft(job)
        self.n += 1

    def remove(self, job: J) -> None:
        q = self.subs[job.rank][job.tenant]
        q.remove(job)
        self.n -= 1
        if not q:
            self._drop(job.rank, job.tenant)

    def _drop(self, rank: int, tenant: str) -> None:
        del self.subs[rank][tenant]
        self.rings[rank].remove(tenant)
        del self.deficit[rank][tenant]

    def clear(self) -> None:
        for rank in range(len(CLASSES)):
            self.subs[rank].clear()
            self.rings[rank].clear()
            self.deficit[rank].clear()
        self.n = 0

    def oldest(self) -> float | None:
        """When the longest-waiting prompt arrived (None: none waits)."""
        return min((q[0].queued_at for subs in self.subs for q in subs.values()), default=None)

    def waiting(self, tenant: str) -> int:
        """``tenant``'s prompts in this queue, every class."""
        return sum(len(subs.get(tenant, ())) for subs in self.subs)

    def peek(self, eligible: Callable[[str], bool] = lambda t: True) -> J | None:
        """The next prompt to run (None: none, or every tenant with one is ineligible). Asking again
        without a :meth:`take` gives the same one while the tenants' eligibility stays."""
        for rank, ring in enumerate(self.rings):
            if not any(eligible(t) for t in ring):
                continue
            deficit = self.deficit[rank]
            while True:
                t = ring[0]
                if deficit[t] >= 1.0 and eligible(t):
                    return self.subs[rank][t][0]
                ring.rotate(-1)
                if eligible(ring[0]):
                    deficit[ring[0]] += self.weight(ring[0])  # its turn: its quantum
        return None

    def take(self, job: J) -> None:
        """Remove ``job``, which :meth:`peek` gave, charging its tenant's turn."""
        rank, q = job.rank, self.subs[job.rank][job.tenant]
        q.popleft()
        self.n -= 1
        self.deficit[rank][job.tenant] -= 1.0
        if not q:
            self._drop(rank, job.tenant)


def estimate_tokens(prompt: Prompt) -> int:
    """A prompt's tokens before the worker has counted them: exact for token ids; text at 3 bytes a
    token, and 8 tokens a chat message for its template (generous, so a reservation seldom falls short)."""
    if isinstance(prompt, str):
        return len(prompt.encode()) // 3 + 1
    if prompt and isinstance(prompt[0], dict):
        return sum(len(as_text(m.get("content")).encode()) // 3 + 8 for m in prompt)  # type: ignore[union-attr]
    return len(prompt)


@dataclass
class TenantState:
    """One tenant's counts."""

    settings: TenantSettings
    window_start: float | None = None  # when the current rate-limit window began (None: no request yet)
    requests: int = 0  # requests admitted in the current window
    tokens: int = 0  # tokens counted in the current window (and what the last ones carried over)
    reserved: int = 0  # tokens the prompts in flight reserved (their estimate, until they end)
    inflight: int = 0  # prompts waiting or running
    running: Counter[str] = field(default_factory=Counter)  # slots held, by model
    last_seen: dict[str, float] = field(default_factory=dict)  # its last request's arrival, by model
    # for the metrics
    outcomes: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    retry_after: int = 1  # what its last refusal told the client to wait, seconds
    prompt_tokens: int = 0
    generated_tokens: int = 0


class Tenancy:
    """Every tenant's settings and counts (the router thread's only). ``window``: the seconds of one
    rate-limit window (``rpm`` and ``tpm`` are scaled to it); ``idle``: the seconds a tenant keeps its
    share of a model's slots after its last request."""

    def __init__(self, table: KeysFile | None, window: float = 60.0, idle: float = 5.0):
        self.table = table or KeysFile()
        self.window, self.idle = window, idle
        self.states: dict[str, TenantState] = {}

    def replace(self, table: KeysFile) -> None:
        """A reload's table: the counts stay, the settings are the new ones."""
        self.table = table
        for name, st in self.states.items():
            st.settings = table.settings(name)

    def state(self, name: str) -> TenantState:
        st = self.states.get(name)
        if st is None:
            st = self.states[name] = TenantState(self.table.settings(name))
        return st

    def weight(self, name: str) -> float:
        return self.state(name).settings.weight

    def _per_window(self, per_minute: int) -> int:
        return max(1, round(per_minute * self.window / 60.0)) if per_minute else 0

    def _roll(self, st: TenantState, now: float) -> None:
        """Start the window ``now`` falls in; tokens over the last one's limit are carried into it."""
        if st.window_start is None:
            st.window_start = now
        if now < st.window_start + self.window:
            return
        passed = math.floor((now - st.window_start) / self.window)
        st.window_start += passed * self.window
        st.requests = 0
        limit = self._per_window(st.settings.tpm)
        st.tokens = max(0, st.tokens - passed * limit) if limit else 0

    # ---------------------------------------------------------------- admission

    def refusal(self, name: str, rank: int, model: str, prompts: list[Prompt], jobs: int, max_tokens: int,
                queue: FairQueue[Any], max_queue: int, now: float) -> Refusal | None:
        """Why tenant ``name`` may not queue this request now (code, message, field, reason), or None.
        Nothing is counted: :meth:`admitted` does that once the request is queued."""
        st = self.state(name)
        s = st.settings
        self._roll(st, now)
        if rank < CLASSES.index(s.priority):
            return (ErrorCode.FORBIDDEN, f"tenant {name!r} may ask for the class \"{s.priority}\" at most, not "
                    f"\"{CLASSES[rank]}\" (its key's cap)", "priority", "forbidden")
        if s.concurrency and st.inflight + jobs > s.concurrency:
            return (ErrorCode.RATE_LIMITED, f"tenant {name!r} has {st.inflight} prompts in flight; its limit is "
                    f"{s.concurrency} at once (concurrency)", None, "concurrency")
        if s.rpm and st.requests >= self._per_window(s.rpm):
            return (ErrorCode.RATE_LIMITED, f"tenant {name!r} reached its {self._per_window(s.rpm)} requests a "
                    f"{self.window:g} s window ({s.rpm} a minute)", None, "requests")
        if s.tpm:
            limit, used = self._per_window(s.tpm), st.tokens + st.reserved
            need = self.estimate(prompts, jobs, max_tokens, limit)
            if used >= limit or (used and used + need > limit):
                return (ErrorCode.RATE_LIMITED, f"tenant {name!r} has {max(0, limit - used)} of its {limit} tokens a "
                        f"{self.window:g} s window left ({s.tpm} a minute); this request may take {need}", None,
                        "tokens")
        waiting = queue.waiting(name)
        if s.queue_share and waiting + jobs > max(1, int(s.queue_share * max_queue)):
            return (ErrorCode.RATE_LIMITED, f"tenant {name!r} has {waiting} prompts waiting for model {model!r}: its "
                    f"share of the queue is {s.queue_share:g} of server.max_queue={max_queue}", None, "queue_share")
        if rank == FLEX_RANK and len(queue) + jobs > max(1, int(FLEX_QUEUE_SHARE * max_queue)):
            return (ErrorCode.OVERLOADED, f"queue of model {model!r} holds {len(queue)} prompts: flex requests "
                    f"wait only while it is under half of server.max_queue={max_queue}", None, "flex")
        return None

    @staticmethod
    def estimate(prompts: list[Prompt], n: int, max_tokens: int, limit: int) -> int:
        """The tokens a request reserves: its prompts' (estimated) and ``max_tokens`` for each of its
        choices (``n`` prompts in all, choices counted), at most the whole window's ``limit``."""
        choices = n // max(1, len(prompts))
        return min(limit, choices * sum(estimate_tokens(p) + max_tokens for p in prompts))

    def refused(self, name: str, reason: str, now: float) -> None:
        """Count a refusal; the seconds its client is told to wait: the window's end for ``requests`` and
        ``tokens``, 1 for the others (a prompt in flight may end any moment)."""
        st = self.state(name)
        st.refused[reason] += 1
        st.retry_after = 1
        if reason in ("requests", "tokens") and st.window_start is not None:
            st.retry_after = max(1, math.ceil(st.window_start + self.window - now))

    def admitted(self, name: str, model: str, jobs: list[Any], max_tokens: int, now: float) -> None:
        """Count a queued request: one request, its prompts in flight, their tokens reserved."""
        st = self.state(name)
        st.requests += 1
        st.last_seen[model] = now
        limit = self._per_window(st.settings.tpm)
        for job in jobs:
            job.counted = True
            st.inflight += 1
            if limit:
                job.reserved = min(limit, estimate_tokens(job.prompt) + max_tokens)
                st.reserved += job.reserved

    def started(self, job: Job) -> None:
        if job.counted and not job.on_slot:
            job.on_slot = True
            self.state(job.tenant).running[job.model] += 1

    def requeued(self, job: Job) -> None:
        if job.counted and job.on_slot:
            job.on_slot = False
            self.state(job.tenant).running[job.model] -= 1

    def ended(self, job: Job, outcome: str, prompt_tokens: int, generated_tokens: int) -> None:
        """A prompt's final reply: its slot and reservation given back, its actual tokens counted."""
        if not job.counted:
            return
        st = self.state(job.tenant)
        self.requeued(job)
        st.inflight -= 1
        st.reserved -= job.reserved
        job.reserved = 0
        st.tokens += prompt_tokens + generated_tokens
        st.prompt_tokens += prompt_tokens
        st.generated_tokens += generated_tokens
        st.outcomes[outcome] += 1
        job.counted = False  # counted once

    # ---------------------------------------------------------------- fair share of slots

    def eligible(self, model: str, slots: int, now: float, queue: FairQueue[Any]) -> Callable[[str], bool]:
        """Whether each tenant may start one more prompt of ``model`` now: it holds fewer of the model's
        ``slots`` than its share, its weight over the weights of the tenants active on the model (with
        prompts waiting or running, or a request within ``idle`` seconds), rounded up."""
        active = {n: st for n, st in self.states.items()
                  if st.running[model] > 0 or now - st.last_seen.get(model, -1e18) <= self.idle or queue.waiting(n)}
        total = sum(st.settings.weight for st in active.values())

        def ok(name: str) -> bool:
            st = self.states.get(name)
            if st is None or len(active) <= 1:
                return True
            return st.running[model] < max(1, math.ceil(slots * st.settings.weight / (total or 1.0)))

        return ok

    # ---------------------------------------------------------------- what the client is told

    def limits(self, name: str, now: float, retry: bool = False) -> dict[str, Any] | None:
        """The tenant's rate-limit state for the gateway's headers (None: it has no rate limits):
        ``limit_requests``, ``remaining_requests``, ``reset_requests`` (seconds), the same for tokens,
        and with ``retry`` the seconds to wait (``retry_after``)."""
        st = self.state(name)
        s = st.settings
        if not (s.rpm or s.tpm or retry):
            return None
        self._roll(st, now)
        assert st.window_start is not None
        reset = round(max(0.0, st.window_start + self.window - now), 3)
        out: dict[str, Any] = {}
        if s.rpm:
            limit = self._per_window(s.rpm)
            out.update(limit_requests=limit, remaining_requests=max(0, limit - st.requests), reset_requests=reset)
        if s.tpm:
            limit = self._per_window(s.tpm)
            out.update(limit_tokens=limit, remaining_tokens=max(0, limit - st.tokens - st.reserved),
                       reset_tokens=reset)
        if retry:
            out["retry_after"] = st.retry_after
        return out

    # ---------------------------------------------------------------- metrics

    def collect(self, queues: dict[str, FairQueue[Any]]) -> Iterator[Metric]:
        """The per-tenant series, labelled with the tenant's name (never a key)."""
        req = CounterMetricFamily("llamapool_tenant_requests", "Prompts answered per tenant, by outcome",
                                  labels=["tenant", "outcome"])
        tok = CounterMetricFamily("llamapool_tenant_tokens", "Tokens per tenant (prompt and generated)",
                                  labels=["tenant", "kind"])
        ref = CounterMetricFamily("llamapool_tenant_refused", "Requests refused per tenant, by reason",
                                  labels=["tenant", "reason"])
        wait = GaugeMetricFamily("llamapool_tenant_waiting", "Prompts waiting per tenant (all models)",
                                 labels=["tenant"])
        run = GaugeMetricFamily("llamapool_tenant_running", "Prompts running per tenant (all models)",
                                labels=["tenant"])
        for name in sorted(self.states):
            st = self.states[name]
            for outcome, n in sorted(st.outcomes.items()):
                req.add_metric([name, outcome], n)
            tok.add_metric([name, "prompt"], st.prompt_tokens)
            tok.add_metric([name, "generated"], st.generated_tokens)
            for reason, n in sorted(st.refused.items()):
                ref.add_metric([name, reason], n)
            wait.add_metric([name], sum(q.waiting(name) for q in queues.values()))
            run.add_metric([name], sum(st.running.values()))
        yield from (req, tok, ref, wait, run)


__all__ = ["DEFAULT_RANK", "DEFAULT_TENANT", "FairQueue", "Tenancy"]
