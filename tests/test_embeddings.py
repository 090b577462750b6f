"""Embeddings, tokenize and detokenize against a real daemon (CPU, the tiny random model), checked
against llama-cpp-python on the same GGUF: a generation model and the same GGUF listed again as an
embedding model (mean pooling, and last pooling)."""

from __future__ import annotations

import base64
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from llamapool import AsyncClient, BadRequestError, Client
from tests.conftest import Daemon, reference_llama
from tests.test_gateway import start_gateway

WORDS = ("the river ran past old stone houses while a quiet wind moved over fields of wheat and "
         "children counted boats under a pale sky").split()
# 32 inputs of mixed length: 3 to 127 characters, 2 to about 80 tokens
INPUTS = [" ".join(WORDS[(i * 7) % len(WORDS):] + WORDS * (i % 4))[: 3 + i * 4] for i in range(32)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    common = {"path": model_path, "devices": "cpu", "cpu_workers": 1, "threads": 1}
    models = [
        {"name": "gen", **common, "slots": 4, "ctx_per_slot": 2048, "max_batch_tokens": 512},
        {"name": "emb", **common, "embedding": True, "pooling": "mean", "slots": 32, "ctx_per_slot": 256,
         "max_batch_tokens": 4096},
        {"name": "emb-last", **common, "embedding": True, "pooling": "last", "slots": 8, "ctx_per_slot": 256},
    ]
    d, url = start_gateway(tmp_path_factory.mktemp("emb"), model_path, models=models)
    d.wait_ready(3)
    yield d, url
    d.stop()


def reference(model_path: str, pooling: int, inputs: list[str]) -> np.ndarray:
    """llama-cpp-python's vectors (it does not normalise by default: we do, as the daemon does)."""

    llm = reference_llama(model_path, embedding=True, pooling_type=pooling, n_ctx=512)
    try:
        vecs = np.array(llm.embed(inputs), dtype=np.float64)
    finally:
        llm.close()
    return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


def assert_close(got: Any, want: np.ndarray) -> None:
    got = np.array(got, dtype=np.float64)
    assert got.shape == want.shape
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # L2-normalised
    cos = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() >= 0.9999, cos


def test_sdk_vectors_equal_llama_cpp_python(daemon: tuple[Daemon, str], model_path: str) -> None:
    import llama_cpp

    d, _ = daemon
    with d.client() as c:
        vecs = c.embed(INPUTS, model="emb")
        n_tokens = sum(len(c.tokenize(t, model="emb", add_special=True, parse_special=False)) for t in INPUTS)
        last = c.embed(INPUTS[:8], model="emb-last")
        one = c.embed(INPUTS[5], model="emb")  # a string: a list of one vector
        ids = c.embed(c.tokenize(INPUTS[5], model="emb", add_special=True), model="emb")  # token ids
    assert len(vecs) == 32 and vecs.model == "emb" and vecs.prompt_tokens == n_tokens
    assert_close(vecs, reference(model_path, llama_cpp.LLAMA_POOLING_TYPE_MEAN, INPUTS))
    assert_close(last, reference(model_path, llama_cpp.LLAMA_POOLING_TYPE_LAST, INPUTS[:8]))
    assert_close(one, np.array(vecs[5:6]))
    assert_close(ids, np.array(vecs[5:6]))

    async def aio() -> list[list[float]]:
        async with AsyncClient(d.endpoint) as ac:
            return await ac.embed(INPUTS[:3], model="emb")

    import asyncio

    assert_close(asyncio.run(aio()), np.array(vecs[:3]))


def test_openai_client_float_and_base64(daemon: tuple[Daemon, str]) -> None:
    d, url = daemon
    with d.client() as c:
        want = np.array(c.embed(INPUTS, model="emb"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    floats = client.embeddings.create(model="emb", input=INPUTS, encoding_format="float")
    assert [e.index for e in floats.data] == list(range(32)) and floats.model == "emb"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 32
    assert_close([e.embedding for e in floats.data], want)
    default = client.embeddings.create(model="emb", input=INPUTS[:4])  # the client asks for base64 and decodes it
    assert_close([e.embedding for e in default.data], want[:4])
    r = httpx.post(url + "/v1/embeddings", json={"model": "emb", "input": INPUTS[:2], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = [base64.b64decode(e["embedding"]) for e in r.json()["data"]]
    assert_close([struct.unpack(f"<{len(b) // 4}f", b) for b in raw], want[:2])
    one = client.embeddings.create(model="emb", input=[1, 2, 3, 4])  # token ids
    assert len(one.data) == 1


def test_wrong_model_kind_and_bad_parameters_are_400s(daemon: tuple[Daemon, str]) -> None:
    d, url = daemon
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="'gen' is a generation model"):
        client.embeddings.create(model="gen", input="hello")
    with pytest.raises(openai.BadRequestError, match="'emb' is an embedding model"):
        client.completions.create(model="emb", prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="dimensions") as e:
        client.embeddings.create(model="emb", input="hello", dimensions=8)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    for body, param in (({"model": "emb", "input": []}, "input"), ({"model": "emb", "input": ["a", ""]}, "input[1]"),
                        ({"model": "emb", "input": [1, -2]}, "input[0]"),
                        ({"model": "emb", "input": "a", "encoding_format": "hex"}, "encoding_format"),
                        ({"model": "emb", "input": [[5, 999999]]}, "input")):
        r = httpx.post(url + "/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with d.client() as c:
        with pytest.raises(BadRequestError, match="'gen' is a generation model"):
            c.embed(["a", "b"], model="gen")
        with pytest.raises(BadRequestError, match="'emb' is an embedding model"):
            c.generate("hello", model="emb", max_tokens=4)
        with pytest.raises(BadRequestError, match="limit is 256"):
            c.embed("word " * 400, model="emb")
        assert c.generate("hello", model="gen", max_tokens=4, temperature=0).usage.completion_tokens == 4
    assert d.proc.poll() is None


def test_tokenize_detokenize_round_trip(daemon: tuple[Daemon, str], model_path: str) -> None:
    from llama_cpp import Llama

    d, url = daemon
    llm = Llama(model_path, vocab_only=True, verbose=False)
    text = "Hello world, the river ran <|im_start|> past 42 houses."
    with d.client() as c:
        plain = c.tokenize(text, model="gen")
        assert plain == llm.tokenize(text.encode(), add_bos=False, special=True)
        assert c.tokenize(text, model="gen", add_special=True, parse_special=False) == llm.tokenize(text.encode())
        # the special token is read as one; the SentencePiece text after it gets its own leading space
        assert c.detokenize(plain, model="gen") == llm.detokenize(plain, special=True).decode().removeprefix(" ")
        prose = "Hello world, the river ran past 42 houses."
        assert c.detokenize(c.tokenize(prose, model="gen"), model="gen") == prose
        assert c.detokenize(c.tokenize(prose, model="gen", add_special=True), model="gen") == "<s> " + prose
        pieces = c.tokenize("Hello world", model="emb", with_pieces=True)
        assert [p["id"] for p in pieces] == llm.tokenize(b"Hello world", add_bos=False)
        assert "".join(p["piece"] for p in pieces).strip() == "Hello world"
        with pytest.raises(BadRequestError, match="out of range") as e:
            c.detokenize([1, 10**6], model="gen")
        assert e.value.field == "tokens"
    r = httpx.post(url + "/tokenize", json={"content": text, "model": "gen"})
    assert r.json() == {"tokens": plain}
    r = httpx.post(url + "/detokenize", json={"tokens": plain, "model": "gen"})
    content = llm.detokenize(plain, special=True).decode().removeprefix(" ")
    assert r.json() == {"content": content, "prompt": content}  # llama-server's key, and vLLM's
    r = httpx.post(url + "/tokenize", json={"content": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "content"


def test_tokenize_does_not_wait_behind_generation(daemon: tuple[Daemon, str]) -> None:
    """Every slot of the generation model busy and more waiting: a tokenize is answered at once."""
    d, _ = daemon
    done = threading.Event()

    def busy() -> None:
        with d.client() as c:
            c.generate_many(["x"] * 8, model="gen", max_tokens=1500, ignore_eos=True, temperature=0)
        done.set()

    t = threading.Thread(target=busy)
    t.start()
    try:
        time.sleep(0.5)
        with Client(d.endpoint) as c:
            start = time.monotonic()
            assert c.detokenize(c.tokenize("a b c", model="gen"), model="gen") == "a b c"
            took = time.monotonic() - start
        assert not done.is_set(), "the generation ended before the tokenize: make it longer"
        assert took < 1.0
    finally:
        t.join(120)


def test_config_keys_are_checked(tmp_path: Path) -> None:
    from llamapool.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=r"models\[0\]\.pooling"):
        from_dict({"models": [{"path": "m.gguf", "embedding": True, "pooling": "max"}]})
    with pytest.raises(ConfigError, match="embedding = true"):
        from_dict({"models": [{"path": "m.gguf", "pooling": "cls"}]})
    cfg = from_dict({"models": [{"path": "m.gguf", "name": "a"}, {"path": "m.gguf", "name": "b", "embedding": True}]})
    assert [m.embedding for m in cfg.models] == [False, True] and cfg.models[1].pooling == ""


def test_without_a_model_embeddings_go_to_the_first_embedding_model(daemon: tuple[Daemon, str]) -> None:
    """The pool's first model is a generation model: a body without ``model`` goes to the first embedding
    model, not to it (and the bare path, as llama-server and vLLM serve it, is the same endpoint)."""
    url = daemon[1]
    named = httpx.post(url + "/v1/embeddings", json={"model": "emb", "input": "a quiet wind"}, timeout=60)
    for path in ("/v1/embeddings", "/embeddings"):
        r = httpx.post(url + path, json={"input": "a quiet wind"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "emb" and r.json()["data"] == named.json()["data"]
