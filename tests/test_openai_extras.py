"""Issue 22 item 5 and 7 over HTTP with the real ``openai`` client: ``GET /v1/models/{id}``,
``context_length_exceeded`` for a prompt over the context (also over the SDK), and
``usage.prompt_tokens_details.cached_tokens`` for a prompt served from the prefix cache."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llamapool import BadRequestError
from tests.conftest import Daemon
from tests.test_gateway import start_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    # one worker: a repeated prompt meets its own prefix cache
    d, url = start_gateway(tmp_path_factory.mktemp("extras"), model_path, workers={"cpu_workers": 1, "slots": 4})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture
def oa(gw: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw[1] + "/v1", api_key="unused", max_retries=0)


def test_one_model_by_its_id(gw: tuple[Daemon, str], oa: openai.OpenAI, model_path: str) -> None:
    name = Path(model_path).stem
    m = oa.models.retrieve(name)
    assert (m.id, m.object, m.owned_by) == (name, "model", "llamapool")
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("no-such-model")
    err = e.value.body
    assert isinstance(err, dict) and (err["code"], err["param"]) == ("model_not_found", "model")
    assert "'no-such-model' does not exist" in err["message"] and name in err["message"]
    r = httpx.get(gw[1] + "/v1/models/org/with-a-slash", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_prompt_over_the_context_is_context_length_exceeded(gw: tuple[Daemon, str], oa: openai.OpenAI) -> None:
    d, _ = gw
    with d.client() as c, pytest.raises(BadRequestError) as sdk:
        c.generate([5] * 600, max_tokens=2)
    assert sdk.value.code == "context_length_exceeded" and sdk.value.field == "prompt"
    assert sdk.value.message == "prompt has 600 tokens; the limit is 511 (model.ctx_per_slot)"
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt=[5] * 600, max_tokens=2)
    err = e.value.body
    assert isinstance(err, dict) and (err["code"], err["param"], err["type"]) == (
        "context_length_exceeded", "prompt", "invalid_request_error")
    assert "600 tokens" in err["message"] and "the limit is 511" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a chat far over it: refused before it is tokenized
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * 20000}],
                                   max_tokens=2)
    err = e.value.body
    assert isinstance(err, dict) and (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert "the limit is 511" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:  # many tiny messages: refused before they are rendered
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}] * 100_000, max_tokens=2)
    err = e.value.body
    assert isinstance(err, dict) and (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert "the chat has 100000 messages" in err["message"], err


def test_cached_tokens_of_a_repeated_prompt(oa: openai.OpenAI) -> None:
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    first = oa.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = oa.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < (again.usage.prompt_tokens_details.cached_tokens or 0) < again.usage.prompt_tokens
    msgs = [{"role": "user", "content": prompt}]
    oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    chat = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert (chat.usage.prompt_tokens_details.cached_tokens or 0) > 0
    streamed = list(oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,  # type: ignore[arg-type]
                                               stream=True, stream_options={"include_usage": True}))
    last = streamed[-1].usage
    assert last is not None and last.prompt_tokens_details is not None
    assert (last.prompt_tokens_details.cached_tokens or 0) > 0
