"""One validation: the SDK and the HTTP API take the same parameter ranges and give the same message,
naming the public parameter, with numbers printed as written."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from llamapool import BadRequestError
from llamapool.protocol import limits

from .conftest import Daemon, free_port

BAD = [
    ("temperature", 2.5, "'temperature' must be a number from 0 to 2, got 2.5"),
    ("max_tokens", 2**31, "'max_tokens' must be an integer from 1 to 1073741824, got 2147483648"),
    ("max_tokens", 0, "'max_tokens' must be an integer from 1 to 1073741824, got 0"),
    ("top_p", 0, "'top_p' must be a number above 0 and at most 1, got 0"),
    ("top_k", -1, "'top_k' must be an integer from 0 to 1048576, got -1"),
    ("min_p", 1.5, "'min_p' must be a number from 0 to 1, got 1.5"),
    ("repeat_penalty", 0.0, "'repeat_penalty' must be a number above 0 and at most 10, got 0"),
]


def test_numbers_print_as_written() -> None:
    assert [limits.show(v) for v in (2**30, 1e-05, 0.7, 2.0, True)] == ["1073741824", "1e-05", "0.7", "2", "True"]


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Any:
    from .conftest import launch

    port = free_port()
    d = launch(tmp_path_factory.mktemp("v"), model_path, workers={"cpu_workers": 1, "devices": "cpu", "slots": 2,
                                                                   "threads": 1},
               http={"listen": f"127.0.0.1:{port}"})
    d.wait_ready(1)
    d.wait_log("listening on", timeout=30)
    yield d, f"http://127.0.0.1:{port}"
    d.stop()


@pytest.mark.parametrize("name, value, message", BAD)
def test_the_sdk_and_http_refuse_a_bad_value_alike(http_daemon: tuple[Daemon, str], name: str, value: Any,
                                                    message: str) -> None:
    d, url = http_daemon
    with d.client() as c, pytest.raises(BadRequestError) as e:
        c.generate("hi", **{name: value})
    assert (e.value.field, e.value.message) == (name, message)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", name: value}, timeout=30)
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (name, message)


def test_an_empty_chat_names_messages(http_daemon: tuple[Daemon, str]) -> None:
    d, url = http_daemon
    with d.client() as c, pytest.raises(BadRequestError) as e:
        c.chat([], max_tokens=2)
    assert e.value.field == "messages"
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_the_same_values_are_good_everywhere(http_daemon: tuple[Daemon, str]) -> None:
    d, url = http_daemon
    good = {"temperature": 2, "top_p": 1, "top_k": 0, "min_p": 0, "repeat_penalty": 10, "max_tokens": 2}
    with d.client() as c:
        assert c.generate("hi", **good).usage.completion_tokens <= 2
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", **good}, timeout=30)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------ what the wire cannot carry (issue 29, item 4)

BIG = 2**64  # JSON has no limit on integers; msgpack carries -2**63 to 2**64-1
UNENCODABLE = [  # (route, body, param, start of the message)
    ("completions", '{"prompt": [1, 2, 18446744073709551616], "max_tokens": 2}', "prompt[2]",
     "'prompt[2]' must be a token id, an integer from 0 to 2147483647, got 18446744073709551616"),
    ("completions", '{"prompt": [[1], [3, 18446744073709551616]], "max_tokens": 2}', "prompt[1][1]",
     "'prompt[1][1]' must be a token id"),
    ("completions", '{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt",
     "'prompt' is not valid Unicode text: a lone surrogate U+D800 at character 2"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "a \\udc00"}],'
     ' "max_tokens": 2}', "messages[1].content", "'messages[1].content' is not valid Unicode text"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x"}], "stop": ["ok", "\\ud800"], "max_tokens": 2}',
     "stop[1]", "'stop[1]' is not valid Unicode text"),
    ("embeddings", '{"model": "tiny", "input": ["a", "\\ud800"]}', "input[1]", "'input[1]' is not valid Unicode text"),
]


@pytest.mark.parametrize("route, body, param, message", UNENCODABLE, ids=[u[2] for u in UNENCODABLE])
def test_what_the_wire_cannot_carry_is_a_400_naming_the_field(http_daemon: tuple[Daemon, str], route: str,
                                                              body: str, param: str, message: str) -> None:
    _, url = http_daemon
    r = httpx.post(f"{url}/v1/{route}", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err


def test_the_sdk_names_what_it_cannot_encode(http_daemon: tuple[Daemon, str]) -> None:
    d, _ = http_daemon
    with d.client() as c:
        for call, field in [(lambda: c.generate([1, BIG]), "prompt[1]"),
                            (lambda: c.chat([{"role": "user", "content": "\ud800"}]), "prompt[0].content"),
                            (lambda: c.generate("x", stop=["\udfff"]), "params.stop[0]"),
                            (lambda: c.embed(["a", "b\ud800"]), "input[1]"),
                            (lambda: c.tokenize("\ud800"), "content")]:
            with pytest.raises(BadRequestError) as e:
                call()
            assert e.value.field == field and e.value.message.startswith(f"'{field}' "), e.value


def test_top_logprobs_without_logprobs_is_refused_as_openai_does(http_daemon: tuple[Daemon, str]) -> None:
    d, url = http_daemon
    message = "'top_logprobs' is only allowed when 'logprobs' is true"
    for extra in ({}, {"logprobs": False}):
        for top in (2, 0):
            r = httpx.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_logprobs": top, **extra},
                timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
            assert r.json()["error"]["message"] == message
    with d.client() as c:
        with pytest.raises(BadRequestError) as e:
            c.generate("x", top_logprobs=3)
        assert (e.value.field, e.value.message) == ("top_logprobs", message)
        assert c.generate("x", max_tokens=2, logprobs=True, top_logprobs=3).logprobs
