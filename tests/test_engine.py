"""The engine alone (no sockets): continuous batching and batch-independent greedy output."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig, EngineError
from llamapool.worker.text import TextStream

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model_path, slots=8, ctx_per_slot=256, max_batch_tokens=24, n_ubatch=256,
                              threads=2))
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
        for rid, _reason, text, _pt, _ct, *_ in step.done:
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
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
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


def test_slots_change_hands_between_graph_and_host_sampling(model_path: str, engine: Engine) -> None:
    """Backend sampling, slots passing between greedy rows sampled in the graph and rows sampled on the
    host (a grammar, logprobs, a penalty): the greedy text is the same as alone, wave after wave."""
    eng = Engine(EngineConfig(model_path, slots=3, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
                              threads=2, backend_sampling=True))
    host = [dataclasses.replace(GREEDY, json_schema={"type": "object"}), dataclasses.replace(GREEDY, logprobs=True),
            dataclasses.replace(GREEDY, frequency_penalty=0.5)]
    try:
        want = run_all(engine, [Run(i, p, GREEDY, False) for i, p in enumerate(PROMPTS[:3])])
        for wave in range(4):  # each wave puts the greedy runs in slots the host runs had
            runs = [Run(100 * wave + i, p, GREEDY, False) for i, p in enumerate(PROMPTS[:3])]
            others = [Run(100 * wave + 50 + i, "z", host[(i + wave) % 3], False) for i in range(3)]
            got = run_all(eng, (others + runs) if wave % 2 else (runs + others),
                          {r.rid: 1 + i for i, r in enumerate(runs)} if wave % 2 else {})
            assert [got[100 * wave + i] for i in range(3)] == [want[i] for i in range(3)]
        assert len(eng.free_ids) == 3
    finally:
        eng.close()


def test_a_constrained_greedy_row_sampled_in_the_graph_gives_the_host_paths_text(model_path: str,
                                                                                 engine: Engine) -> None:
    """A constrained greedy row keeps the graph's argmax when the mask allows it, and takes the likeliest
    allowed token from the row's logits when not: the same text as sampling it on the host."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
                              threads=2, backend_sampling=True))
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = dataclasses.replace(GREEDY, max_tokens=60, ignore_eos=False, json_schema=schema)
    try:
        runs = [Run(i, p, constrained, False) for i, p in enumerate(PROMPTS[:4])]
        assert eng.sampling.in_graph(constrained)
        graph, host = run_all(eng, runs), run_all(engine, runs)
        assert graph == host and all(json.loads(t) for t in graph.values())
    finally:
        eng.close()


SYSTEM = " ".join(["the model server worker router pool token"] * 12)  # a shared system prompt


def test_a_shared_prompt_prefix_is_reused_not_recomputed(model_path: str) -> None:
    def fresh(prefix_cache: bool) -> Engine:
        return Engine(EngineConfig(model_path, slots=4, ctx_per_slot=512, max_batch_tokens=512, n_ubatch=512,
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


def test_a_long_prompt_is_prefilled_within_the_step_budget_while_others_decode(model_path: str) -> None:
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=2048, max_batch_tokens=64, n_ubatch=512,
                              threads=2, prefix_cache=False))
    try:
        for i in range(3):
            eng.submit(Run(i, f"short {i}", SamplingParams(max_tokens=100, temperature=0.0,
                                                           ignore_eos=True), True), Step())
        eng.step()
        eng.submit(Run(9, [5] * 1500, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       False), Step())
        sizes = []
        while any(s.prefilling for s in eng.active.values()) or eng.waiting:
            before = {s.rid: s.generated for s in eng.active.values() if s.rid < 9}
            eng.step()
            sizes.append(eng.batch.n)
            after = {s.rid: s.generated for s in eng.active.values() if s.rid < 9}
            assert all(after[r] == before[r] + 1 for r in before), "every decoder got its token"
        assert max(sizes) == 64, "decode tokens and the prompt chunk fill the budget, never more"
        assert len(sizes) == -(-1500 // (64 - 3))
    finally:
        eng.close()


def test_a_short_prompt_behind_a_long_one_gets_its_first_token_first(model_path: str) -> None:
    """Shortest remaining prompt first (worker/scheduler.py): a 30-token prompt arriving while a
    1,200-token one is being computed is done in its first step, not after the long prompt."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=2048, max_batch_tokens=128, n_ubatch=512,
                              threads=2, prefix_cache=False, target_step="off"))
    try:
        once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        eng.submit(Run(1, [7] * 1200, once, False), Step())
        eng.step()
        eng.step()
        eng.submit(Run(2, [9] * 30, once, False), Step())
        done = eng.step().done
        assert [d.rid for d in done] == [2], "the short prompt finished in its first step"
        long = next(s for s in eng.active.values() if s.rid == 1)
        assert long.n_past == 128 * 3 - 30, "the long prompt lost only the short one's tokens"
        while eng.busy:
            done = eng.step().done
        assert [d.rid for d in done] == [1]
    finally:
        eng.close()


def test_prompts_of_one_length_are_computed_in_arrival_order(model_path: str) -> None:
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=512, max_batch_tokens=100, n_ubatch=512,
                              threads=2, prefix_cache=False))
    try:
        once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        eng.submit(Run(1, [7] * 250, once, False), Step())
        eng.submit(Run(2, [8] * 250, once, False), Step())
        eng.step()  # the oldest takes the whole budget; the younger waits (no slot without tokens)
        first = next(s for s in eng.active.values() if s.rid == 1)
        assert first.n_past == 100 and [r.rid for r in eng.waiting] == [2]
        eng.step()
        assert first.n_past == 200 and [r.rid for r in eng.waiting] == [2]
        eng.step()  # the oldest completes; the budget it leaves admits the younger
        second = next(s for s in eng.active.values() if s.rid == 2)
        assert (first.n_past, second.n_past) == (250, 50) and not eng.waiting
    finally:
        eng.close()


def test_waiting_prompts_take_every_slot_that_frees(model_path: str) -> None:
    """Under steady load no slot stays idle while a prompt waits and the budget has room."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
                              threads=2, prefix_cache=False))
    try:
        for i in range(24):
            eng.submit(Run(i, [10 + i] * 20, SamplingParams(max_tokens=2 + i % 5, temperature=0.0,
                                                             ignore_eos=True), False), Step())
        finished = 0
        while eng.busy:
            done = eng.step().done
            finished += len(done)
            if eng.waiting:  # only the slots freed by this very step's tokens are free now
                assert len(eng.free_ids) <= len(done), "a slot stayed free while prompts were waiting"
        assert finished == 24
    finally:
        eng.close()


@pytest.mark.parametrize("backend_sampling", [False, True])
def test_batch_sequence_ids_are_contiguous_so_decode_tokens_form_one_micro_batch(
        model_path: str, backend_sampling: bool) -> None:
    """llama.cpp splits a per-sequence-KV batch at gaps in sequence ids: free slots between busy ones
    get one padding token, and a slot's cached prefix survives the padding."""
    eng = Engine(EngineConfig(model_path, slots=6, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
                              threads=2, backend_sampling=backend_sampling))
    try:
        lengths = [3, 30, 3, 30, 3, 30]
        for i, n in enumerate(lengths):
            eng.submit(Run(i, f"prompt {i} " * 4, SamplingParams(max_tokens=n, temperature=0.0,
                                                                 ignore_eos=True), False), Step())
        texts: dict[int, str] = {}
        padded_steps = 0
        while eng.busy:
            for d in eng.step().done:
                texts[d[0]] = d[2]
            ids = sorted(set(eng.batch.seq[: eng.batch.n].tolist()))
            assert ids == list(range(ids[0], ids[-1] + 1)) if ids else True
            padded_steps += any(i not in eng.active for i in ids)
        assert padded_steps > 0, "the short sequences' slots were padded while the long ones ran"
        for i, n in enumerate(lengths):  # same text as alone, and the padded slots' prefixes are reused
            alone = run_all(eng, [Run(100 + i, f"prompt {i} " * 4, SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True), False)])
            assert alone[100 + i] == texts[i]
        assert eng.reused_tokens > 0
    finally:
        eng.close()


def test_pipelined_steps_honour_stop_strings_and_aborts(model_path: str, engine: Engine) -> None:
    """With GPU-style pipelining a stop string found after the next batch was launched must still
    end the text before it, and the extra token computed must never be sent."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
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
            for rid, text, _n, *_ in step.deltas:
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


def test_tokens_ready_before_a_prompt_step_are_flushed_before_it_is_launched(model_path: str) -> None:
    """A batch with a prompt chunk runs as several micro-batches and llama_decode blocks on all but
    the last: the tokens already read go out first, so a prefill step never delays them."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=512, max_batch_tokens=256, n_ubatch=64,
                              threads=2, backend_sampling=True))
    try:
        eng.submit(Run(1, "Hello", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), True), Step())
        for _ in range(3):
            eng.step()
        flushed: list[Step] = []
        assert eng.step(flushed.append).deltas and not flushed, "decode-only steps are not flushed early"
        eng.submit(Run(2, [7] * 200, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), True), Step())
        rest = eng.step(flushed.append)
        assert len(flushed) == 1 and [d[0] for d in flushed[0].deltas] == [1]
        assert not rest.deltas, "nothing is left to send after the launch"
    finally:
        eng.close()


def test_a_first_token_is_sent_before_the_next_launch(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a prompt step the next launch is slow on a GPU (a CUDA graph captured again), so a prompt's
    first token is handed to ``flush`` before the next batch is launched; the other sequences' tokens go
    after the launch, as in every pipelined step."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=512, max_batch_tokens=256, threads=2,
                              backend_sampling=True))
    events: list[str] = []
    launch = Engine._launch

    def recording(self: Engine, order: list, out: Step) -> bool:  # type: ignore[type-arg]
        events.append("launch")
        return launch(self, order, out)

    monkeypatch.setattr(Engine, "_launch", recording)
    try:
        p = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        eng.submit(Run(1, "Hello", p, True), Step())
        for _ in range(3):
            eng.step()
        eng.submit(Run(2, "Hello there", p, True), Step())
        flushed: list[Step] = []
        eng.step(lambda part: (events.append("flush"), flushed.append(part)))  # the prompt step
        assert events[-1] == "launch"
        events.clear()
        flushed.clear()
        rest = eng.step(lambda part: (events.append("flush"), flushed.append(part)))
        assert events == ["flush", "launch"]
        assert [d[0] for d in flushed[0].deltas] == [2]  # the first token, alone
        assert [d[0] for d in rest.deltas] == [1]  # the running sequence's, after the launch
    finally:
        eng.close()


def test_every_sampling_parameter_builds_a_sampler_and_generates(engine: Engine) -> None:
    """repeat_penalty, top_k, top_p, min_p, temperature and seed, alone and together: each request
    generates its tokens (a sampler llama.cpp refused would fail the request, not the engine)."""
    variants = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repeat_penalty=1.3),
        SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True, repeat_penalty=1.1, top_k=20, top_p=0.9,
                       min_p=0.05, seed=7),
        SamplingParams(max_tokens=8, temperature=1.2, ignore_eos=True, seed=1),
    ]
    runs = [Run(900 + i, "a repeated repeated repeated prompt", p, False) for i, p in enumerate(variants)]
    out = run_all(engine, runs)
    assert sorted(out) == [900, 901, 902] and all(out.values())


def test_a_sampler_that_cannot_be_built_fails_its_request_and_frees_the_slot(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(slot: int, p: SamplingParams, matcher: object = None, **kw: object) -> None:
        raise TypeError("no such sampler")

    free = len(engine.free_ids)
    monkeypatch.setattr(engine.sampling, "admit", broken)
    out = Step()
    engine.submit(Run(950, "hello", SamplingParams(max_tokens=4, temperature=0.7), False), out)
    while engine.busy:
        step = engine.step()
        out.failed += step.failed
    assert [f[:2] for f in out.failed] == [(950, "internal")] and "no such sampler" in out.failed[0].message
    assert len(engine.free_ids) == free


def test_an_error_escaping_the_engine_thread_ends_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail-stop: never a dead engine thread behind a worker that still says it is ready."""
    import zmq

    from llamapool.worker import server

    class Exploding:
        busy, active, waiting = True, {}, []

        def step(self, flush: object = None) -> Step:
            raise RuntimeError("boom")

    codes: list[int] = []
    monkeypatch.setattr(server.os, "_exit", codes.append)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://engine-out-test")
    loop = server.EngineLoop(Exploding(), ctx, "inproc://engine-out-test", "t0")
    loop.run()
    pull.close(linger=0)
    ctx.term()
    assert codes == [server.EXIT_ENGINE]


def test_repeat_penalty_applies_on_the_backend_sampling_path_too(model_path: str, engine: Engine) -> None:
    """llama.cpp cannot run the penalties sampler inside the decode graph: on the GPU path such a
    request is sampled on the host, and gives the same text as the CPU path (it once was silently
    sampled greedily, without the penalty)."""
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=256, n_ubatch=256,
                              threads=2, backend_sampling=True))
    try:
        pen = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repeat_penalty=3.0)
        runs = [Run(20, "a b a b a b", pen, False), Run(21, "a b a b a b", GREEDY, False)]
        gpu_path, cpu_path = run_all(eng, runs), run_all(engine, runs)
        assert gpu_path == cpu_path
        assert gpu_path[20] != run_all(engine, [Run(22, "a b a b a b", SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True), False)])[22], "the penalty changes the text"
        assert run_all(eng, [Run(23, "y", GREEDY, False)])[23] == run_all(engine, [Run(23, "y", GREEDY, False)])[23]
        assert len(eng.free_ids) == 4
    finally:
        eng.close()


def logprob_runs(eng: Engine, runs: list[Run]) -> dict[int, tuple[str, list]]:
    """Each run's text and every logprob record it got, streamed (deltas) and in its result."""
    got: dict[int, list] = {r.rid: [] for r in runs}
    out: dict[int, tuple[str, list]] = {}
    for r in runs:
        eng.submit(r, Step())
    while eng.busy:
        step = eng.step()
        assert not step.failed
        for d in step.deltas:
            got[d.rid] += d.logprobs or []
        for d in step.done:
            out[d.rid] = (d.text, got[d.rid] + (d.logprobs or []))
    return out


def test_logprobs_of_a_pipelined_step_equal_the_host_steps(model_path: str, engine: Engine) -> None:
    """With the step pipelined (backend sampling), a step's logprob rows are copied off the logits and
    their records made after the next launch: the same records, in the same places, as computed before
    it; a sequence that ends (its length, a stop string) has all of its records, none pending."""
    eng = Engine(EngineConfig(model_path, slots=6, ctx_per_slot=256, max_batch_tokens=64, n_ubatch=256,
                              threads=2, backend_sampling=True))
    lp = [dataclasses.replace(GREEDY, logprobs=True, top_logprobs=k, max_tokens=6 + 3 * k) for k in (0, 1, 5, 20)]
    stop = dataclasses.replace(GREEDY, logprobs=True, top_logprobs=2, max_tokens=40)
    try:
        first = run_all(engine, [Run(99, "water", stop, False)])[99]
        stop = dataclasses.replace(stop, stop=(first[5:8],))  # a stop string the reply meets
        runs = [Run(i, PROMPTS[i], p, i % 2 == 0) for i, p in enumerate([*lp, stop, GREEDY])]
        runs[4] = Run(4, "water", stop, True)
        want, got = logprob_runs(engine, runs), logprob_runs(eng, runs)
    finally:
        eng.close()
    assert [got[r][0] for r in sorted(got)] == [want[r][0] for r in sorted(want)]
    for rid in range(5):
        a, b = got[rid][1], want[rid][1]
        assert len(a) == len(b) > 0 and all(x.token for x in a)  # none left pending
        assert [x.token for x in a] == [x.token for x in b]
        assert [[t.token for t in x.top] for x in a] == [[t.token for t in x.top] for x in b]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)) < 1e-5
    assert [len(x.top) for x in got[3][1]] == [20] * len(got[3][1])
    assert got[4][0].endswith(first[:5]) and not got[5][1]


def test_an_engine_waiting_only_for_grammars_is_stalled_not_busy_stepping(model_path: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """While every waiting run waits for its grammar to compile and nothing runs, ``stalled`` says so (the
    worker's loop then waits 2 ms between steps instead of spinning a core); once compiled, it runs."""
    import time

    from llamapool.worker import constraints

    build = constraints.Grammars._build

    def slow(self: constraints.Grammars, spec: object) -> object:
        time.sleep(0.3)
        return build(self, spec)  # type: ignore[arg-type]

    monkeypatch.setattr(constraints.Grammars, "_build", slow)
    eng = Engine(EngineConfig(model_path, slots=2, ctx_per_slot=256, threads=2))
    try:
        p = dataclasses.replace(GREEDY, max_tokens=4, ignore_eos=False, json_schema={"type": "object"})
        eng.submit(Run(1, "x", p, False), Step())
        eng.step()
        assert eng.busy and eng.stalled
        done = []
        end = time.monotonic() + 30
        while eng.busy and time.monotonic() < end:
            done += eng.step().done
        assert not eng.stalled and [d.rid for d in done] == [1]
    finally:
        eng.close()


def test_a_chat_of_more_messages_than_the_context_is_refused_before_it_is_rendered(engine: Engine) -> None:
    """Every message renders to a token at least: 100,000 one-letter messages are refused at once (their
    rendering held the engine thread 8-14 s before its context_length_exceeded)."""
    import time

    out = Step()
    t0 = time.monotonic()
    engine.submit(Run(7, [{"role": "user", "content": "a"}] * 100_000, GREEDY, False), out)
    assert time.monotonic() - t0 < 0.5
    assert [(f.code, f.field) for f in out.failed] == [("context_length_exceeded", "messages")], out.failed
    assert "the chat has 100000 messages" in out.failed[0].message


def test_a_decode_only_batch_is_filled_as_the_general_path_fills_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``batch.fill``'s decode-only path (consecutive slots, a decode token each) writes the same batch rows,
    positions, outputs and shape as its general path."""
    from types import SimpleNamespace

    import numpy as np

    from llamapool.worker.engine import batch as batch_mod
    from llamapool.worker.engine.sequence import Sequence

    def seqs() -> dict[int, Sequence]:
        return {sid: Sequence(rid=sid, seq_id=sid, tokens=np.arange(5, dtype=np.int32), params=GREEDY, stream=False,
                              sampling=SimpleNamespace(in_graph=False), text=None,  # type: ignore[arg-type]
                              n_past=5 + sid, last=100 + sid) for sid in range(3, 3 + n)}

    for n in (1, 2, 5):
        got = []
        for general in (False, True):
            if general:
                monkeypatch.setattr(batch_mod, "_decode_only", lambda *a: False)
            b, active = batch_mod.Batch(16), seqs()
            filled = batch_mod.fill(b, dict.fromkeys(active, 1), active, {}, None, 512)
            got.append((b.n, b.token[: b.n].tolist(), b.pos[: b.n].tolist(), b.seq[: b.n].tolist(),
                        b.logits[: b.n].tolist(), [s.seq_id for s in filled.outputs], filled.shape, filled.split,
                        [(s.n_past, s.rows) for s in active.values()]))
        monkeypatch.undo()
        assert got[0] == got[1]
        assert got[0][0] == n and got[0][1] == [100 + sid for sid in range(3, 3 + n)]
