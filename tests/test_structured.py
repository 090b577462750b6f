"""Structured outputs and tool calls, through the daemon with the real ``openai`` client and the SDK.

The guarantees: an output constrained by a JSON schema parses and validates against it, on a trained
model (Gemma 3 270M) and on a random-weight one alike; ``tool_choice`` ``required`` or a named
function always gives calls whose arguments validate against the function's ``parameters``; a
streamed call accumulates to the same call as the reply that is not streamed; unconstrained requests
sharing the batch with constrained ones get exactly the tokens they get alone; a schema, grammar or
tool list that is wrong is a 400 naming the field, before the request takes a slot.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from llamapool import BadRequestError, Client, default_model

from .conftest import Daemon
from .test_gateway import start_gateway

S = {"type": "string", "maxLength": 12}


def closed(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An object schema as strict structured outputs write them: no properties beyond ``props``."""
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    closed({"name": S}, ["name"]),
    closed({"age": {"type": "integer", "minimum": 0, "maximum": 120}}, ["age"]),
    closed({"colour": {"enum": ["red", "green", "blue"]}}, ["colour"]),
    closed({"ok": {"type": "boolean"}, "note": S}, ["ok"]),  # an optional field
    closed({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, ["tags"]),
    closed({"point": closed({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                             "y": {"type": "integer", "minimum": -9, "maximum": 9}}, ["x", "y"])}, ["point"]),
    closed({"items": {"type": "array", "maxItems": 2, "items": closed(
        {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, ["sku", "qty"])}}, ["items"]),
    closed({"kind": {"const": "event"}, "day": {"enum": ["mon", "tue"]}}, ["kind", "day"]),
    closed({"level": {"type": "integer", "enum": [1, 2, 3]}, "name": S}, ["level", "name"]),
    closed({"name": S, "nick": S}, ["name"]),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2, "maxItems": 4},
    closed({"a": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, S]}}, ["a"]),
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris? And what is 2 plus 3?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, openai.OpenAI]]:
    d, url = start_gateway(tmp_path_factory.mktemp("structured"), model_path, model={"ctx_per_slot": 2048},
                           workers={"slots": 8, "cpu_workers": 1})
    yield d, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, openai.OpenAI]]:
    path = str(default_model.fetch(Path(__file__).resolve().parent.parent / "models"))
    template = str(Path(__file__).resolve().parent.parent / "configs" / "gemma3.jinja")
    d, url = start_gateway(tmp_path_factory.mktemp("structured-gemma"), path, workers={"slots": 4, "cpu_workers": 1},
                           model={"path": path, "ctx_per_slot": 2048, "chat_template": template})
    yield d, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    d.stop(signal.SIGQUIT, timeout=30)


def name_of(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_validate_on_a_random_weight_model(tiny: tuple[Daemon, openai.OpenAI], i: int) -> None:
    c = tiny[1]
    r = c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": f"Answer {i}"}],
                                  response_format=schema_format(SCHEMAS[i]), max_tokens=400, temperature=0)
    text = r.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert r.choices[0].finish_reason == "stop"  # the grammar completed the reply


def test_json_object_on_gemma(gemma: tuple[Daemon, openai.OpenAI]) -> None:
    c = gemma[1]
    ask = "Give a JSON object with the keys \"city\" and \"country\" for Paris."
    r = c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": ask}],
                                  response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content or "") == {"city": "Paris", "country": "France"}


# schemas as users write them (pydantic, zod): no additionalProperties, no bounds (held out of the closing's design)
AS_WRITTEN = [
    {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}, "score": {"type": "number"}}, "required": ["name", "tags", "score"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "object", "properties": {
        "name": {"type": "string"}, "born": {"type": "integer"}}, "required": ["name"]}}, "required": ["title"]},
]


@pytest.mark.parametrize("max_tokens", [16, 24, 48])
def test_replies_cut_by_max_tokens_parse_on_gemma(gemma: tuple[Daemon, openai.OpenAI], max_tokens: int) -> None:
    """A subset of what scripts/structured_check.py checked (in git history): every reply parses and
    validates, or the request is a 400 naming max_tokens (too few for any valid reply)."""
    c = gemma[1]
    for i, schema in enumerate(AS_WRITTEN):
        ask = f"Give me the data of a {['city', 'product', 'book'][i]} as JSON, with a long description."
        try:
            r = c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": ask}],
                                          response_format=schema_format(schema), max_tokens=max_tokens,
                                          temperature=0)
        except openai.BadRequestError as e:
            assert e.body["param"] == "max_tokens" and max_tokens < 24, e.body  # type: ignore[index]
            continue
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
        assert r.usage is not None and r.usage.completion_tokens <= max_tokens


def test_sampled_regex_and_grammars(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    d = tiny[0]
    with d.client() as sdk:
        assert sdk.generate("x", regex=r"[0-9]{3}-[a-z]{2}", max_tokens=50, temperature=0.7).text[3] == "-"
        out = sdk.generate("x", grammar='root ::= "yes" | "no"', max_tokens=10, temperature=0)
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        lark = sdk.generate("x", grammar='start: "n=" /[1-9][0-9]?/', max_tokens=10, temperature=0)
        assert lark.text.startswith("n=") and 3 <= len(lark.text) <= 4


def test_pydantic_parse_on_gemma(gemma: tuple[Daemon, openai.OpenAI]) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        age: int = pydantic.Field(ge=0, le=150)
        city: str = pydantic.Field(max_length=24)

    c = gemma[1]
    r = c.chat.completions.parse(model=name_of(c), response_format=Person, temperature=0, max_tokens=100, messages=[
        {"role": "user", "content": "Anna is 31 years old and lives in Oslo. Give her name, age and city as JSON."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_forced_tool_calls_validate(request: pytest.FixtureRequest, which: str, choice: Any) -> None:
    c = request.getfixturevalue(which)[1]
    # a 270M base model repeats itself: one call at a time, so that the grammar completes
    r = c.chat.completions.create(model=name_of(c), messages=ASK, tools=TOOLS, tool_choice=choice,
                                  max_tokens=300, temperature=0, parallel_tool_calls=which == "tiny")
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    for call in msg.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    if isinstance(choice, dict):
        assert {call.function.name for call in msg.tool_calls} == {"add"}


def test_a_streamed_tool_call_equals_the_reply(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    c = tiny[1]
    kw: Any = {"model": name_of(c), "messages": ASK, "tools": TOOLS, "tool_choice": "required",
               "max_tokens": 300, "temperature": 0}
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            got = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            got["name"] += (tc.function.name or "") if tc.function else ""
            got["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and whole
    assert [calls[i] for i in sorted(calls)] == [{"name": t.function.name, "arguments": t.function.arguments}
                                                  for t in whole]


def test_a_history_with_tool_results_on_gemma(gemma: tuple[Daemon, openai.OpenAI]) -> None:
    c = gemma[1]
    history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = c.chat.completions.create(model=name_of(c), messages=history, tools=TOOLS, tool_choice="none",
                                  max_tokens=30, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_auto_leaves_prose_free(gemma: tuple[Daemon, openai.OpenAI]) -> None:
    c = gemma[1]
    r = c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": "Say hello in French."}],
                                  tools=TOOLS, max_tokens=20, temperature=0)
    choice = r.choices[0]
    assert choice.message.content or choice.message.tool_calls
    for call in choice.message.tool_calls or ():  # a call, when the model makes one, still validates
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_unconstrained_text_is_unchanged_by_constrained_neighbours(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    d = tiny[0]
    prompts = [f"plain prompt {i}" for i in range(3)]
    with d.client() as sdk:
        alone = [sdk.generate(p, max_tokens=24, temperature=0, ignore_eos=True).text for p in prompts]
    together: dict[int, str] = {}

    def constrained(i: int) -> None:
        with d.client() as sdk:
            sdk.generate(f"json {i}", json_schema={"type": "object", "properties": {"s": {"type": "string"}}},
                         max_tokens=60, temperature=0, ignore_eos=True)

    def plain(i: int) -> None:
        with d.client() as sdk:
            together[i] = sdk.generate(prompts[i], max_tokens=24, temperature=0, ignore_eos=True).text

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=plain, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [together[i] for i in range(3)] == alone


@pytest.mark.parametrize("extra, param", [
    ({"response_format": schema_format({"type": "strnig"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"extra_body": {"grammar": "root ::= ("}}, "grammar"),
    ({"extra_body": {"regex": "(ab"}}, "regex"),
    ({"extra_body": {"json_schema": {"type": "object"}, "regex": "a"}}, "regex"),
])
def test_bad_constraints_are_400_naming_the_field(tiny: tuple[Daemon, openai.OpenAI], extra: dict[str, Any],
                                                  param: str) -> None:
    c = tiny[1]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                  **extra)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


def test_the_sdk_names_a_bad_grammar_and_takes_no_slot(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    d = tiny[0]
    with d.client() as sdk:
        with pytest.raises(BadRequestError) as e:
            sdk.generate("x", json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
        assert e.value.field == "json_schema"
        with pytest.raises(BadRequestError) as e:
            sdk.chat([{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="banana")
        assert e.value.field == "tool_choice"
        with pytest.raises(BadRequestError) as e:
            sdk.generate("plain text", tools=[WEATHER], tool_choice="required")
        assert e.value.field == "tools"
        assert sdk.status()["running"] == 0
        done = sdk.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
        assert done.finish_reason == "tool_calls" and done.tool_calls
        for call in done.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])


def test_async_client_takes_the_same_parameters(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    import asyncio

    from llamapool import AsyncClient

    async def go() -> Any:
        async with AsyncClient(tiny[0].endpoint) as c:
            return await c.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                max_tokens=200, temperature=0)

    done = asyncio.run(go())
    assert [t.name for t in done.tool_calls] and all(t.name == "add" for t in done.tool_calls)


def test_client_sdk_streams_prose_before_calls_only(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    with Client(tiny[0].endpoint) as sdk:
        stream = sdk.chat_stream(ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
        text = "".join(ch.text for ch in stream)
        assert stream.completion is not None and stream.completion.tool_calls
        assert text == ""  # the calls are not streamed as text
