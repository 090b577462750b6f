"""A draft model (``speculative = "draft:<path>"``, worker/engine/draft.py): its drafts verified as prompt
lookup's are, under the same policy; one whose vocabulary differs from its model's is refused at start."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import llama_cpp as L
import numpy as np
import pytest

from llamapool.config import ConfigError, load_config
from llamapool.modelgen import make_model
from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig, EngineError
from llamapool.worker.engine.draft import AMORTIZE, DraftModel, band
from llamapool.worker.engine.model import load_model
from llamapool.worker.engine.spec import MODEL_MAX
from llamapool.worker.engine.speculator import Speculator


def run(engine: Engine, runs: list[tuple[Any, SamplingParams]]) -> list[Any]:
    for i, (prompt, p) in enumerate(runs):
        engine.submit(Run(i, prompt, p, False), Step())
    done: dict[int, Any] = {}
    while engine.busy:
        step = engine.step()
        assert not step.failed, step.failed
        done.update((d.rid, d) for d in step.done)
    return [done[i] for i in range(len(runs))]


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_naming_both(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model.gguf")
    other = make_model(tmp_path / "other-vocab.gguf", n_vocab=600)
    with pytest.raises(EngineError) as e:
        Engine(EngineConfig(str(model), slots=1, ctx_per_slot=64, threads=1, speculative=f"draft:{other}"))
    assert str(model) in str(e.value) and str(other) in str(e.value) and "vocabulary" in str(e.value)
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(str(model), slots=1, ctx_per_slot=64, threads=1,
                            speculative=f"draft:{tmp_path / 'missing.gguf'}"))


def test_the_setting_names_a_draft_model(tmp_path: Path) -> None:
    def config(value: str) -> Path:
        p = tmp_path / "c.toml"
        p.write_text(f'[model]\npath = "m.gguf"\nspeculative = "{value}"\n')
        return p

    assert load_config(config("draft:/models/small.gguf")).models[0].speculative == "draft:/models/small.gguf"
    for bad in ("draft:", "model:x"):
        with pytest.raises(ConfigError, match="speculative"):
            load_config(config(bad))


@pytest.fixture
def every_draft_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Width costs and a draft model's price that make every draft worth verifying (the choice is
    test_spec_policy's business)."""
    monkeypatch.setattr(Speculator, "width_cost", lambda self, n_rows, rows, prefilling: (lambda k: 1.0))
    monkeypatch.setattr(DraftModel, "seconds", lambda self, seqs, length, plain, left=(): 0.0)


@pytest.mark.parametrize("graph", [False, True])
def test_a_draft_model_that_is_always_right_has_every_draft_kept(tmp_path: Path, every_draft_pays: None,
                                                                 graph: bool) -> None:
    """Two ``peaked`` models of one vocabulary and seed have the same greedy cycle: the draft model's drafts
    are all kept, several tokens a step (up to ``MODEL_MAX``), and the text is the text without
    speculation; a draft model of another seed (another cycle) is never right, and the text is the same
    too. ``graph``: a GPU worker's path (the rows sampled in the decode graph, the target's up to
    ``1 + MODEL_MAX`` a sequence; llama.cpp's backend sampling runs on the CPU too)."""
    target = make_model(tmp_path / "target.gguf", peaked=True)
    right = make_model(tmp_path / "right.gguf", peaked=True, n_layer=1)
    wrong = make_model(tmp_path / "wrong.gguf", peaked=True, n_layer=1, seed=7)
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = [("tok1 tok2 tok3", p), ("tok7 tok5", p)]
    for draft, kept in ((right, True), (wrong, False)):
        eng = Engine(EngineConfig(str(target), slots=4, ctx_per_slot=96, max_batch_tokens=128, threads=1,
                                  speculative=f"draft:{draft}", prefix_cache=False, backend_sampling=graph))
        widths: list[int] = []
        propose = eng.spec.propose
        eng.spec.propose = lambda *a, p=propose, w=widths: w.append(p(*a)) or w[-1]  # type: ignore[method-assign]
        try:
            got = run(eng, runs + [(q, dataclasses.replace(r, speculative=False)) for q, r in runs])
            assert [x.text for x in got[:2]] == [x.text for x in got[2:]]
            assert eng.spec.drafted_tokens > 0
            if kept:
                assert eng.spec.accepted_tokens == eng.spec.drafted_tokens
                assert eng.sampling_steps < 0.8 * eng.sampled_tokens  # several tokens a step
                assert MODEL_MAX in widths, widths
            else:
                assert eng.spec.accepted_tokens < eng.spec.drafted_tokens / 10
        finally:
            eng.close()


# ---------------------------------------------------------------- the draft model's calls

@pytest.fixture(scope="module")
def peaked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ``peaked`` target and two 1-layer drafts of its vocabulary: "right" (its seed: the same greedy cycle)
    and "wrong" (another seed: another cycle)."""
    tmp = tmp_path_factory.mktemp("peaked")
    return {"target": make_model(tmp / "target.gguf", peaked=True),
            "right": make_model(tmp / "right.gguf", peaked=True, n_layer=1),
            "wrong": make_model(tmp / "wrong.gguf", peaked=True, n_layer=1, seed=7)}


def seq(rid: int, toks: list[int], room: int = 64) -> SimpleNamespace:
    history = np.zeros(len(toks) + room, np.int32)
    history[: len(toks)] = toks
    return SimpleNamespace(rid=rid, seq_id=rid, history=history, n_history=len(toks))


def grow(s: SimpleNamespace, toks: list[int]) -> None:
    s.history[s.n_history : s.n_history + len(toks)] = toks
    s.n_history += len(toks)


@pytest.mark.parametrize("graph", [False, True])
def test_the_drafting_sequences_are_drafted_together(peaked: dict[str, Path], graph: bool) -> None:
    """Several sequences' drafts in ``1 + (n - 1)`` calls of the draft model (their catching up in one, then
    one a draft position), each draft what drafting it alone gives; a sequence that did not draft for a
    while catches up in one call when it drafts again; its kept tokens are not decoded again. ``graph``: the
    argmax picked in the decode graph (a GPU worker's path; llama.cpp's backend sampling runs on the CPU too)."""
    cfg = EngineConfig(str(peaked["target"]), slots=4, ctx_per_slot=128, threads=1,
                       speculative=f"draft:{peaked['right']}")
    target, _keep = load_model(cfg)
    together, alone = DraftModel(cfg, target, graph), DraftModel(cfg, target, graph)
    try:
        prompts = [[1, 5, 9, 13], [2, 7], [3, 3, 3, 4, 8, 21, 30], [40]]
        seqs = [seq(i, p) for i, p in enumerate(prompts)]
        drafts = together.draft(seqs, [6, 2, 6, 4])
        assert together.calls == 6 and together.tokens == sum(map(len, prompts)) + 4 + 3 + 3 + 2 + 2  # rows a call
        assert drafts == [alone.draft([s], [n])[0] for s, n in zip(seqs, [6, 2, 6, 4], strict=True)]
        assert [len(d) for d in drafts] == [6, 2, 6, 4]
        # sequence 0 kept 4 of its draft tokens and took 1 more; sequence 2 stood by for 20 tokens
        grow(seqs[0], [*drafts[0][:4], 77])
        grow(seqs[2], list(range(100, 120)))
        calls, tokens = together.calls, together.tokens
        again = together.draft([seqs[0], seqs[2]], [3, 3])
        assert together.calls - calls == 3  # catching up: one call for both
        assert together.tokens - tokens == 1 + 20 + 2 * 2  # 0: only its new token; 2: its 20
        fresh = DraftModel(cfg, target, graph)
        try:
            assert again == [fresh.draft([s], [3])[0] for s in (seqs[0], seqs[2])]
        finally:
            fresh.close()
    finally:
        together.close()
        alone.close()
        L.llama_model_free(target)


def test_a_draft_model_never_right_backs_off_and_is_no_longer_called(peaked: dict[str, Path],
                                                                    every_draft_pays: None) -> None:
    """A draft model whose drafts are never kept (another seed's cycle): its sequence drafts shorter (one
    token), its estimate falls under what a draft token must be worth, and it backs off; from then on the
    draft model is not called at all, not even to catch up (the step costs what it costs without
    speculation). The text is the text without it."""
    eng = Engine(EngineConfig(str(peaked["target"]), slots=2, ctx_per_slot=256, max_batch_tokens=64, threads=1,
                              speculative=f"draft:{peaked['wrong']}", prefix_cache=False))
    try:
        drafter = eng.spec.drafter
        assert isinstance(drafter, DraftModel)
        p = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
        for i, q in enumerate((p, dataclasses.replace(p, speculative=False))):
            eng.submit(Run(i, "tok1 tok2 tok3", q, False), Step())
        calls, done = [], {}
        while eng.busy:
            step = eng.step()
            done.update((d.rid, d.text) for d in step.done)
            calls.append(drafter.calls)
        assert done[0] == done[1]
        assert 0 < calls[40] <= 16 and calls[-1] == calls[40], calls  # a few calls, then none
        assert eng.spec.accepted_tokens == 0 < eng.spec.drafted_tokens <= 16
    finally:
        eng.close()


def test_a_real_model_drafting_for_itself_keeps_its_drafts_and_its_text(smollm2: str, every_draft_pays: None) -> None:
    """SmolLM2 135M as its own draft model (always right): held prompts, greedy, with the draft model and
    without (the request's ``speculative: false``) in one engine: nearly every draft token kept, several
    tokens a step, and the same text but where the reference's two likeliest tokens are within
    ``NEAR_TIE`` (llama.cpp's CPU kernels compute a verified row otherwise: test_speculative)."""
    from tests.test_speculative import GROUNDED, OPEN, agreeing_tokens

    g = SamplingParams(max_tokens=32, temperature=0.0, logprobs=True, top_logprobs=2)
    runs = [(prompt, g) for prompt in [*GROUNDED, OPEN]]
    eng = Engine(EngineConfig(smollm2, slots=2 * len(runs), ctx_per_slot=1024, max_batch_tokens=512, threads=1,
                              speculative=f"draft:{smollm2}"))
    try:
        got = run(eng, runs + [(prompt, dataclasses.replace(p, speculative=False)) for prompt, p in runs])
        on, off = got[: len(runs)], got[len(runs):]
        agree = [agreeing_tokens(r.logprobs, x.logprobs) for r, x in zip(off, on, strict=True)]
        assert sum(agree) >= 0.8 * sum(len(r.logprobs) for r in off), agree
        for r, x, n in zip(off, on, agree, strict=True):
            if n == len(r.logprobs):
                assert (x.text, x.reason) == (r.text, r.reason)
        drafted, kept = eng.spec.drafted_tokens, eng.spec.accepted_tokens
        # a refusal (a near-tie the verify step's kernels compute otherwise) drops the rest of its draft (to 16)
        assert drafted > 50 and kept >= 0.8 * drafted, (drafted, kept)
        on_steps = eng.sampling_steps - sum(r.completion_tokens for r in off)  # the others take a token a step
        assert sum(x.completion_tokens for x in on) > 3 * on_steps, on_steps
    finally:
        eng.close()


def test_a_long_backlog_is_priced_as_a_share_of_the_reply_it_serves(peaked: dict[str, Path]) -> None:
    """A new sequence's first proposal catches the draft model up on its whole prompt, once for every later
    proposal: the step is charged ``length + 1`` of the tokens its reply has left (at most ``AMORTIZE``) of
    that catching up, not all of it (priced whole, a long prompt's first proposal looked too dear to make,
    and a sequence never drafted). With no reply left to share it, or none given, the whole of it."""
    cfg = EngineConfig(str(peaked["target"]), slots=2, ctx_per_slot=1024, threads=1,
                       speculative=f"draft:{peaked['right']}")
    target, _keep = load_model(cfg)
    drafter = DraftModel(cfg, target)
    try:
        drafter.timing = {band(1): 0.001, band(5): 0.002, band(601): 0.050}  # a call's seconds by its tokens
        fresh = seq(0, [1 + i % 500 for i in range(600)])  # 600 tokens, none in the draft model's cache
        whole = 0.050 + 3 * 0.001
        assert drafter.seconds([fresh], 4, 1.0) == pytest.approx(whole)
        assert drafter.seconds([fresh], 4, 1.0, [5]) == pytest.approx(whole)
        share = 5 / AMORTIZE  # a reply of 1,000 tokens left shares it over AMORTIZE of them
        assert drafter.seconds([fresh], 4, 1.0, [1000]) == pytest.approx(0.002 + share * 0.048 + 3 * 0.001)
        drafter.draft([fresh], [4])  # caught up: the next proposal pays for its own new tokens, shared or not
        grow(fresh, [7, 8])
        assert drafter.seconds([fresh], 4, 1.0, [1000]) == drafter.seconds([fresh], 4, 1.0) < whole
    finally:
        drafter.close()
        L.llama_model_free(target)
