"""The random-weight GGUF generator: file layout, vocab, and that real llama.cpp loads and runs it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamapool.modelgen import QTYPES, build_vocab, make_model, peaked_next
from tests.conftest import reference_llama

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = [
    "Hello world",
    "Hello world, the llama said: 42 + x_y = {z}! ~`|\\",
    "Hello world, ünïcødé 你好",  # pieces, multi-byte pieces and byte fallback
    "emoji 🦙 and\ttabs\nnewlines  double  spaces",
]


@pytest.fixture(scope="module", params=QTYPES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = make_model(tmp_path_factory.mktemp("modelgen") / f"tiny-{request.param}.gguf", qtype=request.param)
    llm = reference_llama(str(path), n_ctx=512, n_threads=2, logits_all=True)
    yield path, llm
    llm.close()


def test_file_layout(tmp_path: Path) -> None:
    path = make_model(tmp_path / "sub" / "m.gguf", n_layer=3, n_vocab=1000, n_ctx_train=2048, qtype="q8_0")
    assert path == tmp_path / "sub" / "m.gguf" and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["m.gguf"]  # no temp file left behind
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    assert len(t) == 2 + 1 + 3 * 9
    assert list(t["token_embd.weight"].shape) == [64, 1000]  # gguf order: (in, out)
    assert list(t["blk.2.attn_k.weight"].shape) == [64, 32]  # n_head_kv * head_dim = 2 * 16
    assert list(t["blk.0.ffn_down.weight"].shape) == [128, 64]
    assert t["blk.1.ffn_gate.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert t["blk.1.ffn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.all(t["output_norm.weight"].data == 1.0)
    f = r.fields
    assert f["llama.context_length"].contents() == 2048
    assert f["llama.rope.dimension_count"].contents() == 16
    assert f["tokenizer.ggml.model"].contents() == "llama"
    assert len(f["tokenizer.ggml.tokens"].contents()) == 1000
    assert f["tokenizer.ggml.add_bos_token"].contents() is True


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a, b, c = (make_model(tmp_path / f"{n}.gguf", seed=s) for n, s in (("a", 7), ("b", 7), ("c", 8)))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("n_vocab", [300, 512, 4096, 32000])
def test_vocab(n_vocab: int) -> None:
    tokens, scores, types = build_vocab(n_vocab)
    assert len(tokens) == len(set(tokens)) == len(scores) == len(types) == n_vocab
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert tokens[259] == "\u2581"
    assert all(x > y for x, y in itertools.pairwise(scores[259:]))


def test_loads(model: Any) -> None:
    _, llm = model
    assert llm.n_vocab() == 512
    assert llm.n_embd() == 64
    assert llm.metadata["llama.context_length"] == "32768"
    assert llm.metadata["general.architecture"] == "llama"
    assert llm.token_bos() == 1 and llm.token_eos() == 2


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_roundtrip(model: Any, text: str) -> None:
    _, llm = model
    ids = llm.tokenize(text.encode())
    assert ids[0] == llm.token_bos() and all(0 <= i < 512 for i in ids)
    assert llm.detokenize(ids).decode() == text


def test_common_words_are_single_tokens(tmp_path: Path) -> None:
    path = make_model(tmp_path / "v.gguf", n_vocab=4096)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ids = llm.tokenize(b"Hello world, the people", add_bos=False)
    assert [llm.detokenize([i]) for i in ids] == [b" Hello", b" world", b",", b" the", b" people"]


def test_logits_and_greedy_generation(model: Any) -> None:
    _, llm = model
    prompt = llm.tokenize(b"Hello world")
    runs = []
    for _ in range(2):
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(prompt, temp=0.0):
            out.append(tok)
            if len(out) == 6:
                break
        runs.append(out)
        logits = llm.scores[len(prompt) - 1]
        assert np.isfinite(logits).all() and logits.std() > 0.5  # neither NaN nor flat
    assert runs[0] == runs[1] and all(0 <= t < 512 for t in runs[0])


@pytest.mark.parametrize("kw", [
    {"n_vocab": 299},
    {"qtype": "q4_0"},
    {"n_head": 5},  # 64 % 5
    {"n_head_kv": 3},  # 4 % 3
    {"n_embd": 96, "n_head": 32},  # odd head dim 3
    {"qtype": "q8_0", "n_ff": 100},
    {"qtype": "q8_0", "n_embd": 48, "n_head": 4},
    {"n_layer": 0},
    {"n_embd": -64},
])
def test_bad_args(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make_model(tmp_path / "m.gguf", **kw)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("qtype", QTYPES)
def test_peaked_model_has_the_same_tensors(tmp_path: Path, qtype: str) -> None:
    """Names, shapes, types and sizes as the plain model's (the same decode cost); deterministic; the CLI's
    ``--peaked`` writes the same bytes."""
    from llamapool.cli import main

    plain = make_model(tmp_path / "plain.gguf", n_layer=3, n_vocab=1000, qtype=qtype)
    peaked = make_model(tmp_path / "peaked.gguf", n_layer=3, n_vocab=1000, qtype=qtype, peaked=True)

    def tensors(p: Path) -> list[tuple[str, list[int], int, int]]:
        return [(t.name, list(t.shape), int(t.tensor_type), int(t.n_bytes)) for t in gguf.GGUFReader(p).tensors]

    assert tensors(peaked) == tensors(plain) and peaked.stat().st_size == plain.stat().st_size
    assert main(["make-model", str(tmp_path / "cli.gguf"), "--n-layer", "3", "--n-vocab", "1000", "--type", qtype,
                 "--peaked"]) == 0
    assert (tmp_path / "cli.gguf").read_bytes() == peaked.read_bytes() != plain.read_bytes()


def test_peaked_next_is_one_cycle_through_the_normal_tokens() -> None:
    types = build_vocab(4096)[2]
    normal = np.flatnonzero(np.array(types) == int(gguf.TokenType.NORMAL))
    nxt = peaked_next(4096)
    assert np.isin(nxt, normal).all()  # never a control or byte token
    t, seen = int(normal[0]), set()
    while t not in seen:
        seen.add(t)
        t = int(nxt[t])
    assert len(seen) == len(normal) and t == normal[0]
    assert (peaked_next(4096, seed=1) != nxt).any()


@pytest.mark.parametrize("qtype", QTYPES)
def test_peaked_greedy_output_wins_by_a_wide_margin(tmp_path: Path, qtype: str) -> None:
    """Every position of a random prompt (control and byte tokens too) and of 64 greedy tokens: the top
    logit is :func:`peaked_next` of the token, ahead of the second by > 10 logits (about 16 at least
    on the tiny shape), and the output runs through 64 different tokens."""
    path = make_model(tmp_path / "p.gguf", qtype=qtype, peaked=True)
    llm = reference_llama(str(path), n_ctx=256, n_threads=2, logits_all=True)
    nxt = peaked_next(512)
    prompt = [1, 2, 0, 3, 200, 510, 511] + [int(t) for t in np.random.default_rng(0).integers(3, 512, 40)]
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(64):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    llm.close()
    toks = prompt + out
    scores = np.sort(llm.scores[: len(toks)], axis=1)
    assert (np.argmax(llm.scores[: len(toks)], axis=1) == nxt[toks]).all()
    assert (scores[:, -1] - scores[:, -2]).min() > 10
    assert len(set(out)) == 64
