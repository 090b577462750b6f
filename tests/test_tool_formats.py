"""Tool calls per chat-template family, on the real templates (tests/templates/) in tiny GGUFs.

For Qwen 2.5 (``hermes``), Llama 3.1 (``llama3``), Mistral Nemo (``mistral``) and the tiny model's
ChatML template that takes no tools (``generic``): the family is detected from the GGUF's template; a
conversation with tools, an earlier call and its result renders the way that family writes them;
replies written the way that family writes calls parse into names, arguments and content; and the
engine on the random-weight model, with ``tool_choice`` ``required`` or a named function, answers
calls whose arguments follow the function's ``parameters`` schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamapool.modelgen import CHATML_TEMPLATE, make_model
from llamapool.protocol.messages import Done, Run, Step
from llamapool.protocol.params import parse as parse_params
from llamapool.worker.chat import ChatError
from llamapool.worker.constraints import spec_of
from llamapool.worker.engine import Engine, EngineConfig
from llamapool.worker.tools import ToolFormat, detect

# llguidance builds its tokenizer with llama_cpp's deprecated llama_token_get_attr: a warning per token
pytestmark = pytest.mark.filterwarnings("ignore:llama_token_get_attr is deprecated:DeprecationWarning")

TEMPLATES = Path(__file__).parent / "templates"
FILES = {
    "hermes": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama3": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "generic": None,  # modelgen's ChatML template: no tools
}


def template(family: str) -> str:
    name = FILES[family]
    return CHATML_TEMPLATE if name is None else (TEMPLATES / name).read_text(encoding="utf-8")


BOOK: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "party": {"type": "integer", "minimum": 1, "maximum": 12},
        "when": {
            "type": "object",
            "properties": {
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "meal": {"type": "string", "enum": ["lunch", "dinner"]},
                "seats": {"type": "array", "items": {"type": "string", "enum": ["window", "terrace"]},
                          "maxItems": 2},
            },
            "required": ["day", "meal"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "party", "when"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "book_table", "description": "Book a table in a restaurant.",
                                      "parameters": BOOK}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

ARGS: dict[str, Any] = {"city": "Paris", "party": 2, "when": {"day": 14, "meal": "dinner"}}
CALL_ID = "call_7f3a9c1e2b8d4f6a0c5e9b1d"  # an OpenAI-style id (not what Mistral's template takes)
RESULT = '{"confirmed": true, "table": 12}'
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Book a table for two in Paris on the 14th, for dinner."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "book_table", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
]
ASK = [{"role": "user", "content": "Book a table for two in Paris on the 14th, for dinner."}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """An engine per family, on a tiny random-weight GGUF whose tokenizer.chat_template is that family's."""
    d = tmp_path_factory.mktemp("tool-models")
    out: dict[str, Engine] = {}
    try:
        for family in FILES:
            path = make_model(d / f"{family}.gguf", chat_template=template(family))
            out[family] = Engine(EngineConfig(str(path), slots=2, ctx_per_slot=4096, max_batch_tokens=1024,
                                              n_ubatch=512, threads=2))
        yield out
    finally:
        for eng in out.values():
            eng.close()


def run(engine: Engine, messages: list[dict[str, Any]], **params: Any) -> Done:
    out = Step()
    engine.submit(Run(1, messages, parse_params(params), False), out)
    assert not out.failed, out.failed
    done: list[Done] = []
    while engine.busy:
        step = engine.step()
        assert not step.failed, step.failed
        done += step.done
    assert len(done) == 1
    return done[0]


def assert_valid_calls(calls: list[dict[str, Any]] | None, names: set[str]) -> list[dict[str, Any]]:
    assert calls
    for c in calls:
        assert c["name"] in names, c
        assert c["id"]
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    return calls


# ------------------------------------------------------------ detection


@pytest.mark.parametrize("family", list(FILES))
def test_the_family_is_detected_from_the_gguf_template(engines: dict[str, Engine], family: str) -> None:
    fmt = engines[family].chat.tool_format
    assert fmt.family == family
    assert fmt.native == (family != "generic")
    assert fmt.special == {}  # the tiny byte-level vocab has no control token for <tool_call> or [TOOL_CALLS]
    assert detect(template(family), lambda _: None).family == family


def test_a_marker_that_is_a_control_token_is_written_as_that_token() -> None:
    ids = {"[TOOL_CALLS]": 5}
    fmt = detect(template("mistral"), ids.get)
    assert fmt.special == {"[TOOL_CALLS]": 5}
    g = fmt.grammar(TOOLS, "required", True)
    assert 'start: <[5]> "[{\\"name\\": \\""' in g and "[TOOL_CALLS]" not in g
    hermes = detect(template("hermes"), {"<tool_call>": 7, "</tool_call>": 8}.get)
    g = hermes.grammar(TOOLS, "auto", False)
    assert "<[7]>" in g and "<[8]>" in g and "tool_call>" not in g


# ------------------------------------------------------------ rendering


def test_hermes_renders_tools_call_and_result_as_qwen_writes_them(engines: dict[str, Engine]) -> None:
    text = engines["hermes"].chat.render(CONVERSATION, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n")
    for t in TOOLS:
        assert "\n" + json.dumps(t, ensure_ascii=False) + "\n" in text  # one per line in <tools></tools>
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "book_table", "arguments": ' + json.dumps(ARGS) + \
        "}\n</tool_call><|im_end|>\n"
    assert call in text  # the arguments as an object, not the JSON text OpenAI sends
    assert "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # parallel calls render as one block each
    two = [*CONVERSATION[:2], {"role": "assistant", "content": "", "tool_calls": [
        CONVERSATION[2]["tool_calls"][0],
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Oslo", "unit": "celsius"}}}]}]
    text = engines["hermes"].chat.render(two, TOOLS)
    assert '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' \
        in text


def test_llama3_renders_tools_call_and_result_as_llama_writes_them(engines: dict[str, Engine]) -> None:
    text = engines["llama3"].chat.render(CONVERSATION, TOOLS)
    assert text.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert text.count("You are a careful assistant.") == 1
    user = text.index("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions")
    for t in TOOLS:  # in the first user message, indented
        assert text.index(json.dumps(t, indent=4, ensure_ascii=False)) > user
    assert '"parameters": dictionary of argument name and its value' in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "book_table", "parameters": '
            + json.dumps(ARGS) + "}<|eot_id|>") in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(RESULT) + "<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Llama 3.1's template takes one call per message: two are the template's error, a 400
    two = [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": CONVERSATION[2]["tool_calls"] * 2}]
    with pytest.raises(ChatError, match="single tool-calls"):
        engines["llama3"].chat.render(two, TOOLS)


def test_mistral_renders_tools_call_and_result_as_mistral_writes_them(engines: dict[str, Engine]) -> None:
    text = engines["mistral"].chat.render(CONVERSATION, TOOLS)
    tools = "[AVAILABLE_TOOLS][" + ", ".join(
        json.dumps({"type": "function", "function": t["function"]}) for t in TOOLS) + "][/AVAILABLE_TOOLS]"
    assert text.startswith("<s>" + tools + "[INST]Book a table")
    # the template takes only 9-letter call ids: an OpenAI id becomes one, the same in the call and its result
    start = text.index('[TOOL_CALLS][{"name": "book_table", "arguments": ' + json.dumps(ARGS) + ', "id": "')
    cid = text[start:].split('"id": "')[1][:9]
    assert cid.isalnum() and len(cid) == 9
    assert '"id": "' + cid + '"}]</s>' in text
    assert text.endswith('[TOOL_RESULTS]{"content": ' + RESULT + ', "call_id": "' + cid + '"}[/TOOL_RESULTS]')
    # an id that fits is kept; parallel calls are one list
    two = [*CONVERSATION[:2], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "book_table", "arguments": ARGS}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    text = engines["mistral"].chat.render(two, TOOLS)
    assert ('[TOOL_CALLS][{"name": "book_table", "arguments": ' + json.dumps(ARGS) + ', "id": "abcDEF123"}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "') in text


def test_generic_puts_tools_in_a_system_message_and_calls_in_the_turns(engines: dict[str, Engine]) -> None:
    text = engines["generic"].chat.render(CONVERSATION, TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a careful assistant.\n\n")
    for t in TOOLS:
        assert "\n" + json.dumps(t["function"]) + "\n" in system
    assert "<tool_call>" in system and "</tool_call>" in system
    assert ("<|im_start|>assistant\n<tool_call>\n" + json.dumps({"name": "book_table", "arguments": ARGS})
            + "\n</tool_call><|im_end|>\n") in text
    assert "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n" in text
    # without tools the messages render as they are (no system message added)
    plain = engines["generic"].chat.render(ASK)
    assert plain == "<|im_start|>user\n" + ASK[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", list(FILES))
def test_earlier_arguments_that_do_not_decode_render_as_an_empty_object(engines: dict[str, Engine],
                                                                        family: str) -> None:
    # a client's history, not the model's: invalid JSON, or JSON nested past Python's recursion limit
    # (which raised RecursionError in the worker: a 500 instead of a reply)
    for args in ("{not json", '{"a": ' + "[" * 5000 + "]" * 5000 + "}"):
        call = {"id": CALL_ID, "type": "function", "function": {"name": "book_table", "arguments": args}}
        convo = [*CONVERSATION[:2], {"role": "assistant", "content": "", "tool_calls": [call]}, CONVERSATION[3]]
        text = engines[family].chat.render(convo, TOOLS)
        assert "book_table" in text.split("Book a table for two")[-1] and "[[[" not in text


# ------------------------------------------------------------ parsing replies


W1: dict[str, Any] = {"city": "Oslo", "unit": "celsius"}
W2: dict[str, Any] = {"city": "Rome", "unit": "fahrenheit", "days": 3}


def hermes(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls)


def llama3(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def mistral(calls: list[tuple[str, dict[str, Any]]]) -> str:  # with ids, as the template writes earlier calls
    return "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a, "id": f"a1b2c3d4{i}"})
                                       for i, (n, a) in enumerate(calls)) + "]"


WRITERS = {"hermes": hermes, "llama3": llama3, "mistral": mistral, "generic": hermes}
PROSE = "Let me look that up."
EXPECTED: dict[str, tuple[str, list[tuple[str, dict[str, Any]]]]] = {
    "single": ("", [("book_table", ARGS)]),
    "parallel": ("", [("get_weather", W1), ("get_weather", W2)]),
    "prose": (PROSE, [("get_weather", W1)]),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("family", list(FILES))
def test_replies_parse_into_calls(engines: dict[str, Engine], family: str, kind: str) -> None:
    fmt = engines[family].chat.tool_format
    want_content, want_calls = EXPECTED[kind]
    reply = WRITERS[family](want_calls)
    if want_content:
        reply = want_content + ("" if family == "mistral" else "\n") + reply
    content, calls = fmt.parse(reply, TOOLS)
    assert content == want_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
    assert len({c["id"] for c in calls}) == len(calls)


def test_a_call_written_as_the_control_token_parses(engines: dict[str, Engine]) -> None:
    """A control token has no text: the engine's text of a Mistral call starts at the list."""
    fmt = engines["mistral"].chat.tool_format
    content, calls = fmt.parse("[" + json.dumps({"name": "get_weather", "arguments": W1}) + "]", TOOLS)
    assert content == "" and [json.loads(c["arguments"]) for c in calls] == [W1]


@pytest.mark.parametrize("family", list(FILES))
def test_what_is_not_a_call_stays_content(engines: dict[str, Engine], family: str) -> None:
    fmt = engines[family].chat.tool_format
    for text in ("It is sunny in Oslo.",
                 'Here is JSON: {"name": "get_weather", "city": "Oslo"}',  # no arguments object
                 '{"name": "order_pizza", "arguments": {"size": "L"}}',  # not one of the tools
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'):  # cut off
        assert fmt.parse(text, TOOLS) == (text, [])


# ------------------------------------------------------------ the engine: forced calls on the tiny model


CHOICES: list[Any] = ["required", {"type": "function", "function": {"name": "book_table"}},
                      {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named-book_table", "named-get_weather"])
@pytest.mark.parametrize("family", list(FILES))
def test_forced_calls_follow_the_schema(engines: dict[str, Engine], family: str, choice: Any) -> None:
    done = run(engines[family], ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=256,
               parallel_tool_calls=False)
    names = {choice["function"]["name"]} if isinstance(choice, dict) else set(SCHEMAS)
    calls = assert_valid_calls(done.tool_calls, names)
    assert len(calls) == 1
    assert done.reason == "tool_calls"
    assert done.text == ""  # the whole reply is the call


@pytest.mark.parametrize("family", list(FILES))
def test_parallel_forced_calls_follow_the_schema(engines: dict[str, Engine], family: str) -> None:
    """With parallel calls allowed the random model may go on calling until max_tokens; every call that
    completed still follows its schema."""
    done = run(engines[family], ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    assert_valid_calls(done.tool_calls, set(SCHEMAS))
    assert done.reason in ("tool_calls", "length")


@pytest.mark.parametrize("family", list(FILES))
def test_a_conversation_with_an_earlier_call_runs(engines: dict[str, Engine], family: str) -> None:
    """The whole history (an OpenAI-style call id included) renders, and the next call is forced."""
    done = run(engines[family], CONVERSATION, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, temperature=0, max_tokens=256, parallel_tool_calls=False)
    assert_valid_calls(done.tool_calls, {"get_weather"})
    assert done.reason == "tool_calls"


@pytest.mark.parametrize("family", list(FILES))
def test_the_auto_grammar_compiles(engines: dict[str, Engine], family: str) -> None:
    eng = engines[family]
    spec = spec_of(parse_params({"tools": TOOLS, "tool_choice": "auto"}), eng.chat.tool_format)
    assert spec is not None and "[lazy]" in spec.grammar
    assert not eng.grammars.compile(spec).result(timeout=30).matcher.is_error()


def test_a_call_opened_by_a_control_token(engines: dict[str, Engine]) -> None:
    """Mistral's [TOOL_CALLS] is a control token in real vocabularies: the grammar writes it as that
    token, the engine marks the call there (the token has no text), and the reply parses into the call.
    The tiny vocab's <|im_start|> stands in for it."""
    eng = engines["mistral"]
    real = eng.chat.tool_format
    im_start = eng.chat._tokenize("<|im_start|>")
    assert len(im_start) == 1
    eng.chat.tool_format = detect(template("mistral"), {"[TOOL_CALLS]": im_start[0]}.get)
    try:
        assert isinstance(eng.chat.tool_format, ToolFormat) and eng.chat.tool_format.special
        done = run(eng, ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=256,
                   parallel_tool_calls=False)
    finally:
        eng.chat.tool_format = real
    assert_valid_calls(done.tool_calls, set(SCHEMAS))
    assert done.reason == "tool_calls" and done.text == ""
