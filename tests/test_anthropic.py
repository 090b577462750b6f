"""Anthropic's Messages API (issue 22 item 6) with the real ``anthropic`` client against the daemon
(the tiny random-weight model): ``messages.create`` and ``messages.stream``, text and forced tool
calls, tool results in the history, errors in Anthropic's shape (the 404, 405 and 500 no endpoint answers
included: issue 44 item 6), ``x-api-key``."""

from __future__ import annotations

import dataclasses
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import Daemon
from tests.test_gateway import start_gateway

WEATHER: dict[str, Any] = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ADD: dict[str, Any] = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}
SCHEMA_OF = {t["name"]: t["input_schema"] for t in (WEATHER, ADD)}
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris? And what is 2 plus 3?"}]
GREEDY: Any = {"temperature": 0}  # the anthropic client takes sampling parameters as extra_body


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    folder = tmp_path_factory.mktemp("anthropic")
    keys = folder / "keys"
    keys.write_text("secret-key\n")
    d, url = start_gateway(folder, model_path, model={"ctx_per_slot": 2048},
                           workers={"cpu_workers": 1, "slots": 4}, http={"api_keys_file": str(keys)})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture
def client(gw: tuple[Daemon, str]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw[1], api_key="secret-key", max_retries=0)


def test_create_text(client: anthropic.Anthropic, model_path: str) -> None:
    m = client.messages.create(model=Path(model_path).stem, max_tokens=12, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello"}], extra_body=GREEDY)
    assert (m.type, m.role, m.model, m.stop_reason) == ("message", "assistant", "tiny", "max_tokens")
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens == 12 and m.usage.input_tokens > 5
    again = client.messages.create(model="tiny", max_tokens=12, system="Be brief.",
                                   messages=[{"role": "user", "content": "Hello"}], extra_body=GREEDY)
    assert again.content == m.content
    assert (again.usage.cache_read_input_tokens or 0) > 0  # the prefix cache, as Anthropic counts it
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == (
        m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0))


def test_a_stop_sequence_is_reported(client: anthropic.Anthropic) -> None:
    ask: Any = {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "Hello"}],
                "extra_body": GREEDY}
    text = client.messages.create(**ask).content[0].text
    stop = text[6:9]  # three characters the greedy reply writes
    m = client.messages.create(**ask, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[: text.index(stop)]


def test_stream_text_equals_create(client: anthropic.Anthropic) -> None:
    kw: Any = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Tell me a story"}],
               "extra_body": {"temperature": 0, "top_k": 1, "top_p": 1}}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert isinstance(whole.content[0], anthropic.types.TextBlock)
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0))


def _calls(m: Any) -> list[Any]:
    calls = [b for b in m.content if b.type == "tool_use"]
    for b in calls:
        jsonschema.validate(b.input, SCHEMA_OF[b.name])
        assert b.id
    return calls


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_a_forced_tool_call(client: anthropic.Anthropic, choice: Any) -> None:
    m = client.messages.create(model="tiny", max_tokens=300, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                               extra_body=GREEDY)
    calls = _calls(m)
    assert m.stop_reason == "tool_use" and calls
    if choice["type"] == "tool":
        assert [c.name for c in calls] == ["add"]
    with client.messages.stream(model="tiny", max_tokens=300, messages=ASK, tools=[WEATHER, ADD],
                                tool_choice=choice, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert final.stop_reason == "tool_use"
    assert [(c.name, c.input) for c in _calls(final)] == [(c.name, c.input) for c in calls]


def test_a_history_with_tool_use_and_tool_result(client: anthropic.Anthropic) -> None:
    history: Any = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "18 degrees, sunny"}]},
                                     {"type": "text", "text": "Thanks!"}]},
    ]
    m = client.messages.create(model="tiny", max_tokens=8, messages=history, tools=[WEATHER, ADD],
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.content[0].type == "text"
    forced = client.messages.create(model="tiny", max_tokens=300, messages=history, tools=[WEATHER, ADD],
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert [c.name for c in _calls(forced)] == ["get_weather"]


BAD = [
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"max_tokens": 0}, "'max_tokens' must be an integer from 1 to 1073741824, got 0"),
    ({"temperature": 3}, "'temperature' must be a number from 0 to 2, got 3"),
    ({"top_k": -1}, "'top_k' must be an integer from 0 to 1048576, got -1"),
    ({"stop_sequences": [""]}, "'stop_sequences' entries must be strings of 1 to 256 characters"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'messages[0].role' must be 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'messages[0].content[0].source' must be {'type': 'base64'"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "'tools[0].name' must be 1 to 64 letters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'tool_choice' names the function 'nope'"),
    ({"tool_choice": {"type": "sometimes"}}, "'tool_choice.type' must be one of auto, any, tool, none"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools of type 'web_search_20250305'"),
    ({"tools": [{"name": "get_weather", "description": "no schema"}]}, "'tools[0].input_schema' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "'messages[0].content[0].tool_use_id' is 'toolu_9': no tool_use block of the assistant turn before it"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "text", "text": "here:"},
                                                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]},
     "'messages[2].content[1].tool_use_id' is 'toolu_2'"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_bad_requests_are_400s_in_anthropics_shape(client: anthropic.Anthropic, change: dict[str, Any],
                                                   message: str) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body=body, cast_to=httpx.Response)
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert message in err["error"]["message"], err


def test_errors_and_keys(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    url = gw[1]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(url + "/v1/messages", headers={"authorization": "Bearer secret-key"}, content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    too_long = [{"role": "user", "content": "hello " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=too_long)
    assert "the limit is 2047" in e.value.body["error"]["message"]  # type: ignore[index]


def test_no_such_route_or_method_under_v1_messages_is_in_anthropics_shape(gw: tuple[Daemon, str],
                                                                          client: anthropic.Anthropic) -> None:
    """Starlette's 404 and 405 (no endpoint answers them) under /v1/messages reach Anthropic's client in
    Anthropic's shape, as its own errors do; outside it they stay OpenAI's."""
    with pytest.raises(anthropic.NotFoundError) as nf:  # the Message Batches API, which llamapool lacks
        client.messages.batches.list()
    assert nf.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "no such endpoint: GET /v1/messages/batches"}}, nf.value.body
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        with pytest.raises(anthropic.APIStatusError) as na:
            client.get(path, cast_to=httpx.Response)
        assert na.value.status_code == 405 and na.value.response.headers["allow"] == "POST"
        assert na.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": f"method not allowed: GET {path} (allowed: POST)"}}
    for path in ("/v1/messagesx", "/v1/message"):  # not Anthropic's API: OpenAI's shape
        r = httpx.get(gw[1] + path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_a_bug_is_a_500_in_the_shape_of_the_paths_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's 500 handler, unit-tested (no request makes a handler fail; one that raises stands in
    for a bug): Anthropic's shape under /v1/messages, OpenAI's elsewhere."""
    from starlette.testclient import TestClient

    from llamapool.client.aio import AsyncClient
    from llamapool.gateway import GatewaySpec
    from llamapool.gateway import app as gateway_app

    async def bug(s: Any, call: Any) -> Any:
        raise RuntimeError("a bug")

    messages = dataclasses.replace(gateway_app.anthropic.MESSAGES, handle=bug)  # Anthropic's door, its handler a bug
    monkeypatch.setattr(gateway_app.anthropic, "MESSAGES", messages)
    monkeypatch.setattr(gateway_app.completions, "handle", bug)
    spec = GatewaySpec(name="t", frontend="ipc:///nonexistent/router", host="127.0.0.1", port=0, model="tiny",
                       listen_fd=-1)
    app = gateway_app.Gateway(spec, cast(AsyncClient, None)).app()  # the bug comes before any router call
    http = TestClient(app, base_url="http://localhost", raise_server_exceptions=False)
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": []})
    assert r.status_code == 500 and r.json() == {"type": "error", "error": {
        "type": "api_error", "message": "internal error: RuntimeError"}}, r.text
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": "internal_error"}


def test_raw_stream_events(gw: tuple[Daemon, str]) -> None:
    body = {"model": "tiny", "max_tokens": 3, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", gw[1] + "/v1/messages", json=body, headers={"x-api-key": "secret-key"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [d["type"] for d in data] == names
    delta = data[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
