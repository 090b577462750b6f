"""A draft model (``speculative = "draft:<path>"``, worker/engine/draft.py): its drafts verified as prompt
lookup's are, under the same policy; one whose vocabulary differs from its model's is refused at start."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from llamapool.config import ConfigError, load_config
from llamapool.modelgen import make_model
from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig, EngineError
from llamapool.worker.engine.draft import DraftModel
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
        Engine(EngineConfig(str(model), slots=1, ctx_per_slot=64, threads=2, speculative=f"draft:{other}"))
    assert str(model) in str(e.value) and str(other) in str(e.value) and "vocabulary" in str(e.value)
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(str(model), slots=1, ctx_per_slot=64, threads=2,
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
    monkeypatch.setattr(DraftModel, "seconds", lambda self, seqs, length, plain: 0.0)


def test_a_draft_model_that_is_always_right_has_every_draft_kept(tmp_path: Path, every_draft_pays: None) -> None:
    """Two ``peaked`` models of one vocabulary and seed have the same greedy cycle: the draft model's drafts
    are all kept, several tokens a step, and the text is the text without speculation; a draft model of
    another seed (another cycle) is never right, and the text is the same too."""
    target = make_model(tmp_path / "target.gguf", peaked=True)
    right = make_model(tmp_path / "right.gguf", peaked=True, n_layer=1)
    wrong = make_model(tmp_path / "wrong.gguf", peaked=True, n_layer=1, seed=7)
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = [("tok1 tok2 tok3", p), ("tok7 tok5", p)]
    for draft, kept in ((right, True), (wrong, False)):
        eng = Engine(EngineConfig(str(target), slots=4, ctx_per_slot=96, max_batch_tokens=64, threads=2,
                                  speculative=f"draft:{draft}", prefix_cache=False))
        try:
            got = run(eng, runs + [(q, dataclasses.replace(r, speculative=False)) for q, r in runs])
            assert [x.text for x in got[:2]] == [x.text for x in got[2:]]
            assert eng.spec.drafted_tokens > 0
            if kept:
                assert eng.spec.accepted_tokens == eng.spec.drafted_tokens
                assert eng.sampling_steps < 0.8 * eng.sampled_tokens  # several tokens a step
            else:
                assert eng.spec.accepted_tokens < eng.spec.drafted_tokens / 10
        finally:
            eng.close()
