"""The OpenAI-compatible HTTP gateway, checked with the real ``openai`` client over a real socket,
the daemon (supervisor, router, workers, gateway process) running as a real process tree."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Daemon, launch

GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, daemon: Daemon, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if daemon.proc.poll() is not None:
            raise AssertionError(daemon.log_text())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"gateway not healthy:\n{daemon.log_text()}")


def start_gateway(folder: Path, model_path: str, **sections: dict[str, Any]) -> tuple[Daemon, str]:
    port = free_port()
    http = {"listen": f"127.0.0.1:{port}", **sections.pop("http", {})}
    d = launch(folder, model_path, http=http, **sections)
    d.wait_ready(2 if sections.get("workers", {}).get("cpu_workers", 2) == 2 else 1)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, d)
    return d, url


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    d, url = start_gateway(tmp_path_factory.mktemp("gw"), model_path, model={"ctx_per_slot": 4096},
                           workers={"slots": 16})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture
def client(gateway: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway[1] + "/v1", api_key="unused", max_retries=0)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---------------------------------------------------------------- the happy paths


def test_models_and_health(gateway: tuple[Daemon, str], client: openai.OpenAI, model_path: str) -> None:
    assert [m.id for m in client.models.list().data] == [Path(model_path).stem]
    r = httpx.get(gateway[1] + "/health")
    assert r.status_code == 200 and r.json()["workers_ready"] == 2


def test_completion_streamed_equals_completion_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=model_name(client), prompt="Hello world", max_tokens=24, **GREEDY)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    chunks = list(client.completions.create(model=model_name(client), prompt="Hello world", max_tokens=24,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_token_id_prompts_and_several_prompts(client: openai.OpenAI) -> None:
    one = client.completions.create(model=model_name(client), prompt=[5, 6, 7, 8], max_tokens=8, **GREEDY)
    assert one.usage is not None and one.usage.prompt_tokens == 4
    many = client.completions.create(model=model_name(client), prompt=["Hello", "the model"], max_tokens=8, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    alone = client.completions.create(model=model_name(client), prompt="the model", max_tokens=8, **GREEDY)
    assert many.choices[1].text == alone.choices[0].text
    streamed = client.completions.create(model=model_name(client), prompt=["Hello", "the model"], max_tokens=8,
                                         stream=True, **GREEDY)
    texts = {0: "", 1: ""}
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: many.choices[0].text, 1: many.choices[1].text}


def test_chat_streamed_equals_chat_whole(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=model_name(client), messages=msgs, max_tokens=16, **GREEDY)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model=model_name(client), messages=msgs, max_tokens=16,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=model_name(client), prompt="Hello world", max_tokens=40, **GREEDY)
    stop = free.choices[0].text[10:13]
    cut = client.completions.create(model=model_name(client), prompt="Hello world", max_tokens=40, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free.choices[0].text[: free.choices[0].text.find(stop)]


def test_32_concurrent_streams_all_complete(gateway: tuple[Daemon, str]) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=gateway[1] + "/v1", api_key="unused", max_retries=0)

        name = (await aclient.models.list()).data[0].id

        async def one(i: int) -> str:
            text = ""
            async for c in await aclient.completions.create(model=name, prompt=f"prompt {i}", max_tokens=12,
                                                            stream=True, temperature=0,
                                                            extra_body={"ignore_eos": True}):
                text += c.choices[0].text if c.choices else ""
            return text

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    texts = asyncio.run(main())
    assert len(texts) == 32 and all(texts)


# ---------------------------------------------------------------- errors, in OpenAI's shape


@pytest.mark.parametrize("kw, param", [
    ({"n": 2}, "n"),
    ({"logprobs": 2}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"prompt": []}, "prompt"),
])
def test_bad_requests_are_400_naming_the_parameter(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": model_name(client), "prompt": "Hello", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.body["param"] == param  # type: ignore[index]


def test_tools_and_prompts_too_long_are_refused(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": "x"}],
                                       tools=[tool])
    assert e.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # the worker's check, mapped with its field
        client.completions.create(model=model_name(client), prompt=[5] * 5000, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "ctx_per_slot" in e.value.message  # type: ignore[index]


def test_unknown_model_is_404_and_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=4)
    ok = client.completions.create(model=model_name(client), prompt="Hello", max_tokens=4,
                                   extra_body={"some_future_field": 1})
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


def test_keys_overload_and_mid_stream_worker_loss(tmp_path: Path, model_path: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nsecret-1\nsecret-2\n")
    d, url = start_gateway(tmp_path / "d", model_path, http={"api_keys_file": str(keys)},
                           server={"max_queue": 1}, workers={"cpu_workers": 1, "slots": 1},
                           model={"ctx_per_slot": 4096})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/metrics").status_code == 401  # the metrics take the API keys too
        r = httpx.get(url + "/metrics", headers={"Authorization": "Bearer secret-1"})
        assert r.status_code == 200 and "llamapool_requests_total" in r.text
        c = openai.OpenAI(base_url=url + "/v1", api_key="secret-2", max_retries=0)
        name = model_name(c)
        # one long stream holds the only slot; one more waits in the queue; the next is refused
        long = c.completions.create(model=name, prompt="Hello", max_tokens=3000, stream=True, **GREEDY)
        it = iter(long)
        next(it)
        waiting = openai.AsyncOpenAI(base_url=url + "/v1", api_key="secret-2", max_retries=0)

        async def queued_then_refused() -> None:
            task = asyncio.create_task(waiting.completions.create(model=name, prompt="x", max_tokens=2))
            await asyncio.sleep(0.5)
            with pytest.raises(openai.RateLimitError) as e:
                await waiting.completions.create(model=name, prompt="y", max_tokens=2)
            assert e.value.response.headers.get("retry-after") == "1"
            task.cancel()
            await waiting.close()

        asyncio.run(queued_then_refused())
        # the worker dies mid-stream: the stream ends with an error event, not a silent cut
        worker = next(w for w in d.status()["workers"] if w["state"] == "ready")
        os.kill(worker["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError) as lost:
            for _ in it:
                pass
        assert "worker" in str(lost.value.message).lower()
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


# ---------------------------------------------------------------- lifecycle


def test_a_client_that_disconnects_frees_its_slot(gateway: tuple[Daemon, str]) -> None:
    d, url = gateway

    def engine_steps() -> int:
        time.sleep(1.2)  # a heartbeat carries the engines' step counters
        return sum(w.get("steps") or 0 for w in d.status()["workers"])

    before = engine_steps()
    with httpx.stream("POST", url + "/v1/completions", json={
            "prompt": "Hello", "max_tokens": 4000, "stream": True, "temperature": 0, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    end = time.monotonic() + 5
    while time.monotonic() < end and d.status()["running"]:
        time.sleep(0.05)
    st = d.status()
    assert st["running"] == 0 and sum(w["active"] for w in st["workers"]) == 0
    assert engine_steps() - before < 2000, "the worker stopped generating for the client that left"


def test_the_gateway_is_restarted_when_it_dies(gateway: tuple[Daemon, str], client: openai.OpenAI) -> None:
    url = gateway[1]

    def gateway_pids() -> list[str]:
        pattern = f"llamapool.gateway .*{url.rsplit(':', 1)[1]}"
        return subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()

    out = gateway_pids()
    assert len(out) == 1
    os.kill(int(out[0]), signal.SIGKILL)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    again = gateway_pids()
    assert again and again != out
    assert client.completions.create(model=model_name(client), prompt="Hello", max_tokens=4).choices


def test_sigterm_lets_streams_in_flight_finish(tmp_path: Path, model_path: str) -> None:
    """Two gateway processes share the port (SO_REUSEPORT); SIGTERM drains both."""
    d, url = start_gateway(tmp_path / "d", model_path, workers={"cpu_workers": 1}, http={"processes": 2})
    port = url.rsplit(":", 1)[1]
    pids = subprocess.run(["pgrep", "-f", f"llamapool.gateway .*{port}"], capture_output=True, text=True).stdout
    assert len(pids.split()) == 2
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    streams = [iter(c.completions.create(model=model_name(c), prompt="Hello", max_tokens=200, stream=True,
                                         **GREEDY)) for _ in range(4)]
    for s in streams:
        next(s)
    d.proc.send_signal(signal.SIGTERM)
    for s in streams:
        chunks = list(s)
        assert chunks[-1].choices[0].finish_reason == "length"
    assert d.proc.wait(30) == 0
