"""The engine alone (no sockets): continuous batching and batch-independent greedy output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig, EngineError
from llamapool.worker.text import TextStream

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model_path, slots=8, ctx_per_slot=256, n_batch=256, n_ubatch=256,
                              prefill_chunk=16, threads=2))
    yield eng
    eng.close()


def run_all(engine: Engine, runs: list[Run], steps_before: dict[int, int] | None = None) -> dict[int, str]:
    """Submit ``runs`` (a run with ``steps_before[rid] = k`` joins after k steps); step to the end."""
    out: dict[int, str] = {}
    later = dict(steps_before or {})
    for r in runs:
        if r.rid not in later:
            engine.submit(r, Step())
    n = 0
    while engine.busy or later:
        for r in runs:
            if later.get(r.rid) == n:
                engine.submit(r, Step())
                del later[r.rid]
        step = engine.step()
        n += 1
        for rid, _reason, text, _pt, _ct in step.done:
            out[rid] = text
        assert not step.failed
    return out


PROMPTS = ["Hello world", "the model", "a much longer prompt that spans several prefill chunks of sixteen",
           "x", "token server worker router pool", "ünïcødé 你好", "one two", "water"]


def test_greedy_output_does_not_depend_on_the_batch(engine: Engine) -> None:
    alone = {i: run_all(engine, [Run(i, p, GREEDY, False)])[i] for i, p in enumerate(PROMPTS)}
    together = run_all(engine, [Run(i, p, GREEDY, False) for i, p in enumerate(PROMPTS)])
    staggered = run_all(engine, [Run(i, p, GREEDY, False) for i, p in enumerate(PROMPTS)],
                        steps_before={i: 3 * i for i in range(len(PROMPTS))})
    assert together == alone
    assert staggered == alone


def test_one_decode_per_step_for_all_sequences(engine: Engine) -> None:
    runs = [Run(100 + i, "Hello", GREEDY, False) for i in range(4)]
    for r in runs:
        engine.submit(r, Step())
    before = engine.steps
    while engine.busy:
        engine.step()
    # 4 sequences x 24 tokens in 24 steps (prompt + first token in step 1): one batch per step
    assert engine.steps - before == GREEDY.max_tokens


def test_more_runs_than_slots_wait_and_then_run(engine: Engine) -> None:
    runs = [Run(200 + i, f"p{i}", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), False)
            for i in range(20)]
    assert len(run_all(engine, runs)) == 20
    assert len(engine.free_ids) == 8


def test_abort_frees_the_sequence(engine: Engine) -> None:
    engine.submit(Run(300, "Hello", SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), True),
                  Step())
    engine.step()
    out = Step()
    engine.abort(300, out)
    assert out.done and out.done[0][1] == "cancelled"
    assert not engine.busy and len(engine.free_ids) == 8


def test_missing_model_is_a_permanent_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineError) as e:
        Engine(EngineConfig(str(tmp_path / "nope.gguf")))
    assert e.value.permanent and "does not exist" in str(e.value)


def test_corrupt_model_is_a_permanent_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(EngineError) as e:
        Engine(EngineConfig(str(bad)))
    assert e.value.permanent


# ------------------------------------------------------------ text deltas


def test_utf8_characters_are_never_split_across_deltas() -> None:
    ts = TextStream()
    data = "aé你😀z".encode()
    deltas = [ts.push(data[i:i + 1]) for i in range(len(data))] + [ts.finish()]
    assert "".join(deltas) == "aé你😀z"
    assert all(d.encode().decode() == d for d in deltas)
    assert "" in deltas  # the partial bytes were held back, not emitted as replacement chars


def test_stop_string_across_pieces_is_cut_and_never_sent() -> None:
    ts = TextStream(("END",))
    sent = ts.push(b"abc E") + ts.push(b"N") + ts.push(b"D more")
    assert ts.stopped and ts.text == "abc " and sent + ts.finish() == "abc "


def test_held_back_prefix_is_released_when_it_is_not_a_stop() -> None:
    ts = TextStream(("END",))
    assert ts.push(b"xE") == "x"
    assert ts.push(b"Nx") == "ENx"
    assert not ts.stopped


def test_backend_sampling_path_gives_the_same_greedy_text(model_path: str, engine: Engine) -> None:
    """The GPU-sampling code path (llama.cpp backend sampler chains), exercised on the CPU backend."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, n_batch=256, n_ubatch=256,
                              threads=2, backend_sampling=True))
    try:
        runs = [Run(i, p, GREEDY, False) for i, p in enumerate(PROMPTS[:4])]
        assert run_all(eng, runs) == run_all(engine, runs)
        seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
        mixed = [Run(10, "x", seeded, False), Run(11, "y", GREEDY, False)]
        first, second = run_all(eng, mixed), run_all(eng, mixed)
        assert first == second, "seeded sampling on the backend is reproducible"
        assert first[11] == run_all(engine, [Run(11, "y", GREEDY, False)])[11]
        assert len(eng.free_ids) == 4
    finally:
        eng.close()


SYSTEM = " ".join(["the model server worker router pool token"] * 12)  # a shared system prompt


def test_a_shared_prompt_prefix_is_reused_not_recomputed(model_path: str) -> None:
    def fresh(prefix_cache: bool) -> Engine:
        return Engine(EngineConfig(model_path, slots=4, ctx_per_slot=512, n_batch=512, n_ubatch=512,
                                   threads=2, prefix_cache=prefix_cache))

    cached, plain = fresh(True), fresh(False)
    try:
        n_prefix = len(cached.tokenize(SYSTEM))
        runs = [Run(i, SYSTEM + f" question {i}", GREEDY, False) for i in range(3)]
        texts = {}
        for r in runs:  # one after another: each later one finds the prefix in a free slot's KV
            texts.update(run_all(cached, [r]))
        assert cached.reused_tokens >= 2 * (n_prefix - 2)
        assert texts == {r.rid: run_all(plain, [r])[r.rid] for r in runs}
        assert plain.reused_tokens == 0
        # an active sequence's computed prompt is shared too (llama_memory_seq_cp)
        cached.submit(Run(10, SYSTEM + " first", GREEDY, False), Step())
        cached.step()
        before = cached.reused_tokens
        cached.submit(Run(11, SYSTEM + " second", GREEDY, False), Step())
        cached.step()
        assert cached.reused_tokens - before >= n_prefix - 2
    finally:
        cached.close()
        plain.close()


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(model_path: str) -> None:
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=2048, n_batch=2048, n_ubatch=512,
                              prefill_chunk=64, threads=2, prefix_cache=False))
    try:
        for i in range(3):
            eng.submit(Run(i, f"short {i}", SamplingParams(max_tokens=100, temperature=0.0,
                                                           ignore_eos=True), True), Step())
        eng.step()  # nobody decodes yet: the short prompts go in whole
        eng.submit(Run(9, [5] * 1500, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       False), Step())
        sizes = []
        while any(s.prefilling for s in eng.active.values()) or eng.waiting:
            before = {s.rid: s.generated for s in eng.active.values() if s.rid < 9}
            eng.step()
            sizes.append(eng.batch.n)
            after = {s.rid: s.generated for s in eng.active.values() if s.rid < 9}
            assert all(after[r] == before[r] + 1 for r in before), "every decoder got its token"
        assert max(sizes) <= 3 + 64 and len(sizes) >= 1500 // 64
    finally:
        eng.close()


def test_pipelined_steps_honour_stop_strings_and_aborts(model_path: str, engine: Engine) -> None:
    """With GPU-style pipelining a stop string found after the next batch was launched must still
    end the text before it, and the extra token computed must never be sent."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, n_batch=256, n_ubatch=256,
                              threads=2, backend_sampling=True))
    try:
        free = run_all(engine, [Run(1, "Hello world", GREEDY, True)])[1]
        stop = free[8:10]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
        eng.submit(Run(2, "Hello world", params, True), Step())
        eng.submit(Run(3, "Hello world", GREEDY, True), Step())
        streamed: dict[int, str] = {2: "", 3: ""}
        done: dict[int, list] = {}
        while eng.busy:
            step = eng.step()
            for rid, text, _n in step.deltas:
                streamed[rid] += text
            for d in step.done:
                done[d[0]] = d
            if 3 in streamed and len(streamed[3]) > 4 and 3 not in done:
                out = Step()
                eng.abort(3, out)
                done[3] = out.done[0]
        assert done[2][1] == "stop" and done[2][2] == free[: free.find(stop)] == streamed[2]
        assert done[3][1] == "cancelled"
        assert len(eng.free_ids) == 4 and not eng.active
    finally:
        eng.close()


def test_a_burst_of_arrivals_gets_the_whole_batch_for_its_prompts(model_path: str) -> None:
    """More sequences waiting for their first token than decoding: prefill is not capped."""
    eng = Engine(EngineConfig(model_path, slots=8, ctx_per_slot=512, n_batch=512, n_ubatch=512,
                              prefill_chunk=16, threads=2, prefix_cache=False))
    try:
        eng.submit(Run(0, "first", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), False), Step())
        eng.step()  # "first" is decoding now
        for i in range(1, 5):
            eng.submit(Run(i, [5 + i] * 100, SamplingParams(max_tokens=2, ignore_eos=True), False), Step())
        eng.step()
        assert eng.batch.n > 1 + 16, "four prompts against one decoder: not capped at prefill_chunk"
    finally:
        eng.close()
