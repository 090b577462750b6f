"""Fill-in-the-middle against a real daemon (CPU, real sockets): ``POST /infill`` and ``suffix`` on
``/v1/completions`` with the random model ``make_model(fim=True)`` writes, whose GGUF declares its FIM tokens.

The expected prompts are built here, independently: the FIM token ids read from the GGUF's metadata
(``tokenizer.ggml.fim_*_token_id``), the texts tokenized by llama-cpp-python, laid out as llama-server's
``format_prompt_infill`` does; the daemon must put exactly those tokens in front of the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon
from tests.test_gateway import start_gateway

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"
FILES = [{"filename": "util/math.py", "text": "def sub(a, b):\n    return a - b\n"},
         {"filename": "README.md", "text": "the math helpers"}]
CTX = 4096


@pytest.fixture(scope="module")
def fim_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from llamapool.modelgen import make_model

    return str(make_model(tmp_path_factory.mktemp("fim") / "fim.gguf", fim=True))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, fim_path: str, model_path: str,
           smollm2: str) -> Iterator[tuple[Daemon, str]]:
    common = {"devices": "cpu", "cpu_workers": 1, "threads": 1, "slots": 4, "ctx_per_slot": CTX,
              "max_batch_tokens": 2048, "n_ubatch": 512}
    models = [{"name": "code", "path": fim_path, **common}, {"name": "plain", "path": model_path, **common},
              {"name": "smol", "path": smollm2, **common, "slots": 1, "ctx_per_slot": 512}]  # a real chat model
    d, url = start_gateway(tmp_path_factory.mktemp("infill"), fim_path, models=models)
    d.wait_ready(3)
    yield d, url
    d.stop()


class Vocab:
    """The model's FIM tokens as its GGUF declares them, and llama-cpp-python's tokenizer."""

    def __init__(self, path: str):
        import gguf
        from llama_cpp import Llama

        reader = gguf.GGUFReader(path)
        self.fim = {role: int(reader.fields[f"tokenizer.ggml.fim_{role}_token_id"].contents())
                    for role in ("pre", "suf", "mid", "pad", "rep", "sep")}
        self.bos = int(reader.fields["tokenizer.ggml.bos_token_id"].contents())
        self.llm = Llama(model_path=path, vocab_only=True, verbose=False)

    def tok(self, text: str, special: bool = False) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=False, special=special))

    def text(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids, special=True).decode()

    def layout(self, prefix: str, suffix: str, files: list[dict[str, str]] | None = None, prompt: str = "",
               n_predict: int = -1) -> list[int]:
        """llama-server's format_prompt_infill, written out (n_batch 2048, the slot's context CTX)."""
        f = self.fim
        extra: list[int] = []
        if files is not None:
            extra = [f["rep"], *self.tok("myproject\n")]
            for file in files:
                extra += [f["sep"], *self.tok(file["filename"] + "\n"), *self.tok(file["text"])]
            extra += [f["sep"], *self.tok("filename\n")]
        p, s, pr = self.tok(prefix), self.tok(suffix), self.tok(prompt, special=True)
        p = p[max(0, len(p) - 1536):]
        s = s[:max(0, 512 - (2 + len(pr)))]
        n_extra = min(max(0, CTX - 2048 - 2 * n_predict), len(extra))
        n_extra = min(n_extra, CTX - 1 - (len(p) + len(pr) + len(s) + 4))  # within the slot (n_predict -1)
        return [*extra[len(extra) - n_extra:], self.bos, f["pre"], *p, *pr, f["suf"], *s, f["mid"]]


@pytest.fixture(scope="module")
def vocab(fim_path: str) -> Vocab:
    return Vocab(fim_path)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def events(r: httpx.Response) -> list[Any]:
    lines = [ln for ln in r.text.split("\n\n") if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines), r.text
    return [ln[6:] if ln[6:] == "[DONE]" else json.loads(ln[6:]) for ln in lines]


def test_make_model_fim_declares_its_tokens_as_llama_cpp_reads_them(fim_path: str, vocab: Vocab) -> None:
    import llama_cpp as L

    v = vocab.llm._model.vocab
    assert [vocab.llm.detokenize([vocab.fim[r]], special=True) for r in ("pre", "suf", "mid", "pad", "rep", "sep")] \
        == [b"<|fim_prefix|>", b"<|fim_suffix|>", b"<|fim_middle|>", b"<|fim_pad|>", b"<|repo_name|>", b"<|file_sep|>"]
    assert [L.llama_vocab_fim_pre(v), L.llama_vocab_fim_suf(v), L.llama_vocab_fim_mid(v), L.llama_vocab_fim_pad(v),
            L.llama_vocab_fim_rep(v), L.llama_vocab_fim_sep(v)] == [vocab.fim[r] for r in
                                                                    ("pre", "suf", "mid", "pad", "rep", "sep")]
    assert vocab.tok("<|fim_prefix|>x", special=True)[0] == vocab.fim["pre"]  # control tokens, parsed as such
    assert L.llama_vocab_is_eog(v, vocab.fim["sep"]) and not L.llama_vocab_is_eog(v, vocab.fim["mid"])


def test_suffix_puts_the_fim_tokens_where_the_gguf_says(daemon: tuple[Daemon, str], vocab: Vocab) -> None:
    url = daemon[1]
    want = vocab.layout(PREFIX, SUFFIX)
    (rendered,) = post(url, "/v1/completions/render", {"model": "code", "prompt": PREFIX, "suffix": SUFFIX}).json()
    assert rendered["token_ids"] == want
    body = {"model": "code", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(want)
    # the same tokens sent as token ids give the same greedy text
    same = post(url, "/v1/completions", {**body, "prompt": want, "suffix": None}).json()
    assert same["choices"][0]["text"] == out["choices"][0]["text"]
    # streamed: the same text
    got = events(post(url, "/v1/completions", {**body, "stream": True}))
    assert got[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in got[:-1]) == out["choices"][0]["text"]
    # token ids as the prefix (a mixed prompt) and several prompts
    mixed = {"model": "code", "prompt": vocab.tok(PREFIX), "suffix": SUFFIX}
    (ids,) = post(url, "/v1/completions/render", mixed).json()
    assert ids["token_ids"] == want
    two = post(url, "/v1/completions/render", {"model": "code", "prompt": [PREFIX, "x = "], "suffix": SUFFIX}).json()
    assert [t["token_ids"] for t in two] == [want, vocab.layout("x = ", SUFFIX)]


def test_long_prefix_and_suffix_are_cut_as_llama_server_cuts_them(daemon: tuple[Daemon, str], vocab: Vocab) -> None:
    prefix = " ".join(f"v{i} = {i}" for i in range(900))  # thousands of tokens
    suffix = " ".join(f"w{i}" for i in range(600))
    want = vocab.layout(prefix, suffix)
    assert len(vocab.tok(prefix)) > 1536 and len(vocab.tok(suffix)) > 510 and len(want) == 1 + 1536 + 2 + 510 + 1
    body = {"model": "code", "prompt": prefix, "suffix": suffix}
    (rendered,) = post(daemon[1], "/v1/completions/render", body).json()
    assert rendered["token_ids"] == want


def test_infill_with_repo_level_context(daemon: tuple[Daemon, str], vocab: Vocab) -> None:
    url = daemon[1]
    body = {"model": "code", "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": FILES,
            "prompt": "c = ", "n_predict": 6, "temperature": 0}
    want = vocab.layout(PREFIX, SUFFIX, FILES, "c = ", n_predict=6)
    assert want[0] == vocab.fim["rep"] and want.count(vocab.fim["sep"]) == 3
    r = post(url, "/infill", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["model"] == "code" and out["stop_type"] in ("eos", "limit")
    assert out["tokens_evaluated"] == len(want) and 0 < out["tokens_predicted"] <= 6
    assert out["prompt"] == vocab.text(want)  # the prompt's text, special tokens written out
    # (each piece tokenized alone, so SentencePiece puts its space before each, as llama.cpp does)
    assert out["prompt"].startswith("<|repo_name|> myproject\n<|file_sep|> util/math.py\n def sub(a, b):")
    same = post(url, "/v1/completions", {"model": "code", "prompt": want, "max_tokens": 6, "temperature": 0}).json()
    assert same["choices"][0]["text"] == out["content"]
    # a file without a filename is "tmp"; mixed token ids in the prefix
    # a prompt of many control-token texts (read as those tokens, 64 at a time: worker/content_text.py)
    many = "<|im_start|>x" * 100
    r = post(url, "/infill", {**body, "prompt": many, "n_predict": 1}).json()
    assert r["prompt"] == vocab.text(vocab.layout(PREFIX, SUFFIX, FILES, many, n_predict=1))
    assert r["prompt"].count("<|im_start|>") == 100 and r["tokens_evaluated"] == len(vocab.layout(
        PREFIX, SUFFIX, FILES, many, n_predict=1))
    # without input_extra: llama-server's repo-level header all the same
    bare = post(url, "/infill", {**body, "input_extra": None, "n_predict": 1}).json()
    assert bare["prompt"] == vocab.text(vocab.layout(PREFIX, SUFFIX, [], "c = ", n_predict=1))
    assert bare["prompt"].startswith("<|repo_name|> myproject\n<|file_sep|> filename\n<s><|fim_prefix|>")
    tmp = post(url, "/infill", {**body, "input_extra": [{"text": "x"}], "input_prefix": [vocab.tok(PREFIX)[0], "b"],
                                "n_predict": 1}).json()
    assert "<|file_sep|> tmp\n x<|file_sep|> filename\n" in tmp["prompt"]


def test_infill_keeps_the_end_of_long_files_within_the_context(daemon: tuple[Daemon, str], vocab: Vocab) -> None:
    prefix = " ".join(f"v{i} = {i}" for i in range(900))
    suffix = " ".join(f"w{i}" for i in range(600))
    files = [{"filename": f"m{i}.py", "text": " ".join(f"k{i}_{j} = {j}" for j in range(300))} for i in range(4)]
    want = vocab.layout(prefix, suffix, files)  # n_predict -1: as many extra tokens as still fit the slot
    assert len(want) == CTX - 1 and want[0] != vocab.fim["rep"]  # the oldest files' start cut
    r = post(daemon[1], "/infill", {"model": "code", "input_prefix": prefix, "input_suffix": suffix,
                                    "input_extra": files, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_evaluated"] == CTX - 1 and out["prompt"] == vocab.text(want)
    assert "<|fim_suffix|> w0 w1 " in out["prompt"] and out["prompt"].endswith("<|fim_middle|>")


def test_infill_streams_llama_server_events(daemon: tuple[Daemon, str]) -> None:
    body = {"model": "code", "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0}
    whole = post(daemon[1], "/infill", body).json()
    got = events(post(daemon[1], "/infill", {**body, "stream": True}))
    assert "[DONE]" not in got and got[-1]["stop"] is True and all(e["stop"] is False for e in got[:-1])
    assert "".join(e["content"] for e in got[:-1]) == whole["content"] == got[-1]["content"]
    assert got[-1]["tokens_predicted"] == whole["tokens_predicted"]
    assert all(e["tokens_evaluated"] == whole["tokens_evaluated"] for e in got)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/infill", {"model": "plain", "input_prefix": "a", "input_suffix": "b"}, "model"),
    ("/v1/completions", {"model": "plain", "prompt": "a", "suffix": "b"}, "suffix"),
    ("/v1/completions", {"model": "code", "prompt": "a", "suffix": 3}, "suffix"),
    ("/v1/completions", {"model": "code", "prompt": "a", "suffix": "b", "echo": True}, "echo"),
    ("/v1/completions", {"model": "code", "prompt": [1, 99999], "suffix": "b"}, "prompt"),
    ("/v1/chat/completions", {"model": "code", "messages": [{"role": "user", "content": "a"}], "suffix": "b"},
     "suffix"),
    ("/infill", {"model": "code", "input_suffix": "b"}, "input_prefix"),
    ("/infill", {"model": "code", "input_prefix": "a"}, "input_suffix"),
    ("/infill", {"model": "code", "input_prefix": {"x": 1}, "input_suffix": "b"}, "input_prefix"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": [99999]}, "input_suffix"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "input_extra": "x"}, "input_extra"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "input_extra": ["x"]}, "input_extra[0]"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]},
     "input_extra[0].text"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b",
                 "input_extra": [{"text": "t", "filename": 1}]}, "input_extra[0].filename"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b",
                 "input_extra": [{"text": "t", "path": "p"}]}, "input_extra[0].path"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "prompt": 5}, "prompt"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "n_predict": "x"}, "n_predict"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "temperature": -1}, "temperature"),
    ("/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "n": 2}, "n"),
])
def test_bad_infill_is_a_400_naming_the_parameter(daemon: tuple[Daemon, str], path: str, body: dict[str, Any],
                                                  param: str) -> None:
    r = post(daemon[1], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param in ("model", "suffix") and "plain" in json.dumps(body):
        assert "FIM" in err["message"] and "'plain'" in err["message"]
    # the daemon serves on
    ok = post(daemon[1], "/infill", {"model": "code", "input_prefix": "a", "input_suffix": "b", "n_predict": 1})
    assert ok.status_code == 200, ok.text


def test_a_real_chat_model_without_fim_tokens_is_refused(daemon: tuple[Daemon, str]) -> None:
    """SmolLM2's vocab has StarCoder's <reponame> (llama.cpp finds it as FIM_REP) but no prefix, suffix or middle."""
    r = post(daemon[1], "/infill", {"model": "smol", "input_prefix": "def f():", "input_suffix": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "no FIM prefix, suffix, middle token" in r.json()["error"]["message"]
    r = post(daemon[1], "/v1/completions", {"model": "smol", "prompt": "def f():", "suffix": "\n"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    ok = post(daemon[1], "/v1/completions", {"model": "smol", "prompt": "def f():", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_infill_unknown_model_is_a_404(daemon: tuple[Daemon, str]) -> None:
    r = post(daemon[1], "/infill", {"model": "nope", "input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_make_model_cli_fim(tmp_path: Path) -> None:
    from llamapool.cli import main

    assert main(["make-model", str(tmp_path / "m.gguf"), "--fim"]) == 0
    assert Vocab(str(tmp_path / "m.gguf")).fim["pre"] > 0
