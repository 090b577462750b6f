"""llamapool's samplers in the decode graph (worker/graph_samplers.py): a greedy row leaves only its token,
a greedy request's logprobs are the host path's numbers, while only the row's likeliest tokens leave the
backend, and a constrained greedy row is sampled under its grammar's mask in the graph (only its token
leaves it), or with ``graph_masks`` off keeps its logits (a refused pick is replaced from them).

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


def engines(path: str, slots: int, masks: str = "always", **over: int | bool) -> Iterator[tuple[Engine, Engine]]:
    """A host-sampling engine and a graph-sampling one; ``masks``: how the graph samples a constrained
    greedy row (``Sampling.graph_masks``)."""
    kw = {"slots": slots, "ctx_per_slot": 256, "max_batch_tokens": 256, "n_ubatch": 256, "threads": 2, **over}
    host, graph = Engine(EngineConfig(path, **kw)), Engine(EngineConfig(path, **kw, backend_sampling=True))
    graph.sampling.graph_masks = masks
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


def test_a_plain_greedy_row_and_a_masked_one_leave_only_their_tokens(model_path: str) -> None:
    """The slot's greedy chain copies no logits to the host, nor does a constrained greedy request's
    masked chain (with ``graph_masks`` "keeping": llama.cpp's greedy chain, which keeps them); the slot's
    plain chain comes back after it, and each gives the host path's text."""
    import llama_cpp as L

    for host, graph in engines(model_path, slots=1):
        plain = dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0, max_tokens=6)
        constrained = dataclasses.replace(plain, json_schema={"type": "object"}, ignore_eos=False)
        s = graph.sampling
        for rid, (p, masks) in enumerate([(plain, "always"), (constrained, "always"), (constrained, "keeping"),
                                          (constrained, "on_refusal"), (plain, "on_refusal"),
                                          (constrained, "keeping"), (constrained, "always")]):
            s.graph_masks = masks
            run = Run(rid, "x" * (rid + 1), p, False)
            assert run_all(graph, [run])[rid][0] == run_all(host, [run])[rid][0]
            chains = s._greedy if not p.constrained else s._masked if masks != "keeping" else s._keeping
            assert s._on[0] is chains[0]
            kept = L.llama_get_sampled_logits_count_ith(graph.ctx, -1)  # the last step's row
            assert kept == (graph.n_vocab if p.constrained and masks == "keeping" else 0), (rid, kept)


SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10},
                                           "b": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["a", "b", "c"], "additionalProperties": False}
CONSTRAINED = [dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0, max_tokens=48, ignore_eos=False,
                                   **kw) for kw in ({"json_schema": SCHEMA}, {"regex": r"[a-z]{2,8}( [0-9]{1,3}){2,5}"},
                                                    {"grammar": 'root ::= "(" [a-z]+ ", " ("yes" | "no") ")"'})]


def masked_and_host_agree(host: Engine, graph: Engine, runs: list[Run]) -> dict[int, str]:
    """``runs`` on both engines: the same texts, every constrained token of the graph engine picked in
    the graph under its mask (the host's replacement of a refused pick never runs; llama.cpp set the
    masked rows' inputs at least once a token)."""
    s = graph.sampling

    def no_host_pick(*a: object) -> int:
        raise AssertionError("a constrained row of the graph engine was picked on the host")

    s._pick_constrained = no_host_pick  # type: ignore[method-assign]
    assert s._graph is not None
    before = s._graph.masked_inputs
    want, got = run_all(host, runs), run_all(graph, runs)
    for r in runs:
        assert got[r.rid][0] == want[r.rid][0], (r.params, got[r.rid][0], want[r.rid][0])
    tokens = sum(len(host.tokenize(want[r.rid][0])) for r in runs if r.params.constrained)
    assert s._graph.masked_inputs - before >= tokens // 2 > 0
    return {r.rid: want[r.rid][0] for r in runs}


@pytest.mark.parametrize("masks", ["always", "on_refusal"])
@pytest.mark.parametrize("n_vocab", [512, 1001])
def test_constrained_greedy_rows_masked_in_the_graph_give_the_host_paths_text(
        tmp_path_factory: pytest.TempPathFactory, n_vocab: int, masks: str) -> None:
    """A random model (its argmaxes refused all the time: the mask decides), a vocabulary a multiple of
    32 and one that is not (the mask's last word padded): JSON schema, regex and grammar requests beside
    plain ones in one batch, waves of them in slots changing hands, token for token the host's text.
    With masks applied "on_refusal", every refused pick is decoded again under its mask."""
    import json
    import re

    from llamapool.modelgen import make_model

    path = str(make_model(tmp_path_factory.mktemp("vocab") / f"v{n_vocab}.gguf", n_vocab=n_vocab))
    plain = dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0, max_tokens=20)
    for host, graph in engines(path, slots=5, masks=masks):
        for wave in range(3):
            kinds = [*CONSTRAINED, plain, CONSTRAINED[wave]]
            runs = [Run(10 * wave + i, PROMPTS[(i + wave) % len(PROMPTS)], kinds[(i + wave) % 5], False)
                    for i in range(5)]
            texts = masked_and_host_agree(host, graph, runs)
            for r in runs:
                if r.params.json_schema is not None and texts[r.rid].endswith("}"):
                    assert set(json.loads(texts[r.rid])) == {"a", "b", "c"}
                if r.params.regex is not None:
                    assert re.fullmatch(r"[a-z]{2,8}( [0-9]{1,3}){0,5}", texts[r.rid]), texts[r.rid]
            assert len(graph.free_ids) == 5
        assert (graph.sampling.retries > 0) == (masks == "on_refusal")


@pytest.mark.parametrize("masks", ["always", "on_refusal"])
def test_masked_rows_on_gemma(gemma: str, masks: str) -> None:
    """Gemma 3 270M (262,144 tokens): constrained greedy replies masked in the graph are the host's. Its
    near-ties make a reply depend on the batch it was decoded in (the CPU's kernels for one row and for
    several), and a request joins a batch when its grammar has compiled (a thread), its prompt partly
    cached or not: the grammars are compiled by a first round, the second is compared, without the
    prefix cache."""
    import json

    runs = [Run(i, f"Describe item {i} as JSON:", CONSTRAINED[0], False) for i in range(3)]
    runs += [Run(3, "Name a colour and two numbers:", CONSTRAINED[1], False),
             Run(4, "Is the sky green?", CONSTRAINED[2], False),
             Run(5, PROMPTS[0], dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0), False)]
    for host, graph in engines(gemma, slots=6, masks=masks, prefix_cache=False):
        run_all(host, runs), run_all(graph, runs)
        texts = masked_and_host_agree(host, graph, runs)
        assert all(json.loads(texts[i]) for i in range(3) if texts[i].endswith("}"))
        assert texts[4].startswith("(")


def test_without_the_mask_table_constrained_rows_keep_their_logits(model_path: str) -> None:
    """A backend where the table cannot be made: the masked samplers take the plain argmax and keep the
    row, and a refused pick is replaced on the host (the host path's text)."""
    for host, graph in engines(model_path, slots=3):
        g = graph.sampling._graph
        assert g is not None

        def no_table(buft: object) -> tuple[int, int, int]:
            raise MemoryError("no room")

        g._make_table = no_table  # type: ignore[method-assign]
        runs = [Run(i, PROMPTS[i], CONSTRAINED[i], False) for i in range(3)]
        assert {k: v[0] for k, v in run_all(graph, runs).items()} == {k: v[0] for k, v in run_all(host, runs).items()}
        assert g._table is None and graph.sampling._on[0] is graph.sampling._masked[0]


@pytest.mark.parametrize("masks", ["always", "on_refusal"])
def test_masked_rows_in_steps_of_several_micro_batches(model_path: str, masks: str) -> None:
    """Long prompts arriving while others decode, in micro-batches of 16 tokens: a step's masked rows
    lie in several micro-batches (each sets the masked inputs of its own graph), the host's text."""

    def staggered(engine: Engine, runs: list[Run]) -> dict[int, str]:
        out: dict[int, str] = {}
        for n in range(10_000):
            if n % 3 == 0 and n // 3 < len(runs):
                engine.submit(runs[n // 3], Step())
            if not engine.busy and n // 3 >= len(runs):
                return out
            step = engine.step() if engine.busy else Step()
            assert not step.failed, step.failed
            out.update((d.rid, d.text) for d in step.done)
        raise AssertionError("not done")

    plain = dataclasses.replace(GREEDY_LP, logprobs=False, top_logprobs=0, max_tokens=30)
    runs = [Run(i, f"word{i} " * (5 + 7 * i), [*CONSTRAINED, plain][i % 4], False) for i in range(8)]
    for host, graph in engines(model_path, slots=6, masks=masks, max_batch_tokens=128, n_ubatch=16):
        s = graph.sampling
        assert s._graph is not None

        def no_host_pick(*a: object) -> int:
            raise AssertionError("a constrained row of the graph engine was picked on the host")

        s._pick_constrained = no_host_pick  # type: ignore[method-assign]
        assert staggered(graph, runs) == staggered(host, runs)
        assert s._graph.masked_inputs > 0


def test_a_slot_handed_over_within_a_step_keeps_its_new_sequences_mask(model_path: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One slot: a constrained request ends by a stop string on its first token (``{``), which the worker
    sends before the next launch, and a constrained request waiting takes the slot in the same step. The
    first one's next mask, left to fill after the launch (every mask taken as wide here), is not filled
    over the second one's first mask, which the graph applies and the host checks the pick against: the
    second request ends well."""
    import json

    from llamapool.worker import sampling

    monkeypatch.setattr(sampling, "WIDE", 0.0)
    first = dataclasses.replace(CONSTRAINED[0], stop=["{"])
    for _, graph in engines(model_path, slots=1, masks="on_refusal"):
        graph.submit(Run(1, PROMPTS[0], first, False), Step())
        while not graph.active or any(seq.prefilling for seq in graph.active.values()):  # its prompt decoded
            graph.step()
        graph.submit(Run(2, PROMPTS[1], CONSTRAINED[0], False), Step())  # compiled: the first one's grammar
        reports: list[Step] = []
        while graph.busy:
            reports.append(graph.step(reports.append))  # what is flushed before a launch, then the rest
        failed = [f for r in reports for f in r.failed]
        done = {d.rid: d for r in reports for d in r.done}
        assert not failed, failed
        assert done[1].reason == "stop" and done[2].reason in ("stop", "length")
        if done[2].reason == "stop":
            json.loads(done[2].text)
