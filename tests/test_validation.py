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
