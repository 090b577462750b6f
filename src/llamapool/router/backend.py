"""The router's worker side: hellos, heartbeats and steps read; jobs dispatched to the worker of their
model with the most free slots (prefix affinity among them); a lost worker's jobs retried or failed."""

from __future__ import annotations

import contextlib
import time

import zmq

from llamapool import security
from llamapool.protocol import codec
from llamapool.protocol.control import (
    WorkerJoined,
)
from llamapool.protocol.messages import (
    LIGHT_TASKS,
    Abort,
    AdapterDone,
    Chunk,
    Done,
    Failed,
    Heartbeat,
    Hello,
    KVPart,
    Message,
    Run,
    Shutdown,
    Step,
)
from llamapool.router.adapters import AdapterOps
from llamapool.router.fleet import HOST_COUNTERS, SPECULATION
from llamapool.router.policy import pick_worker, remember
from llamapool.router.tables import ENDINGS, LOG, Job, RequestStatus, WorkerState
from llamapool.router.tenants import FairQueue

# A request whose worker was lost before it streamed a token is sent to another worker this many times
# at most: a request that kills every worker it runs on (a poison pill) must not take its model down.
RETRIES_AFTER_LOSS = 1
SHUT_DOWN = "it shut down"  # a worker that left in good order (drained): its requests are not to blame


class Backend(AdapterOps):
    """The backend: workers' messages in, runs and aborts out."""

    def _peer_key(self) -> str:
        try:
            return str(self._peer.get("User-Id")) if self._peer is not None else ""
        except zmq.ZMQError:
            return ""


    def _send_worker(self, w: WorkerState, msg: Message) -> None:
        try:
            self.back.send_multipart([w.ident, codec.encode(msg)])
        except zmq.ZMQError:
            self._lose_worker(w, "its socket disconnected")

    def _on_worker(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            msg = codec.decode(frames, codec.WORKER_TYPES, 1 << 30)
        except codec.ProtocolError:
            return
        name = ident.decode(errors="replace").split(":")[0]
        w = self.workers.get(name)
        now = time.monotonic()
        if isinstance(msg, Hello):
            if w is not None and w.ident == ident:  # it lost track of us and says hello again
                w.last_seen = now
                return
            key = self._peer_key() if self._back_keys else ""
            why = self._why_refused(name, msg, key)
            if why:
                self._refuse_worker(ident, name, msg, key, why)
                return
            if w is not None:
                self._lose_worker(w, "replaced by a new process")
            model = msg.model_name if isinstance(msg.model_name, str) and msg.model_name else self.models[0]
            if model not in self.models:
                LOG.warning(f"worker {name} serves model {model!r}, which is not in the pool "
                            f"({', '.join(self.models)}): no request can reach it", worker=name)
            self.workers[name] = WorkerState(name, ident, msg, now, model, key=key)
            self._unpark(self.workers[name])
            self._adapters_for(self.workers[name])  # the model's run-time LoRA adapters, before any request
            if msg.node:
                self.remote_lost.pop(name, None)
                LOG.info(f"worker {name} of node {msg.node} joined (pid {msg.pid}, {msg.device}, {msg.slots} slots)",
                         worker=name, node=msg.node, key=security.fingerprint(key.encode()) if key else None)
            self._queue(model)
            self.on_event(WorkerJoined(name, msg.pid))
            return
        if w is None or w.ident != ident:
            return  # a worker we dropped; it will be killed by the supervisor
        w.last_seen = now
        if isinstance(msg, Step):
            self._on_step(w, msg)
        elif isinstance(msg, Heartbeat):
            w.steps, w.busy_for, w.decode_s, w.step_s = msg.steps, msg.busy_for, msg.decode_s, msg.step_s
            w.reused_tokens, w.kv_used, w.kv_total = msg.reused_tokens, msg.kv_used, msg.kv_total
            w.schedule = (msg.step_target, msg.step_budget, msg.step_cost)
            w.speculation, w.kv_host = msg.speculation, msg.kv_host
            if msg.draining and w.state == "ready":  # SIGTERM on its node: it finishes what it has
                w.state = "retiring"
        elif isinstance(msg, KVPart):
            self._hand_over(w, msg)
        elif isinstance(msg, AdapterDone):
            self._adapter_done(w, msg)
        elif isinstance(msg, Shutdown):  # drained and leaving
            self._lose_worker(w, SHUT_DOWN)

    def _hand_over(self, w: WorkerState, part: KVPart) -> None:
        """A part of a draining worker's host KV tier, to one ready sibling of its model (the same one for all
        its parts; dropped when there is none). The prefixes the router remembers of ``w`` go with the first
        part, so that the sessions whose KV moved follow it there."""
        part.source = w.name
        sib = self.workers.get(w.handover_to) if w.handover_to else None
        if sib is None or not sib.routable:
            sibs = [s for s in self.workers.values() if s.model == w.model and s is not w and s.routable]
            if not sibs:  # kept for the model's next worker (router/handover.py)
                self.parked.park(w.model, part, w.prefixes)
                return
            sib = max(sibs, key=lambda s: (s.free, s.name))
            w.handover_to = sib.name
            remember(sib, tuple(w.prefixes))
        self._send_worker(sib, part)

    def _unpark(self, w: WorkerState) -> None:
        """A new worker of a model whose last worker's KV was parked: it gets the parts and the prefix keys."""
        parts, prefixes = self.parked.take(w.model)
        if parts:
            LOG.info(f"worker {w.name}: {len(parts)} parked KV handover part(s) of model {w.model} sent to it",
                     worker=w.name)
            remember(w, tuple(prefixes))
        for part in parts:
            self._send_worker(w, part)

    def _on_step(self, w: WorkerState, step: Step) -> None:
        now = time.monotonic()
        for d in step.deltas:
            rid, text, ntok = d.rid, d.text, d.tokens
            job = w.jobs.get(rid)
            if job is None and rid not in w.orphans:  # a request of a previous router, or one we lost it
                w.orphans.add(rid)  # with (a partition): its client had its final reply; free the slot
                self._send_worker(w, Abort(rid))
            if job is not None and job.status is RequestStatus.RUNNING:
                first = job.delivered == 0
                if first:
                    self.metrics.of(job.model).ttft.observe(now - job.queued_at)
                elif ntok > job.delivered:
                    n = ntok - job.delivered
                    self.metrics.of(job.model).itl.observe((now - job.last_token) / n, n)
                job.delivered, job.last_token = ntok, now
                if not job.first_at:
                    job.first_at = now
                if first:
                    job.prompt_tokens = d.prompt_tokens
                    limits = self.tenancy.limits(job.tenant, now) if job.counted else None
                    chunk = Chunk(job.id, job.index, text, ntok, d.logprobs, d.prompt_tokens, d.cached_tokens, limits)
                else:
                    chunk = Chunk(job.id, job.index, text, ntok, d.logprobs)
                self._reply(job.client, chunk)
        for entry in step.done:
            done = Done(*entry)  # a named tuple from the codec (a plain list from a test)
            self.metrics.tokens(w.name, done.prompt_tokens, done.completion_tokens, w.model)
            w.orphans.discard(done.rid)
            job = w.jobs.pop(done.rid, None) or w.light.pop(done.rid, None)
            if job is None:
                continue
            if job.status in (RequestStatus.RUNNING, RequestStatus.CANCELLED):
                status = RequestStatus.CANCELLED if done.reason == "cancelled" else RequestStatus.FINISHED
                self._end(job, status, self._result(job, done, w.name))
            else:  # aborted by the router: its answer, with what the worker had done
                self._end(job, job.status, message=f"request {ENDINGS[job.status][1]}: stopped after "
                                                   f"{done.completion_tokens} tokens")
        for item in step.failed:
            failed = Failed(*item)
            job = w.jobs.pop(failed.rid, None) or w.light.pop(failed.rid, None)
            if job is not None:
                self._end(job, RequestStatus.FAILED, self._failure(job, failed))

    def _lose_worker(self, w: WorkerState, why: str) -> None:
        """Take ``w`` out of routing; retry its unstarted jobs (once, unless it shut down in good order),
        fail its streaming ones and those it was the second lost worker of."""
        if self.workers.get(w.name) is w:
            del self.workers[w.name]
            self.metrics.worker_gone(w.name, {"reused_tokens": w.reused_tokens, "decode_s": w.decode_s,
                                              "step_s": w.step_s, "steps": w.steps,
                                              **dict(zip(SPECULATION, w.speculation, strict=False)),
                                              **{f"kv_host_{k}": v for k, v in w.kv_host.items()
                                                 if k in HOST_COUNTERS}})
        if w.jobs:
            LOG.warning(f"worker {w.name} lost ({why}) with {len(w.jobs)} request(s)", worker=w.name,
                        requests=",".join(sorted(j.log_id for j in w.jobs.values())))
        for job in sorted([*w.jobs.values(), *w.light.values()], key=lambda j: j.rid, reverse=True):
            job.losses += why != SHUT_DOWN
            if job.status.finished:  # aborted: the worker will never confirm it
                self._end(job, job.status)
            elif job.delivered == 0 and job.losses > RETRIES_AFTER_LOSS:
                message = (f"request {job.log_id} was running on {job.losses} workers that were lost (the last, "
                           f"{w.name}: {why}); it is not sent to another one, in case it is what kills them")
                LOG.warning(message, id=job.log_id, worker=w.name)
                self._end(job, RequestStatus.WORKER_LOST, message=message)
            elif job.delivered == 0:
                job.worker, job.status = None, RequestStatus.WAITING
                self.tenancy.requeued(job)
                # invisible retry on another worker
                (self.light if job.task in LIGHT_TASKS else self._queue(job.model)).appendleft(job)
            else:
                self._end(job, RequestStatus.WORKER_LOST, message=f"worker {w.name} was lost ({why}) after "
                                                                  f"{job.delivered} tokens were delivered")
        w.jobs.clear()
        w.light.clear()
        self._adapter_worker_gone(w)
        if w.hello.node and w.name not in self.workers:
            if why != SHUT_DOWN:
                LOG.warning(f"worker {w.name} of node {w.hello.node} lost: {why}", worker=w.name, node=w.hello.node)
            self.remote_lost[w.name] = {
                "id": w.name, "node": w.hello.node, "pid": w.hello.pid, "device": w.hello.device, "slots": 0,
                "active": 0, "state": "stopped" if why == SHUT_DOWN else "lost", "reason": why,
                "model": w.model}

    def _why_refused(self, name: str, hello: Hello, key: str) -> str:
        """Why a worker's hello cannot be accepted ("" if it can): its name must be unique, and the
        name of a node's worker is "<node>/..."; a node's name belongs to the key that holds it."""
        node = hello.node
        if node and not name.startswith(f"{node}/"):
            return f"the worker name {name!r} does not start with its node's name {node!r} and '/'"
        if not node and "/" in name:
            return f"the worker name {name!r} has a '/' but names no node"
        if not key or (self.cfg.local_key and key == self.cfg.local_key.decode()):
            # one of this router's own workers (or no CURVE: no key tells them apart), so it must carry
            # this daemon's boot id: a worker left over from an earlier daemon on the same socket may not join
            if not node and self.cfg.boot_id and hello.boot != self.cfg.boot_id:
                return (f"a worker of another daemon (boot id {hello.boot or '-'}; this daemon's is "
                        f"{self.cfg.boot_id}): only this daemon's own workers may join")
            return ""
        if name in self.supervisor_view:
            return f"name clash: {name!r} is one of the router's own workers"
        for other in self.workers.values():
            if other.key != key and (other.name == name or (node and other.hello.node == node)):
                return (f"name clash: node {other.hello.node or other.name!r} is connected with another key "
                        f"({security.fingerprint(other.key.encode()) if other.key else 'none'})")
        return ""

    def _refuse_worker(self, ident: bytes, name: str, hello: Hello, key: str, why: str) -> None:
        """Tell the worker (it logs it and exits for good) and log it here, once per 10 s per worker."""
        with contextlib.suppress(zmq.ZMQError):
            self.back.send_multipart([ident, codec.encode(Shutdown(reason=why))], zmq.NOBLOCK)
        now = time.monotonic()
        if now - self._refused_at.get((name, why), -1e9) >= 10.0:
            self._refused_at[(name, why)] = now
            LOG.warning(f"refused worker {name} (node {hello.node or '-'}, pid {hello.pid}): {why}", worker=name,
                        node=hello.node or None, key=security.fingerprint(key.encode()) if key else None)

    def _dispatch(self) -> None:
        """Each model's queue, oldest first, to that model's workers (prefix affinity among them)."""
        if self.light:
            self._dispatch_light()
        for model, queue in list(self.queues.items()):  # a lost worker may requeue (and add a queue)
            if queue:
                self._dispatch_model(model, queue, [w for w in self.workers.values() if w.model == model])

    def _dispatch_model(self, model: str, queue: FairQueue[Job], pool: list[WorkerState]) -> None:
        """The queue's next prompts (by class, then the tenants' turns; a tenant holding its share of
        the model's slots waits: router/tenants.py) to the workers while they have free slots."""
        if not any(w.routable and w.free > 0 for w in pool):
            return
        eligible = self.tenancy.eligible(model, sum(w.hello.slots for w in pool if w.routable), time.monotonic(),
                                         queue)
        while queue:
            job = queue.peek(eligible)
            if job is None:
                return
            w = pick_worker(pool, job.keys, self.cfg.affinity_slack)
            if w is None:
                return
            queue.take(job)
            if not queue:  # the placement policy hears that nothing waits (no load for a stale queue): at
                # once when it last heard that something did (a worker dying then is not replaced for it)
                heard = self._demand.models.get(model) if self._demand is not None else None
                if heard is not None and heard.queued:
                    self._demand_now = True
                else:
                    self._demand_soon = True
            remember(w, job.keys)
            self._start_on(w, job)
            for sib in job.siblings:  # the prompt's other choices: on the same worker, after the first
                self._start_on(w, sib, after=job.rid)
            job.siblings = []
            if self.workers.get(w.name) is not w:  # its socket was gone: lost, and the job is queued again
                pool.remove(w)

    def _start_on(self, w: WorkerState, job: Job, after: int = -1) -> None:
        """Send ``job`` to ``w`` (``after``: the rid of the first choice whose computed prompt it copies)."""
        if not job.started:
            job.started = time.monotonic()
            self.metrics.of(job.model).queue_wait.observe(job.started - job.queued_at)
        job.worker = job.last_worker = w.name
        job.status, job.dispatched_at = RequestStatus.RUNNING, time.monotonic()
        w.jobs[job.rid] = job
        self.tenancy.started(job)
        if LOG.enabled("debug"):
            LOG.debug("dispatch", id=job.log_id, worker=w.name, rid=job.rid)
        self._send_worker(w, Run(job.rid, job.prompt, job.params, job.stream, job.log_id, task=job.task,
                                 options=job.options, after=after))  # options: a rerank's query

    def _dispatch_light(self) -> None:
        """Tokenize and detokenize jobs: each to the ready worker of its model with the most free slots,
        full or not (its I/O thread answers them at once: worker/tasks.py)."""
        for job in list(self.light):
            pool = [w for w in self.workers.values() if w.model == job.model and w.routable]
            if not pool:
                continue
            w = max(pool, key=lambda w: (w.free, w.name))
            self.light.remove(job)
            job.started = job.started or time.monotonic()
            job.worker = job.last_worker = w.name
            job.status, job.dispatched_at = RequestStatus.RUNNING, time.monotonic()
            w.light[job.rid] = job
            self._send_worker(w, Run(job.rid, job.prompt, job.params, False, job.log_id, task=job.task,
                                     options=job.options))

    def _retire(self, w: WorkerState) -> None:
        w.state, w.closing = "retiring", False
        self._send_worker(w, Shutdown())

