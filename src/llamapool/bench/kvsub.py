"""``llamapool bench --kv-stall``: what a KV-cache event subscriber costs the daemon (issue 53: a stalled
subscriber must leave throughput unchanged).

The chosen workload runs four times against a daemon with ``[kv_events]`` on, each with fresh prompts
(seeds ``seed`` to ``seed + 3``: nothing of one run is in the prefix cache of the next), after one unmeasured
warm-up run, with these subscribers (``none`` first and last, so that a drift of the machine's speed shows, and
the stalled run is compared with the mean of both):

- ``none``: no subscriber;
- ``live``: a subscriber that reads every batch as llm-d would: it decodes each payload (msgpack alone),
  counts the events and checks that ``seq`` goes up by one from batch to batch (``gaps``: batches missed);
- ``stalled``: a subscriber that connects over TCP, subscribes, and never reads, with a receive high-water
  mark of one message and a small kernel receive buffer, so that the publisher's queue to it fills and the
  publisher reaches its own high-water mark (``[kv_events] hwm``): from there it drops batches. Before
  that the kernel's TCP buffers take megabytes of batches, so unmeasured runs go first until the publisher
  drops (``kv_prime_runs``), and the measured run starts past the mark. A live subscriber runs beside it
  (``beside_*``): the publisher refuses a batch for every subscriber once one of them is past the mark
  (``XPUB_NODROP``), until its heartbeat lets the stalled one go (``HEARTBEAT_TIMEOUT_MS`` in
  supervisor/kvevents.py; the stalled one reconnects and fills its buffers again), so the live one misses
  the batches of a few seconds each time (it sees the gap, which replay fills).

Each row is the workload's row (tok/s, turns/s = requests/s, TTFT p50/p90) with the publisher's counters
over the run, read from the daemon's metrics (``llamapool_kv_events_*``): batches published, batches the
PUB socket dropped, and what the live subscriber received. Only pyzmq and msgpack read the events: no
llamapool code decodes them.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import zmq

MODES = ("none", "live", "stalled", "none")  # the baseline on both sides of the others: drift shows
STALLED_RCVBUF = 4096  # bytes: the stalled subscriber's kernel receive buffer
PRIME_S = 120.0  # the most the stalled run waits for the publisher to drop (or to let the subscriber go) ...
PRIME_RUNS = 5  # ... in at most this many unmeasured runs (the heartbeat lets a stalled subscriber go in seconds)
JOIN_S = 0.5  # a SUB socket's subscription reaches the publisher a moment after it connects
COUNTERS = {"batches": r"llamapool_kv_events_batches_total", "events": r"llamapool_kv_events_events_total",
            "dropped": r'llamapool_kv_events_dropped_total\{where="publisher"\}',
            "worker_dropped": r'llamapool_kv_events_dropped_total\{where="worker"\}',
            # the engines' steps (every worker's summed): their mean length, the decode the events must not slow
            "steps": r"llamapool_engine_steps_total\{[^}]*\}",
            "step_s": r"llamapool_engine_step_seconds_total\{[^}]*\}"}


def local_endpoint(endpoint: str) -> str:
    """The address a subscriber on this host dials for a publisher bound to ``endpoint``
    (``tcp://*:5557`` -> ``tcp://127.0.0.1:5557``)."""
    return endpoint.replace("//*:", "//127.0.0.1:").replace("//[::]:", "//[::1]:").replace("//:::", "//[::1]:")


def kv_counters(metrics: str) -> dict[str, float]:
    """The publisher's counters (and the engines' steps) from the daemon's Prometheus text, each summed over
    its series (a missing one reads 0)."""
    return {name: sum(float(v) for v in re.findall(rf"^{series} (\S+)$", metrics, re.MULTILINE))
            for name, series in COUNTERS.items()}


class LiveSubscriber(threading.Thread):
    """Reads every batch: counts batches and events and the ``seq`` numbers skipped."""

    def __init__(self, endpoint: str, topic: bytes = b"kv@"):
        super().__init__(name="kv-live", daemon=True)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.batches = self.events = self.bytes = self.gaps = self.bad = 0
        self.last = -1
        self._done = threading.Event()

    def run(self) -> None:
        try:
            while not self._done.is_set():
                if self.sock.poll(50):
                    self.batch(self.sock.recv_multipart())
        finally:
            self.sock.close(linger=0)

    def batch(self, frames: list[bytes]) -> None:
        try:
            _topic, seq_b, payload = frames
            seq = int.from_bytes(seq_b, "big", signed=True)
            _ts, events, _rank = msgpack.unpackb(payload)
        except (ValueError, TypeError, msgpack.ExtraData):
            self.bad += 1
            return
        if self.last >= 0 and seq != self.last + 1:
            self.gaps += max(0, seq - self.last - 1)
        self.last = seq
        self.batches += 1
        self.events += len(events)
        self.bytes += sum(len(f) for f in frames)

    def stop(self) -> dict[str, int]:
        time.sleep(JOIN_S)  # what was published by the end is delivered
        self._done.set()
        self.join(5)
        return {"received_batches": self.batches, "received_events": self.events, "received_bytes": self.bytes,
                "gaps": self.gaps,
                "bad_batches": self.bad}


class StalledSubscriber:
    """Connects and subscribes, then never reads (a receive mark of 1, a small kernel buffer)."""

    def __init__(self, endpoint: str, topic: bytes = b"kv@"):
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, STALLED_RCVBUF)
        self.sock.setsockopt(zmq.LINGER, 0)
        # the publisher's heartbeat lets it go: told by a monitor socket
        self.monitor: zmq.Socket[bytes] = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)

    def let_go(self) -> bool:
        """The publisher's heartbeat disconnected it (it reconnects by itself, and stalls again)."""
        return bool(self.monitor.poll(0))

    def start(self) -> None:
        pass

    def stop(self) -> dict[str, int]:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        return {}


async def measure_modes(run: Callable[[int], Awaitable[dict[str, Any]]], metrics: Callable[[], Awaitable[str]],
                        endpoint: str, seed: int) -> list[dict[str, Any]]:
    """One row per mode: ``run(seed)`` (the workload's row) with a subscriber of that mode on ``endpoint``,
    and the publisher's counters over it from ``metrics()``. The stalled run is measured once the publisher
    drops (:func:`prime`)."""
    await run(seed + 99)  # the warm-up wave: the first run is not the cold one
    rows = []
    for i, mode in enumerate(MODES):
        sub: LiveSubscriber | StalledSubscriber | None = (
            None if mode == "none" else LiveSubscriber(endpoint) if mode == "live" else StalledSubscriber(endpoint))
        primed: dict[str, Any] = {}
        if sub is not None:
            sub.start()
            await asyncio.sleep(JOIN_S)
        beside = None
        if mode == "stalled":
            assert isinstance(sub, StalledSubscriber)
            primed = await prime(run, metrics, seed + 100, sub.let_go)
            beside = LiveSubscriber(endpoint)  # what a live subscriber gets while another one stalls
            beside.start()
            await asyncio.sleep(JOIN_S)
        before = kv_counters(await metrics())
        row = await run(seed + i)
        after = kv_counters(await metrics())
        seen = sub.stop() if sub is not None else {}
        if beside is not None:
            seen = {f"beside_{k}": v for k, v in beside.stop().items()}
        delta = {k: after[k] - before[k] for k in COUNTERS}
        step_s, steps = delta.pop("step_s"), delta.pop("steps")
        row.update({"mode": "kv-stall", "kv_subscriber": mode, "kv_endpoint": endpoint,
                    **{f"kv_{k}": int(v) for k, v in delta.items()},
                    "engine_step_ms": round(1e3 * step_s / steps, 3) if steps else None, **seen, **primed})
        rows.append(row)
    return rows


async def prime(run: Callable[[int], Awaitable[dict[str, Any]]], metrics: Callable[[], Awaitable[str]],
                seed: int, let_go: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Unmeasured runs of the workload (seeds from ``seed``) until the publisher drops: until then the stalled
    subscriber's batches go into the kernel's TCP buffers (megabytes: Linux
    grows a socket's send buffer up to ``net.ipv4.tcp_wmem``'s maximum, and goes on growing it after the
    first drops) and the publisher's queue. At most ``PRIME_RUNS`` runs and ``PRIME_S`` seconds; says how many
    runs it took and whether the publisher was dropping or had let the subscriber go (``kv_let_go``; a
    subscriber that stopped reading may not see its own disconnection: ``kv_primed`` false then)."""
    end = time.monotonic() + PRIME_S
    runs = 0
    before = kv_counters(await metrics())
    while time.monotonic() < end and runs < PRIME_RUNS:
        row = await run(seed + runs)
        runs += 1
        after = kv_counters(await metrics())
        if row["errors"]:
            break
        if after["dropped"] > before["dropped"] or let_go():  # past the mark, or let go by the heartbeat first
            return {"kv_prime_runs": runs, "kv_primed": True, "kv_let_go": let_go()}
        before = after
    return {"kv_prime_runs": runs, "kv_primed": False}


def stalled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in rows if r["kv_subscriber"] == "stalled")


def ratio(rows: list[dict[str, Any]], mode: str = "stalled") -> dict[str, float]:
    """``mode``'s throughput over the no-subscriber runs' mean."""
    base = [r for r in rows if r["kv_subscriber"] == "none"]
    other = next(r for r in rows if r["kv_subscriber"] == mode)  # the first of its mode
    out = {}
    for k in ("tok_s", "req_s"):
        mean = sum(r[k] for r in base) / len(base)
        out[k] = round(other[k] / mean, 3) if mean else 0.0
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The runs side by side, then the stalled over none ratio."""
    head = (f"{'subscriber':<10} {'tok/s':>9} {'turns/s':>8} {'TTFT p50':>9} {'p90 ms':>7} {'batches':>8} "
            f"{'dropped':>8} {'received':>9} {'missed':>7} {'step ms':>8} {'errors':>6}")
    lines = [f"kv-stall: {rows[0]['workload']} C={rows[0]['concurrency']}, events from {rows[0]['kv_endpoint']}",
             head]
    for r in rows:
        live = "" if "received_batches" in r else "beside_"  # the stalled run's: the live one beside it
        got = r.get(f"{live}received_batches")
        # missed: the batches of the run (sent or dropped, one seq each) it did not receive
        missed = "-" if got is None else max(0, r["kv_batches"] + r["kv_dropped"] - got)
        lines.append(f"{r['kv_subscriber']:<10} {r['tok_s']:9.1f} {r['req_s']:8.2f} {r['ttft_p50_ms']:9.1f} "
                     f"{r['ttft_p90_ms']:7.1f} {r['kv_batches']:8d} {r['kv_dropped']:8d} "
                     f"{'-' if got is None else got:>9} {missed:>7} {r['engine_step_ms'] or 0:8.3f} {r['errors']:6d}")
    lines.append("(received, missed: a live subscriber's; in the stalled run, one beside the stalled one)")
    q, st = ratio(rows), stalled(rows)
    lines.append(f"stalled / none (mean of both): tok/s {q['tok_s']:.3f}, turns/s {q['req_s']:.3f} (the stalled "
                 f"run after {st.get('kv_prime_runs', 0)} unmeasured run(s)"
                 f"{'' if st.get('kv_primed') else ', the publisher NOT yet dropping'})")
    return "\n".join(lines)


__all__ = ["MODES", "LiveSubscriber", "StalledSubscriber", "kv_counters", "local_endpoint", "measure_modes",
           "ratio", "stalled", "table"]
