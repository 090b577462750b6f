"""OpenAI's Responses API (issue 33 item 1; stored responses: issue 55 item 4), with the real ``openai``
client (``responses.create``, ``responses.stream``, ``retrieve``, ``input_items.list``, ``delete``) and the
``openai-agents`` SDK against the daemon serving SmolLM2-135M-Instruct: a Responses request is the chat
request it translates to (the same greedy reply), streamed in the order OpenAI documents; a chain of
``previous_response_id`` turns is the whole history sent at once (its prefix found warm), stored in SQLite
across restarts, per API key, bounded; what needs state llamapool does not keep is refused by name."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
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
    # deterministic: a greedy reply is the same whether its prefix came from the cache or not (docs/http.md,
    # "Determinism"), so a chain's reply and the whole history's compare exactly
    d, url = start_gateway(tmp_path_factory.mktemp("responses"), smollm2,
                           model={"ctx_per_slot": 2048, "deterministic": True}, workers={"cpu_workers": 1, "slots": 4})
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


def test_store_keeps_the_response_and_store_false_does_not(gw: tuple[Daemon, str], client: openai.OpenAI) -> None:
    body = {"model": model(client), "input": "Hi", "max_output_tokens": 2, "metadata": {"k": "v"}, "user": "u1"}
    kept = httpx.post(gw[1] + "/v1/responses", json=body, timeout=60)
    assert kept.status_code == 200, kept.text
    assert kept.json()["store"] is True and kept.json()["metadata"] == {"k": "v"}
    again = httpx.get(gw[1] + f"/v1/responses/{kept.json()['id']}", timeout=10)
    assert again.status_code == 200 and again.json() == kept.json()
    gone = httpx.post(gw[1] + "/v1/responses", json={**body, "store": False}, timeout=60)
    assert gone.status_code == 200 and gone.json()["store"] is False
    for url in (f"/v1/responses/{gone.json()['id']}", f"/v1/responses/{gone.json()['id']}/input_items"):
        r = httpx.get(gw[1] + url, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id", r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model(client), input="Hi", previous_response_id=gone.json()["id"])
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "previous_response_not_found"


@pytest.mark.parametrize("key, value", [("conversation", "conv_1"), ("background", True), ("prompt", {"id": "pmpt_1"})])
def test_what_needs_state_llamapool_does_not_keep_is_refused_by_name(client: openai.OpenAI, key: str,
                                                                     value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model(client), input="Hi", max_output_tokens=2, extra_body={key: value})
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == key and "previous_response_id" in err["message"]


@pytest.mark.parametrize("change, param", [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].image_url"),  # an image, to a model without a projector (tests/test_images.py)
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
    ({"store": "yes"}, "store"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"previous_response_id": "resp_" + "0" * 24}, "previous_response_id"),  # none such: OpenAI's 400
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


# ---------------------------------------------------------------- stored responses (issue 55 item 4)

TURNS = ["My name is Ada and I like green. Say hello to me.", "What is two plus two?", "What is my name?"]


def chain_of(client: openai.OpenAI, turns: list[str], first: str | None = None,
             **kw: Any) -> list[Any]:
    """The responses of ``turns``, each chained to the one before (the first to ``first``)."""
    out: list[Any] = []
    for text in turns:
        prev = out[-1].id if out else first
        out.append(client.responses.create(model=model(client), input=text, max_output_tokens=12, temperature=0,
                                           **({"previous_response_id": prev} if prev else {}), **kw))
    return out


def history(turns: list[str], replies: list[Any]) -> list[dict[str, Any]]:
    """The whole conversation as input items: each turn, and the reply to it where there is one."""
    items: list[dict[str, Any]] = []
    for i, text in enumerate(turns):
        items.append({"role": "user", "content": text})
        if i < len(replies):
            items.append({"role": "assistant", "content": replies[i].output_text})
    return items


def test_a_chain_is_the_whole_history_and_its_prefix_is_warm(client: openai.OpenAI) -> None:
    """Three turns by previous_response_id give the greedy reply of sending the whole history at once
    (the same prompt tokens), and each turn finds the turn before it in the prefix cache."""
    rs = chain_of(client, TURNS, instructions="Be brief.")
    assert [r.previous_response_id for r in rs] == [None, rs[0].id, rs[1].id] and all(r.store for r in rs)
    whole = client.responses.create(model=model(client), input=history(TURNS, rs[:2]),  # type: ignore[arg-type]
                                    instructions="Be brief.", max_output_tokens=12, temperature=0)
    assert whole.output_text == rs[2].output_text
    assert whole.usage and rs[2].usage and whole.usage.input_tokens == rs[2].usage.input_tokens
    for before, after in itertools.pairwise(rs):
        assert before.usage and after.usage
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens, (before.usage, after.usage)


def test_instructions_are_not_carried_over(client: openai.OpenAI) -> None:
    """OpenAI's rule: a chained request has its own instructions, none of the previous response's."""
    first = client.responses.create(model=model(client), input="Hi", instructions="Answer in French.",
                                    max_output_tokens=4, temperature=0)
    chained = client.responses.create(model=model(client), input="Name a colour.", previous_response_id=first.id,
                                      max_output_tokens=8, temperature=0)
    plain = client.responses.create(model=model(client), max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name a colour."}])
    assert chained.instructions is None and chained.output_text == plain.output_text
    assert chained.usage and plain.usage and chained.usage.input_tokens == plain.usage.input_tokens


def test_the_openai_client_retrieves_lists_and_deletes(client: openai.OpenAI) -> None:
    m = model(client)
    first = client.responses.create(model=m, input="Say hi.", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.store is True
    given: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Just one."}]}]
    second = client.responses.create(model=m, input=given, previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    page = client.responses.input_items.list(second.id)  # OpenAI's default order: newest first
    assert [i.type for i in page.data] == ["message"] * 3 and not page.has_more
    texts = [i.content[0].text for i in page.data]  # type: ignore[union-attr]
    assert texts == ["Just one.", "Name a fruit.", "Be brief."]
    assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    one = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert len(one.data) == 1 and one.has_more and one.data[0].id == page.data[-1].id
    walked = [i.id for i in client.responses.input_items.list(second.id, order="asc", limit=1)]  # pages by after
    assert walked == [i.id for i in reversed(page.data)] and len(set(walked)) == 3
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    # the response after it is still there, but its conversation cannot be rebuilt without it
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.BadRequestError) as e2:
        client.responses.create(model=m, input="More.", previous_response_id=second.id)
    err = e2.value.body
    assert isinstance(err, dict) and err["code"] == "previous_response_not_found" and first.id in err["message"]


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=101", "limit"), ("order=sideways", "order"),
                                          ("after=msg_none", "after")])
def test_bad_list_queries_name_the_parameter(gw: tuple[Daemon, str], client: openai.OpenAI, query: str,
                                             param: str) -> None:
    r = client.responses.create(model=model(client), input="Hi", max_output_tokens=2)
    got = httpx.get(gw[1] + f"/v1/responses/{r.id}/input_items?{query}", timeout=10)
    assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text


def test_a_streamed_response_is_stored_before_its_last_event(gw: tuple[Daemon, str], client: openai.OpenAI) -> None:
    evs = events(gw[1], {"model": model(client), "input": TURNS[0], "max_output_tokens": 8, "temperature": 0})
    final = evs[-1]["response"]
    assert evs[0]["response"]["store"] is True and final["store"] is True
    assert httpx.get(gw[1] + f"/v1/responses/{final['id']}", timeout=10).json() == final
    chained = events(gw[1], {"model": model(client), "input": TURNS[1], "previous_response_id": final["id"],
                             "max_output_tokens": 8, "temperature": 0})[-1]["response"]
    said = final["output"][0]["content"][0]["text"]
    whole = client.responses.create(model=model(client), max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": said},
        {"role": "user", "content": TURNS[1]}])
    assert chained["previous_response_id"] == final["id"] and chained["store"] is True
    assert chained["output"][0]["content"][0]["text"] == whole.output_text


def keys_file(folder: Any) -> Any:
    path = folder / "keys.txt"
    path.write_text("sk-alice-0123456789 name=alice\nsk-bob-9876543210 name=bob\n")
    return path


def test_a_chain_survives_a_restart_and_is_invisible_to_another_key(tmp_path: Any, smollm2: str) -> None:
    folder = tmp_path / "keys"
    folder.mkdir()
    keys = keys_file(folder)
    setup: dict[str, Any] = {"model": {"ctx_per_slot": 2048, "deterministic": True},
                             "workers": {"cpu_workers": 1, "slots": 2},
                             "http": {"api_keys_file": str(keys)}}
    d, url = start_gateway(folder, smollm2, **setup)
    try:
        alice = openai.OpenAI(base_url=url + "/v1", api_key="sk-alice-0123456789", max_retries=0)
        bob = openai.OpenAI(base_url=url + "/v1", api_key="sk-bob-9876543210", max_retries=0)
        rs = chain_of(alice, TURNS[:2])
        for call in (lambda: bob.responses.retrieve(rs[1].id), lambda: bob.responses.input_items.list(rs[1].id),
                     lambda: bob.responses.delete(rs[1].id)):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert isinstance(e.value.body, dict) and e.value.body["param"] == "response_id"
            assert TURNS[1] not in str(e.value.body)
        with pytest.raises(openai.BadRequestError) as e2:
            bob.responses.create(model=model(bob), input="Hi", previous_response_id=rs[1].id)
        assert isinstance(e2.value.body, dict) and e2.value.body["code"] == "previous_response_not_found"
    finally:
        d.stop(signal.SIGTERM, timeout=60)
    d, url = start_gateway(folder, smollm2, **setup)  # the same state dir: the same store
    try:
        alice = openai.OpenAI(base_url=url + "/v1", api_key="sk-alice-0123456789", max_retries=0)
        bob = openai.OpenAI(base_url=url + "/v1", api_key="sk-bob-9876543210", max_retries=0)
        assert alice.responses.retrieve(rs[1].id).output_text == rs[1].output_text
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(rs[1].id)
        third = chain_of(alice, TURNS[2:], first=rs[1].id)[0]
        whole = alice.responses.create(model=model(alice), input=history(TURNS, rs),  # type: ignore[arg-type]
                                       max_output_tokens=12, temperature=0)
        assert third.output_text == whole.output_text
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_the_store_is_bounded_oldest_first(tmp_path: Any, smollm2: str) -> None:
    """``responses_max_mb``: past it the oldest responses go; the newest stay (two gateway processes
    writing to the one store)."""
    d, url = start_gateway(tmp_path, smollm2, model={"ctx_per_slot": 1024}, workers={"cpu_workers": 1, "slots": 2},
                           http={"responses_max_mb": 0.006, "processes": 2})  # about 6 KiB: a few short responses
    try:
        ids = []
        for i in range(10):  # a connection each: both gateway processes write to the store
            r = httpx.post(url + "/v1/responses", json={"input": f"Count to {i}.", "max_output_tokens": 2}, timeout=60)
            assert r.status_code == 200 and r.json()["store"] is True, r.text
            ids.append(r.json()["id"])
        kept = [httpx.get(f"{url}/v1/responses/{rid}", timeout=10).status_code == 200 for rid in ids]
        assert kept[-1] and not kept[0] and kept == sorted(kept), kept  # a suffix: the oldest went first
        assert 2 <= sum(kept) < 10
        size = sum(len(json.dumps(httpx.get(f"{url}/v1/responses/{rid}", timeout=10).json())) for rid, k in
                   zip(ids, kept, strict=True) if k)
        assert size <= 0.006 * (1 << 20)
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_an_unwritable_store_serves_the_response_anyway(tmp_path: Any, smollm2: str) -> None:
    """A store that cannot be opened (a directory where its file goes): every response is served, says
    ``"store": false``, and the failure is logged and counted."""
    (tmp_path / "run" / "responses.sqlite").mkdir(parents=True)
    d, url = start_gateway(tmp_path, smollm2, model={"ctx_per_slot": 1024}, workers={"cpu_workers": 1, "slots": 2})
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = c.responses.create(model=model(c), input="Hi", max_output_tokens=4, temperature=0)
        assert r.status in ("completed", "incomplete") and r.output_text and r.store is False
        evs = events(url, {"model": model(c), "input": "Hi", "max_output_tokens": 4, "temperature": 0})
        assert evs[-1]["type"] in ("response.completed", "response.incomplete")
        assert evs[-1]["response"]["store"] is False
        d.wait_log("served but not stored (unwritable)")
        got = httpx.get(f"{url}/v1/responses/{r.id}", timeout=10)
        assert got.status_code == 503 and got.json()["error"]["code"] == "store_unavailable", got.text
        deadline, failures = time.monotonic() + 20, 0.0
        while time.monotonic() < deadline and failures < 2:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            line = next((x for x in text.splitlines()
                         if x.startswith('llamapool_responses_store_failures_total{reason="unwritable"}')), "")
            failures = float(line.split()[-1]) if line else 0.0
            time.sleep(0.5)
        assert failures == 2, text
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def _writer(path: str, n: int, who: int) -> None:
    """One process's writes (test_several_processes_write_one_store)."""
    from llamapool.gateway.openai.store import Owner, ResponseStore, Stored

    store = ResponseStore(path, 3600.0, 1 << 30)
    for i in range(n):
        store.put(Owner(b"key"), Stored(f"resp_{who}_{i}", {"output": [{"type": "message", "n": i}]}, [{"i": i}],
                                        f"resp_{who}_{i - 1}" if i else None))
    store.close()


def test_several_processes_write_one_store(tmp_path: Any) -> None:
    """Gateway processes share the file: concurrent writers (WAL, busy timeout, short transactions) lose
    nothing, and the size kept by the triggers is the rows' own."""
    import multiprocessing
    import sqlite3

    from llamapool.gateway.openai.store import Owner, ResponseStore

    path = str(tmp_path / "responses.sqlite")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, 40, who)) for who in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    db = sqlite3.connect(path)
    count, size = db.execute("SELECT COUNT(*), SUM(size) FROM responses").fetchone()
    assert count == 160 and db.execute("SELECT value FROM meta WHERE key = 'bytes'").fetchone()[0] == size
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store = ResponseStore(path, 3600.0, 1 << 30)
    got = store.chain(Owner(b"key"), "resp_2_39")
    assert got is not None and got.missing is None and [x["i"] for x in got.items[::2]] == list(range(40))
    assert store.chain(Owner(b"other"), "resp_2_39") is None and store.get(Owner(), "resp_2_39") is None


def test_the_store_forgets_what_is_older_than_its_ttl(tmp_path: Any) -> None:
    from llamapool.gateway.openai.store import Owner, ResponseStore, Stored, StoreError

    store = ResponseStore(str(tmp_path / "responses.sqlite"), 0.5, 1 << 20)
    store.put(Owner(), Stored("resp_old", {"output": []}, []))
    assert store.get(Owner(), "resp_old") is not None
    time.sleep(0.6)
    assert store.get(Owner(), "resp_old") is None  # invisible once expired
    store.put(Owner(), Stored("resp_new", {"output": []}, [], "resp_old"))  # and deleted by the next write
    assert [r[0] for r in store._open().execute("SELECT id FROM responses")] == ["resp_new"]
    chained = store.chain(Owner(), "resp_new")
    assert chained is not None and chained.missing == "resp_old"
    with pytest.raises(StoreError) as e:  # larger than the whole store: not stored, "full" (the caller serves it)
        store.put(Owner(), Stored("resp_big", {"output": [], "text": "x" * (1 << 20)}, []))
    assert e.value.reason == "full" and store.get(Owner(), "resp_new") is not None
