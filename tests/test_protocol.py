"""The codec: every message round-trips, and bad input raises an error naming the field."""

from __future__ import annotations

import msgpack
import pytest

from llamapool.protocol import codec
from llamapool.protocol.messages import (
    Abort,
    Cancel,
    Chunk,
    Delta,
    Done,
    Error,
    ErrorCode,
    Failed,
    Generate,
    Heartbeat,
    Hello,
    Result,
    Run,
    SamplingParams,
    Shutdown,
    StatusReply,
    StatusRequest,
    Step,
    TokenLogprob,
    TopLogprob,
)


def pack(d: object) -> list[bytes]:
    return [msgpack.packb(d)]


def gen(**kw: object) -> dict[str, object]:
    return {"v": 1, "type": "generate", "id": "r1", "prompt": "hi", **kw}


@pytest.mark.parametrize("msg, types", [
    (Generate("a", ["hello"], SamplingParams(max_tokens=5, stop=("x",)), True, 2.5), codec.CLIENT_TYPES),
    (Generate("b", ["x", [1, 2, 3]], SamplingParams(), False, None, batch=True), codec.CLIENT_TYPES),
    (Cancel("a"), codec.CLIENT_TYPES),
    (StatusRequest("s"), codec.CLIENT_TYPES),
    (Chunk("a", 0, "tx", 3), codec.REPLY_TYPES),
    (Result("a", 1, "t", "length", 4, 5, "cpu0"), codec.REPLY_TYPES),
    (Error("a", ErrorCode.TIMEOUT, "late", index=2, tokens_delivered=7), codec.REPLY_TYPES),
    (StatusReply("s", [{"id": "cpu0"}], 1, 2), codec.REPLY_TYPES),
    (Hello("w", 1, "cpu", "m", 4, 512, 300, []), codec.WORKER_TYPES),
    (Heartbeat(2, 10, 0.5), codec.WORKER_TYPES),
    (Step([Delta(1, "a", 1)], [Done(2, "stop", "t", 3, 4)], [Failed(3, "internal", "x", None)], 1), codec.WORKER_TYPES),
    (Shutdown(), codec.WORKER_TYPES),
    (Run(7, [1, 2], SamplingParams(seed=3), True), codec.ROUTER_TYPES),
    (Abort(7), codec.ROUTER_TYPES),
])
def test_every_message_round_trips(msg: object, types: dict) -> None:
    assert codec.decode([codec.encode(msg)], types) == msg  # type: ignore[arg-type]


LP = [TokenLogprob("Hi", None, [72, 105], []),
      TokenLogprob("!", -0.25, [33], [TopLogprob("!", -0.25, [33]), TopLogprob("?", -1.5, [63])])]


@pytest.mark.parametrize("msg, types", [
    (Chunk("a", 0, "Hi!", 2, LP), codec.REPLY_TYPES),
    (Result("a", 0, "Hi!", "length", 1, 2, "cpu0", logprobs=LP), codec.REPLY_TYPES),
    (Step([Delta(1, "Hi!", 2, LP)], [Done(1, "length", "Hi!", 1, 2, logprobs=LP)]), codec.WORKER_TYPES),
])
def test_logprob_records_travel_as_arrays_and_come_back_typed(msg: object, types: dict) -> None:
    """A token's logprobs are one record from the sampler to the API shapes: ``[token, logprob, bytes,
    top]`` on the wire (arrays, as compact as the untyped lists were), read back as records by name."""
    frame = codec.encode(msg)  # type: ignore[arg-type]
    raw = msgpack.unpackb(frame)
    wire = raw["deltas"][0][3] if "deltas" in raw else raw["logprobs"]
    assert wire == [["Hi", None, [72, 105], []], ["!", -0.25, [33], [["!", -0.25, [33]], ["?", -1.5, [63]]]]]
    back = codec.decode([frame], types)
    # the router passes a step's on unread, as arrays; a client reads records
    got = codec.token_logprobs(back.deltas[0].logprobs) if isinstance(back, Step) else back.logprobs  # type: ignore[union-attr]
    assert got is not None and got == LP and type(got[1]) is TokenLogprob and type(got[1].top[0]) is TopLogprob
    assert got[1].top[1].token == "?" and got[1].bytes == [33] and got[0].logprob is None


def test_single_prompt_travels_as_prompt_and_a_batch_as_prompts() -> None:
    one = msgpack.unpackb(codec.encode(Generate("a", ["p"])))
    many = msgpack.unpackb(codec.encode(Generate("a", ["p", "q"], batch=True)))
    assert one["prompt"] == "p" and "prompts" not in one
    assert many["prompts"] == ["p", "q"] and "prompt" not in many


@pytest.mark.parametrize("frames, code, field", [
    ([b"\xc1"], ErrorCode.MALFORMED, None),
    (pack([1, 2]), ErrorCode.MALFORMED, None),
    ([msgpack.packb(gen()), b"extra"], ErrorCode.MALFORMED, None),
    (pack({**gen(), "v": 2}), ErrorCode.UNSUPPORTED_VERSION, "v"),
    (pack({**gen(), "type": "explode"}), ErrorCode.UNKNOWN_TYPE, "type"),
    (pack({"v": 1, "type": "generate", "prompt": "x"}), ErrorCode.INVALID_REQUEST, "id"),
    (pack({"v": 1, "type": "generate", "id": "a"}), ErrorCode.INVALID_REQUEST, "prompt"),
    (pack(gen(params={"max_tokens": -1})), ErrorCode.INVALID_REQUEST, "max_tokens"),
    (pack(gen(params={"top_p": 1.5})), ErrorCode.INVALID_REQUEST, "top_p"),
    (pack(gen(params={"bogus": 1})), ErrorCode.INVALID_REQUEST, "bogus"),
    (pack(gen(prompt=[1, -2])), ErrorCode.INVALID_REQUEST, "prompt"),
    (pack(gen(timeout=0)), ErrorCode.INVALID_REQUEST, "timeout"),
])
def test_bad_input_is_named(frames: list[bytes], code: str, field: str | None) -> None:
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode(frames, codec.CLIENT_TYPES)
    assert e.value.code == code
    assert e.value.field == field


def test_oversize_frame_is_refused_before_parsing() -> None:
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode(pack(gen(prompt="x" * 5000)), codec.CLIENT_TYPES, max_frame=1000)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_error_reply_keeps_the_request_id_when_it_is_readable() -> None:
    with pytest.raises(codec.ProtocolError) as e:
        codec.decode(pack(gen(params={"temperature": "hot"})), codec.CLIENT_TYPES)
    assert e.value.to_error().id == "r1"


def test_stop_accepts_a_single_string() -> None:
    msg = codec.decode(pack(gen(params={"stop": "END"})), codec.CLIENT_TYPES)
    assert isinstance(msg, Generate) and msg.params.stop == ("END",)


def test_client_errors_survive_pickling() -> None:
    """Errors cross process boundaries (multiprocessing pools of clients) with their fields."""
    import pickle

    from llamapool.client.errors import WorkerLostError

    err = pickle.loads(pickle.dumps(WorkerLostError("worker_lost", "gone", None, 7, 2)))
    assert isinstance(err, WorkerLostError) and (err.code, err.tokens_delivered, err.index) == ("worker_lost", 7, 2)
    assert str(err) == "worker_lost: gone"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
DOORS = {  # each HTTP door's parser and a body giving most of the parameters it reads
    "chat": ("llamapool.gateway.openai.chat", lambda g: g, {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "temperature": 1, "top_p": 0.5,
        "stop": ["x", "yz"], "seed": 7, "logit_bias": {"5": 2}, "logprobs": True, "top_logprobs": 2, "n": 2,
        "speculative": 3, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
        "response_format": {"type": "json_object"}}),
    "completions": ("llamapool.gateway.openai.completions", lambda g: g, {
        "prompt": "Once", "stop": "END", "logprobs": 3, "presence_penalty": 0.5, "regex": "[ab]+"}),
    "responses": ("llamapool.gateway.openai.responses", lambda r: r.gen, {
        "input": "hi", "max_output_tokens": 20, "temperature": 0, "tools": [
            {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}],
        "tool_choice": "auto"}),
    "messages": ("llamapool.gateway.anthropic", lambda g: g, {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "top_k": 5,
        "stop_sequences": ["\n\n"], "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}}),
}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_the_gateways_typed_params_reach_the_worker_equal_and_parsed_once(
        door: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway reads a body's parameters into one SamplingParams; the client sends that object
    (to_wire), the router reads it back once (its check: any client may write a frame), and the worker
    reads the router's ``run`` with no second check: equal at every stop."""
    import importlib

    from llamapool.client.calls import generate_frame
    from llamapool.protocol import params

    parses: list[str] = []
    checks: list[str] = []
    parse, check = params.parse, params.check
    monkeypatch.setattr(params, "parse", lambda raw, **kw: parses.append(door) or parse(raw, **kw))
    monkeypatch.setattr(params, "check", lambda name, v: checks.append(name) or check(name, v))
    module, gen_of, body = DOORS[door]
    mod = importlib.import_module(module)
    req = gen_of(mod.parse_messages(body) if door == "messages" else mod.parse(body))
    assert isinstance(req.params, SamplingParams) and req.params != SamplingParams()
    assert parses == [] and len(checks) == len(set(checks)), f"the gateway checked {checks} and parsed {parses}"

    frame = generate_frame("r1", req.prompts, False, False, None, req.params)
    msg = codec.decode([frame], codec.CLIENT_TYPES)
    assert isinstance(msg, Generate) and msg.params == req.params and len(parses) == 1  # the router's check

    parses.clear()
    checks.clear()
    run = codec.decode([codec.encode(Run(5, msg.prompts[0], msg.params, False))], codec.ROUTER_TYPES)
    assert isinstance(run, Run) and run.params == req.params
    assert type(run.params.stop) is tuple
    assert parses == [] and checks == [], "the worker checked the router's parameters again"


def test_the_sdk_takes_typed_params_or_keywords_not_both() -> None:
    from llamapool.client.calls import choices, generate_frame, given
    from llamapool.protocol import params

    typed = params.parse({"n": 2, "stop": "END", "temperature": 0})
    assert given({}, typed) is typed and choices(typed) == 2
    with pytest.raises(TypeError, match="not both"):
        given({"n": 2}, typed)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        given({}, {"n": 2})  # type: ignore[arg-type]
    sent = msgpack.unpackb(generate_frame("r1", ["hi"], False, False, None, typed))["params"]
    assert sent == {"n": 2, "stop": ["END"], "temperature": 0.0}
