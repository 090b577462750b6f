"""Log-probabilities: OpenAI's shapes over HTTP, the SDK's entries, and llama.cpp's own numbers.

A token's logprob is the log-softmax of the model's logits for its position (the raw distribution,
before temperature and the other samplers); at temperature 0 the chosen token is the first of
``top_logprobs``, whose probabilities are sorted and sum to at most 1.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from llamapool import BadRequestError, default_model

from .conftest import Daemon, launch, reference_llama
from .test_gateway import start_gateway


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, openai.OpenAI]]:
    d, url = start_gateway(tmp_path_factory.mktemp("logprobs"), model_path, workers={"slots": 4, "cpu_workers": 1})
    yield d, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    d.stop(signal.SIGQUIT, timeout=30)


def name_of(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_chat_logprobs_in_openais_shape(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    c = tiny[1]
    r = c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the top one
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-6
        assert t.logprob <= 0 and bytes(t.bytes or []).decode(errors="replace") == t.token


def test_streamed_logprobs_equal_the_reply(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    c = tiny[1]
    kw: Any = {"model": name_of(c), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
               "temperature": 0, "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    whole = c.chat.completions.create(**kw).choices[0].logprobs
    assert whole is not None and whole.content is not None
    streamed = [t for ch in c.chat.completions.create(**kw, stream=True)
                for t in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [t.token for t in streamed] == [t.token for t in whole.content]
    # the same numbers but for float rounding (the second run's prompt comes from the prefix cache)
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, whole.content, strict=True))


def test_completions_logprobs_and_offsets(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    c = tiny[1]
    r = c.completions.create(model=name_of(c), prompt="Once", max_tokens=5, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert lp.top_logprobs is not None and all(len(m) <= 2 for m in lp.top_logprobs)
    plain = c.completions.create(model=name_of(c), prompt="Once", max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None  # only rows that ask pay for it


def test_echo_returns_the_prompt_and_its_logprobs(tiny: tuple[Daemon, openai.OpenAI]) -> None:
    c = tiny[1]
    prompt = "The quick brown fox jumps over the lazy dog " * 3
    r = c.completions.create(model=name_of(c), prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1,
                             extra_body={"ignore_eos": True})
    plain = c.completions.create(model=name_of(c), prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    choice, usage = r.choices[0], r.usage
    assert usage is not None and choice.text.endswith(plain.choices[0].text)
    assert choice.text == prompt + plain.choices[0].text  # the prompt as it was sent
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    # the tokens' pieces (SentencePiece writes the first word's space)
    assert len(lp.tokens) == usage.prompt_tokens + 4 and "".join(lp.tokens).strip() == choice.text.strip()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    with pool_client(tiny) as sdk:
        echoed = sdk.generate(prompt, max_tokens=4, temperature=0, echo=True, ignore_eos=True)
    assert echoed.text == choice.text and echoed.logprobs is None


def pool_client(tiny: tuple[Daemon, openai.OpenAI]) -> Any:
    return tiny[0].client()


@pytest.mark.parametrize("kw, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
])
def test_bad_logprobs_are_refused_by_name(tiny: tuple[Daemon, openai.OpenAI], kw: dict[str, Any], param: str) -> None:
    c = tiny[1]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name_of(c), messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw)
    assert e.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name_of(c), prompt="x", max_tokens=2, logprobs=6)
    assert e.value.body["param"] == "logprobs"  # type: ignore[index]
    with tiny[0].client() as sdk, pytest.raises(BadRequestError) as err:
        sdk.generate("x", **kw)
    assert err.value.field == param


def test_logprobs_equal_llama_cpps_log_softmax_on_gemma(tmp_path: Path) -> None:
    """The daemon's greedy tokens and logprobs on Gemma 3 270M against llama-cpp-python's own logits."""
    gemma = str(default_model.fetch(Path(__file__).resolve().parent.parent / "models"))
    prompt = "The capital of France is"
    d = launch(tmp_path, gemma, model={"path": gemma, "ctx_per_slot": 512}, workers={"slots": 2, "cpu_workers": 1})
    try:
        d.wait_ready(1)
        with d.client() as sdk:
            done = sdk.generate(prompt, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5)
            echoed = sdk.generate(prompt, max_tokens=1, temperature=0, logprobs=True, echo=True)
    finally:
        d.stop(signal.SIGQUIT, timeout=30)
    # the same logits: attention as a CPU worker computes it, the prompt in one batch, then a token a step
    llm = reference_llama(gemma, n_ctx=512, n_threads=2, logits_all=True)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        generated: list[int] = []
        llm.eval(tokens)
        assert echoed.logprobs is not None and len(echoed.logprobs) == len(tokens) + 1
        for i in range(1, len(tokens)):  # the prompt's own logprobs, computed in one batch as here
            row = np.array(llm.scores[i - 1], dtype=np.float64)
            want = row[tokens[i]] - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert abs(echoed.logprobs[i].logprob - want) < 1e-3
        for _ in range(6):
            if generated:
                llm.eval(generated[-1:])
            row = np.array(llm.scores[len(tokens) + len(generated) - 1], dtype=np.float64)
            logsm = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            generated.append(int(row.argmax()))
            entry = done.logprobs[len(generated) - 1] if done.logprobs else None
            assert entry is not None
            assert bytes(entry.bytes) == llm.detokenize([generated[-1]])  # the same token
            assert abs(entry.logprob - logsm[generated[-1]]) < 1e-3
            assert entry.top[0].token == entry.token and len(entry.top) == 5
            best = np.argsort(-logsm)[:5]  # the 5 likeliest, likeliest first, with their logprobs
            assert [bytes(t.bytes) for t in entry.top] == [llm.detokenize([int(t)]) for t in best]
            assert all(abs(t.logprob - logsm[int(b)]) < 1e-3 for t, b in zip(entry.top, best, strict=True))
    finally:
        llm.close()


@pytest.mark.parametrize("vocab", [512, 4096, 32000, 262144])
def test_the_batched_log_softmax_and_top_k_equal_their_definitions(vocab: int) -> None:
    """The host path's numbers for a step's rows at once (chunked, a bounded top-k above a small
    vocabulary) equal the log-softmax computed row by row in float64 and the likeliest tokens by a full
    sort, also for a row a grammar masked to a few tokens and a row of ties."""
    from llamapool.worker.sampling import log_softmax_top

    rng = np.random.default_rng(vocab)
    block = (rng.normal(size=(12, vocab)) * 4).astype(np.float32)
    block[3, :] = -np.inf
    block[3, [7, 100, 101]] = [1.0, 0.5, 0.25]  # masked: three tokens allowed
    block[5, :] = np.round(block[5, :])  # many ties
    toks = [int(t) for t in rng.integers(0, vocab, 12)]
    toks[3] = 100
    for top in (0, 1, 5, 20):
        chosen, ids, vals = log_softmax_top(block, toks, top)
        ref = block.astype(np.float64)
        m = ref.max(axis=1, keepdims=True)
        logsm = ref - (m + np.log(np.exp(ref - m).sum(axis=1, keepdims=True)))
        assert np.abs(chosen - logsm[np.arange(12), toks]).max() < 1e-5
        assert ids.shape == vals.shape == (12, top)
        want = np.sort(logsm, axis=1)[:, ::-1][:, :top]  # the likeliest values, likeliest first
        assert np.allclose(vals, want, atol=1e-5)  # the masked row's fourth and later: -inf
        assert np.allclose(np.take_along_axis(logsm, ids, axis=1), vals, atol=1e-5)  # each id has its value
        assert all(len(set(row)) == top for row in ids.tolist())
        if top:
            assert list(ids[3, :3]) == [7, 100, 101][:top]
