"""``n`` choices per prompt: the prompt is computed once and its KV copied to the other choices.

At temperature 0 every choice is the single greedy reply; with a seed, choice ``j`` samples with
``seed + j``, so a request is reproducible and its choices differ; ``usage`` counts the prompt once.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from llamapool import BadRequestError

from .conftest import Daemon
from .test_gateway import start_gateway

PROMPT = [11 + i % 50 for i in range(300)]  # 300 token ids: long enough to tell computed from copied


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, openai.OpenAI]]:
    d, url = start_gateway(tmp_path_factory.mktemp("choices"), model_path, workers={"slots": 4, "cpu_workers": 1},
                           model={"ctx_per_slot": 1024})
    yield d, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    d.stop(signal.SIGQUIT, timeout=30)


def cached_tokens(d: Daemon) -> float:
    with d.client() as c:
        text = c.metrics()
    return sum(float(v) for v in re.findall(r"^llamapool_prompt_tokens_cached_total\{[^}]*\} (\S+)$", text, re.M))


def test_greedy_choices_equal_the_single_reply_and_the_prompt_is_computed_once(pool: tuple[Daemon, openai.OpenAI]
                                                                               ) -> None:
    d = pool[0]
    with d.client() as c:
        single = c.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
        before = cached_tokens(d)
        three = c.generate_many([PROMPT[::-1]], n=3, max_tokens=12, temperature=0, ignore_eos=True)
        again = c.generate_many([PROMPT], n=3, max_tokens=12, temperature=0, ignore_eos=True)
    assert [x.index for x in three] == [0, 1, 2] and len({x.text for x in three}) == 1
    assert [x.text for x in again] == [single.text] * 3
    time.sleep(2.5)  # two heartbeats: the workers' counters reach the router
    # the reversed prompt is new: its two later choices copy the first one's computed prompt
    assert cached_tokens(d) - before >= 2 * (len(PROMPT) - 1)


def test_seeded_choices_are_reproducible_and_differ(pool: tuple[Daemon, openai.OpenAI]) -> None:
    with pool[0].client() as c:
        kw: dict[str, Any] = {"n": 3, "max_tokens": 16, "temperature": 1.0, "seed": 42, "ignore_eos": True}
        a = [x.text for x in c.generate_many(["Once upon a time"], **kw)]
        b = [x.text for x in c.generate_many(["Once upon a time"], **kw)]
        solo = c.generate("Once upon a time", **{**kw, "n": 1, "seed": 43})
    assert a == b and len(set(a)) == 3
    assert a[1] == solo.text  # choice 1 samples with seed + 1


def test_openai_n_over_http_streamed_and_not(pool: tuple[Daemon, openai.OpenAI]) -> None:
    c = pool[1]
    model = c.models.list().data[0].id
    kw: Any = {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 8,
               "temperature": 0.9, "seed": 7}
    r = c.chat.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1]
    one = c.chat.completions.create(**{**kw, "n": 1})
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    texts = {0: "", 1: ""}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == [ch.message.content for ch in r.choices]
    cr = c.completions.create(model=model, prompt=["a b c", "d e f"], n=2, max_tokens=4, temperature=0)
    assert [ch.index for ch in cr.choices] == [0, 1, 2, 3] and cr.choices[0].text == cr.choices[1].text


def test_bad_n_is_refused_by_name(pool: tuple[Daemon, openai.OpenAI]) -> None:
    d, c = pool
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=c.models.list().data[0].id, prompt="x", n=5, max_tokens=2)  # 4 slots a worker
    assert e.value.body["param"] == "n"  # type: ignore[index]
    with d.client() as sdk:
        for bad in (0, 129, 1.5):
            with pytest.raises(BadRequestError) as err:
                sdk.generate_many(["x"], n=bad)
            assert err.value.field == "n"
        with pytest.raises(TypeError, match="generate_many"):
            sdk.generate("x", n=2)
