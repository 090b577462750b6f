"""LoRA adapters (issue 55, part 3): ``make-model --lora``, ``[[models.lora]]``, an adapter named as the model
(vLLM's way) or per request in ``lora`` (llama-server's field), /v1/models, and bad input.

The real engine on the tiny random-weight model and two random adapters of it, the daemon as a process over
real sockets; each reply is compared with llama-cpp-python's own single-stream run with the adapter applied
(``Llama(lora_path=..., lora_scale=...)``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamapool.modelgen import LORA_TARGETS, make_lora
from tests.conftest import Daemon, free_port, launch, reference_llama
from tests.test_gateway import wait_http

# long enough that a prompt's KV is reused from the prefix cache (a block and more)
PROMPTS = ("The history of the city begins in the twelfth century, when a small market grew up on the banks "
           "of the river and the people of the valley came to trade", "Once upon a time there was a")
MAX_TOKENS = 16
BASE = "tiny"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("lora")
    return {"a": str(make_lora(folder / "a.gguf", model_path, seed=1)),
            "b": str(make_lora(folder / "b.gguf", model_path, seed=2, rank=4))}


def reference(model_path: str, prompt: str, lora: str | None = None, scale: float = 1.0) -> str:
    """llama-cpp-python's greedy completion of ``prompt``, with the adapter file ``lora`` at ``scale``."""
    kw: dict[str, Any] = {"lora_path": lora, "lora_scale": scale} if lora else {}
    llm = reference_llama(model_path, n_ctx=512, n_threads=1, **kw)
    try:
        out: list[int] = []
        for tok in llm.generate(llm.tokenize(prompt.encode()), top_k=1, temp=0.0, repeat_penalty=1.0):
            if llm.token_eos() == tok or len(out) == MAX_TOKENS:
                break
            out.append(tok)
        return llm.detokenize(out).decode(errors="replace")  # a byte token's broken UTF-8 as the daemon sends it
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected(model_path: str, adapters: dict[str, str]) -> dict[tuple[str, str], str]:
    """(prompt, what is applied: "base", "a" (scale 1), "b" (0.5), "b1" (1), "a+b") -> llama.cpp's text. Both
    adapters at once have no reference in llama-cpp-python (one lora_path): "a+b" is left out."""
    runs = {"base": (None, 1.0), "a": (adapters["a"], 1.0), "b": (adapters["b"], 0.5), "b1": (adapters["b"], 1.0)}
    return {(p, k): reference(model_path, p, *v) for p in PROMPTS for k, v in runs.items()}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model_path: str,
         adapters: dict[str, str]) -> Iterator[tuple[Daemon, str]]:
    """``tiny`` with adapters ``tiny-a`` (scale 1) and ``tiny-b`` (0.5), and ``plain`` (none), one CPU worker
    each, deterministic (a reply depends on the request alone), with the HTTP gateway."""
    port = free_port()
    common = {"path": model_path, "ctx_per_slot": 512, "max_batch_tokens": 512, "n_ubatch": 512,
              "cpu_workers": 1, "deterministic": True}
    lora = [{"name": "tiny-a", "path": adapters["a"]}, {"name": "tiny-b", "path": adapters["b"], "scale": 0.5}]
    d = launch(tmp_path_factory.mktemp("lora-daemon"), model_path,
               models=[{"name": BASE, "lora": lora, **common}, {"name": "plain", **common}],
               http={"listen": f"127.0.0.1:{port}"})
    try:
        d.wait_ready(2)
        url = f"http://127.0.0.1:{port}"
        wait_http(url, d)
        yield d, url
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def complete(url: str, prompt: str, model: str = BASE, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, **extra}, timeout=120)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_make_model_lora_writes_an_adapter_llama_cpp_loads(tmp_path: Path, model_path: str,
                                                           adapters: dict[str, str],
                                                           expected: dict[tuple[str, str], str]) -> None:
    import gguf

    r = gguf.GGUFReader(adapters["a"])
    assert r.get_field("general.type").contents() == "adapter"  # type: ignore[union-attr]
    assert r.get_field("adapter.type").contents() == "lora"  # type: ignore[union-attr]
    assert r.get_field("adapter.lora.alpha").contents() == 16.0  # type: ignore[union-attr]
    names = {t.name for t in r.tensors}
    assert names == {f"blk.{i}.{m}.weight.lora_{ab}" for i in range(2) for m in LORA_TARGETS for ab in "ab"}
    # the adapter changes greedy output (llama.cpp loaded it: its text is another)
    for p in PROMPTS:
        assert expected[(p, "a")] != expected[(p, "base")]
        assert expected[(p, "b")] != expected[(p, "base")] and expected[(p, "b")] != expected[(p, "b1")]
    # the CLI writes the same bytes; a file that is no model is refused, naming --lora
    out = tmp_path / "cli.gguf"
    cli = [sys.executable, "-m", "llamapool.cli", "make-model", str(out), "--seed", "1"]
    subprocess.run([*cli, "--lora", model_path], check=True, capture_output=True)
    assert out.read_bytes() == Path(adapters["a"]).read_bytes()
    bad = subprocess.run([*cli, "--lora", adapters["a"], "--seed", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--lora" in bad.stderr, bad.stderr


def test_an_adapter_named_as_the_model_gives_llama_cpps_reply_with_it(
        pool: tuple[Daemon, str], expected: dict[tuple[str, str], str]) -> None:
    _, url = pool
    for p in PROMPTS:
        base = complete(url, p)
        assert text_of(base) == expected[(p, "base")]
        r = complete(url, p, "tiny-a")
        assert text_of(r) == expected[(p, "a")] != expected[(p, "base")]
        assert r.json()["model"] == "tiny-a"  # the reply names the model asked for
        assert text_of(complete(url, p, "tiny-b")) == expected[(p, "b")]  # its configured scale, 0.5
        assert text_of(complete(url, p)) == expected[(p, "base")]  # the base again: no adapter left applied


def test_the_lora_field_by_id_and_name_with_a_scale(pool: tuple[Daemon, str],
                                                    expected: dict[tuple[str, str], str]) -> None:
    _, url = pool
    p = PROMPTS[0]
    assert text_of(complete(url, p, lora=[{"id": 0, "scale": 1.0}])) == expected[(p, "a")]
    assert text_of(complete(url, p, lora=[{"name": "tiny-b"}])) == expected[(p, "b")]  # no scale: configured
    assert text_of(complete(url, p, lora=[{"id": 1, "scale": 1.0}])) == expected[(p, "b1")]
    assert text_of(complete(url, p, "tiny-b", lora=[{"name": "tiny-b", "scale": 1}])) == expected[(p, "b1")]
    assert text_of(complete(url, p, lora=[{"id": 0, "scale": 0}])) == expected[(p, "base")]  # scale 0: off
    assert text_of(complete(url, p, lora=[])) == expected[(p, "base")]
    both = text_of(complete(url, p, lora=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]))
    assert both not in (expected[(p, "a")], expected[(p, "b")], expected[(p, "base")])
    assert text_of(complete(url, p, "tiny-a", lora=[{"name": "tiny-b"}])) == both  # the model's adapter and more
    # chat: the same field
    chat = {"messages": [{"role": "user", "content": "Tell me about the river"}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    replies = [httpx.post(f"{url}/v1/chat/completions", json={**chat, **body}, timeout=120)
               for body in ({"model": BASE}, {"model": BASE, "lora": [{"name": "tiny-a"}]}, {"model": "tiny-a"})]
    texts = []
    for r in replies:
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[1] == texts[2] != texts[0]
    streamed = ""  # streamed: the same text
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "model": "tiny-a", "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["model"] == "tiny-a"
                streamed += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert streamed == texts[2]


def test_the_prefix_cache_keeps_each_adapter_sets_kv_apart(pool: tuple[Daemon, str],
                                                          expected: dict[tuple[str, str], str]) -> None:
    """A prompt the base model just computed is computed again under an adapter (none of its KV reused), and
    an adapter's own earlier KV is reused for it."""
    _, url = pool
    p = "In the north of the country the mountains rise above the lakes, and the roads that cross them are " \
        "closed for the winter months"  # no test before computed it
    complete(url, p)
    assert complete(url, p).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    under_a = complete(url, p, "tiny-a")
    # at most the BOS token, from an earlier prompt under tiny-a (never the base's KV of the prompt)
    assert under_a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= 1
    again = complete(url, p, "tiny-a")
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert text_of(again) == text_of(under_a)
    base = complete(url, p, lora=[{"id": 0, "scale": 0.5}])  # another scale: another set
    assert base.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_base_and_adapter_requests_together_each_get_their_own_reply(
        pool: tuple[Daemon, str], expected: dict[tuple[str, str], str]) -> None:
    d, url = pool
    asks: list[tuple[str, str, dict[str, Any]]] = []
    for p in PROMPTS:
        asks += [(p, "base", {}), (p, "a", {"model": "tiny-a"}), (p, "b", {"model": "tiny-b"}),
                 (p, "b1", {"lora": [{"id": 1, "scale": 1.0}]}), (p, "base", {}), (p, "a", {"lora": [{"id": 0}]})]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        p, _, extra = asks[i]
        try:
            got[i] = text_of(complete(url, p, **{"model": BASE, **extra}))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i, (p, which, _) in enumerate(asks):
        assert got[i] == expected[(p, which)], (i, which)
    # the SDK: the adapter as its model, and the lora parameter
    with d.client() as c:
        r = c.generate(PROMPTS[1], model="tiny-a", max_tokens=MAX_TOKENS, temperature=0)
        assert r.text == expected[(PROMPTS[1], "a")] and r.model == "tiny-a"
        r = c.generate(PROMPTS[1], model=BASE, lora=[{"id": 1, "scale": 1.0}], max_tokens=MAX_TOKENS, temperature=0)
        assert r.text == expected[(PROMPTS[1], "b1")]


def test_v1_models_lists_each_adapter_under_its_model(pool: tuple[Daemon, str]) -> None:
    _, url = pool
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    ids = [m["id"] for m in data]
    assert ids == [BASE, "tiny-a", "tiny-b", "plain"]
    rows = {m["id"]: m for m in data}
    assert rows["tiny-a"]["parent"] == BASE and rows["tiny-b"]["lora_scale"] == 0.5
    assert "parent" not in rows["plain"]
    assert httpx.get(f"{url}/v1/models/tiny-b", timeout=10).json()["parent"] == BASE
    # an adapter's vocabulary is its model's: tokenize names either (llama-server's /tokenize)
    toks = [httpx.post(f"{url}/tokenize", json={"model": m, "content": PROMPTS[1]}, timeout=10)
            for m in (BASE, "tiny-a")]
    assert toks[0].status_code == 200 and toks[0].json()["tokens"], toks[0].text
    assert toks[0].json() == toks[1].json(), toks[1].text


@pytest.mark.parametrize(("model", "lora", "param"), [
    (BASE, [{"name": "nope"}], "lora[0].name"),
    (BASE, [{"id": 0}, {"id": 2}], "lora[1].id"),
    (BASE, [{"id": 0, "scale": 100}], "lora[0].scale"),
    (BASE, [{"id": 0, "scale": "1"}], "lora[0].scale"),
    (BASE, [{"id": 0, "name": "tiny-a"}], "lora[0]"),
    (BASE, [{"id": -1}], "lora[0].id"),
    (BASE, {"id": 0}, "lora"),
    ("plain", [{"id": 0}], "lora"),
    ("tiny-c", None, "model"),
])
def test_bad_lora_input_is_a_400_naming_the_parameter(pool: tuple[Daemon, str], model: str, lora: Any,
                                                      param: str) -> None:
    d, url = pool
    extra = {} if lora is None else {"lora": lora}
    r = complete(url, "hi", model, **extra)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert d.proc.poll() is None
    assert complete(url, "hi", "tiny-a").status_code == 200  # the worker serves on


def test_a_scale_that_is_not_finite_is_refused(pool: tuple[Daemon, str]) -> None:
    _, url = pool
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "lora": [{"id": 0, "scale": Infinity}]}'
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora[0].scale", r.text


@pytest.mark.parametrize(("lora", "where"), [
    ([{"name": "x", "path": "a.gguf", "scale": 17}], "models[0].lora[0].scale"),
    ([{"name": "x", "path": "a.gguf", "scale": float("nan")}], "models[0].lora[0].scale"),
    ([{"name": "x", "path": "a.gguf", "weight": 1}], "models[0].lora[0].weight"),
    ([{"name": "x"}], "models[0].lora[0].path"),
    ([{"name": "x", "path": "a.gguf"}, {"name": "x", "path": "b.gguf"}], "models[0].lora[1].name"),
    ([{"name": "m", "path": "a.gguf"}], "models[0].lora[0].name"),  # the model's own name
    ([{"name": "bad name", "path": "a.gguf"}], "models[0].lora[0].name"),
    ([{"name": "x", "path": "hf:nobody"}], "models[0].lora[0].path"),
    ("a.gguf", "models[0].lora"),
])
def test_bad_lora_tables_are_config_errors_naming_the_key(lora: Any, where: str) -> None:
    from llamapool.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({"models": [{"name": "m", "path": "m.gguf", "lora": lora}]}, base_dir=Path("/cfg"))
    assert str(e.value).startswith(f"{where}:"), str(e.value)


def test_lora_tables_resolve_paths_as_model_paths_do(tmp_path: Path) -> None:
    from llamapool.config import ConfigError, from_dict

    cfg = from_dict({"models": [{"name": "m", "path": "m.gguf", "lora": [
        {"name": "a", "path": "ad/a.gguf", "scale": -0.5}, {"name": "b", "path": "hf:owner/repo/b.gguf"}]},
        {"name": "n", "path": "n.gguf"}]}, base_dir=tmp_path)
    assert cfg.models[0].lora == (("a", str(tmp_path / "ad" / "a.gguf"), -0.5), ("b", "hf:owner/repo/b.gguf", 1.0))
    assert cfg.adapters == [("a", "m", -0.5), ("b", "m", 1.0)]
    with pytest.raises(ConfigError, match=r"^models\[1\].lora\[0\].name: 'a' is also the name of models\[0\].lora"):
        from_dict({"models": [{"name": "m", "path": "m.gguf", "lora": [{"name": "a", "path": "a.gguf"}]},
                              {"name": "n", "path": "n.gguf", "lora": [{"name": "a", "path": "a.gguf"}]}]})
    for other in ({"embedding": True}, {"task": "rerank"}, {"engine": "echo"}):
        with pytest.raises(ConfigError, match=r"^models\[0\].lora: adapters apply to a generative"):
            from_dict({"models": [{"name": "m", "path": "m.gguf", **other, "lora": [{"name": "a", "path": "a.gguf"}]}]})


def test_fair_pick_takes_each_adapter_set_with_work_in_turn() -> None:
    from llamapool.worker.engine.adapters import BASE, fair_pick

    a, b = ((0, 1.0),), ((1, 0.5),)
    turns, last = [], BASE
    for _ in range(6):
        last = fair_pick([b, BASE, a, a], last)
        turns.append(last)
    assert turns == [a, b, BASE, a, b, BASE]
    assert fair_pick([b], a) == b and fair_pick([], a) == a


def test_an_adapter_of_another_base_stops_the_start_naming_it(tmp_path: Path, model_path: str) -> None:
    from llamapool.modelgen import make_model

    other = make_lora(tmp_path / "other-lora.gguf", make_model(tmp_path / "wide.gguf", n_embd=128, n_ff=256))
    d = launch(tmp_path / "d", model_path, models=[{"name": BASE, "path": model_path, "ctx_per_slot": 256,
                                                    "lora": [{"name": "wide-lora", "path": str(other)}]}],
               workers={"cpu_workers": 1})
    assert d.proc.wait(60) == 78  # EX_CONFIG: every worker failed at start-up, not restarted
    assert "LoRA adapter 'wide-lora': llama.cpp cannot load" in d.log_text()


def test_responses_and_messages_take_adapters_too(pool: tuple[Daemon, str]) -> None:
    """The Responses API and Anthropic's Messages: an adapter as the model, and the lora field, agree."""
    _, url = pool
    texts = {}
    for name, body in (("base", {"model": BASE}), ("model", {"model": "tiny-a"}),
                       ("field", {"model": BASE, "lora": [{"name": "tiny-a"}]})):
        r = httpx.post(f"{url}/v1/responses", json={"input": "Tell me about the river", "max_output_tokens": 12,
                                                     "temperature": 0, "store": False, **body}, timeout=60)
        assert r.status_code == 200, r.text
        texts[f"responses-{name}"] = r.json()["output"][0]["content"][0]["text"]
        m = httpx.post(f"{url}/v1/messages", json={"messages": [{"role": "user", "content": "Tell me about the river"}],
                                                   "max_tokens": 12, "temperature": 0, **body}, timeout=60)
        assert m.status_code == 200, m.text
        texts[f"messages-{name}"] = m.json()["content"][0]["text"]
        if name == "model":
            assert r.json()["model"] == "tiny-a" and m.json()["model"] == "tiny-a"
    for door in ("responses", "messages"):
        assert texts[f"{door}-model"] == texts[f"{door}-field"] != texts[f"{door}-base"], texts
    bad = httpx.post(f"{url}/v1/responses", json={"model": BASE, "input": "hi", "lora": [{"name": "nope"}]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora[0].name", bad.text


def test_the_host_tier_keeps_each_adapter_sets_kv_apart(model_path: str, adapters: dict[str, str]) -> None:
    """The engine alone (2 slots, a host tier): a session's KV saved to the tier under the base model is never
    restored for it under an adapter, and its KV under the adapter is, for the adapter only; each text is the
    one an engine without a tier gives."""
    import numpy as np

    from llamapool.protocol.messages import Run, SamplingParams, Step
    from llamapool.worker.engine import Engine, EngineConfig

    base = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    under_a = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora=({"id": 0},))
    lora = (("tiny-a", adapters["a"], 1.0),)

    def engine(kv_host: str) -> Engine:
        return Engine(EngineConfig(model_path, slots=2, ctx_per_slot=512, max_batch_tokens=256, n_ubatch=256,
                                   threads=1, kv_host=kv_host, deterministic=True, lora=lora))

    def run(eng: Engine, rid: int, tokens: list[int], p: SamplingParams) -> tuple[str, int]:
        before = eng.reused_tokens
        eng.submit(Run(rid, tokens, p, False), Step())
        text = ""
        while eng.busy:
            step = eng.step()
            assert not step.failed, step.failed
            text = next((d[2] for d in step.done), text)
        return text, eng.reused_tokens - before

    rng = np.random.default_rng(5)
    a, b, c, d = (rng.integers(3, 500, 150).tolist() for _ in range(4))
    tiered, plain = engine("64MiB"), engine("0")
    try:
        for i, s in enumerate((a, b, c)):  # a's KV (the base model's) goes to the tier when c takes its slot
            run(tiered, i, s, base)
        hits = tiered.kv_host()["hits"]
        text, reused = run(tiered, 10, a, under_a)
        assert reused <= 1 and tiered.kv_host()["hits"] == hits  # at most a BOS, never the base's KV of a
        assert text == run(plain, 10, a, under_a)[0] != run(plain, 11, a, base)[0]
        run(tiered, 12, d, base)  # a's KV under the adapter goes to the tier too
        run(tiered, 13, b, base)
        text, reused = run(tiered, 14, a + [7] * 5, under_a)
        assert reused >= 0.9 * len(a) and tiered.kv_host()["hits"] == hits + 1  # the adapter's own entry
        assert text == run(plain, 15, a + [7] * 5, under_a)[0]
        text, reused = run(tiered, 16, a + [7] * 5, base)
        assert reused >= 0.9 * len(a)  # the base's entry, kept beside it
        assert text == run(plain, 17, a + [7] * 5, base)[0]
    finally:
        tiered.close()
        plain.close()


def test_a_sighup_adds_and_removes_adapters(tmp_path: Path, model_path: str, adapters: dict[str, str],
                                            expected: dict[tuple[str, str], str]) -> None:
    """Adapters at run time by reload: an edited [[models.lora]] and a SIGHUP, the model's worker replaced."""
    from llamapool import UnknownModelError
    from tests.conftest import write_config

    table = {"name": BASE, "path": model_path, "ctx_per_slot": 512, "max_batch_tokens": 512, "n_ubatch": 512,
             "cpu_workers": 1, "deterministic": True}
    d = launch(tmp_path, model_path, models=[table])
    try:
        d.wait_ready(1)
        p = PROMPTS[1]
        with d.client() as c:
            with pytest.raises(UnknownModelError):
                c.generate(p, model="tiny-a", max_tokens=2)
            for n, lora in enumerate(([{"name": "tiny-a", "path": adapters["a"]}], [])):
                write_config(d.config, model_path, d.config.parent / "run", models=[{**table, "lora": lora}])
                d.proc.send_signal(signal.SIGHUP)
                end = time.monotonic() + 120
                while d.log.read_text(errors="replace").count("reload done") <= n:
                    assert time.monotonic() < end, d.log_text()
                    time.sleep(0.1)
                d.wait_ready(1)
                if lora:
                    r = c.generate(p, model="tiny-a", max_tokens=MAX_TOKENS, temperature=0)
                    assert r.text == expected[(p, "a")] and r.model == "tiny-a"
                    assert c.status()["models"][0]["lora"] == [{"id": 0, "name": "tiny-a", "scale": 1.0}]
                else:
                    with pytest.raises(UnknownModelError):
                        c.generate(p, model="tiny-a", max_tokens=2)
                    assert "lora" not in c.status()["models"][0]
            assert c.generate(p, max_tokens=MAX_TOKENS, temperature=0).text == expected[(p, "base")]
    finally:
        d.stop(signal.SIGQUIT, timeout=30)
