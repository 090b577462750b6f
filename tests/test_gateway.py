"""The OpenAI-compatible HTTP gateway, checked with the real ``openai`` client over a real socket,
the daemon (supervisor, router, workers, gateway process) running as a real process tree."""

from __future__ import annotations

import asyncio
import json
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
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"gateway not ready:\n{daemon.log_text()}")


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
    r = httpx.get(gateway[1] + "/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["workers_ready"] == 2


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
    ({"n": 0}, "n"),
    ({"logprobs": 6}, "logprobs"),  # completions take 0 to 5 alternatives
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format.type"),
    ({"prompt": []}, "prompt"),
])
def test_bad_requests_are_400_naming_the_parameter(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": model_name(client), "prompt": "Hello", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.body["param"] == param  # type: ignore[index]


def test_bad_tools_and_prompts_too_long_are_refused(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "function": {"name": "no spaces", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": "x"}],
                                       tools=[tool])
    assert e.value.body["param"] == "tools[0].function.name"  # type: ignore[index]
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


LIMIT = 4 * 1024 * 1024  # server.max_message_bytes, the gateway's body limit


def assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] == "request_too_large"
    assert f"{LIMIT} bytes (server.max_message_bytes)" in err["message"]


def raw_exchange(url: str, request: bytes, timeout: float = 10) -> bytes:
    """Send ``request`` as is (no body), read the answer until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_a_body_over_the_limit_is_413_at_once(gateway: tuple[Daemon, str]) -> None:
    """A body over server.max_message_bytes used to hang until request_timeout: the router refused the
    message without an id the client could match (up to 4 x the limit), or ZeroMQ dropped the gateway's
    connection for it (beyond that), and with it every stream of that gateway process."""
    url = gateway[1]
    # from the Content-Length, before the body: curl sends 'Expect: 100-continue' and waits
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {6 << 20}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n").encode()
    t0 = time.monotonic()
    answer = raw_exchange(url, head)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer, answer[:300]
    assert b'"request_too_large"' in answer and time.monotonic() - t0 < 5
    # 20 MB sent whole (no Expect), while a stream of the same gateway process runs on
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = iter(c.completions.create(model=model_name(c), prompt="Hello", max_tokens=1500, stream=True, **GREEDY))
    next(stream)
    big = json.dumps({"prompt": "x" * (20 << 20), "max_tokens": 2}).encode()
    assert_too_large(httpx.post(url + "/v1/completions", content=big, timeout=20,
                                headers={"content-type": "application/json"}))
    assert [ch.choices[0].finish_reason for ch in stream][-1] == "length"

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused once 4 MiB have arrived
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(6 << 4):
            yield b"y" * 65536
        yield b'"}]}'

    assert_too_large(httpx.post(url + "/v1/chat/completions", content=chunked(), timeout=20))
    assert client_ok(url)


def client_ok(url: str) -> bool:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return bool(c.completions.create(model=model_name(c), prompt="Hello", max_tokens=2).choices)


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_under_the_limit_that_encodes_over_it_is_413(gateway: tuple[Daemon, str], stream: bool) -> None:
    """The router's message adds an envelope to the prompt: a body a few bytes under the limit can
    encode over it; the gateway refuses it at once rather than send what the router would refuse."""
    url = gateway[1]
    head = json.dumps({"prompt": "", "max_tokens": 2, "stream": stream}).encode()
    body = head.replace(b'""', b'"' + b"z" * (LIMIT - 16 - len(head)) + b'"')
    assert LIMIT - 32 < len(body) <= LIMIT
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", content=body, timeout=20, headers={"content-type": "application/json"})
    assert_too_large(r)
    assert "encodes to a" in r.json()["error"]["message"] and time.monotonic() - t0 < 10
    # a body as long whose message is small (JSON whitespace) is served
    padded = b'{"prompt": "Hello", "max_tokens": 2' + b" " * (LIMIT - 64) + b"}"
    r = httpx.post(url + "/v1/completions", content=padded, timeout=20, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_router_too_large_is_413() -> None:
    """The router's own refusal (its limit lower than the gateway's) maps to OpenAI's 413."""
    from llamapool.client.errors import BadRequestError
    from llamapool.gateway import errors as oai

    e = oai.from_llamapool(BadRequestError("too_large", "message is 5000000 bytes, the limit is 4194304"))
    assert (e.status, e.type, e.code, e.param) == (413, "invalid_request_error", "request_too_large", None)


def test_an_error_message_names_the_field_as_the_client_sent_it() -> None:
    """A codec error names a wire field (``prompts[0][1].tool_calls``); the HTTP error's message names the
    request's own (``messages[1].tool_calls``, ``input[2].tool_calls``), as its ``param`` does."""
    from llamapool.client.errors import BadRequestError
    from llamapool.gateway import errors as oai

    wire = BadRequestError("invalid_request", "'prompts[0][1].tool_calls' must be a list of tool calls",
                           "prompts[0][1].tool_calls")
    e = oai.from_llamapool(wire, chat=True)
    assert (e.param, e.message) == ("messages[1].tool_calls", "'messages[1].tool_calls' must be a list of tool calls")
    e = oai.from_llamapool(wire, chat=True, messages=["instructions", "input[2]"])
    assert (e.param, e.message) == ("input[2].tool_calls", "'input[2].tool_calls' must be a list of tool calls")
    e = oai.from_llamapool(BadRequestError("invalid_value", "'top_p' must be a number", "params.top_p"))
    assert (e.param, e.message) == ("top_p", "'top_p' must be a number")


OK_CHAT: list[Any] = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": None},
                      {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "x"}]}]


@pytest.mark.parametrize("messages, extra, param, code", [
    ([{"role": "user"}], {}, "messages[0].content", "invalid_value"),
    ([{"role": "user", "content": None}], {}, "messages[0].content", "invalid_value"),
    ([{"role": "system", "content": "x"}, {"role": "wizard", "content": "x"}], {}, "messages[1].role",
     "invalid_value"),
    ([{"content": "x"}], {}, "messages[0].role", "invalid_value"),
    ([{"role": "user", "content": "x"}, {"role": "function", "content": "42", "name": "f"}], {},
     "messages[1].role", "unsupported_parameter"),
    ([{"role": "user", "content": 5}], {}, "messages[0].content", "invalid_value"),
    ([{"role": "user", "content": []}], {}, "messages[0].content", "invalid_value"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                   {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], {},
     "messages[0].content[1].image_url", "invalid_value"),  # a model without a projector (docs/models.md#images)
    ([{"role": "user", "content": [{"type": "text"}]}], {}, "messages[0].content[0].text", "invalid_value"),
    ([{"role": "user", "content": ["a"]}], {}, "messages[0].content[0]", "invalid_value"),
    ([{"role": "user", "content": "x"}], {"stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage", "invalid_value"),
])
def test_bad_chat_messages_are_400_naming_the_parameter(gateway: tuple[Daemon, str], messages: list[Any],
                                                        extra: dict[str, Any], param: str, code: str) -> None:
    r = httpx.post(gateway[1] + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    if "tool" in str(messages):
        assert "system, developer, user, assistant" in err["message"]


def test_good_chat_messages_are_served(client: openai.OpenAI) -> None:
    """A null assistant content, text parts, and the developer role are all fine."""
    r = client.chat.completions.create(model=model_name(client), messages=OK_CHAT, max_tokens=2,
                                       stream_options={"include_usage": False}, stream=True)
    assert [c for c in r]


def test_unknown_routes_methods_and_bad_json_in_openai_shape(gateway: tuple[Daemon, str]) -> None:
    url = gateway[1]
    for method, path, status, code in (("GET", "/v1/nope", 404, "not_found"), ("POST", "/", 404, "not_found"),
                                       ("GET", "/v1/completions", 405, "method_not_allowed"),
                                       ("DELETE", "/v1/models", 405, "method_not_allowed")):
        r = httpx.request(method, url + path)
        assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert (err["code"], err["type"], err["param"]) == (code, "invalid_request_error", None)
        assert f"{method} {path}" in err["message"]
        if status == 405:
            assert "POST" in r.headers["allow"] or "GET" in r.headers["allow"]
    for body in (b'{"prompt": "x",', b"[" * 200_000, b"\xff\xfe"):  # cut, nested too deep, not UTF-8
        r = httpx.post(url + "/v1/completions", content=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "invalid_json"


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
    """Two gateway processes accept on the supervisor's listening socket; SIGTERM drains both."""
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
