"""llamapool's samplers in the decode graph (worker/graph_samplers.py): a greedy row leaves only its token,
a greedy request's logprobs are the host path's numbers, while only the row's likeliest tokens leave the
backend, and a constrained greedy row keeps its logits (a refused pick is replaced from them).

The graph path runs where llama.cpp's backend sampling runs (GPU workers); ``backend_sampling=True``
exercises the same code on the CPU backend, against the host path of a CPU engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamapool import default_model
from llamapool.protocol.messages import Run, SamplingParams, Step, TokenLogprob
from llamapool.worker.engine import Engine, EngineConfig

GREEDY_LP = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "def add(a, b):",
           "The three primary colours are", "1, 2, 3,"]


def run_all(engine: Engine, runs: list[Run]) -> dict[int, tuple[str, list[TokenLogprob]]]:
    """Each run's text and logprob records (the streamed and final ones), stepped to the end."""
    for r in runs:
        engine.submit(r, Step())
    out: dict[int, tuple[str, list[TokenLogprob]]] = {}
    while engine.busy:
        step = engine.step()
        assert not step.failed, step.failed
        for done in step.done:
            out[done.rid] = (done.text, list(done.logprobs or []))
    return out


@pytest.fixture(scope="module")
def gemma() -> str:
    return str(default_model.fetch(Path(__file__).resolve().parent.parent / "models"))


def engines(path: str, slots: int) -> Iterator[tuple[Engine, Engine]]:
    kw = {"slots": slots, "ctx_per_slot": 256, "max_batch_tokens": 256, "n_ubatch": 256, "threads": 2}
    host, graph = Engine(EngineConfig(path, **kw)), Engine(EngineConfig(path, **kw, backend_sampling=True))
    try:
        yield host, graph
    finally:
        host.close()
        graph.close()


def assert_same(host: list[TokenLogprob], graph: list[TokenLogprob], top: int, greedy: bool = True) -> None:
    assert len(host) == len(graph)
    for h, g in zip(host, graph, strict=True):
        assert g.token == h.token and g.bytes == h.bytes
        if h.logprob is None:  # echo: the prompt's first token has none
            assert g.logprob is None and g.top == h.top == []
            continue
        assert g.logprob is not None and abs(g.logprob - h.logprob) < 1e-3
        assert len(g.top) == len(h.top) == top
        assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(g.top, h.top, strict=True))
        # the same alternatives, but for the order of two within float rounding of each other
        assert all(a.token == b.token or abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g.top, h.top, strict=True))
        if top and greedy:
            assert g.top[0].token == g.token  # the likeliest


def test_graph_logprobs_equal_the_host_paths_on_gemma(gemma: str) -> None:
    """Gemma 3 270M (a vocabulary of 262,144): the same greedy text, and every token's logprob and its
    ``top`` likeliest alternatives within 1e-3 of the host's log-softmax, a batch of six at once."""
    for host, graph in engines(gemma, slots=6):
        for top in (0, 1, 5, 20):
            p = dataclasses.replace(GREEDY_LP, top_logprobs=top)
            runs = [Run(10 * top + i, prompt, p, False) for i, prompt in enumerate(PROMPTS)]
            want, got = run_all(host, runs), run_all(graph, runs)
            for r in runs:
                assert got[r.rid][0] == want[r.rid][0], (r.prompt, got[r.rid][0], want[r.rid][0])
                assert len(got[r.rid][1]) == 12
                assert_same(want[r.rid][1], got[r.rid][1], top)


def test_graph_logprob_rows_beside_others_and_slots_changing_hands(model_path: str) -> None:
    """Graph logprob rows share steps with plain greedy rows, host-sampled rows (a penalty, a sampled
    request with logprobs) and echo: each gets what it gets alone; a slot passes between them."""
    for host, graph in engines(model_path, slots=4):
        kinds = [GREEDY_LP, dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0),
                 dataclasses.replace(GREEDY_LP, frequency_penalty=0.5),
                 dataclasses.replace(GREEDY_LP, temperature=0.8, seed=3, top_logprobs=2),
                 dataclasses.replace(GREEDY_LP, echo=True, top_logprobs=1)]
        for wave in range(3):
            runs = [Run(10 * wave + i, PROMPTS[i], kinds[(i + wave) % len(kinds)], False) for i in range(4)]
            want, got = run_all(host, runs), run_all(graph, runs)
            for r in runs:
                assert got[r.rid][0] == want[r.rid][0]
                assert_same(want[r.rid][1], got[r.rid][1], r.params.top_logprobs if r.params.logprobs else 0,
                            r.params.greedy and not r.params.adjusts_logits and not r.params.echo)
            assert len(graph.free_ids) == 4


def test_only_a_greedy_unconstrained_request_without_echo_takes_the_graph_path(model_path: str) -> None:
    for _host, graph in engines(model_path, slots=2):
        s = graph.sampling
        assert s.in_graph(GREEDY_LP)
        for other in ({"temperature": 0.7}, {"echo": True}, {"json_schema": {"type": "object"}},
                      {"logit_bias": {3: 1.0}}, {"repeat_penalty": 1.2}):
            assert not s.in_graph(dataclasses.replace(GREEDY_LP, **other)), other


def test_a_plain_greedy_row_leaves_only_its_token_and_a_constrained_one_its_logits(model_path: str) -> None:
    """The slot's greedy chain copies no logits to the host; a constrained greedy request gets the slot's
    other greedy chain (llama.cpp's, which keeps them), the slot's plain chain comes back after it, and
    each gives the host path's text."""
    import llama_cpp as L

    for host, graph in engines(model_path, slots=1):
        plain = dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0, max_tokens=6)
        constrained = dataclasses.replace(plain, json_schema={"type": "object"}, ignore_eos=False)
        s = graph.sampling
        for rid, p in enumerate([plain, constrained, constrained, plain, constrained]):
            run = Run(rid, "x" * (rid + 1), p, False)
            assert run_all(graph, [run])[rid][0] == run_all(host, [run])[rid][0]
            assert s._on[0] is (s._keeping if p.constrained else s._greedy)[0]
            kept = L.llama_get_sampled_logits_count_ith(graph.ctx, -1)  # the last step's row
            assert kept == (graph.n_vocab if p.constrained else 0), (rid, kept)
