"""The serving path end to end: client -> router -> worker -> router -> client, real engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from llamapool import AsyncClient, BadRequestError, Completion


@pytest.fixture
def daemon(start_daemon):  # type: ignore[no-untyped-def]
    return start_daemon()


def test_generate_returns_text_usage_and_worker(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        done = c.generate("Hello world", max_tokens=12, temperature=0.0, ignore_eos=True)
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens > 0
    assert done.text
    assert done.worker in {"cpu0", "cpu1"}


def test_stream_chunks_concatenate_to_the_final_text(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        stream = c.stream("Hello world", max_tokens=24, temperature=0.0, ignore_eos=True)
        chunks = list(stream)
        assert stream.completion is not None
        assert "".join(ch.text for ch in chunks) == stream.completion.text
        assert chunks[-1].tokens == 24
        same = c.generate("Hello world", max_tokens=24, temperature=0.0, ignore_eos=True)
    assert same.text == stream.completion.text


def test_generate_many_answers_each_prompt_in_order(daemon) -> None:  # type: ignore[no-untyped-def]
    prompts = ["one", "two two", "three three three", [1, 300, 301], "five"]
    with daemon.client() as c:
        many = c.generate_many(prompts, max_tokens=6, temperature=0.0, ignore_eos=True)
        singles = [c.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in prompts]
    assert [m.index for m in many] == list(range(len(prompts)))
    assert [m.text for m in many] == [s.text for s in singles]
    assert {m.worker for m in many} == {"cpu0", "cpu1"}, "a micro-batch is spread across workers"


def test_two_workers_both_serve_sixteen_concurrent_requests(daemon) -> None:  # type: ignore[no-untyped-def]
    results: list[Completion] = []
    lock = threading.Lock()
    with daemon.client() as c:

        def one(i: int) -> None:
            r = c.generate(f"request {i}", max_tokens=16, temperature=0.7, seed=i, ignore_eos=True)
            with lock:
                results.append(r)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len(results) == 16
    assert all(r.usage.completion_tokens == 16 for r in results)
    by_worker = Counter(r.worker for r in results)
    assert set(by_worker) == {"cpu0", "cpu1"}, by_worker


def test_closing_a_stream_frees_its_slot(daemon) -> None:  # type: ignore[no-untyped-def]
    def engine_steps(c) -> int:  # type: ignore[no-untyped-def]
        time.sleep(1.2)  # a heartbeat carries the engines' step counters
        return sum(w.get("steps") or 0 for w in c.status()["workers"])

    with daemon.client() as c:
        before = engine_steps(c)
        stream = c.stream("Hello", max_tokens=400, temperature=0.0, ignore_eos=True)
        next(iter(stream))
        busy = sum(w["active"] for w in c.status()["workers"])
        assert busy == 1
        stream.close()
        end = time.monotonic() + 5
        while time.monotonic() < end and sum(w["active"] for w in c.status()["workers"]):
            time.sleep(0.02)
        assert sum(w["active"] for w in c.status()["workers"]) == 0
        # the worker stopped generating well before the 400 tokens asked for (the tiny model makes a
        # step in about a millisecond, so a loaded 2-core machine may still run tens of steps while
        # the cancel travels client -> router -> worker)
        assert engine_steps(c) - before < 300


def test_stop_strings_end_the_text_before_them(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        free = c.generate("Hello world", max_tokens=40, temperature=0.0, ignore_eos=True)
        stop = free.text[10:13]
        cut = c.generate("Hello world", max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]


def test_seeded_sampling_is_reproducible(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        a = c.generate("x", max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
        b = c.generate("x", max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    assert a.text == b.text


def test_status_lists_every_worker(daemon) -> None:  # type: ignore[no-untyped-def]
    st = daemon.status()
    assert [w["id"] for w in st["workers"]] == ["cpu0", "cpu1"]
    for w in st["workers"]:
        assert w["state"] == "ready" and w["slots"] == 4 and w["active"] == 0
        assert w["device"] == "cpu" and w["pid"] > 0 and w["visible_devices"] == []


def test_prompt_too_long_is_a_bad_request_naming_the_prompt(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c, pytest.raises(BadRequestError) as e:
        c.generate([5] * 600, max_tokens=4)
    assert e.value.field == "prompt" and "limit" in e.value.message


def test_token_id_out_of_vocab_is_a_bad_request(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c, pytest.raises(BadRequestError) as e:
        c.generate([1, 10_000_000], max_tokens=4)
    assert e.value.field == "prompt"


def test_async_client_generate_stream_and_many(daemon) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        async with AsyncClient(daemon.endpoint) as c:
            results = await asyncio.gather(*(c.generate(f"p{i}", max_tokens=5, temperature=0.0,
                                                        ignore_eos=True) for i in range(8)))
            assert all(r.usage.completion_tokens == 5 for r in results)
            text = "".join([ch.text async for ch in c.stream("p0", max_tokens=5, temperature=0.0,
                                                              ignore_eos=True)])
            assert text == results[0].text
            many = await c.generate_many(["a", "b"], max_tokens=3, temperature=0.0, ignore_eos=True)
            assert [m.index for m in many] == [0, 1]
            st = await c.status()
            assert len(st["workers"]) == 2

    asyncio.run(go())


def test_breaking_out_of_a_stream_loop_cancels_at_once(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        for _chunk in c.stream("Once upon a time", max_tokens=400, ignore_eos=True):
            break
        end = time.monotonic() + 3
        while time.monotonic() < end and c.status()["running"]:
            time.sleep(0.02)
        assert c.status()["running"] == 0


def test_client_errors_are_raised_before_anything_is_sent(daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from llamapool import Client, UnavailableError

    with daemon.client() as c:
        with pytest.raises(BadRequestError) as e:
            c.generate("x", timeout=-1)
        assert e.value.field == "timeout"
        with pytest.raises(BadRequestError):
            c.generate("x", max_tokens=2**70)
        with pytest.raises(BadRequestError) as e:
            c.generate("x", max_tokens=None)
        assert e.value.field == "max_tokens"
        with pytest.raises(ValueError):
            c.generate_many([])
    t0 = time.monotonic()
    with Client(f"ipc://{tmp_path / 'nobody.sock'}") as c, pytest.raises(UnavailableError):
        c.generate("anyone?")
    assert time.monotonic() - t0 < 1.0


def test_every_sampling_parameter_is_served(daemon) -> None:  # type: ignore[no-untyped-def]
    """Through the daemon, each documented sampling parameter gives a full answer (repeat_penalty
    once crashed the worker's engine thread)."""
    with daemon.client() as c:
        for kw in ({"repeat_penalty": 1.3}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
                                               "seed": 3, "repeat_penalty": 1.1}):
            r = c.generate("a b a b a b", max_tokens=12, ignore_eos=True, timeout=30, **kw)
            assert r.usage.completion_tokens == 12, kw
