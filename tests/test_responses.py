"""OpenAI's Responses API (issue 33 item 1), stateless, with the real ``openai`` client
(``responses.create``, ``responses.stream``) and the ``openai-agents`` SDK against the daemon serving
SmolLM2-135M-Instruct: a Responses request is the chat request it translates to (the same greedy reply),
streamed in the order OpenAI documents, and what would need stored state is refused by name."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Daemon
from tests.test_gateway import start_gateway

WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                          "required": ["city"], "additionalProperties": False}}
ADD: dict[str, Any] = {"type": "function", "name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}
CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Berlin"]}},
                        "required": ["city"], "additionalProperties": False}
ASK = "What is the capital of France?"
# The events of a reply with text, in the order OpenAI documents them
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[tuple[Daemon, str]]:
    d, url = start_gateway(tmp_path_factory.mktemp("responses"), smollm2, model={"ctx_per_slot": 2048},
                           workers={"cpu_workers": 1, "slots": 4})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture
def client(gw: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw[1] + "/v1", api_key="unused", max_retries=0)


def model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw server-sent events of a streamed response, each ``event:`` line equal to its data's type."""
    out = []
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def collapsed(types: list[str]) -> list[str]:
    """Runs of the same event type as one (the deltas)."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_create_is_the_chat_it_translates_to(client: openai.OpenAI) -> None:
    """``instructions`` + ``input`` give the reply chat gives for a system and a user message."""
    m = model(client)
    r = client.responses.create(model=m, instructions="Answer in one sentence.", input=ASK, max_output_tokens=24,
                                temperature=0)
    chat = client.chat.completions.create(model=m, messages=[{"role": "system", "content": "Answer in one sentence."},
                                                             {"role": "user", "content": ASK}],
                                          max_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == m
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None and chat.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence." and r.max_output_tokens == 24 and r.temperature == 0


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=model(client), input="Write a long story about a dragon.", max_output_tokens=5,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage and r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete"


def test_usage_counts_cached_tokens(client: openai.OpenAI) -> None:
    ask = {"model": model(client), "input": "Name three colours. " * 20, "max_output_tokens": 2, "temperature": 0}
    client.responses.create(**ask)
    again = client.responses.create(**ask)
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0


def test_store_is_accepted_and_acts_as_false(gw: tuple[Daemon, str], client: openai.OpenAI) -> None:
    r = httpx.post(gw[1] + "/v1/responses", json={"model": model(client), "input": "Hi", "store": True,
                                                  "max_output_tokens": 2, "metadata": {"k": "v"}, "user": "u1"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False and r.json()["metadata"] == {"k": "v"}


@pytest.mark.parametrize("key, value", [("previous_response_id", "resp_123"), ("conversation", "conv_1"),
                                        ("background", True), ("prompt", {"id": "pmpt_1"})])
def test_what_needs_stored_state_is_refused_by_name(client: openai.OpenAI, key: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model(client), input="Hi", max_output_tokens=2, extra_body={key: value})
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == key and "keeps no state" in err["message"]


@pytest.mark.parametrize("change, param", [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    # too few tokens for the shortest reply in the format: refused by the worker, named as the body has it
    ({"max_output_tokens": 2, "text": {"format": {"type": "json_schema", "name": "c", "schema": CITY}}},
     "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
])
def test_bad_fields_are_400s_naming_them(gw: tuple[Daemon, str], change: dict[str, Any], param: str) -> None:
    body = {"input": "Hi", "max_output_tokens": 2, **change}
    r = httpx.post(gw[1] + "/v1/responses", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_stream_events_come_in_openais_order(gw: tuple[Daemon, str], client: openai.OpenAI) -> None:
    body = {"model": model(client), "input": ASK, "max_output_tokens": 12, "temperature": 0}
    evs = events(gw[1], body)
    kinds = [e["type"] for e in evs]
    assert collapsed(kinds) == [*TEXT_EVENTS, "response.completed" if evs[-1]["response"]["status"] == "completed"
                                else "response.incomplete"]
    whole = client.responses.create(**body)
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == whole.output_text
    assert next(e for e in evs if e["type"] == "response.output_text.done")["text"] == text
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    final = evs[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] > 0
    item_ids = {e.get("item_id") or e.get("item", {}).get("id") for e in evs[2:-1]}
    assert item_ids == {final["output"][0]["id"]}


def test_responses_stream_with_the_client(client: openai.OpenAI) -> None:
    """``responses.stream``: the client's accumulated response equals the events, and a JSON format
    constrains the streamed text too."""
    with client.responses.stream(model=model(client), input="Which city is the capital of France?",
                                 text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                  "strict": True}},
                                 max_output_tokens=40, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), CITY)


def test_responses_parse_gives_the_pydantic_model(client: openai.OpenAI) -> None:
    """``responses.parse(text_format=Model)`` (what the Agents SDK's ``output_type`` sends): a strict
    json_schema format, the reply parsed into the model."""
    pydantic = pytest.importorskip("pydantic")

    class Capital(pydantic.BaseModel):
        city: str
        country: str

    r = client.responses.parse(model=model(client), input="What is the capital of Italy?", text_format=Capital,
                               max_output_tokens=60, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Capital)


@pytest.mark.parametrize("ask", ["What is the capital of Italy?", "What is the weather in Rome?"])
def test_a_format_together_with_tools_gives_a_call_or_an_answer_in_the_format(client: openai.OpenAI,
                                                                               ask: str) -> None:
    """``text.format`` with ``tools`` (what the Agents SDK sends for an ``output_type`` with tools): the
    reply is a call whose arguments follow its schema, or text in the format."""
    r = client.responses.create(model=model(client), input=ask, tools=[WEATHER], parallel_tool_calls=False,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
                                max_output_tokens=60, temperature=0)
    assert r.status == "completed" and r.parallel_tool_calls is False
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) <= 1  # parallel_tool_calls false, without a tool_choice too
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    if not calls:
        jsonschema.validate(json.loads(r.output_text), CITY)


def test_a_forced_call_then_its_output_is_the_chat_with_tool_messages(client: openai.OpenAI) -> None:
    m = model(client)
    ask = "What is the weather in Paris?"
    r = client.responses.create(model=m, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=40,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].id and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    call = calls[0]
    history: Any = [{"role": "user", "content": ask},
                    {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    after = client.responses.create(model=m, input=history, tools=[WEATHER], max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=m, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_tokens=24, temperature=0)
    assert after.output_text == (chat.choices[0].message.content or "")
    assert after.usage and chat.usage and after.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_call_sends_the_argument_events(gw: tuple[Daemon, str], client: openai.OpenAI) -> None:
    body = {"model": model(client), "input": "What is 2 plus 3?", "tools": [WEATHER, ADD],
            "tool_choice": {"type": "function", "name": "add"}, "parallel_tool_calls": False,
            "max_output_tokens": 40, "temperature": 0}
    evs = events(gw[1], body)
    assert collapsed([e["type"] for e in evs]) == ["response.created", "response.in_progress", *CALL_EVENTS,
                                                   "response.completed"]
    added, delta, done, item_done = evs[2:6]
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    assert added["item"]["name"] == "add" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    jsonschema.validate(json.loads(done["arguments"]), ADD["parameters"])
    assert evs[-1]["response"]["output"] == [item_done["item"]]
    with client.responses.stream(**body) as s:
        final = s.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.arguments == done["arguments"]


def test_an_openai_agents_loop_with_two_tools(gw: tuple[Daemon, str]) -> None:
    """The Agents SDK's default model (the Responses API) runs its loop against the daemon: each run
    calls a tool (the named one), the SDK runs it and sends its output back, and the agent answers."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran: list[tuple[str, Any]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        return f"Sunny, 21 C in {city}."

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append(("add", (a, b)))
        return a + b

    async def run(tool: str, ask: str) -> Any:
        client = openai.AsyncOpenAI(base_url=gw[1] + "/v1", api_key="unused", max_retries=0)
        name = (await client.models.list()).data[0].id
        agent = agents.Agent(name="helper", instructions="You are a helpful assistant. Use the tools.",
                             tools=[get_weather, add],
                             model=agents.OpenAIResponsesModel(model=name, openai_client=client),
                             model_settings=agents.ModelSettings(tool_choice=tool, parallel_tool_calls=False,
                                                                 temperature=0, max_tokens=48))
        return await agents.Runner.run(agent, ask, max_turns=4)

    weather = asyncio.run(run("get_weather", "What is the weather in Paris?"))
    total = asyncio.run(run("add", "What is 2 plus 3?"))
    assert [r[0] for r in ran] == ["get_weather", "add"]
    for result in (weather, total):
        kinds = [type(i).__name__ for i in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        assert isinstance(result.final_output, str)
