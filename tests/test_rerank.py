"""Rerank against a real daemon (CPU, real sockets): the random-weight BERT reranker of
``llamapool make-model --reranker`` (and one carrying a rerank template), checked against llama.cpp's
own rank pooling through llama-cpp-python, one pair at a time, on the same GGUF; Jina's /v1/rerank and
Cohere's /v2/rerank shapes, the SDK, batching of concurrent requests, truncation, and bad input."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llamapool import AsyncClient, BadRequestError
from tests.conftest import Daemon, reference_llama
from tests.test_gateway import start_gateway

QUERY = "where does the river go"
DOCS = ["the river ran past old stone houses", "a quiet wind moved over fields of wheat",
        "children counted boats under a pale sky", "the river goes to the sea", "hello world",
        "water is over the river", "people read a book at home", "the city by the sea"]
# a rerank template as a Qwen3-Reranker GGUF carries one (llama-server replaces {query} and {document})
TEMPLATE = "[CLS] query: {query} [SEP] document: {document} [SEP]"
CTX = 64  # the rerankers' ctx_per_slot: a long document is cut to fit


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """The BERT reranker, one with a rerank template, and a causal one of Qwen3-Reranker's layout."""
    from llamapool.modelgen import make_reranker

    folder = tmp_path_factory.mktemp("rerankers")
    return (str(make_reranker(folder / "rr.gguf")), str(make_reranker(folder / "tpl.gguf", seed=1,
                                                                        rerank_template=TEMPLATE)),
            str(make_reranker(folder / "qwen3.gguf", arch="qwen3")))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_path: str,
           rerankers: tuple[str, str, str]) -> Iterator[tuple[Daemon, str]]:
    common = {"devices": "cpu", "cpu_workers": 1, "threads": 1}
    models = [
        {"name": "gen", "path": model_path, **common, "slots": 2, "ctx_per_slot": 512},
        {"name": "rr", "path": rerankers[0], "task": "rerank", **common, "slots": 16, "ctx_per_slot": CTX,
         "max_batch_tokens": 1024},
        {"name": "rr-tpl", "path": rerankers[1], "task": "rerank", **common, "slots": 8, "ctx_per_slot": CTX},
        {"name": "rr-qwen3", "path": rerankers[2], "task": "rerank", **common, "slots": 8, "ctx_per_slot": 512,
         "max_batch_tokens": 2048},
        {"name": "emb", "path": model_path, "task": "embed", **common, "slots": 4, "ctx_per_slot": 128},
    ]
    d, url = start_gateway(tmp_path_factory.mktemp("rerank"), model_path, models=models)
    d.wait_ready(5)
    yield d, url
    d.stop()


class Reference:
    """llama.cpp's rank pooling on one pair at a time (llama-cpp-python, a context of one sequence), the
    pair built as llama-server's ``format_prompt_rerank`` builds it."""

    def __init__(self, path: str, template: str | None = None):
        import llama_cpp as L

        self.L, self.template = L, template
        self.llm = reference_llama(path, embedding=True, pooling_type=L.LLAMA_POOLING_TYPE_RANK, n_ctx=512,
                                   n_batch=512, n_ubatch=512)
        self.vocab = self.llm._model.vocab

    def tokens(self, query: str, doc: str | list[int]) -> list[int]:
        L, v = self.L, self.vocab
        if self.template is not None:
            text = doc if isinstance(doc, str) else self.detokenize(doc)
            prompt = self.template.replace("{query}", query).replace("{document}", text)
            return self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        q = self.llm.tokenize(query.encode(), add_bos=False, special=False)
        d = self.llm.tokenize(doc.encode(), add_bos=False, special=False) if isinstance(doc, str) else doc
        eos = L.llama_vocab_eos(v) if L.llama_vocab_eos(v) != L.LLAMA_TOKEN_NULL else L.llama_vocab_sep(v)
        out = [L.llama_vocab_bos(v)] if L.llama_vocab_get_add_bos(v) else []
        out += q + ([eos] if L.llama_vocab_get_add_eos(v) else []) + ([L.llama_vocab_sep(v)]
                                                                       if L.llama_vocab_get_add_sep(v) else [])
        return out + d + ([eos] if L.llama_vocab_get_add_eos(v) else [])

    def detokenize(self, ids: list[int]) -> str:
        """llama.cpp's text of ``ids`` (``llama_detokenize``, special tokens left out)."""
        import ctypes

        buf = ctypes.create_string_buffer(16 * len(ids) + 16)
        n = self.L.llama_detokenize(self.vocab, (self.L.llama_token * len(ids))(*ids), len(ids), buf, len(buf),
                                    False, False)
        assert n >= 0
        return buf.raw[:n].decode()

    def doc_tokens(self, doc: str) -> list[int]:
        return self.llm.tokenize(doc.encode(), add_bos=False, special=False)

    def score(self, tokens: list[int]) -> float:
        L = self.L
        b = L.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
                b.seq_id[i][0] = 0
            b.n_tokens = len(tokens)
            mem = L.llama_get_memory(self.llm._ctx.ctx)  # a causal reranker's KV: each pair alone
            if mem:
                L.llama_memory_clear(mem, True)
            assert L.llama_decode(self.llm._ctx.ctx, b) == 0
            return float(L.llama_get_embeddings_seq(self.llm._ctx.ctx, 0)[0])
        finally:
            L.llama_batch_free(b)

    def ranked(self, query: str, docs: list[str]) -> list[tuple[int, float]]:
        scores = [self.score(self.tokens(query, d)) for d in docs]
        return sorted(enumerate(scores), key=lambda p: -p[1])

    def close(self) -> None:
        self.llm.close()


@pytest.fixture(scope="module")
def ref(rerankers: tuple[str, str, str]) -> Iterator[Reference]:
    r = Reference(rerankers[0])
    yield r
    r.close()


def assert_ranked(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    """The same documents in the same order, each score equal to llama.cpp's (float32 rounding aside:
    the daemon decodes many pairs in one batch)."""
    assert [i for i, _ in got] == [i for i, _ in want], (got, want)
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-4, rel=1e-4), (got, want)
    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)


def test_generated_reranker_loads_with_rank_pooling(rerankers: tuple[str, str, str], ref: Reference) -> None:
    L = ref.L
    assert L.llama_pooling_type(ref.llm._ctx.ctx) == L.LLAMA_POOLING_TYPE_RANK
    assert L.llama_model_n_cls_out(ref.llm._model.model) == 1
    scores = [s for _, s in ref.ranked(QUERY, DOCS)]
    assert len(set(scores)) == len(DOCS) and max(scores) - min(scores) > 0.05  # the pairs score apart
    for flags, made in ((["--reranker"], rerankers[0]), (["--reranker", "--reranker-arch", "qwen3"], rerankers[2])):
        cli = subprocess.run([sys.executable, "-m", "llamapool.cli", "make-model", *flags,
                              str(Path(made).with_name("cli.gguf"))], capture_output=True, text=True)
        assert cli.returncode == 0, cli.stderr
        assert Path(made).with_name("cli.gguf").read_bytes() == Path(made).read_bytes()
    with pytest.raises(ValueError, match="arch"):
        from llamapool.modelgen import make_reranker

        make_reranker(Path(rerankers[0]).with_name("x.gguf"), arch="t5")


def test_jina_shape_equals_llama_cpp_rank_pooling(daemon: tuple[Daemon, str], ref: Reference) -> None:
    url = daemon[1]
    want = ref.ranked(QUERY, DOCS)
    n_tokens = sum(len(ref.tokens(QUERY, d)) for d in DOCS)
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(url + path, json={"model": "rr", "query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "rr" and body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
        assert_ranked([(x["index"], x["relevance_score"]) for x in body["results"]], want)
        assert [x["document"] for x in body["results"]] == [{"text": DOCS[i]} for i, _ in want]
    r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3,
                                             "return_documents": False}, timeout=60)  # the first reranker
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "rr" and all("document" not in x for x in r.json()["results"])
    assert_ranked([(x["index"], x["relevance_score"]) for x in r.json()["results"]], want[:3])
    r = httpx.post(url + "/v1/rerank", json={"model": "rr", "query": QUERY, "top_n": 50,
                                             "documents": [{"text": d} for d in DOCS[:2]]}, timeout=60)
    assert [x["document"] for x in r.json()["results"]] == [{"text": DOCS[i]} for i, _ in ref.ranked(QUERY, DOCS[:2])]


def test_cohere_shape(daemon: tuple[Daemon, str], ref: Reference) -> None:
    r = httpx.post(daemon[1] + "/v2/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 5},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "results", "meta"} and body["id"]
    assert body["meta"]["api_version"]["version"] == "2" and body["meta"]["billed_units"] == {"search_units": 1}
    assert all(set(x) == {"index", "relevance_score"} for x in body["results"])
    assert_ranked([(x["index"], x["relevance_score"]) for x in body["results"]], ref.ranked(QUERY, DOCS)[:5])


def test_sdk_sync_and_async(daemon: tuple[Daemon, str], ref: Reference) -> None:
    d = daemon[0]
    want = ref.ranked(QUERY, DOCS)
    with d.client() as c:
        got = c.rerank(QUERY, DOCS, model="rr")
        top = c.rerank(QUERY, DOCS, model="rr", top_n=2)
    assert got.model == "rr" and got.prompt_tokens == sum(len(ref.tokens(QUERY, x)) for x in DOCS)
    assert_ranked([(x.index, x.relevance_score) for x in got], want)
    assert [x.document for x in got] == [DOCS[i] for i, _ in want]
    assert_ranked([(x.index, x.relevance_score) for x in top], want[:2])

    async def aio() -> list[tuple[int, float]]:
        async with AsyncClient(d.endpoint) as ac:
            return [(x.index, x.relevance_score) for x in await ac.rerank(QUERY, DOCS, model="rr")]

    assert_ranked(asyncio.run(aio()), want)


def test_concurrent_requests_batched_give_the_same_scores(daemon: tuple[Daemon, str], ref: Reference) -> None:
    """Eight requests at once (64 pairs for 16 slots): the worker scores the pairs of several requests in
    one decode; each request's scores are still llama.cpp's for its pairs alone."""
    url = daemon[1]
    queries = [QUERY, "a boat on the sea", "old houses", "wind over the fields", "the book", "hello",
               "people at home", "the pale sky"]
    out: dict[int, Any] = {}

    def ask(i: int) -> None:
        out[i] = httpx.post(url + "/v1/rerank", json={"model": "rr", "query": queries[i], "documents": DOCS},
                            timeout=120)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, q in enumerate(queries):
        assert out[i].status_code == 200, out[i].text
        assert_ranked([(x["index"], x["relevance_score"]) for x in out[i].json()["results"]], ref.ranked(q, DOCS))


def test_worker_scores_pairs_of_several_requests_in_one_decode(rerankers: tuple[str, str, str],
                                                                 ref: Reference) -> None:
    """The reranker's engine (worker/embedder.py, in this process): the pairs of two requests (two
    queries) waiting together are scored by ONE step's decode, each equal to llama.cpp's score alone."""
    import struct

    from llamapool.protocol.messages import Run, SamplingParams, Step
    from llamapool.worker.embedder import Embedder
    from llamapool.worker.engine import EngineConfig

    eng = Embedder(EngineConfig(rerankers[0], slots=16, ctx_per_slot=CTX, max_batch_tokens=1024, threads=1), "rank")
    try:
        queries = [QUERY, "a boat on the sea"]
        runs = [Run(i * 100 + j, d, SamplingParams(), False, task="rerank", options={"query": q})
                for i, q in enumerate(queries) for j, d in enumerate(DOCS)]
        out = Step()
        for r in runs:
            eng.submit(r, out)
        assert not out.failed and len(eng.waiting) == 2 * len(DOCS)
        step = eng.step()
        assert not eng.waiting and len(step.done) == 2 * len(DOCS)  # one decode for both requests
        got = {d.rid: struct.unpack("<f", d.embedding or b"")[0] for d in step.done}
        for i, q in enumerate(queries):
            for j, d in enumerate(DOCS):
                assert got[i * 100 + j] == pytest.approx(ref.score(ref.tokens(q, d)), abs=1e-4)
        assert all(d.prompt_tokens == len(ref.tokens(queries[d.rid // 100], DOCS[d.rid % 100])) for d in step.done)
        assert "rerank, rank pooling" in eng.desc
    finally:
        eng.close()


def test_long_documents_are_truncated(daemon: tuple[Daemon, str], ref: Reference) -> None:
    """``max_tokens_per_doc`` keeps a document's first tokens; a pair longer than a slot's context has
    its document cut to fit (Cohere's default behaviour); the scores are llama.cpp's on those tokens."""
    url = daemon[1]
    long_doc = " ".join(DOCS * 4)
    d_tokens = ref.doc_tokens(long_doc)
    assert len(ref.tokens(QUERY, long_doc)) > CTX
    short = DOCS[4]  # "hello world": within the limit, kept whole
    assert len(ref.doc_tokens(short)) <= 6
    r = httpx.post(url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": [long_doc, short],
                                             "max_tokens_per_doc": 6}, timeout=60)
    assert r.status_code == 200, r.text
    scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert scores[0] == pytest.approx(ref.score(ref.tokens(QUERY, d_tokens[:6])), abs=1e-4)
    assert scores[1] == pytest.approx(ref.score(ref.tokens(QUERY, short)), abs=1e-4)
    assert r.json()["usage"]["prompt_tokens"] == len(ref.tokens(QUERY, d_tokens[:6])) + len(ref.tokens(QUERY, short))
    fit = CTX - (len(ref.tokens(QUERY, "")))
    r = httpx.post(url + "/v2/rerank", json={"model": "rr", "query": QUERY, "documents": [long_doc]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["relevance_score"] == pytest.approx(
        ref.score(ref.tokens(QUERY, d_tokens[:fit])), abs=1e-4)


def test_rerank_template_of_the_gguf(daemon: tuple[Daemon, str], rerankers: tuple[str, str, str]) -> None:
    """A GGUF with a rerank template (tokenizer.chat_template.rerank): the pair is the template with
    {query} and {document} replaced, special tokens parsed, as llama-server renders it."""
    tpl = Reference(rerankers[1], TEMPLATE)
    try:
        assert tpl.L.llama_model_chat_template(tpl.llm._model.model, b"rerank").decode() == TEMPLATE
        want = tpl.ranked(QUERY, DOCS)
        n_tokens = sum(len(tpl.tokens(QUERY, d)) for d in DOCS)
        assert tpl.tokens(QUERY, DOCS[0])[0] == tpl.L.llama_vocab_bos(tpl.vocab)  # [CLS] read as the token
        long_doc = " ".join(DOCS * 4)  # cut to 5 tokens: the template rendered again with their text
        cut = tpl.score(tpl.tokens(QUERY, tpl.doc_tokens(long_doc)[:5]))
    finally:
        tpl.close()
    r = httpx.post(daemon[1] + "/v1/rerank", json={"model": "rr-tpl", "query": QUERY, "documents": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n_tokens
    assert_ranked([(x["index"], x["relevance_score"]) for x in r.json()["results"]], want)
    r = httpx.post(daemon[1] + "/v1/rerank", json={"model": "rr-tpl", "query": QUERY, "documents": [long_doc],
                                                   "max_tokens_per_doc": 5}, timeout=60)
    assert r.json()["results"][0]["relevance_score"] == pytest.approx(cut, abs=1e-4)


def test_causal_reranker_of_qwen3_layout(daemon: tuple[Daemon, str], rerankers: tuple[str, str, str]) -> None:
    """A causal reranker (Qwen3-Reranker's layout: rank pooling on the last token, softmax over yes/no,
    a ChatML rerank template): its worker keeps a KV cache, cleared each step, and scores several pairs
    per decode; the scores are llama.cpp's P(yes) for each pair alone."""
    from llamapool.modelgen import QWEN3_RERANK_TEMPLATE

    ref = Reference(rerankers[2], QWEN3_RERANK_TEMPLATE)
    try:
        L = ref.L
        assert L.llama_pooling_type(ref.llm._ctx.ctx) == L.LLAMA_POOLING_TYPE_RANK
        assert L.llama_model_n_cls_out(ref.llm._model.model) == 2
        im_start = ref.llm.tokenize(b"<|im_start|>", add_bos=False, special=True)
        assert len(im_start) == 1 and ref.tokens(QUERY, DOCS[0])[0] == im_start[0]  # the template's control token
        want = ref.ranked(QUERY, DOCS)
    finally:
        ref.close()
    assert all(0 < s < 1 for _, s in want) and len({s for _, s in want}) == len(DOCS)
    r = httpx.post(daemon[1] + "/v2/rerank", json={"model": "rr-qwen3", "query": QUERY, "documents": DOCS},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert_ranked([(x["index"], x["relevance_score"]) for x in r.json()["results"]], want)


def test_bad_input_in_each_apis_shape(daemon: tuple[Daemon, str]) -> None:
    d, url = daemon
    good = {"model": "rr", "query": QUERY, "documents": DOCS[:2]}
    cases = [({**good, "documents": []}, "documents"), ({"model": "rr", "query": QUERY}, "documents"),
             ({**good, "documents": ["a", 3]}, "documents[1]"), ({**good, "top_n": 0}, "top_n"),
             ({**good, "top_n": -1}, "top_n"), ({**good, "top_n": "2"}, "top_n"), ({**good, "top_n": True}, "top_n"),
             ({"model": "rr", "documents": DOCS}, "query"), ({**good, "query": ""}, "query"),
             ({**good, "query": 5}, "query"), ({**good, "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
             ({**good, "return_documents": "yes"}, "return_documents"), ({**good, "model": "gen"}, "model"),
             ({**good, "model": "emb"}, "model"), ({**good, "model": 7}, "model"),
             ({**good, "query": "river " * 200}, "query"), ({"model": "rr", "query": QUERY, "texts": DOCS}, "texts")]
    for body, param in cases:
        r = httpx.post(url + "/v1/rerank", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
        c = httpx.post(url + "/v2/rerank", json=body, timeout=60)
        assert c.status_code == 400 and set(c.json()) == {"id", "message"}, (body, c.text)
        assert c.json()["message"].startswith("invalid request: ") and param.split("[")[0] in c.json()["message"]
    r = httpx.post(url + "/v1/rerank", json={**good, "model": "gen"}, timeout=60)
    assert "'gen' is a generation model: it does not rerank documents" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/rerank", json={**good, "model": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.post(url + "/v2/rerank", content=b"[1]", timeout=60).status_code == 400
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="'rr' is a reranker") as e:
        client.completions.create(model="rr", prompt="hello", max_tokens=4)
    assert e.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="'rr' is a reranker"):
        client.embeddings.create(model="rr", input="hello")
    with d.client() as c:
        with pytest.raises(BadRequestError, match="top_n") as b:
            c.rerank(QUERY, DOCS, model="rr", top_n=0)
        assert b.value.field == "top_n"
        for args, kw, field in (((QUERY, []), {}, "documents"), (("", DOCS), {}, "query"),
                                ((QUERY, ["a", None]), {}, "documents[1]"),
                                ((QUERY, DOCS), {"max_tokens_per_doc": -1}, "max_tokens_per_doc")):
            with pytest.raises(BadRequestError) as b:
                c.rerank(*args, model="rr", **kw)  # type: ignore[arg-type]
            assert b.value.field == field, (args, kw, b.value)
        with pytest.raises(BadRequestError, match="'gen' is a generation model") as b:
            c.rerank(QUERY, DOCS, model="gen")
        assert b.value.field == "model"
        with pytest.raises(BadRequestError, match="'rr' is a reranker"):
            c.generate("hello", model="rr", max_tokens=4)
        assert len(c.rerank(QUERY, DOCS, model="rr")) == len(DOCS)  # the daemon serves on
        assert c.generate("hello", model="gen", max_tokens=4, temperature=0).usage.completion_tokens == 4
    assert d.proc.poll() is None


def test_pool_without_a_reranker_names_model(daemon: tuple[Daemon, str]) -> None:
    """An embedding request without a model still goes to the embedding model, not to a reranker."""
    r = httpx.post(daemon[1] + "/v1/embeddings", json={"input": "a quiet wind"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "emb", r.text


def test_config_task(tmp_path: Path) -> None:
    from llamapool.config import ConfigError, from_dict

    cfg = from_dict({"models": [{"path": "m.gguf", "name": "a"}, {"path": "m.gguf", "name": "b", "embedding": True},
                                {"path": "m.gguf", "name": "c", "task": "rerank"},
                                {"path": "m.gguf", "name": "d", "task": "embed"}]})
    assert [(m.task, m.embedding) for m in cfg.models] == [("generate", False), ("embed", True), ("rerank", False),
                                                            ("embed", True)]
    for model, match in (({"task": "score"}, r"models\[0\]\.task"),
                         ({"task": "rerank", "pooling": "cls"}, r"models\[0\]\.pooling"),
                         ({"task": "rerank", "embedding": True}, r"models\[0\]\.embedding"),
                         ({"task": "rerank", "engine": "echo"}, r"models\[0\]\.task")):
        with pytest.raises(ConfigError, match=match):
            from_dict({"models": [{"path": "m.gguf", **model}]})
