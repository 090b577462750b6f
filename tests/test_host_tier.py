"""The host-RAM KV tier (worker/engine/hostkv.py): a session's KV outlives its slot.

The store alone (its bound, LRU, superseding, block-prefix lookup), then the engine on the tiny model:
a returning prompt whose slot another session took restores its KV and gives the greedy text a
recomputed one gives; a mismatched or corrupt entry is dropped and the prompt recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig
from llamapool.worker.engine.hostkv import BLOCK, Entry, HostStore, block_hashes
from llamapool.worker.handover import Assembler, parts
from llamapool.worker.settings import host_kv_bytes

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ID = b"model-a"


def _entry(tokens: list[int], nbytes: int = 100, identity: bytes = ID) -> Entry:
    t = np.asarray(tokens, dtype=np.int32)
    return Entry(t, np.zeros(nbytes, np.uint8), block_hashes(t, identity), identity)


def test_the_store_never_holds_more_than_its_bound_and_drops_the_least_recently_used() -> None:
    store = HostStore(capacity=350, identity=ID)
    for i in range(6):
        assert store.add(_entry([i] * 40))
        assert store.stats.bytes <= 350
    assert [int(e.tokens[0]) for e in store.entries.values()] == [3, 4, 5]
    t3 = np.asarray([3] * 40, np.int32)
    assert store.covers(t3, block_hashes(t3, ID))  # touched: now the most recently used
    store.add(_entry([9] * 40))
    assert [int(e.tokens[0]) for e in store.entries.values()] == [5, 3, 9]
    assert store.stats.evictions == 4
    assert not store.add(_entry([1] * 40, nbytes=351)), "an entry larger than the bound is never kept"


def test_a_prompt_sharing_only_the_first_blocks_finds_the_entry_and_its_exact_common_prefix() -> None:
    store = HostStore(capacity=10_000, identity=ID)
    base = list(range(100, 100 + 5 * BLOCK))
    store.add(_entry(base))
    want = np.asarray(base[: 2 * BLOCK + 5] + [1] * 40, np.int32)
    eid, n = store.find(want, block_hashes(want, ID))
    assert eid >= 0 and n == 2 * BLOCK + 5
    other = np.asarray([1] * 80, np.int32)
    assert store.find(other, block_hashes(other, ID)) == (-1, 0)
    # another model's hashes never meet this one's, even for the same tokens
    same = np.asarray(base, np.int32)
    assert set(block_hashes(same, b"model-b")).isdisjoint(block_hashes(same, ID))


def test_a_sessions_next_turn_supersedes_its_previous_entry() -> None:
    store = HostStore(capacity=10_000, identity=ID)
    turn1 = list(range(1, 1 + 3 * BLOCK))
    store.add(_entry(turn1))
    store.add(_entry(list(range(500, 500 + 3 * BLOCK))))  # another session
    store.add(_entry(turn1 + [7] * (2 * BLOCK)))
    assert sorted(len(e.tokens) for e in store.entries.values()) == [3 * BLOCK, 5 * BLOCK]
    assert store.stats.bytes == 200 and store.stats.entries == 2


def test_kv_host_setting_is_off_a_size_or_a_share_of_the_ram() -> None:
    assert host_kv_bytes("0") == 0
    assert host_kv_bytes("16MiB") == 16 << 20
    assert host_kv_bytes("auto", kv_bytes=0, workers=4, ram=64 << 30) == 4 << 30
    assert host_kv_bytes("auto", kv_bytes=1 << 20, workers=1, ram=64 << 30) == 8 << 20
    with pytest.raises(ValueError, match="kv_host"):
        host_kv_bytes("lots")


def test_a_handover_joins_its_parts_and_refuses_a_damaged_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamapool.worker import handover

    monkeypatch.setattr(handover, "PART_BYTES", 1000)
    blob = np.random.default_rng(0).integers(0, 255, 3500, dtype=np.uint8)
    sent = list(parts([(np.arange(40, dtype=np.int32), blob, ID)]))
    assert len(sent) == 4
    got = None
    asm = Assembler()
    for p in sent:
        p.source = "cpu0"
        got = asm.add(p) or got
    assert got is not None and got.intact and got.identity == ID
    assert np.array_equal(got.blob, blob) and np.array_equal(got.tokens, np.arange(40))
    sent[2].data = b"x" * len(sent[2].data)  # damaged on the way
    asm2 = Assembler()
    results = [asm2.add(p) for p in sent]
    assert results[-1] is not None and not results[-1].intact
    assert Assembler().add(sent[1]) is None, "a part without its first is dropped"


def test_a_sender_that_stops_midway_has_its_parts_dropped_and_blocks_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sibling killed in its handover leaves entries that never complete: they go once no part has come
    for STALE_SECONDS (on the worker's heartbeat, or when the pending table is full), and another sender's
    entries still join."""
    from llamapool.worker import handover

    monkeypatch.setattr(handover, "PART_BYTES", 1000)
    monkeypatch.setattr(handover, "MAX_PENDING", 2)
    blob = np.random.default_rng(1).integers(0, 255, 2500, dtype=np.uint8)
    asm = Assembler()
    for key, source in enumerate(("dead0", "dead1")):
        first = next(parts([(np.arange(8, dtype=np.int32), blob, ID)]))
        first.source, first.key = source, key
        assert asm.add(first, now=100.0) is None
    assert len(asm.pending) == 2 and asm.expire(100.0 + handover.STALE_SECONDS / 2) == 0
    live = list(parts([(np.arange(8, dtype=np.int32), blob, ID)]))
    for p in live:
        p.source = "live"
    got = [asm.add(p, now=100.0 + handover.STALE_SECONDS) for p in live]  # the full table's stale ones go first
    assert got[-1] is not None and got[-1].intact and asm.pending == {}
    assert asm.dropped == 2


# ------------------------------------------------------------ the engine

def _engine(model_path: str, kv_host: str, slots: int = 2, deterministic: bool = True) -> Engine:
    return Engine(EngineConfig(model_path, slots=slots, ctx_per_slot=512, max_batch_tokens=256, n_ubatch=256,
                               threads=2, kv_host=kv_host, deterministic=deterministic))


def _run(eng: Engine, rid: int, tokens: list[int]) -> tuple[str, int]:
    """The greedy text of one prompt alone, and the prompt tokens it reused."""
    before = eng.reused_tokens
    eng.submit(Run(rid, tokens, GREEDY, False), Step())
    text = ""
    while eng.busy:
        step = eng.step()
        assert not step.failed, step.failed
        for done in step.done:
            text = done[2]
    return text, eng.reused_tokens - before


def _sessions(n: int, length: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 500, 64).tolist()
    return [system + rng.integers(3, 500, length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def tiered(model_path: str) -> Iterator[Engine]:
    eng = _engine(model_path, "64MiB")
    yield eng
    eng.close()


def test_a_returning_session_whose_slot_was_taken_restores_its_kv_and_gives_the_recomputed_text(
        model_path: str, tiered: Engine) -> None:
    sessions = _sessions(6, 150)
    first = [_run(tiered, i, s) for i, s in enumerate(sessions)]  # 6 sessions through 2 slots
    assert tiered.kv_host()["saves"] >= 4
    plain = _engine(model_path, "0")
    try:
        for i, s in enumerate(sessions):
            turn2 = s + [7, 8, 9] * 10
            text, reused = _run(tiered, 100 + i, turn2)
            assert reused >= 0.9 * len(s), f"session {i}: {reused} of {len(s)} tokens reused"
            assert text == _run(plain, 100 + i, turn2)[0], "a restored prefix gives the recomputed greedy text"
        assert plain.kv_host() == {}
    finally:
        plain.close()
    stats = tiered.kv_host()
    assert stats["hits"] >= 4 and stats["restores"] == stats["hits"]
    assert stats["bytes"] <= stats["capacity"]
    assert first[0][1] == 0


def test_an_entry_of_another_model_or_a_corrupt_one_is_dropped_and_the_prompt_recomputed(
        model_path: str) -> None:
    eng = _engine(model_path, "64MiB")
    plain = _engine(model_path, "0")
    try:
        a, b, c = _sessions(3, 150, seed=2)
        for i, s in enumerate((a, b, c)):  # a's KV goes to the tier when c takes its slot
            _run(eng, i, s)
        assert eng.kv.host is not None
        store = eng.kv.host.store
        victim = next(e for e in store.entries.values() if np.array_equal(e.tokens[: len(a)], a))
        victim.identity = b"another model"
        text, reused = _run(eng, 10, a + [5] * 20)
        assert reused <= 64 and eng.kv_host()["failed"] == 1  # at most the shared system prompt, from a slot
        assert text == _run(plain, 10, a + [5] * 20)[0]
        _run(eng, 11, [*c, 1])  # b's KV goes to the tier
        entry = next(e for e in store.entries.values() if np.array_equal(e.tokens[: len(b)], b))
        entry.blob = np.zeros(16, np.uint8)  # not llama.cpp's state of anything
        text, reused = _run(eng, 12, b + [5] * 20)
        assert eng.kv_host()["failed"] == 2 and reused < len(b)
        assert text == _run(plain, 12, b + [5] * 20)[0]
    finally:
        eng.close()
        plain.close()


def test_a_tier_that_finds_nothing_saves_only_a_sample(model_path: str) -> None:
    """Prompts that never return (random documents): after the warm-up most slots' KV is not copied out."""
    eng = _engine(model_path, "64MiB")
    try:
        rng = np.random.default_rng(9)
        for i in range(120):
            _run(eng, i, rng.integers(3, 500, 40).tolist())
        stats = eng.kv_host()
    finally:
        eng.close()
    assert stats["unsaved"] > stats["saves"] > 0, stats
    assert stats["hits"] == 0


def test_a_restore_that_must_first_save_its_slot_into_a_full_tier_keeps_its_entry(model_path: str) -> None:
    """Two slots hold B and C, the tier (room for one session) holds A. A returns: emptying a slot for it
    saves that slot's session, which needs A's room; A is kept for the restore, the other save waits."""
    a, b, c = _sessions(3, 150, seed=11)
    probe = _engine(model_path, "64MiB")
    try:
        for i, s in enumerate((a, b, c)):
            _run(probe, i, s)
        one = max(e.nbytes for e in probe.kv.host.store.entries.values())  # type: ignore[union-attr]
    finally:
        probe.close()
    eng = _engine(model_path, f"{int(one * 1.5)}B")
    plain = _engine(model_path, "0")
    try:
        for i, s in enumerate((a, b, c)):
            _run(eng, i, s)
        assert eng.kv_host()["entries"] == 1
        text, reused = _run(eng, 10, a + [5] * 20)
        assert reused >= len(a) - 2, reused
        assert text == _run(plain, 10, a + [5] * 20)[0]
        stats = eng.kv_host()
        assert stats["hits"] == 1 and stats["failed"] == 0 and stats["bytes"] <= stats["capacity"], stats
    finally:
        eng.close()
        plain.close()


def test_the_probe_predicts_a_slots_state_size(model_path: str) -> None:
    """A GPU worker sizes its page-locked slabs from this probe (pinned.py): a token's K and V rows in every
    layer (f16) and its cell's position and sequence ids, and a fixed part; the slot probed is left empty,
    and a prompt of any length then takes what the probe predicts."""
    import llama_cpp as L

    from llamapool.worker.engine.hostkv import state_bytes, state_size

    eng = _engine(model_path, "0", slots=1)
    try:
        per, fixed = state_size(eng.ctx, 0)
        assert state_bytes(eng.ctx, 0) < fixed  # emptied
        m = eng.model
        head = L.llama_model_n_embd(m) // L.llama_model_n_head(m)
        rows = L.llama_model_n_layer(m) * L.llama_model_n_head_kv(m) * head
        assert 2 * 2 * rows <= per <= 2 * 2 * rows + 16, (per, rows)
        for n in (5, 100, 300):
            tokens = list(range(3, 3 + n))
            _run(eng, n, tokens)  # the slot keeps the prompt's and reply's KV (prefix cache)
            kept = state_bytes(eng.ctx, 0)
            assert kept == fixed + per * (n + GREEDY.max_tokens - 1), (n, kept, fixed, per)
            L.llama_memory_seq_rm(eng.mem, 0, -1, -1)
            eng.kv.cached.pop(0, None)
    finally:
        eng.close()


def test_page_locked_slabs_are_all_allocated_at_start_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slabs (a GPU worker's, here through a stand-in for ggml's CUDA host buffer type) are allocated when
    the tier is made, never while it serves: a state takes a free slab, or numpy memory when it is larger
    than a slab or every slab is taken; a slab given back is taken again; close frees every one."""
    import ctypes

    from llamapool.worker.engine import pinned

    held: dict[int, ctypes.Array[ctypes.c_char]] = {}
    freed: list[int] = []

    class Lib:
        def ggml_backend_buffer_get_base(self, handle: int) -> int:
            return ctypes.addressof(held[handle])

        def ggml_backend_buffer_free(self, handle: int) -> None:
            freed.append(handle)

    def alloc(size: int) -> int:
        held[len(held) + 1] = ctypes.create_string_buffer(size)
        return len(held)

    monkeypatch.setattr(pinned, "_cuda_host_alloc", lambda: (alloc, Lib()))
    slot = 4096
    bufs = pinned.HostBuffers(True, 3 * (slot + pinned.MARGIN) + 100, slot)
    assert bufs.pinned and len(held) == 3 and bufs.slab >= slot + pinned.MARGIN
    taken = [bufs.get(slot) for _ in range(3)]
    assert all(bufs.held_pinned(a) and bufs.held(a) == bufs.slab for a in taken)
    assert len({a.ctypes.data for a in taken}) == 3
    spare = bufs.get(slot)  # every slab taken: numpy memory
    assert not bufs.held_pinned(spare) and bufs.held(spare) == slot
    assert not bufs.held_pinned(bufs.get(bufs.slab + 1)) and bufs.bound(bufs.slab + 1) == bufs.slab + 1
    bufs.give(taken[1])
    again = bufs.get(100)
    assert again.ctypes.data == taken[1].ctypes.data and len(held) == 3  # reused, none allocated
    bufs.close()
    assert sorted(freed) == [1, 2, 3]
