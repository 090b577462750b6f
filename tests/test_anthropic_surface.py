"""Anthropic's current Messages surface (issue 33 item 2) with the installed ``anthropic`` client against
the daemon serving SmolLM2-135M-Instruct: ``output_config`` constrains the reply to its JSON schema,
``thinking``, ``cache_control``, ``metadata`` and ``service_tier`` are accepted and change nothing,
``tool_choice`` ``none``/``auto``/``any``/``tool`` with ``disable_parallel_tool_use``, unknown fields are
ignored (a debug line), ``count_tokens`` counts what ``create`` computes, and a stream's ``message_start``
has the prompt's tokens."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pydantic
import pytest

from tests.conftest import Daemon
from tests.test_gateway import start_gateway

CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Berlin"]},
                                                         "country": {"enum": ["France", "Italy", "Germany"]}},
                        "required": ["city", "country"], "additionalProperties": False}
WEATHER: dict[str, Any] = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}
TIME: dict[str, Any] = {"name": "get_time", "description": "The time in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}
ASK: Any = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: Any = {"temperature": 0}


class City(pydantic.BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[tuple[Daemon, str]]:
    d, url = start_gateway(tmp_path_factory.mktemp("anthropic-surface"), smollm2, model={"ctx_per_slot": 2048},
                           workers={"cpu_workers": 1, "slots": 4}, log={"level": "debug"})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture
def client(gw: tuple[Daemon, str]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw[1], api_key="unused", max_retries=0)


def name(gw: tuple[Daemon, str]) -> str:
    return str(httpx.get(gw[1] + "/v1/models").json()["data"][0]["id"])


def text_of(m: Any) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_output_config_constrains_the_reply_to_its_schema(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=name(gw), max_tokens=40, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": CITY}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(m)), CITY)


def test_messages_parse_with_a_pydantic_output_format(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    """``messages.parse(output_format=Model)`` sends the model's schema as ``output_config.format`` and
    parses the reply into the model."""
    m = client.messages.parse(model=name(gw), max_tokens=60, messages=ASK, output_format=City, extra_body=GREEDY)
    assert isinstance(m.parsed_output, City)


def test_output_config_together_with_tools(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    """A call whose input follows its schema, or text in the format."""
    m = client.messages.create(model=name(gw), max_tokens=60, messages=ASK, extra_body=GREEDY, tools=[WEATHER],
                               output_config={"format": {"type": "json_schema", "schema": CITY}})
    calls = [b for b in m.content if b.type == "tool_use"]
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])
    if not calls:
        jsonschema.validate(json.loads(text_of(m)), CITY)


def test_a_bad_output_config_is_a_400_naming_it(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    for fmt, field in (({"type": "json_schema", "schema": 5}, "output_config.format.schema"),
                       ({"type": "yaml"}, "output_config.format.type")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=name(gw), max_tokens=8, messages=ASK, output_config={"format": fmt})
        assert field in str(e.value)


@pytest.mark.parametrize("extra", [
    {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"thinking": {"type": "adaptive"}},
    {"thinking": {"type": "disabled"}},
    {"metadata": {"user_id": "u-1"}, "service_tier": "auto"},
    {"cache_control": {"type": "ephemeral"}},
    {"output_config": {"effort": "low"}},
])
def test_accepted_fields_change_nothing(gw: tuple[Daemon, str], client: anthropic.Anthropic,
                                        extra: dict[str, Any]) -> None:
    plain = client.messages.create(model=name(gw), max_tokens=12, messages=ASK, extra_body=GREEDY)
    m = client.messages.create(model=name(gw), max_tokens=12, messages=ASK, extra_body={**GREEDY, **extra})
    assert [b.type for b in m.content] == ["text"] and text_of(m) == text_of(plain)  # no thinking blocks


def test_cache_control_on_blocks_and_tools_is_accepted(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    ephemeral: Any = {"type": "ephemeral"}
    plain = client.messages.create(model=name(gw), max_tokens=12, system="Be brief.", messages=ASK,
                                   tools=[WEATHER], extra_body=GREEDY)
    m = client.messages.create(
        model=name(gw), max_tokens=12, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief.", "cache_control": ephemeral}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"],
                                                "cache_control": ephemeral}]}],
        tools=[{**WEATHER, "cache_control": ephemeral}])
    assert m.content == plain.content


def test_unknown_fields_are_ignored_with_a_debug_line(gw: tuple[Daemon, str]) -> None:
    r = httpx.post(gw[1] + "/v1/messages", json={"model": name(gw), "max_tokens": 4, "messages": ASK,
                                                 "frobnicate": {"x": 1}}, timeout=60)
    assert r.status_code == 200, r.text
    assert "frobnicate" in gw[0].wait_log("ignored fields")


def test_tool_choice_none_gives_no_call(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=name(gw), max_tokens=16, tools=[WEATHER], tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                               extra_body=GREEDY)
    assert m.stop_reason != "tool_use" and [b.type for b in m.content] == ["text"]


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}])
def test_a_forced_call_without_parallel_calls_is_one_call(gw: tuple[Daemon, str], client: anthropic.Anthropic,
                                                          choice: Any) -> None:
    m = client.messages.create(model=name(gw), max_tokens=48, tools=[WEATHER, TIME], tool_choice=choice,
                               messages=[{"role": "user", "content": "What is the time in Paris?"}],
                               extra_body=GREEDY)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1
    if choice["type"] == "tool":
        assert calls[0].name == "get_time"
    jsonschema.validate(calls[0].input, TIME["input_schema"])


def test_count_tokens_counts_what_create_computes(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    ask: Any = {"model": name(gw), "system": "You answer questions about the weather.", "tools": [WEATHER],
                "messages": [{"role": "user", "content": "Is it raining in Rome today?"}]}
    count = client.messages.count_tokens(**ask)
    m = client.messages.create(max_tokens=2, extra_body=GREEDY, **ask)
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    # a forced call or a format does not change the prompt, nor stop the count (its one step is unconstrained)
    forced = {**ask, "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema",
                                                                                   "schema": CITY}}}
    assert client.messages.count_tokens(**forced).input_tokens == count.input_tokens
    assert count.input_tokens > client.messages.count_tokens(model=name(gw), messages=ask["messages"]).input_tokens


def test_a_streams_message_start_has_the_prompts_tokens(gw: tuple[Daemon, str], client: anthropic.Anthropic) -> None:
    body = {"model": name(gw), "max_tokens": 6, "messages": ASK, "stream": True, **GREEDY,
            "system": "A different system prompt for this test."}
    with httpx.stream("POST", gw[1] + "/v1/messages", json=body, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = data[0]["message"]["usage"]
    end = next(d for d in data if d["type"] == "message_delta")["usage"]
    assert start["input_tokens"] > 0 and start["output_tokens"] == 0
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (end["input_tokens"],
                                                                        end["cache_read_input_tokens"])
    with client.messages.stream(model=name(gw), max_tokens=6, messages=ASK, extra_body=GREEDY) as s:
        final = s.get_final_message()
    whole = client.messages.create(model=name(gw), max_tokens=6, messages=ASK, extra_body=GREEDY)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
