"""The same request gets the same reply (issue 46): with ``model.deterministic = true`` (CPU workers) a
greedy reply, and a sampled one with a seed, depends on the request alone: not on what the prefix cache
held, nor on the requests decoding or prefilling beside it, nor on when it arrived.

Real models, the daemon as a process: Gemma 3 270M (Q4_K_M: its Q4_K and Q6_K products of 8 rows or
more take llama.cpp's tiled kernels, which round otherwise than one row's, so a prompt computed whole
and one whose cached prefix leaves a few tokens differ without the mode: scripts/determinism_probe.py,
in git history)
and SmolLM2-135M-Instruct (chat). Held prompts include a long one reused across Gemma 3's 512-token
sliding window and one whose cached prefix leaves fewer than 8 tokens to compute.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamapool import default_model
from llamapool.worker.scheduler import at_least_two

from .conftest import Daemon, launch
from .neighbours import Neighbours

GEMMA, SMOL = "gemma-3-270m", "smollm2-135m-instruct"
HISTORY = ("The history of the city begins in the twelfth century, when a small market grew up on the banks of "
           "the river. Over the next three hundred years")
FACTS = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(70))
# (model, prompt): a text for Gemma, a chat for SmolLM2
HELD: list[tuple[str, Any]] = [
    (GEMMA, "Once upon a time"),
    (GEMMA, HISTORY),
    (GEMMA, HISTORY + ", the town"),  # its cached prefix (HISTORY's) leaves 3 tokens to compute
    (GEMMA, f"{FACTS}\nQuestion: is the number 12 even or odd?\nAnswer: the number 12 is"),
    (GEMMA, f"{FACTS}\nQuestion: is the number 31 even or odd?\nAnswer: the number 31 is"),
    (SMOL, [{"role": "user", "content": "What is the capital of France?"}]),
    (SMOL, [{"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"}]),
]
MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _models(gemma: str, smollm2: str, **extra: Any) -> dict[str, Any]:
    common = {"devices": "cpu", "cpu_workers": 1, "threads": 1, "max_batch_tokens": 512, "n_ubatch": 512,
              "deterministic": True, **extra}
    return {"models": [{"path": gemma, "name": GEMMA, "ctx_per_slot": 2048, "slots": 8, **common},
                       {"path": smollm2, "name": SMOL, "ctx_per_slot": 2048, "slots": 4, **common}]}


@pytest.fixture(scope="module")
def gemma() -> str:
    return str(default_model.fetch(Path(__file__).resolve().parent.parent / "models"))


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, gemma: str, smollm2: str) -> Iterator[tuple[Daemon, Daemon]]:
    """Two daemons of both models in deterministic mode: one with the prefix cache, one without."""
    cached = launch(tmp_path_factory.mktemp("cached"), gemma, **_models(gemma, smollm2))
    plain = launch(tmp_path_factory.mktemp("plain"), gemma, **_models(gemma, smollm2, prefix_cache=False))
    try:
        cached.wait_ready(2, timeout=180)
        plain.wait_ready(2, timeout=180)
        yield cached, plain
    finally:
        cached.stop()
        plain.stop()


def _ask(c: Any, model: str, prompt: Any, **params: Any) -> str:
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, **params}
    done = c.chat(prompt, model=model, **params) if isinstance(prompt, list) else c.generate(prompt, model=model,
                                                                                            **params)
    return str(done.text)


def _alone(d: Daemon, **params: Any) -> list[str]:
    with d.client() as c:
        return [_ask(c, m, p, **params) for m, p in HELD]


LONG_PROMPT = " ".join(f"Line {i}: the river runs past the market and the mill." for i in range(100))


def neighbours(d: Daemon) -> Neighbours:
    """Requests decoding beside the held ones on both models: constrained (a JSON schema), sampled, and a
    long prompt; started before them, so that the held prompts arrive mid-decode."""
    return Neighbours(d, [job for m in (GEMMA, SMOL) for job in (
        (m, "A person, as JSON:", {"json_schema": SCHEMA, "temperature": 0.0, "max_tokens": 60}),
        (m, "A recipe for bread:", {"temperature": 0.9, "seed": 3, "max_tokens": 200, "ignore_eos": True}),
        (m, LONG_PROMPT, {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}))])


def _concurrently(d: Daemon, stagger: float = 0.0, **params: Any) -> list[str]:
    """The held requests at once, each from a thread of its own (``stagger``: seconds between arrivals)."""
    out: list[str | BaseException] = [RuntimeError("no reply")] * len(HELD)

    def one(i: int) -> None:
        try:
            with d.client() as c:
                out[i] = _ask(c, *HELD[i], **params)
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(HELD))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(300)
    assert not [o for o in out if isinstance(o, BaseException)], out
    return [str(o) for o in out]


def test_a_greedy_reply_depends_on_the_request_alone(daemons: tuple[Daemon, Daemon]) -> None:
    cached, plain = daemons
    first = _alone(cached)  # first calls (prompts sharing a prefix with an earlier one reuse it)
    assert all(first), first
    assert _alone(cached) == first, "a prompt on its cached prefix"
    assert _alone(plain) == first, "without a prefix cache"
    with neighbours(cached):  # beside constrained, sampled and long neighbours, arriving mid-decode
        assert _concurrently(cached) == first, "all at once, beside neighbours"
    with neighbours(plain):
        assert _concurrently(plain, stagger=0.3) == first, "one by one mid-decode, no prefix cache"


def test_a_sampled_reply_with_a_seed_is_the_same_every_time(daemons: tuple[Daemon, Daemon]) -> None:
    cached, _ = daemons
    sampled = {"temperature": 0.9, "seed": 11, "max_tokens": 32}
    first = _alone(cached, **sampled)
    with neighbours(cached):
        assert _concurrently(cached, stagger=0.3, **sampled) == first
    with cached.client() as c:  # the seed decides: another seed, another reply
        assert [_ask(c, m, p, **{**sampled, "seed": 12}) for m, p in HELD[:2]] != first[:2]


def test_prompt_chunks_and_what_they_leave_are_two_tokens_or_more() -> None:
    for remaining in range(1, 40):
        for n in range(1, remaining + 1):
            for cap in (3, 4, 16):
                k = at_least_two(n, remaining, cap)
                assert 1 <= k <= min(remaining, cap)
                assert k >= 2 or remaining == 1
                assert remaining - k != 1, (n, remaining, cap, k)
                assert abs(k - n) <= 1 or n > cap or n < 2  # moved by one token at most


def test_a_deterministic_step_holds_decode_tokens_or_prompt_chunks_of_two_or_more(
        model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's batches in the mode: a step decodes (two rows or more: a lone sequence is padded) or
    computes prompt chunks (each at least two tokens, a sequence's chunk contiguous in the batch), never
    both; a prompt on a cached prefix still computes its last two tokens."""
    from llamapool.protocol.messages import Run, Step
    from llamapool.protocol.params import SamplingParams
    from llamapool.worker.engine import Engine, EngineConfig

    # the engine turns the tiled kernels off in its process's environment: undone after the test, or every
    # daemon started later in this process would inherit it (and compute otherwise than references here)
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    eng = Engine(EngineConfig(model_path, slots=4, ctx_per_slot=256, max_batch_tokens=24, n_ubatch=256, threads=2,
                              deterministic=True))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["the model server worker router pool token " * 3, "one two", "x y", "the model server worker"]
    kinds: set[str] = set()
    try:
        for i, p in enumerate(prompts + prompts):  # the second round reuses cached prefixes
            eng.submit(Run(i, p, greedy, False), Step())
            for _ in range(2 + i % 3):  # arriving while others decode
                out = eng.step()
                assert not out.failed
                b, n = eng.batch, eng.batch.n
                if not n:
                    continue
                counts = Counter(int(s) for s in b.seq[:n])
                if all(c == 1 for c in counts.values()):  # decode tokens, one a sequence, two rows or more
                    kinds.add("decode")
                    assert n >= 2, counts
                else:  # prompt chunks, each two tokens or more, and no decode token beside them
                    kinds.add("prompt")
                    assert all(c >= 2 for c in counts.values()), counts
        while eng.busy:
            eng.step()
        assert kinds == {"prompt", "decode"}
        assert eng.reused_tokens > 0
    finally:
        eng.close()
