"""LoRA adapters loaded and unloaded at run time (issue 55, part 3): ``llamapool load NAME --lora PATH``, the SDK's
``load_adapter`` and vLLM's ``/v1/load_lora_adapter``; ``unload``; a worker started later gets them; bad input.

The real engine on the tiny random-weight model and random adapters of it, the daemon as a process over real
sockets. A run-time adapter's replies are compared with those of the same file declared in the config
(``[[models.lora]]``), in the same deterministic daemon.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamapool import BadRequestError, LlamapoolError, UnknownModelError
from llamapool.modelgen import make_lora, make_model
from tests.conftest import Daemon, free_port, launch
from tests.test_gateway import wait_http

PROMPT = ("The history of the city begins in the twelfth century, when a small market grew up on the banks of the "
          "river and the people of the valley came to trade")
BASE = "tiny"
LONG = 3000  # tokens of the request that runs during an unload (seconds on a CPU)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("lora-files")
    wide = make_model(folder / "wide.gguf", n_embd=128, n_ff=256)
    (folder / "notes.gguf").write_text("not a GGUF at all\n")
    return {"a": str(make_lora(folder / "a.gguf", model_path, seed=1)),
            "b": str(make_lora(folder / "b.gguf", model_path, seed=2, rank=4)),
            "other-base": str(make_lora(folder / "other.gguf", wide)), "text": str(folder / "notes.gguf")}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, model_path: str,
         files: dict[str, str]) -> Iterator[tuple[Daemon, str]]:
    """``tiny`` with the config adapter ``cfg-a`` (file a), ``plain``, and the embedding model ``emb``: one CPU
    worker each (the generative ones deterministic), with the HTTP gateway."""
    port = free_port()
    common = {"path": model_path, "ctx_per_slot": 4096, "max_batch_tokens": 512, "n_ubatch": 512,
              "cpu_workers": 1, "deterministic": True}
    d = launch(tmp_path_factory.mktemp("lora-runtime"), model_path,
               models=[{"name": BASE, "lora": [{"name": "cfg-a", "path": files["a"]}], **common},
                       {"name": "plain", **common}, {"name": "emb", "path": model_path, "embedding": True}],
               workers={"restart_backoff": 0.2}, http={"listen": f"127.0.0.1:{port}"})
    try:
        d.wait_ready(3)
        url = f"http://127.0.0.1:{port}"
        wait_http(url, d)
        yield d, url
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def text(d: Daemon, model: str, prompt: str = PROMPT, **extra: Any) -> str:
    with d.client() as c:
        return c.generate(prompt, model=model, max_tokens=16, temperature=0, **extra).text


def listed(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def lora_rows(d: Daemon, model: str = BASE) -> list[dict[str, Any]]:
    return list(next(m for m in d.status()["models"] if m["name"] == model).get("lora", []))


def test_a_runtime_adapter_replies_as_the_same_file_declared_in_the_config(pool: tuple[Daemon, str],
                                                                            files: dict[str, str]) -> None:
    d, url = pool
    base, declared = text(d, BASE), text(d, "cfg-a")
    assert declared != base
    with d.client() as c:
        reply = c.load_adapter("rt-a", files["a"], model=BASE)
        assert reply["state"] == "loaded" and reply["model"] == "rt-a" and "1 worker" in reply["message"]
        try:
            assert text(d, "rt-a") == declared
            assert text(d, BASE, lora=[{"name": "rt-a"}]) == declared
            assert text(d, BASE, lora=[{"id": 1}]) == declared  # ids: the config's first, then run-time ones
            r = c.generate(PROMPT, model="rt-a", max_tokens=4, temperature=0)
            assert r.model == "rt-a"
            assert text(d, BASE) == base  # the base model again: no adapter left applied
            assert listed(url) == [BASE, "cfg-a", "rt-a", "plain", "emb"]
            rows = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
            assert rows["rt-a"]["parent"] == BASE and rows["rt-a"]["lora_scale"] == 1.0
            assert lora_rows(d) == [{"id": 0, "name": "cfg-a", "scale": 1.0},
                                    {"id": 1, "name": "rt-a", "scale": 1.0, "runtime": True}]
            # a scale of its own: the reply of the config adapter at that scale
            c.load_adapter("rt-a-half", files["a"], model=BASE, scale=0.5)
            assert text(d, "rt-a-half") == text(d, BASE, lora=[{"name": "cfg-a", "scale": 0.5}]) != declared
            assert c.unload_model("rt-a-half")["state"] == "unloading"
        finally:
            c.unload_model("rt-a")
    wait_gone(d, "rt-a")


def wait_gone(d: Daemon, name: str, timeout: float = 30.0) -> None:
    """Until the router logs that the adapter's workers freed it."""
    d.wait_log(f"LoRA adapter {name!r}: unloaded (freed", timeout)


def test_unload_refuses_the_name_lets_a_running_request_finish_then_frees_it(pool: tuple[Daemon, str],
                                                                             files: dict[str, str]) -> None:
    d, url = pool
    with d.client() as c:
        c.load_adapter("rt-b", files["b"], model=BASE)
        expected = c.generate(PROMPT, model="rt-b", max_tokens=LONG, temperature=0, ignore_eos=True).text
        first, done = threading.Event(), {}

        def long_one() -> None:
            with d.client() as c2:
                stream = c2.stream(PROMPT, model="rt-b", max_tokens=LONG, temperature=0, ignore_eos=True)
                for _ in stream:
                    first.set()
                done["completion"] = stream.completion

        t = threading.Thread(target=long_one)
        t.start()
        assert first.wait(60)
        reply = c.unload_model("rt-b")
        assert reply["state"] == "unloading" and "finish" in reply["message"]
        # refused at once, by name as the model (404 naming it) and in lora (400 naming the entry)
        with pytest.raises(UnknownModelError) as e:
            c.generate("hi", model="rt-b", max_tokens=2)
        assert "'rt-b'" in e.value.message and e.value.field == "model"
        r = httpx.post(f"{url}/v1/completions", json={"model": "rt-b", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "rt-b" in r.text, r.text
        with pytest.raises(BadRequestError) as e:
            c.generate("hi", model=BASE, lora=[{"name": "rt-b"}], max_tokens=2)
        assert e.value.field == "lora[0].name"
        assert "rt-b" not in listed(url) and all(a["name"] != "rt-b" for a in lora_rows(d))
        with pytest.raises(BadRequestError) as e:  # the name is taken until its workers have freed it
            c.load_adapter("rt-b", files["b"], model=BASE)
        assert e.value.field == "name" and "still being unloaded" in e.value.message
        assert not done  # all of this while the request ran
        t.join(120)
        completion = done["completion"]
        assert completion.finish_reason == "length" and completion.usage.completion_tokens == LONG
        assert completion.text == expected  # it ran to its end with the adapter applied
    wait_gone(d, "rt-b")
    assert "LoRA adapter 'rt-b' unloaded (freed)" in d.log_text()  # the worker freed it


def test_an_unloaded_adapters_cached_kv_is_dropped(pool: tuple[Daemon, str], files: dict[str, str]) -> None:
    """The same file loaded again under the same name would find its KV again (the same tag): the unload dropped
    it from the prefix cache, so none of the prompt is reused."""
    d, _ = pool
    prompt = PROMPT + " in the spring"
    with d.client() as c:
        c.load_adapter("rt-kv", files["b"], model=BASE)
        c.generate(prompt, model="rt-kv", max_tokens=2, temperature=0)
        again = c.generate(prompt, model="rt-kv", max_tokens=2, temperature=0)
        assert again.usage.cached_tokens > 0  # kept while loaded
        c.unload_model("rt-kv")
        wait_gone(d, "rt-kv")
        c.load_adapter("rt-kv", files["b"], model=BASE)
        try:
            assert c.generate(prompt, model="rt-kv", max_tokens=2, temperature=0).usage.cached_tokens <= 1  # a BOS
        finally:
            c.unload_model("rt-kv")
    wait_gone(d, "rt-kv")


def test_a_worker_restarted_after_a_runtime_load_has_the_adapter(pool: tuple[Daemon, str],
                                                                 files: dict[str, str]) -> None:
    d, _ = pool
    declared = text(d, "cfg-a")
    with d.client() as c:
        c.load_adapter("rt-restart", files["a"], model=BASE)
        try:
            worker = next(w for w in d.status()["workers"] if w["model"] == BASE)
            os.kill(worker["pid"], signal.SIGKILL)
            d.wait_ready(3, timeout=90, exclude_pids={worker["pid"]})
            assert text(d, "rt-restart") == declared  # its new process loaded it after its hello
            assert text(d, BASE, lora=[{"name": "rt-restart"}]) == declared
        finally:
            c.unload_model("rt-restart")
    wait_gone(d, "rt-restart")


@pytest.mark.parametrize(("name", "path", "extra", "error", "param", "says"), [
    ("x", "a", {"model": "nope"}, UnknownModelError, "model", "'nope' is not a model"),
    ("x", "a", {"model": "emb"}, BadRequestError, "model", "takes no LoRA adapters"),  # an embedding model
    ("x", "model", {}, BadRequestError, "path", "cannot load"),  # a model's GGUF, not an adapter's
    ("x", "text", {}, BadRequestError, "path", "cannot load"),  # not a GGUF
    ("x", "other-base", {}, BadRequestError, "path", "cannot load"),  # made for another base model
    ("x", "missing", {}, BadRequestError, "path", "does not exist"),
    ("x", "relative", {}, BadRequestError, "path", "absolute path"),
    ("x", "hf:owner/repo/a.gguf", {}, BadRequestError, "path", "fetch-model"),
    ("cfg-a", "a", {}, BadRequestError, "name", "already the name of an adapter of model 'tiny'"),
    ("plain", "a", {}, BadRequestError, "name", "already the name of a model"),
    ("bad name", "a", {}, BadRequestError, "name", "letters, digits"),
    ("x", "a", {"scale": 17}, BadRequestError, "scale", "from -16 to 16"),
    ("x", "a", {"scale": math.nan}, BadRequestError, "scale", "from -16 to 16"),
    ("x", "a", {"model": "plain", "scale": "1"}, BadRequestError, "scale", "from -16 to 16"),
])
def test_a_bad_load_is_refused_naming_the_parameter(pool: tuple[Daemon, str], files: dict[str, str],
                                                    model_path: str, name: str, path: str, extra: dict[str, Any],
                                                    error: type[LlamapoolError], param: str, says: str) -> None:
    d, _ = pool
    where = {**files, "model": model_path, "missing": str(Path(files["a"]).with_name("missing.gguf")),
             "relative": "lora/a.gguf"}.get(path, path)
    with d.client() as c:
        with pytest.raises(error) as e:
            c.load_adapter(name, where, **{"model": BASE, **extra})
        assert e.value.field == param and says in e.value.message, e.value
        assert "x" not in {a["name"] for a in lora_rows(d)}
    assert d.proc.poll() is None
    assert text(d, "cfg-a") == text(d, BASE, lora=[{"id": 0}])  # the worker serves on, its adapters intact
    assert all(w["state"] == "ready" and w["restarts"] == 0 for w in d.status()["workers"]
               if w["model"] != BASE)  # (the restart test kills tiny's)


def test_unloading_what_cannot_be_unloaded_is_refused(pool: tuple[Daemon, str]) -> None:
    d, _ = pool
    with d.client() as c:
        with pytest.raises(UnknownModelError) as e:
            c.unload_model("nope")
        assert e.value.field == "model" and "'nope' is not in this pool" in e.value.message
        assert "LoRA adapters: 'cfg-a'" in e.value.message
        with pytest.raises(BadRequestError) as e:
            c.unload_model("cfg-a")
        assert e.value.field == "model" and "[[models.lora]]" in e.value.message
        for action in (lambda: c.load_model("cfg-a"), lambda: c.pin_model("cfg-a")):  # a model's commands
            with pytest.raises(BadRequestError) as e:
                action()
            assert e.value.field == "model" and "is a LoRA adapter of model 'tiny'" in e.value.message
    assert text(d, "cfg-a") != text(d, BASE)


def test_the_cli_loads_and_unloads_an_adapter(pool: tuple[Daemon, str], files: dict[str, str]) -> None:
    d, _ = pool
    cli = [sys.executable, "-m", "llamapool.cli"]
    out = subprocess.run([*cli, "load", "rt-cli", "--lora", files["b"], "--model", BASE, "--scale", "0.5",
                          "--endpoint", d.endpoint], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "state: loaded" in out.stdout, out.stdout + out.stderr
    shown = subprocess.run([*cli, "status", "--endpoint", d.endpoint], capture_output=True, text=True, timeout=60)
    assert "model tiny: LoRA adapters 0 cfg-a, 1 rt-cli (scale 0.5) (loaded at run time)" in shown.stdout
    assert text(d, "rt-cli") == text(d, BASE, lora=[{"name": "rt-cli", "scale": 0.5}])
    bad = subprocess.run([*cli, "load", "rt-cli2", "--lora", files["text"], "--endpoint", d.endpoint],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "cannot load" in bad.stderr, bad.stderr
    wrong = subprocess.run([*cli, "load", BASE, "--scale", "2", "--endpoint", d.endpoint], capture_output=True,
                           text=True, timeout=60)
    assert wrong.returncode == 2 and "--lora" in wrong.stderr
    out = subprocess.run([*cli, "unload", "rt-cli", "--endpoint", d.endpoint], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "state: unloading" in out.stdout, out.stdout + out.stderr
    wait_gone(d, "rt-cli")


def test_vllms_load_and_unload_lora_adapter_endpoints(pool: tuple[Daemon, str], files: dict[str, str]) -> None:
    d, url = pool
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt-http", "lora_path": files["a"]},
                   timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt-http' added successfully.", r.text
    body = {"model": "rt-http", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    got = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == text(d, "cfg-a"), got.text
    dup = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt-http", "lora_path": files["a"]},
                     timeout=60)
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "lora_name", dup.text
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt-bad", "lora_path": files["text"]},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    model = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "plain"}, timeout=30)
    assert model.status_code == 400 and model.json()["error"]["param"] == "lora_name", model.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt-http"}, timeout=30)
    assert r.status_code == 200 and "removed" in r.text, r.text
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name", gone.text
    wait_gone(d, "rt-http")


def test_a_reload_keeps_runtime_adapters(tmp_path: Path, model_path: str, files: dict[str, str]) -> None:
    """A SIGHUP that replaces the model's worker: the new worker gets the run-time adapter too."""
    from tests.conftest import write_config

    table = {"name": BASE, "path": model_path, "ctx_per_slot": 512, "max_batch_tokens": 512, "n_ubatch": 512,
             "cpu_workers": 1, "deterministic": True}
    d = launch(tmp_path, model_path, models=[{**table, "lora": [{"name": "cfg-a", "path": files["a"]}]}])
    try:
        d.wait_ready(1)
        declared = text(d, "cfg-a")
        with d.client() as c:
            c.load_adapter("rt-a", files["a"])  # the pool's first model
        old = {w["pid"] for w in d.status()["workers"]}
        write_config(d.config, model_path, d.config.parent / "run",
                     models=[{**table, "ctx_per_slot": 384, "lora": [{"name": "cfg-a", "path": files["a"]}]}])
        d.proc.send_signal(signal.SIGHUP)
        d.wait_log("reload done", 120)
        d.wait_ready(1, timeout=60, exclude_pids=old)
        assert text(d, "rt-a") == declared
        assert [a["name"] for a in lora_rows(d)] == ["cfg-a", "rt-a"]
    finally:
        d.stop(signal.SIGQUIT, timeout=30)


def test_a_restarted_worker_that_cannot_load_an_adapter_serves_on_and_the_unload_completes(
        pool: tuple[Daemon, str], files: dict[str, str], tmp_path: Path) -> None:
    """The adapter's file is gone when the model's worker restarts: the worker serves without it (a request for
    it fails naming it, the log says why), and an unload still completes."""
    import shutil

    d, _ = pool
    copy = str(shutil.copy(files["b"], tmp_path / "b-copy.gguf"))
    with d.client() as c:
        c.load_adapter("rt-vanish", copy, model=BASE)
        os.unlink(copy)
        worker = next(w for w in d.status()["workers"] if w["model"] == BASE)
        os.kill(worker["pid"], signal.SIGKILL)
        d.wait_ready(3, timeout=90, exclude_pids={worker["pid"]})
        d.wait_log("LoRA adapter 'rt-vanish' not loaded", 30)
        with pytest.raises(BadRequestError) as e:
            c.generate("hi", model="rt-vanish", max_tokens=2)
        assert e.value.field == "lora[0].name" and "rt-vanish" in e.value.message
        assert text(d, "cfg-a") == text(d, BASE, lora=[{"id": 0}])
        assert c.unload_model("rt-vanish")["state"] == "unloading"
    wait_gone(d, "rt-vanish")
    with d.client() as c:  # the name is free again
        c.load_adapter("rt-vanish", files["b"], model=BASE)
        c.unload_model("rt-vanish")


def test_the_engine_frees_an_adapter_once_unused_and_drops_its_kv_from_the_host_tier(
        model_path: str, files: dict[str, str]) -> None:
    """The engine alone (2 slots, a host tier): an unload while a sequence uses the adapter frees it only once
    that sequence ends; its KV in the tier goes (the same file loaded again finds none of it), the base's stays."""
    import numpy as np

    from llamapool.protocol.messages import Run, SamplingParams, Step
    from llamapool.worker.engine import Engine, EngineConfig

    def params(lora: tuple[dict[str, Any], ...] = ()) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora=lora)

    def run(rid: int, tokens: list[int], p: SamplingParams) -> tuple[Step, int]:
        before = eng.reused_tokens
        eng.submit(Run(rid, tokens, p, False), out := Step())
        while eng.busy:
            step = eng.step()
            out.done += step.done
            out.failed += step.failed
        return out, eng.reused_tokens - before

    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(3, 500, 150).tolist() for _ in range(3))
    eng = Engine(EngineConfig(model_path, slots=2, ctx_per_slot=512, max_batch_tokens=256, n_ubatch=256, threads=1,
                              kv_host="64MiB", deterministic=True))
    try:
        assert eng.load_adapter("rt", files["a"], 1.0) == ""
        assert eng.load_adapter("rt", files["b"], 1.0) != ""  # the name is taken, by another file
        under = params(({"name": "rt"},))
        run(1, a, under)
        run(2, b, params())
        run(3, c, params())  # a's KV under rt goes to the tier as c takes its slot
        assert eng.kv.host is not None
        tagged = lambda: sum(1 for e in eng.kv.host.store.entries.values() if e.tag)  # noqa: E731 (an adapter's)
        assert tagged() == 1
        eng.submit(Run(4, b, under, False), Step())
        eng.step()  # running under rt
        assert eng.unload_adapter("rt") == "" and eng.free_adapters() == []
        refused = Step()
        eng.submit(Run(5, a, under, False), refused)  # no new request takes it
        assert refused.failed and refused.failed[0][3] == "lora"  # (its only adapter: none left)
        while eng.busy:
            eng.step()
        base_entries = eng.kv_host()["entries"] - tagged()
        assert eng.kv.tags and base_entries >= 1  # run 4's slot keeps its KV under rt, the tier the base's
        assert eng.free_adapters() == ["rt"]
        assert tagged() == 0 and eng.kv_host()["entries"] == base_entries  # its KV went, the base's stays
        assert not eng.kv.tags  # and its kept prefix in the slot
        assert eng.load_adapter("rt", files["a"], 1.0) == ""
        hits = eng.kv_host()["hits"]
        out, reused = run(6, a, under)
        assert not out.failed and reused <= 1 and eng.kv_host()["hits"] == hits
        assert eng.unload_adapter("cfg-none") == "" and eng.free_adapters() == ["cfg-none"]  # not held: done
    finally:
        eng.close()
