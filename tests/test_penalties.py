"""Penalties and biases (issue 22 item 3): OpenAI's presence_penalty, frequency_penalty and logit_bias
over the SDK and HTTP alike, on the tiny model through the real daemon; bad values refused by name the
same way over both."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llamapool import BadRequestError
from tests.conftest import Daemon
from tests.test_gateway import start_gateway

GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "max_tokens": 32}
REPETITIVE = "hello hello hello hello"  # the tiny model's greedy reply to it repeats itself


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    d, url = start_gateway(tmp_path_factory.mktemp("pen"), model_path, workers={"cpu_workers": 1, "slots": 4})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


def repeats(text: str, n: int = 6) -> bool:
    return any(text.count(text[i:i + n]) > 1 for i in range(len(text) - n))


def test_a_frequency_penalty_changes_a_repetitive_greedy_reply(gw: tuple[Daemon, str]) -> None:
    d, url = gw
    with d.client() as c:
        plain = c.generate(REPETITIVE, **GREEDY).text
        again = c.generate(REPETITIVE, **GREEDY).text
        penalised = c.generate(REPETITIVE, frequency_penalty=2, **GREEDY).text
        present = c.generate(REPETITIVE, presence_penalty=2, **GREEDY).text
        nothing = c.generate(REPETITIVE, frequency_penalty=0, presence_penalty=0, logit_bias={}, **GREEDY).text
    assert plain == again == nothing and repeats(plain), plain
    assert penalised != plain and present != plain
    r = httpx.post(f"{url}/v1/completions", json={"prompt": REPETITIVE, "frequency_penalty": 2, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == penalised  # the same over HTTP


def one_piece(text: str, n: int) -> str:
    """The piece ``text`` repeats ``n`` times (an AssertionError when it is not one token's text n times)."""
    piece = text[: len(text) // n]
    assert piece and piece * n == text, (text, n)
    return piece


@pytest.mark.parametrize("sampled", [False, True])
def test_a_bias_of_100_makes_every_token_that_token(gw: tuple[Daemon, str], sampled: bool) -> None:
    d, url = gw
    kw: dict[str, Any] = {**GREEDY, "temperature": 1.0, "seed": 7} if sampled else dict(GREEDY)
    with d.client() as c:
        sdk = c.generate(REPETITIVE, logit_bias={300: 100}, **kw)
        chat = c.chat([{"role": "user", "content": "hi"}], logit_bias={"300": 100.0}, **kw)
    assert sdk.usage.completion_tokens == chat.usage.completion_tokens == 32
    piece = one_piece(sdk.text, 32)
    assert chat.text == sdk.text
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    body = {"temperature": kw["temperature"], "max_tokens": 32, "seed": kw.get("seed"), "logit_bias": {"300": 100}}
    http = oa.completions.create(model="tiny", prompt=REPETITIVE, extra_body=extra, **body)
    assert http.choices[0].text == piece * 32
    http_chat = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           extra_body=extra, **body)
    assert http_chat.choices[0].message.content == piece * 32


def test_a_bias_of_minus_100_bans_the_greedy_choice(gw: tuple[Daemon, str]) -> None:
    d, _ = gw
    with d.client() as c:
        first = c.generate(REPETITIVE, **{**GREEDY, "max_tokens": 1}).text
        forced = c.generate(REPETITIVE, logit_bias={300: 100}, **{**GREEDY, "max_tokens": 1}).text
        banned = c.generate(REPETITIVE, logit_bias={300: -100}, **{**GREEDY, "max_tokens": 8}).text
    assert forced != first
    assert forced not in banned


BAD = [
    ("presence_penalty", 2.5, "presence_penalty", "'presence_penalty' must be a number from -2 to 2, got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty", "'frequency_penalty' must be a number from -2 to 2, got -3"),
    ("frequency_penalty", "1", "frequency_penalty", "'frequency_penalty' must be a number from -2 to 2, got '1'"),
    ("logit_bias", {"x": 1}, "logit_bias",
     "'logit_bias' keys must be token ids (integers from 0, or their decimal text), got 'x'"),
    ("logit_bias", {"-5": 1}, "logit_bias",
     "'logit_bias' keys must be token ids (integers from 0, or their decimal text), got '-5'"),
    ("logit_bias", {"5": 101}, "logit_bias",
     "'logit_bias' values must be numbers from -100 to 100, got 101 for token 5"),
    ("logit_bias", {"5": "big"}, "logit_bias",
     "'logit_bias' values must be numbers from -100 to 100, got 'big' for token 5"),
    ("logit_bias", [5, 1], "logit_bias",
     "'logit_bias' must be a map of token ids to biases (at most 1024 entries), got [5, 1]"),
    ("logit_bias", {"4000": 1}, "logit_bias",  # the tiny model has 512 tokens: the worker refuses it
     "'logit_bias' names token 4000, outside the model's vocabulary (token ids 0 to 511)"),
]


@pytest.mark.parametrize("name, value, field, message", BAD)
def test_bad_values_are_refused_by_name_alike(gw: tuple[Daemon, str], name: str, value: Any, field: str,
                                               message: str) -> None:
    d, url = gw
    with d.client() as c, pytest.raises(BadRequestError) as e:
        c.generate("hi", max_tokens=2, **{name: value})
    assert (e.value.field, e.value.message) == (field, message)
    for path, body in (("completions", {"prompt": "hi"}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{url}/v1/{path}", json={**body, "max_tokens": 2, name: value}, timeout=30)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (field, message)
