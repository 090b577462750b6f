"""Bad input never crashes the daemon or loses a request: each gets an error naming what is wrong."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import zmq

from llamapool.protocol.messages import ErrorCode


def gen(**kw: Any) -> dict[str, Any]:
    return {"v": 1, "type": "generate", "id": "bad", "prompt": "hi", **kw}


def p(d: Any) -> list[bytes]:
    return [msgpack.packb(d)]


CASES: list[tuple[str, list[bytes], str, str | None]] = [
    ("not msgpack", [b"\xc1\xc1"], ErrorCode.MALFORMED, None),
    ("truncated msgpack", [msgpack.packb(gen())[:-3]], ErrorCode.MALFORMED, None),
    ("a list, not a map", p([1, 2, 3]), ErrorCode.MALFORMED, None),
    ("a bare string", p("generate"), ErrorCode.MALFORMED, None),
    ("two frames", [msgpack.packb(gen()), b"x"], ErrorCode.MALFORMED, None),
    ("empty frame", [b""], ErrorCode.MALFORMED, None),
    ("no version", p({k: v for k, v in gen().items() if k != "v"}), ErrorCode.UNSUPPORTED_VERSION, "v"),
    ("future version", p(gen(v=99)), ErrorCode.UNSUPPORTED_VERSION, "v"),
    ("unknown type", p(gen(type="teleport")), ErrorCode.UNKNOWN_TYPE, "type"),
    ("type not a string", p(gen(type=5)), ErrorCode.UNKNOWN_TYPE, "type"),
    ("missing id", p({"v": 1, "type": "generate", "prompt": "x"}), ErrorCode.INVALID_REQUEST, "id"),
    ("id not a string", p(gen(id=12)), ErrorCode.INVALID_REQUEST, "id"),
    ("missing prompt", p({"v": 1, "type": "generate", "id": "bad"}), ErrorCode.INVALID_REQUEST, "prompt"),
    ("empty prompt", p(gen(prompt="")), ErrorCode.INVALID_REQUEST, "prompt"),
    ("prompt a number", p(gen(prompt=42)), ErrorCode.INVALID_REQUEST, "prompt"),
    ("prompt and prompts", p(gen(prompts=["a"])), ErrorCode.INVALID_REQUEST, "prompt"),
    ("negative token id", p(gen(prompt=[1, -5])), ErrorCode.INVALID_REQUEST, "prompt"),
    ("prompts not a list", p({"v": 1, "type": "generate", "id": "bad", "prompts": "x"}),
     ErrorCode.INVALID_REQUEST, "prompts"),
    ("bad prompt in a batch", p({"v": 1, "type": "generate", "id": "bad", "prompts": ["a", None]}),
     ErrorCode.INVALID_REQUEST, "prompts[1]"),
    ("negative max_tokens", p(gen(params={"max_tokens": -3})), ErrorCode.INVALID_REQUEST, "max_tokens"),
    ("max_tokens a string", p(gen(params={"max_tokens": "10"})), ErrorCode.INVALID_REQUEST,
     "max_tokens"),
    ("negative temperature", p(gen(params={"temperature": -1.0})), ErrorCode.INVALID_REQUEST,
     "temperature"),
    ("top_p zero", p(gen(params={"top_p": 0})), ErrorCode.INVALID_REQUEST, "top_p"),
    ("NaN min_p", p(gen(params={"min_p": float("nan")})), ErrorCode.INVALID_REQUEST, "min_p"),
    ("seed too big", p(gen(params={"seed": 2**40})), ErrorCode.INVALID_REQUEST, "seed"),
    ("stop not strings", p(gen(params={"stop": [1]})), ErrorCode.INVALID_REQUEST, "stop"),
    ("unknown param", p(gen(params={"temprature": 0.5})), ErrorCode.INVALID_REQUEST, "temprature"),
    ("params a list", p(gen(params=[1])), ErrorCode.INVALID_REQUEST, "params"),
    ("stream not a bool", p(gen(stream="yes")), ErrorCode.INVALID_REQUEST, "stream"),
    ("negative timeout", p(gen(timeout=-1)), ErrorCode.INVALID_REQUEST, "timeout"),
    ("unknown field", p(gen(priority=3)), ErrorCode.INVALID_REQUEST, "priority"),
    ("cancel without id", p({"v": 1, "type": "cancel"}), ErrorCode.INVALID_REQUEST, "id"),
    ("oversize frame", p(gen(prompt="x" * (5 * 1024 * 1024))), ErrorCode.TOO_LARGE, None),
    ("worker message from a client", p({"v": 1, "type": "hello", "worker": "x"}), ErrorCode.UNKNOWN_TYPE,
     "type"),
]


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory, model_path):  # type: ignore[no-untyped-def]
    from tests.conftest import launch

    d = launch(tmp_path_factory.mktemp("malformed"), model_path)
    d.wait_ready(2)
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("name, frames, code, field", CASES, ids=[c[0] for c in CASES])
def test_malformed_message_gets_the_right_error_and_the_daemon_still_serves(
        shared_daemon, name: str, frames: list[bytes], code: str, field: str | None) -> None:  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(shared_daemon.endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), f"no reply to {name}"
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "error"
        assert reply["code"] == code, reply
        assert reply["field"] == field, reply
        assert reply["message"]
    finally:
        ctx.destroy(linger=0)
    with shared_daemon.client() as c:
        assert c.generate("still there?", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_duplicate_request_id_in_flight_is_refused(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(shared_daemon.endpoint)
    try:
        msg = msgpack.packb(gen(id="dup", params={"max_tokens": 200, "ignore_eos": True}))
        sock.send(msg)
        sock.send(msg)
        replies = []
        while len(replies) < 2 and sock.poll(20_000):
            replies.append(msgpack.unpackb(sock.recv()))
        kinds = sorted(r["type"] if r["type"] != "error" else r["code"] for r in replies)
        assert kinds == [ErrorCode.DUPLICATE_ID, "result"], replies
    finally:
        ctx.destroy(linger=0)


def test_an_oversized_request_gets_too_large_under_its_own_id(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    """Over server.max_message_bytes (4 MiB): the SDK's request fails at once with ``too_large``,
    not after its timeout (the error must carry the request's id to reach it)."""
    import time

    from llamapool.client.errors import BadRequestError

    with shared_daemon.client() as c:
        t0 = time.monotonic()
        with pytest.raises(BadRequestError) as e:
            c.generate("a" * 6_000_000, max_tokens=2, timeout=20)
        assert e.value.code == ErrorCode.TOO_LARGE and "server.max_message_bytes" in e.value.message
        assert time.monotonic() - t0 < 5
        assert c.generate("still there?", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_a_frame_the_router_would_drop_is_refused_by_the_sdk() -> None:
    from llamapool.client.calls import generate_frame
    from llamapool.client.errors import BadRequestError
    from llamapool.protocol import codec

    with pytest.raises(BadRequestError) as e:
        generate_frame("x", ["a" * (codec.TRANSPORT_MAX_FRAME + 1)], False, False, None, {})
    assert e.value.code == ErrorCode.TOO_LARGE and e.value.field == "prompt"


def test_a_megabytes_long_prompt_is_refused_without_tokenizing_it(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    """3 MB of text cannot fit the context: refused before the tokenizer runs (it would hold the
    worker's engine thread for many seconds), and the worker keeps serving others meanwhile."""
    import time

    from llamapool.client.errors import BadRequestError

    with shared_daemon.client() as c:
        t0 = time.monotonic()
        with pytest.raises(BadRequestError) as e:
            c.generate("word " * 600_000, max_tokens=2)
        took = time.monotonic() - t0
        assert e.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "model.ctx_per_slot" in e.value.message
        assert took < 3, f"took {took:.1f}s"


def test_a_string_the_sdk_cannot_encode_is_a_bad_request() -> None:
    from llamapool.client.calls import generate_frame
    from llamapool.client.errors import BadRequestError

    with pytest.raises(BadRequestError) as e:
        generate_frame("x", ["a lone surrogate \ud800"], False, False, None, {})
    assert e.value.code == ErrorCode.INVALID_REQUEST and e.value.field == "prompt"
    assert "lone surrogate U+D800 at character 17" in e.value.message
