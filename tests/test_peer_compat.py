"""What llama.cpp's server test suite found when run against llamapool (issue 33 item 6), on the tiny
random-weight model: llama-server's ``json_object`` + ``schema`` is constrained by the schema (an invalid
schema a 400 naming it), replies carry a ``system_fingerprint``, the OpenAI routes answer without ``/v1``,
embeddings without a model never go to a generation model, ``/tokenize`` takes vLLM's body, and vLLM's
``/tokenizer_info`` is served."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Daemon
from tests.test_gateway import start_gateway

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                          "required": ["ok", "n"], "additionalProperties": False}
CTX = 1024


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[tuple[Daemon, str]]:
    d, url = start_gateway(tmp_path_factory.mktemp("peer"), model_path, model={"ctx_per_slot": CTX},
                           workers={"cpu_workers": 1, "slots": 4})
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


def post(gw: tuple[Daemon, str], path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw[1] + path, json=body, timeout=60)


def chat(content: str = "Answer in JSON.", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0, **extra}


def test_json_object_with_a_schema_follows_the_schema(gw: tuple[Daemon, str]) -> None:
    r = post(gw, "/v1/chat/completions", chat(response_format={"type": "json_object", "schema": SCHEMA}))
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("schema", [123, {"type": "hiccup"}, {"type": "object", "properties": {"a": {"minimum": "x"}}}])
def test_an_invalid_schema_is_a_400_naming_it(gw: tuple[Daemon, str], schema: Any) -> None:
    for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", {"prompt": "x", "max_tokens": 4})):
        r = post(gw, path, {**body, "response_format": {"type": "json_object", "schema": schema}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format.schema", r.text
        assert "'response_format.schema'" in r.json()["error"]["message"]


def test_replies_and_chunks_carry_a_system_fingerprint(gw: tuple[Daemon, str]) -> None:
    c = openai.OpenAI(base_url=gw[1] + "/v1", api_key="unused", max_retries=0)
    name = c.models.list().data[0].id
    whole = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    text = c.completions.create(model=name, prompt="hi", max_tokens=3)
    chunks = list(c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True))
    prints = {whole.system_fingerprint, text.system_fingerprint, *(ch.system_fingerprint for ch in chunks)}
    assert len(prints) == 1 and str(prints.pop()).startswith("fp_llamapool_")


def test_the_openai_routes_answer_without_v1(gw: tuple[Daemon, str]) -> None:
    c = openai.OpenAI(base_url=gw[1], api_key="unused", max_retries=0)  # a bare base URL
    name = c.models.list().data[0].id
    assert c.models.retrieve(name).id == name
    greedy = {"max_tokens": 6, "temperature": 0}
    v1 = post(gw, "/v1/completions", {"prompt": "Hello", **greedy}).json()["choices"][0]["text"]
    assert c.completions.create(model=name, prompt="Hello", **greedy).choices[0].text == v1
    msgs: Any = [{"role": "user", "content": "Hello"}]
    v1 = post(gw, "/v1/chat/completions", {"messages": msgs, **greedy}).json()["choices"][0]["message"]["content"]
    assert c.chat.completions.create(model=name, messages=msgs, **greedy).choices[0].message.content == v1


def test_embeddings_without_a_model_in_a_pool_without_an_embedding_model(gw: tuple[Daemon, str]) -> None:
    """Not the first (generation) model: a 400 naming ``model`` that says why."""
    for path in ("/v1/embeddings", "/embeddings"):
        r = post(gw, path, {"input": "hello"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "no embedding model" in r.json()["error"]["message"]


def test_tokenize_takes_vllms_prompt_and_llama_servers_content(gw: tuple[Daemon, str]) -> None:
    text = "Hello world, hello"
    llama = post(gw, "/tokenize", {"content": text, "add_special": True}).json()
    vllm = post(gw, "/tokenize", {"prompt": text}).json()  # vLLM adds special tokens by default
    assert vllm["tokens"] == llama["tokens"] and vllm["count"] == len(llama["tokens"])
    assert vllm["max_model_len"] == CTX and vllm["token_strs"] is None
    plain = post(gw, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == post(gw, "/tokenize", {"content": text}).json()["tokens"]
    assert len(plain["token_strs"]) == len(plain["tokens"])
    assert "".join(plain["token_strs"]).lstrip() == text  # (the tiny model's SentencePiece adds a space first)
    back = post(gw, "/detokenize", {"tokens": plain["tokens"]}).json()
    assert back == {"content": text, "prompt": text}  # llama-server's key and vLLM's
    for body, param in (({"prompt": 5}, "prompt"), ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
                        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens")):
        r = post(gw, "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_info_is_served(gw: tuple[Daemon, str], model_path: str) -> None:
    r = httpx.get(gw[1] + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] and info["model_max_length"] == CTX and info["vocab_size"] == 512
    special = post(gw, "/tokenize", {"content": info["bos_token"] + info["eos_token"]}).json()["tokens"]
    assert special == [1, 2]  # the GGUF's BOS and EOS ids, read back as those tokens
    assert info["add_bos_token"] is True and "<|im_start|>" in info["chat_template"]
    assert httpx.get(gw[1] + "/tokenizer_info", params={"model": "nope"}).status_code == 404
