"""tests/spec_oracle.py (issue 34, measurement (a)): the oracle proposer's drafts and the accounting of
what the engine verified, on the tiny model. An oracle at acceptance 1 drafts the recorded greedy output
itself, so every draft is kept; at 0 every draft token is another one, so none is."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llamapool.modelgen import make_model, peaked_next
from llamapool.worker.engine import EngineConfig
from llamapool.worker.engine.ngram import PromptLookup

from . import spec_oracle as so

GEN = 24


def test_oracle_drafts_are_the_recording_corrupted_at_the_set_rate() -> None:
    recorded = {0: np.arange(10, 4010, dtype=np.int32), 1: np.array([40, 2, 41, 42], np.int32)}
    prompt = {0: 5, 1: 3}
    keep = so.Oracle(prompt, recorded, 1.0, 5000, frozenset({2}))
    assert keep(0, np.zeros(5 + 7, np.int32), 3) == [17, 18, 19]  # output position 7 on
    assert keep(1, np.zeros(3, np.int32), 4) == [40, 2]  # ends after an end-of-generation token
    assert keep(0, np.zeros(5 + 3998, np.int32), 4) == [4008, 4009]  # the recording's end
    half = so.Oracle(prompt, recorded, 0.7, 5000, frozenset({2}), seed=3)
    same = half.drafts[0] == recorded[0]
    assert 0.66 < same.mean() < 0.74
    assert not np.isin(half.drafts[0][~same], [2]).any()
    none = so.Oracle(prompt, recorded, 0.0, 5000, frozenset({2}))
    assert not (none.drafts[0] == recorded[0]).any() and not (none.drafts[0] == 2).any()
    assert ((so.FIRST_ID <= none.drafts[0]) & (none.drafts[0] < 5000)).all()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, so.RecordingEngine]]:
    """Engines on a tiny ``peaked`` model: its greedy output no kernel's rounding changes (a random model's
    near-ties could make a verified row's pick differ from the recording's on another CPU)."""
    path = str(make_model(tmp_path_factory.mktemp("peaked") / "tiny-peaked.gguf", peaked=True))
    cfg = EngineConfig(path, slots=2, ctx_per_slot=16 + GEN + 24, max_batch_tokens=64, threads=2,
                       speculative="ngram", prefix_cache=False)
    made = {"host": so.RecordingEngine(cfg),
            "graph": so.RecordingEngine(dataclasses.replace(cfg, backend_sampling=True))}
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("sampling", ["host", "graph"])
def test_the_oracle_is_accepted_exactly_as_set(engines: dict[str, so.RecordingEngine], sampling: str) -> None:
    """Three prompts on two slots (one waits), 24 tokens each: at acceptance 1 every draft is kept and the
    text is the recorded one; at 0 none is kept; the step budget's own choice at 1 keeps all it drafts;
    a speculating engine with backend (GPU) sampling samples these greedy rows in the graph, drafts and
    all (llamapool's greedy takes any number of a sequence's rows)."""
    engine = engines[sampling]
    prompts = so.make_prompts(3, 16, engine.n_vocab, seed=0)
    cases = [so.Case("oracle", 3, 1.0), so.Case("oracle", 3, 0.0), so.Case("oracle", so.BUDGET, 1.0),
             so.Case("random", so.BUDGET, 0.0), so.Case("no-draft", None)]
    rows = so.measure(engine, prompts, GEN, cases, repeats=2)
    # the fixed-k patches are undone
    assert "width_cost" not in vars(engine.spec) and "choose" not in vars(engine.spec.widths)
    assert isinstance(engine.spec.proposer, PromptLookup)  # prompt lookup again
    off, full, none, budget, random, empty = rows
    assert off["tokens"] == 3 * GEN and off["drafted"] == 0 and off["tokens_per_step"] == 1.0
    for r in rows:
        assert r["tokens"] == 3 * GEN and len(r["tok_s_runs"]) == 2
        assert r["mismatched_seqs"] == 0 and r["agree"] == 1.0, r  # greedy: the recorded output
    # acceptance 1: every draft kept; k = 3 every step (but near the end, where fewer tokens are left)
    assert full["drafted"] > 0 and full["accepted"] == full["drafted"] and full["alpha"] == 1.0
    assert max(full["draft_lengths"]) == 3 and full["draft_lengths"][3] >= 3 * (GEN // 4 - 2)
    assert full["tokens_per_step"] > 3.0
    # acceptance 0: k = 3 every step, each refused at its first token
    assert none["drafted"] > 0 and none["accepted"] == 0 and none["alpha"] == 0.0 and none["tokens_per_step"] == 1.0
    assert max(none["draft_lengths"]) == 3 and none["draft_lengths"][3] >= 3 * (GEN - 6)
    # the step budget decides how many: what it drafts at acceptance 1 is all kept, at 0 none
    assert budget["accepted"] == budget["drafted"] and random["accepted"] == 0
    assert empty["drafted"] == 0 and empty["tokens_per_step"] == 1.0
    assert off["sampled"] == full["sampled"] == empty["sampled"] == sampling
    assert off["vs_off"] == 1.0 and all(r["vs_off"] > 0 for r in rows)
    assert "| oracle | 3 | 1.0 | 1.0 | 1.0 |" in so.table([{**r, "B": 2} for r in rows])


def test_a_peaked_model_keeps_every_oracle_draft_at_batch_4(tmp_path: Path) -> None:
    """A ``peaked`` model (``make-model --peaked``), four streams of six prompts: its greedy output is the
    successor cycle, and at acceptance 1 every draft is kept at k = 3 and at ``MAX_DRAFT``, the text
    the recorded one (a wide top-1 margin: a batch of several rows cannot round it otherwise)."""
    path = make_model(tmp_path / "peaked.gguf", peaked=True)
    engine = so.RecordingEngine(EngineConfig(str(path), slots=4, ctx_per_slot=16 + GEN + 24, max_batch_tokens=64,
                                             threads=2, speculative="ngram", prefix_cache=False))
    try:
        prompts = so.make_prompts(6, 16, engine.n_vocab, seed=0)
        cases = [so.Case("oracle", 3, 1.0), so.Case("oracle", so.MAX_DRAFT, 1.0), so.Case("oracle", 3, 0.7)]
        off, k3, kmax, part = so.measure(engine, prompts, GEN, cases)
        nxt = peaked_next(engine.n_vocab)
        for rid, p in enumerate(prompts):  # the last run's outputs: each token the successor of the one before
            toks = np.concatenate([p[-1:], engine.outputs[rid]])
            assert (toks[1:] == nxt[toks[:-1]]).all()
    finally:
        engine.close()
    for r in (off, k3, kmax, part):
        assert r["tokens"] == 6 * GEN and r["mismatched_seqs"] == 0 and r["agree"] == 1.0, r
    for r, k in ((k3, 3), (kmax, so.MAX_DRAFT)):
        assert r["accepted"] == r["drafted"] > 0 and r["alpha"] == 1.0 and max(r["draft_lengths"]) == k
        assert r["tokens_per_step"] > min(k, 4)
    assert 0 < part["accepted"] < part["drafted"]
