"""Constrained replies that parse by construction (issue 33 item 3), and grammar limits (issue 29 items 2, 4).

The guarantees: a schema's objects take no properties it does not declare (unless it says
``additionalProperties: true``), its integers, numbers and strings get bounds where it gives none;
whatever tokens a model picks, a reply constrained by a JSON schema (or a forced tool call) that
runs out of ``max_tokens`` still parses and validates, ending by ``length``; a request whose
shortest reply cannot fit ``max_tokens`` is a 400 naming ``max_tokens``; the closing only acts in a
reply's last tokens; ``response_format`` goes with ``tools``; an invalid regex and a schema over the
size limit are 400s naming the field; and the worker's compiled grammars are bounded in bytes.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest

from llamapool import default_model
from llamapool.protocol.messages import Run, Step
from llamapool.protocol.params import MAX_GRAMMAR_CHARS, parse
from llamapool.worker.closing import Closing
from llamapool.worker.constraints import Grammars, spec_of
from llamapool.worker.engine import Engine, EngineConfig
from llamapool.worker.schemas import INT_BOUND, MAX_STRING, NUMBER_BOUND, bounded

from .conftest import Daemon
from .test_gateway import start_gateway

STR = {"type": "string"}
INT = {"type": "integer"}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """An object schema as users write them: no ``additionalProperties``."""
    return {"type": "object", "properties": props, "required": required or list(props), **kw}


SCHEMAS = [
    obj({"name": STR, "age": INT}),
    obj({"city": STR, "population": INT, "area": {"type": "number"}}),
    obj({"tags": {"type": "array", "items": STR, "minItems": 2}, "ok": {"type": "boolean"}}),
    obj({"who": obj({"first": STR, "last": STR}), "when": {"type": "string", "format": "date"}}),
    obj({"colour": {"enum": ["red", "green", "blue"]}, "note": {"anyOf": [STR, {"type": "null"}]}}),
    obj({"email": {"type": "string", "format": "email"}, "id": {"type": "string", "format": "uuid"}}),
    {"type": "array", "items": obj({"k": STR, "v": INT})},
    {"type": "object"},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": obj({"city": STR, "days": INT})}}


# ---------------------------------------------------------------- bounds added to schemas


def test_objects_take_only_declared_properties_unless_the_schema_says_otherwise() -> None:
    s = bounded(obj({"a": obj({"b": STR}), "properties": STR}))  # a property named "properties"
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["properties"]
    assert bounded(obj({"a": STR}, additionalProperties=True))["additionalProperties"] is True
    assert "additionalProperties" not in bounded({"type": "object"})  # a free object stays free
    merged = bounded({"allOf": [obj({"a": STR}), obj({"b": STR})]})  # allOf's branches are merged: left alone
    assert all("additionalProperties" not in b for b in merged["allOf"])
    defs = bounded({"$defs": {"p": obj({"a": STR})}, "$ref": "#/$defs/p"})
    assert defs["$defs"]["p"]["additionalProperties"] is False


def test_numbers_and_strings_get_bounds_where_the_schema_gives_none() -> None:
    s = bounded(obj({"i": INT, "n": {"type": "number"}, "s": STR, "own": {"type": "integer", "maximum": 5},
                     "long": {"type": "string", "maxLength": 99999}, "e": {"enum": ["x"]}}))["properties"]
    assert (s["i"]["minimum"], s["i"]["maximum"]) == (-INT_BOUND, INT_BOUND) and INT_BOUND < 2**63
    assert s["n"]["maximum"] == NUMBER_BOUND and s["n"]["multipleOf"] == 1e-6
    assert s["s"]["maxLength"] == MAX_STRING and s["long"]["maxLength"] == 99999
    assert s["own"] == {"type": "integer", "maximum": 5, "minimum": -INT_BOUND}
    assert s["e"] == {"enum": ["x"]}


# ---------------------------------------------------------------- closing, whatever the model picks


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model_path, slots=2, ctx_per_slot=1024, max_batch_tokens=256, n_ubatch=256))
    yield eng
    eng.close()


def random_reply(eng: Engine | Grammars, closing: Closing, rng: random.Random) -> list[int]:
    """Tokens a "model" that picks any token the grammar allows writes, closed by ``closing``."""
    grammars = eng.grammars if isinstance(eng, Engine) else eng
    n_vocab, eog = grammars.closer.n_vocab, grammars.closer.eos
    out = []
    m = closing.matcher
    while closing.left > 0 and not m.is_stopped():
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        ids = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:n_vocab])
        tok = closing.take(int(rng.choice(ids)))
        if tok == eog or (isinstance(eng, Engine) and tok in eng._eog):
            break
        out.append(tok)
    return out


@pytest.fixture(scope="module")
def gemma_grammars() -> Iterator[Grammars]:
    """Gemma 3's vocabulary (262,144 tokens, multi-byte pieces: ``"}``, ``}}``, ``":"``), without weights."""
    import llama_cpp as L

    path = default_model.fetch(Path(__file__).resolve().parent.parent / "models")
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    grammars = Grammars(vocab, L.llama_vocab_n_tokens(vocab), frozenset({L.llama_vocab_eos(vocab)}))
    yield grammars
    grammars.close()
    L.llama_model_free(model)


def test_any_tokens_close_within_the_budget_on_gemmas_vocabulary(gemma_grammars: Grammars) -> None:
    rng = random.Random(3)
    tokenizer = gemma_grammars.tokenizer()
    for schema in SCHEMAS:
        spec = spec_of(parse({"json_schema": schema}), None)
        assert spec is not None
        compiled = gemma_grammars.compile(spec).result(timeout=60)
        assert compiled.closing is not None
        for budget in [compiled.closing, *rng.sample(range(compiled.closing + 1, 120), 7)]:
            toks = random_reply(gemma_grammars, gemma_grammars.start(compiled, budget), rng)
            assert len(toks) <= budget
            jsonschema.validate(json.loads(tokenizer.decode_str(toks)), schema)


def test_the_check_that_a_plan_closes_is_taking_it_and_being_done(gemma_grammars: Grammars) -> None:
    """``Closing._closes`` asks llguidance whether EOS may follow the plan, without taking it: the same
    answer as taking the plan and asking whether the grammar is complete, and the state is unchanged."""
    rng = random.Random(5)
    n_vocab = gemma_grammars.closer.n_vocab
    checked = 0
    for schema in SCHEMAS:
        spec = spec_of(parse({"json_schema": schema}), None)
        assert spec is not None
        compiled = gemma_grammars.compile(spec).result(timeout=60)
        closing = gemma_grammars.start(compiled, 200)
        m = closing.matcher
        for _ in range(40):
            if m.is_stopped():
                break
            plan = gemma_grammars.closer.plan(m, 200, closing.where) or []
            for p in (plan, plan[:-1], plan[1:], [*plan, plan[-1]] if plan else []):
                mask = m.compute_bitmask()
                n = m.try_consume_tokens(p)
                want = n == len(p) and m.is_accepting()
                if n:
                    m.rollback(n)
                assert closing._closes(p) == want
                assert m.compute_bitmask() == mask
                checked += 1
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
            ids = np.flatnonzero(bits[:n_vocab])
            closing.take(int(rng.choice(ids)))
    assert checked > 200


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_any_tokens_close_within_the_budget(engine: Engine, i: int) -> None:
    spec = spec_of(parse({"json_schema": SCHEMAS[i]}), None)
    assert spec is not None
    compiled = engine.grammars.compile(spec).result(timeout=60)
    assert compiled.closing is not None
    rng = random.Random(i)
    for budget in [compiled.closing, compiled.closing + 1, *rng.sample(range(compiled.closing + 2, 120), 6)]:
        closing = engine.grammars.start(compiled, budget)
        toks = random_reply(engine, closing, rng)
        text = engine.grammars.tokenizer().decode_str(toks)
        assert len(toks) <= budget
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_a_forced_tool_call_closes_within_the_budget(engine: Engine) -> None:
    tf = engine.chat.tool_format
    spec = spec_of(parse({"tools": [WEATHER], "tool_choice": "required"}), tf)
    assert spec is not None
    compiled = engine.grammars.compile(spec).result(timeout=60)
    assert compiled.closing is not None
    rng = random.Random(1)
    for budget in range(compiled.closing, compiled.closing + 30, 3):
        toks = random_reply(engine, engine.grammars.start(compiled, budget), rng)
        _, calls = tf.parse(engine.grammars.tokenizer().decode_str(toks), [WEATHER])
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_a_whole_call_not_followed_by_one_that_cannot_fit_ends_by_stop(engine: Engine) -> None:
    """A forced call that is whole, where the model starts a second one that the budget cannot hold: the
    reply ends after the first (end of generation), not forced (``stop``: the chat's finish_reason is
    ``tool_calls``, a Responses reply ``completed``; it was ``length``, and the Agents SDK failed on
    ``incomplete``); a call cut inside its arguments still ends by ``length``."""
    spec = spec_of(parse({"tools": [WEATHER], "tool_choice": "required"}), engine.chat.tool_format)
    assert spec is not None
    compiled = engine.grammars.compile(spec).result(timeout=60)
    tokenizer = engine.grammars.tokenizer()
    call = tokenizer.tokenize_str('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":2}}'
                                  '\n</tool_call>')
    closing = engine.grammars.start(compiled, len(call) + 3)
    assert [closing.take(t) for t in call] == call and closing.matcher.is_accepting()
    assert closing.take(tokenizer.tokenize_str("\n")[0]) in engine._eog and not closing.forced
    closing = engine.grammars.start(compiled, len(call) - 2)  # cut inside the arguments
    taken = [closing.take(t) for t in call[: len(call) - 2]]
    assert taken != call[: len(call) - 2] and closing.forced


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": obj({"answer": STR})}}


@pytest.mark.parametrize("extra", [{"response_format": ANSWER}, {"tool_choice": "required"}])
def test_a_later_call_that_would_close_with_forced_values_is_dropped(engine: Engine, extra: dict[str, Any]) -> None:
    """A whole call, then a second one the model starts while its shortest form still fits the budget but
    writes past it: the closing forced the second call's values (``{"city":"R"...}`` cut to a junk call);
    the reply now ends there (end of generation, not forced: ``stop``) and parses to the first call alone."""
    tf = engine.chat.tool_format
    spec = spec_of(parse({"tools": [WEATHER], **extra}), tf)
    assert spec is not None
    compiled = engine.grammars.compile(spec).result(timeout=60)
    tokenizer = engine.grammars.tokenizer()
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":2}}\n</tool_call>'
    second = tf.sep + '<tool_call>\n{"name": "get_weather", "arguments": {"city":"' + "Rome" * 40
    toks = tokenizer.tokenize_str(first + second)
    n_first = len(tokenizer.tokenize_str(first))
    for spare in (0, 2, 5, 9):
        closing = engine.grammars.start(compiled, n_first + compiled.reach + spare)
        taken = []
        for t in toks:
            if closing.left <= 0:
                break
            taken.append(closing.take(t))
            if taken[-1] != t:
                break
        assert taken[-1] in engine._eog and not closing.forced, (spare, tokenizer.decode_str(taken))
        _, calls = tf.parse(tokenizer.decode_str(taken[:-1]), [WEATHER])
        assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris", "days": 2}], spare


def test_free_text_with_quotes_before_a_possible_call_is_taken_as_it_is(engine: Engine) -> None:
    """``tools`` with ``tool_choice`` auto: text (the grammar accepting, no plan needed) in which a token
    with a quote follows an open quote (``""``), in the last tokens of the budget, is the model's own; it
    raised IndexError in the closing (a 500 for SmolLM2 answering after a tool result at max_tokens 30)."""
    spec = spec_of(parse({"tools": [WEATHER]}), engine.chat.tool_format)
    assert spec is not None
    compiled = engine.grammars.compile(spec).result(timeout=60)
    text = engine.grammars.tokenizer().tokenize_str('He said "" and """" to it')
    for budget in (len(text), len(text) + 10, len(text) + 40):
        closing = engine.grammars.start(compiled, budget)
        assert [closing.take(t) for t in text] == text and not closing.forced


def test_the_closing_looks_at_nothing_before_the_last_tokens(engine: Engine) -> None:
    spec = spec_of(parse({"json_schema": SCHEMAS[0]}), None)
    assert spec is not None
    compiled = engine.grammars.compile(spec).result(timeout=60)
    closing = engine.grammars.start(compiled, 500)
    calls = []
    plan = engine.grammars.closer.plan
    engine.grammars.closer.plan = lambda *a: calls.append(a) or plan(*a)  # type: ignore[method-assign]
    try:
        tokenizer = engine.grammars.tokenizer()
        for tok in tokenizer.tokenize_str('{"name":"' + "ab" * 100):
            closing.take(tok)
        assert closing.left > closing.window and not calls  # far from the end: no plan looked for
        while closing.left > 0 and not closing.matcher.is_stopped():
            closing.take(tokenizer.tokenize_str("ab")[0])
        assert calls and closing.forced
    finally:
        del engine.grammars.closer.plan


# ---------------------------------------------------------------- through the daemon


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, openai.OpenAI]]:
    d, url = start_gateway(tmp_path_factory.mktemp("closing"), model_path, model={"ctx_per_slot": 1024},
                           workers={"slots": 8, "cpu_workers": 1})
    yield d, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    d.stop(signal.SIGQUIT, timeout=30)


def ask(c: openai.OpenAI, **kw: Any) -> Any:
    name = c.models.list().data[0].id
    return c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Answer"}], **kw)


def streamed(c: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict[str, str]], str]:
    text, calls, reason = "", {}, ""
    for chunk in ask(c, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        text += ch.delta.content or ""
        for tc in ch.delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return text, calls, reason


@pytest.mark.parametrize("max_tokens", [40, 53, 70])
def test_a_reply_cut_by_max_tokens_still_parses(tiny: tuple[Daemon, openai.OpenAI], max_tokens: int) -> None:
    c = tiny[1]
    for schema in SCHEMAS[:3]:
        rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        r = ask(c, response_format=rf, max_tokens=max_tokens, temperature=0)
        text = r.choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)
        assert r.usage.completion_tokens <= max_tokens
        assert r.choices[0].finish_reason in ("length", "stop")
        assert streamed(c, response_format=rf, max_tokens=max_tokens, temperature=0)[0] == text


def test_a_budget_below_the_shortest_reply_is_a_400_naming_max_tokens(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMAS[3]}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(tiny[1], response_format=rf, max_tokens=3)
    assert e.value.body["param"] == "max_tokens", e.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # streamed: the same 400, nothing said of a stream
        ask(tiny[1], response_format=rf, max_tokens=3, stream=True)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens" and "tokens_delivered" not in body, body
    assert "delivered" not in body["message"], body


def test_a_forced_call_cut_by_max_tokens_is_a_call_streamed_or_not(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    c = tiny[1]
    kw: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 90, "temperature": 0}
    r = ask(c, **kw)
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    _, scalls, reason = streamed(c, **kw)
    assert scalls == {0: {"name": "get_weather", "arguments": calls[0].function.arguments}}
    assert reason == r.choices[0].finish_reason


def test_response_format_goes_with_tools(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    answer = obj({"answer": STR})
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    for seed in range(4):
        r = ask(tiny[1], tools=[WEATHER], response_format=rf, max_tokens=90, temperature=1.0, seed=seed)
        msg = r.choices[0].message
        if msg.tool_calls:
            jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
        else:
            jsonschema.validate(json.loads(msg.content or ""), answer)


@pytest.fixture(scope="module")
def smol(smollm2: str) -> Iterator[Engine]:
    eng = Engine(EngineConfig(smollm2, slots=5, ctx_per_slot=512, max_batch_tokens=512, threads=2))
    yield eng
    eng.close()


def test_tools_with_a_response_format_cut_by_max_tokens_are_calls_the_model_wrote(smol: Engine) -> None:
    """SmolLM2, greedy, answers with two calls (Paris, then Rome: 61 tokens). At a ``max_tokens`` where a
    second call's shortest form fits after the first but the model's own does not (60), the closing
    forced that call's values: ``{"city": ""}``. Now every reply cut short is the calls the model
    finished: each names a city of the question; or an answer that follows the format."""
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": obj({"city": STR})}}
    budgets = range(56, 66, 2)
    out = Step()
    for mt in budgets:
        smol.submit(Run(mt, ask, parse({"tools": [tool], "response_format": ANSWER, "max_tokens": mt,
                                        "temperature": 0}), False), out)
    assert not out.failed, out.failed
    done = {d.rid: d for d in out.done}
    while smol.busy:
        step = smol.step()
        assert not step.failed, step.failed
        done.update((d.rid, d) for d in step.done)
    assert sorted(done) == list(budgets)
    for mt, d in done.items():
        assert d.completion_tokens <= mt
        if not d.tool_calls:
            jsonschema.validate(json.loads(d.text), ANSWER["json_schema"]["schema"])
            continue
        cities = [json.loads(c["arguments"])["city"] for c in d.tool_calls]
        assert cities and all(c in ("Paris", "Rome") for c in cities), (mt, d.reason, cities)
    assert any(len(d.tool_calls or ()) == 2 for d in done.values())  # the model's second call, when it fits


@pytest.mark.parametrize(("extra", "param"), [
    ({"regex": "ab\\"}, "regex"),
    ({"regex": "\\"}, "regex"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "start: foo"}, "grammar"),
    ({"json_schema": {"type": "hiccup"}}, "json_schema"),
    ({"json_schema": {"type": "object", "description": "x" * MAX_GRAMMAR_CHARS}}, "json_schema"),
])
def test_bad_or_oversized_constraints_are_400s_naming_the_field(tiny: tuple[Daemon, openai.OpenAI],
                                                                extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(tiny[1], max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


def test_an_escaped_backslash_is_a_valid_regex(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    with tiny[0].client() as sdk:
        assert sdk.generate("x", regex="a\\\\", max_tokens=4, temperature=0).text == "a\\"


# ---------------------------------------------------------------- the grammar cache, in bytes


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_many_large_regexes_hold_memory_within_the_cache_bound(tmp_path: Path, model_path: str) -> None:
    d, _ = start_gateway(tmp_path, model_path, model={"ctx_per_slot": 256, "grammar_cache_mb": 20},
                         workers={"slots": 2, "cpu_workers": 1})
    try:
        pid = d.status()["workers"][0]["pid"]
        rng = random.Random(0)
        words = ["".join(rng.choice("abcdefghij") for _ in range(10)) for _ in range(7000)]  # ~77 kB a regex
        with d.client() as sdk:
            sdk.generate("x", regex="(" + "|".join(words) + ")", max_tokens=16)
            before = rss_mb(pid)
            t0 = time.monotonic()
            for i in range(24):  # distinct: each compiled anew, ~3.7 MB each (as estimated), 4x the bound in all
                rng.shuffle(words)
                sdk.generate("x", regex=f"{i}(" + "|".join(words) + ")", max_tokens=16)
            grew = rss_mb(pid) - before
        assert grew < 20 + 20, f"the worker grew by {grew:.0f} MB ({time.monotonic() - t0:.1f} s)"
    finally:
        d.stop(signal.SIGQUIT, timeout=30)
