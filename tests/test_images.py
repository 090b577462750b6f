"""Images in requests (issue 54): the generated vision model (``llamapool make-model --vision``: a random text
model and its Gemma 3-shaped mmproj) served by the daemon as a real process, over real sockets, through the
``openai`` and ``anthropic`` clients, the Responses API and the SDK: the reply depends on the image, a
returning image is neither encoded nor prefilled again (its tokens reported cached), and every bad image is a
400 naming its part that leaves the workers up."""

from __future__ import annotations

import base64
import http.server
import signal
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llamapool.client.errors import BadRequestError
from tests.conftest import Daemon, free_port, launch
from tests.test_gateway import wait_http

IMAGE_TOKENS = 16  # the generated projector's: 64 px, 8 px patches, 2 x 2 pooled
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}


def png(w: int, h: int, seed: int) -> bytes:
    """An RGB PNG of ``w`` x ``h`` pixels, a pattern that ``seed`` picks (written by hand: no Pillow)."""
    rows = b"".join(b"\x00" + bytes(((x * 7 + seed * 53) % 256, (y * 5 + seed * 31) % 256, ((x ^ y) * seed) % 256)
                                    [c] for x in range(w) for c in range(3)) for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


RED, BLUE = png(64, 64, 1), png(64, 64, 2)


def data_url(image: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(image).decode()}"


def ask(image: bytes | str, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    url = image if isinstance(image, str) else data_url(image)
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The model and its projector, written by the CLI."""
    folder = tmp_path_factory.mktemp("vision")
    out = subprocess.run([sys.executable, "-m", "llamapool.cli", "make-model", "--vision", str(folder)],
                         capture_output=True, text=True, check=True)
    assert "mmproj" in out.stdout
    return str(folder / "model.gguf"), str(folder / "mmproj.gguf")


class _Images(http.server.BaseHTTPRequestHandler):
    """The image server of the fetch_media tests: /red.png, /big.png (over the size bound), anything else 404."""

    def do_GET(self) -> None:
        body = {"/red.png": RED, "/big.png": b"\x89PNG" + b"\x00" * 300_000}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, vision_model: tuple[str, str],
           model_path: str) -> Iterator[tuple[Daemon, str]]:
    """A daemon serving the vision model ("vis", one worker) and the text-only tiny model ("tiny"); it fetches
    image URLs of 127.0.0.1 alone (the tests' image server: a private address, allowed here)."""
    model, mmproj = vision_model
    port = free_port()
    fetch = {"fetch_media": True, "fetch_media_hosts": ["127.0.0.1"], "fetch_media_private": True,
             "fetch_media_max_bytes": 200_000, "fetch_media_timeout": 5.0}
    d = launch(tmp_path_factory.mktemp("images"), model, http={"listen": f"127.0.0.1:{port}", **fetch},
               models=[{"name": "vis", "path": model, "mmproj": mmproj, "cpu_workers": 1, "ctx_per_slot": 1024},
                       {"name": "tiny", "path": model_path, "cpu_workers": 1, "ctx_per_slot": 512}],
               workers={"devices": "cpu", "slots": 4, "threads": 1})
    d.wait_ready(2)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, d)
    yield d, url
    d.stop(signal.SIGQUIT, timeout=30)


@pytest.fixture
def oai(served: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def chat(oai: openai.OpenAI, messages: list[dict[str, Any]], model: str = "vis") -> Any:
    return oai.chat.completions.create(model=model, messages=messages, **GREEDY)  # type: ignore[arg-type]


def cached(r: Any) -> int:
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


def test_the_reply_depends_on_the_image_and_a_returning_one_is_cached(oai: openai.OpenAI) -> None:
    red = chat(oai, ask(RED))
    blue = chat(oai, ask(BLUE))
    assert red.choices[0].message.content != blue.choices[0].message.content  # two images, two greedy replies
    assert red.usage.prompt_tokens == blue.usage.prompt_tokens > IMAGE_TOKENS  # the image's tokens counted
    again = chat(oai, ask(RED))
    assert again.choices[0].message.content == red.choices[0].message.content
    assert cached(again) == again.usage.prompt_tokens - 1  # all but the last token: the image too
    # another image is not the first one's cache: only the text before it is
    assert cached(blue) < blue.usage.prompt_tokens - IMAGE_TOKENS


def test_a_returning_image_in_a_longer_conversation_is_cached(oai: openai.OpenAI) -> None:
    first = ask(png(64, 64, 7), "Describe it.")
    r1 = chat(oai, first)
    later = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And the colours?"}]
    r2 = chat(oai, later)
    assert cached(r2) >= r1.usage.prompt_tokens - 1  # the first turn, image included, from the prefix cache
    again = chat(oai, later)
    assert again.choices[0].message.content == r2.choices[0].message.content
    other = [*ask(png(64, 64, 8), "Describe it."), *later[1:]]  # another image in the same conversation
    r3 = chat(oai, other)
    assert cached(r3) < IMAGE_TOKENS + 8 and r3.choices[0].message.content != r2.choices[0].message.content


def test_the_anthropic_client_sends_an_image_as_its_docs_show(served: tuple[Daemon, str], oai: openai.OpenAI) -> None:
    client = anthropic.Anthropic(base_url=served[1], api_key="unused", max_retries=0)
    image = png(64, 64, 3)
    m = client.messages.create(model="vis", max_tokens=12, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}},
            {"type": "text", "text": "What is in this picture?"}]}])
    # the same chat as OpenAI's: the same prompt, the same greedy reply
    assert m.content[0].text == chat(oai, ask(image)).choices[0].message.content  # type: ignore[union-attr]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > IMAGE_TOKENS


def test_the_responses_api_takes_input_image(oai: openai.OpenAI) -> None:
    image = png(64, 64, 4)
    r = oai.responses.create(model="vis", temperature=0, max_output_tokens=12, store=False, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                     {"type": "input_text", "text": "What is in this picture?"}]}])
    assert r.output_text == chat(oai, ask(image)).choices[0].message.content


def test_the_sdk_sends_image_bytes(served: tuple[Daemon, str], oai: openai.OpenAI) -> None:
    image = png(64, 64, 5)
    with served[0].client() as c:
        done = c.chat([{"role": "user", "content": [{"type": "image", "data": image},
                                                    {"type": "text", "text": "What is in this picture?"}]}],
                      model="vis", **GREEDY)
        assert done.text == chat(oai, ask(image)).choices[0].message.content
        with pytest.raises(BadRequestError) as e:
            c.chat([{"role": "user", "content": [{"type": "image", "data": b"GIF89a"}]}], model="vis", **GREEDY)
        assert e.value.field == "messages[0].content[0].data"


def test_models_say_which_take_images(oai: openai.OpenAI) -> None:
    got = {m.id: m.model_extra.get("input_modalities") for m in oai.models.list().data}  # type: ignore[union-attr]
    assert got == {"vis": ["text", "image"], "tiny": ["text"]}


WEBP = b"RIFF\x24\x00\x00\x00WEBPVP8 " + b"\x00" * 24
BOMB = png(1, 1, 0)[:16] + struct.pack(">II", 50_000, 50_000) + png(1, 1, 0)[24:]  # a header of 2.5 G pixels


@pytest.mark.parametrize(("url", "why"), [
    ("data:image/png;base64,@@@not base64@@@", "not valid base64"),
    (data_url(b"just some text, no image"), "not an image"),
    (data_url(WEBP, "image/webp"), "WebP"),
    (data_url(BOMB), "pixels"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("https://example.com/cat.png", "not in [http] fetch_media_hosts"),
    ("ftp://example.com/cat.png", "data: URL"),
])
def test_a_bad_image_is_a_400_naming_its_part(oai: openai.OpenAI, served: tuple[Daemon, str], url: str,
                                              why: str) -> None:
    pids = {w["pid"] for w in served[0].status()["workers"]}
    messages = [{"role": "system", "content": "Be brief."}, *ask(url)]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, messages)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "messages[1].content[0].image_url", err
    assert why in err["message"], err
    assert {w["pid"] for w in served[0].status()["workers"]} == pids  # no worker went down


def test_too_many_images_and_a_model_without_a_projector_are_400s(oai: openai.OpenAI) -> None:
    parts = [{"type": "image_url", "image_url": {"url": data_url(RED)}} for _ in range(17)]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}])
    assert e.value.body["param"] == "messages[0].content[16].image_url"  # type: ignore[index]
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, audio)  # images only: an audio part is refused by name
    assert e.value.body["param"] == "messages[0].content[0].type"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, ask(RED), model="tiny")
    assert e.value.body["param"] == "messages[0].content[0].image_url"  # type: ignore[index]
    assert "takes none" in e.value.body["message"]  # type: ignore[index]


def test_an_undecodable_image_with_a_good_header_fails_in_the_worker_alone(served: tuple[Daemon, str],
                                                                          oai: openai.OpenAI) -> None:
    pids = {w["pid"] for w in served[0].status()["workers"]}
    broken = RED[:40] + b"\x00" * 64  # a PNG header, then garbage
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, ask(broken))
    assert e.value.body["param"] == "messages[0].content[0]", e.value.body  # type: ignore[index]
    assert "decoded" in e.value.body["message"]  # type: ignore[index]
    assert {w["pid"] for w in served[0].status()["workers"]} == pids
    assert chat(oai, ask(RED)).choices[0].message.content  # and it serves on


def test_anthropic_image_errors_name_the_block(served: tuple[Daemon, str]) -> None:
    body = {"model": "vis", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}]}]}
    r = httpx.post(served[1] + "/v1/messages", json=body, headers={"x-api-key": "unused"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages[0].content[0].source.data" in r.json()["error"]["message"]


def test_an_image_url_is_fetched_within_the_bounds(oai: openai.OpenAI, image_server: str) -> None:
    fetched = chat(oai, ask(f"{image_server}/red.png"))
    assert fetched.choices[0].message.content == chat(oai, ask(RED)).choices[0].message.content
    for path, why in (("/big.png", "fetch_media_max_bytes"), ("/nothing.png", "HTTP 404")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, ask(f"{image_server}{path}"))
        assert e.value.body["param"] == "messages[0].content[0].image_url"  # type: ignore[index]
        assert why in e.value.body["message"], e.value.body  # type: ignore[index]


def test_the_fetch_bounds_without_a_daemon(image_server: str) -> None:
    """A private address is refused unless allowed; fetch_media off refuses every URL, naming its part."""
    import asyncio

    from llamapool.gateway.errors import ApiError
    from llamapool.gateway.fetch import FetchError, _get, fetch_all

    cfg: dict[str, Any] = {"enabled": True, "hosts": [], "max_bytes": 1 << 20, "timeout": 5.0, "private": False}
    with pytest.raises(FetchError, match="private address"):
        _get(f"{image_server}/red.png", cfg)
    assert _get(f"{image_server}/red.png", {**cfg, "private": True}) == RED
    part: dict[str, Any] = {"type": "image", "data": b""}
    with pytest.raises(ApiError) as e:
        asyncio.run(fetch_all([(part, f"{image_server}/red.png", "input[0].content[1].image_url")],
                              {**cfg, "enabled": False}))
    assert e.value.param == "input[0].content[1].image_url" and "fetch_media = false" in e.value.message


def test_count_tokens_counts_the_image(served: tuple[Daemon, str]) -> None:
    client = anthropic.Anthropic(base_url=served[1], api_key="unused", max_retries=0)
    image = png(64, 64, 9)
    messages: Any = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image).decode()}},
        {"type": "text", "text": "What is in this picture?"}]}]
    count = client.messages.count_tokens(model="vis", messages=messages)
    m = client.messages.create(model="vis", max_tokens=4, messages=messages, extra_body={"temperature": 0})
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert count.input_tokens > IMAGE_TOKENS


@pytest.mark.parametrize("transport", ["sdk", "http"])
def test_bench_image_workload(served: tuple[Daemon, str], transport: str) -> None:
    """``llamapool bench -w image`` against the daemon, over the SDK and over OpenAI's chat API: every
    request an image of its own and a question, every reply its tokens (ignore_eos), none failed."""
    import json

    where = ["--endpoint", served[0].endpoint] if transport == "sdk" else ["--http", served[1]]
    argv = ["bench", "--no-progress", *where, "-w", "image", "-c", "4", "-n", "8", "--gen-tokens", "8",
            "--prompt-tokens", "16", "--n-vocab", "512", "--json"]
    out = subprocess.run([sys.executable, "-m", "llamapool.cli", *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [r] = json.loads(out.stdout)
    assert (r["workload"], r["requests"], r["errors"], r["gen_tokens"]) == ("image", 8, 0, 64), r


def test_the_image_workload_is_seeded() -> None:
    from llamapool.bench.workloads import make_workload
    from llamapool.protocol.media import image_info

    a, b = (make_workload("image", 4, 512, seed=1, image_px=32) for _ in range(2))
    assert a == b and len({r.image for r in a.requests}) == 4  # the same requests; an image each
    assert all(image_info(r.image).width == 32 and len(r.text.split()) == 64 and r.max_tokens == 64
               for r in a.requests)


@pytest.mark.parametrize("deterministic", [False, True])
def test_images_of_many_streams_in_one_step_match_each_alone(vision_model: tuple[str, str],
                                                           deterministic: bool) -> None:
    """The engine in this process: four prompts with an image each (text before and after it), submitted
    together, are fed in the same steps (a small step budget splits the text; the images go in their own
    decodes) and reply as each does alone; a projector the worker cannot load is a clear EngineError."""
    from llamapool.protocol.messages import Run, SamplingParams, Step
    from llamapool.worker.engine import Engine, EngineConfig, EngineError

    model, mmproj = vision_model
    eng = Engine(EngineConfig(model, mmproj=mmproj, slots=4, ctx_per_slot=512, max_batch_tokens=40, n_ubatch=512,
                              prefix_cache=False, deterministic=deterministic))
    try:
        images = [png(64, 64, 20 + k) for k in range(4)]

        def run(batch: list[bytes]) -> list[str]:
            out = Step()
            for i, image in enumerate(batch):
                chat = [{"role": "user", "content": [{"type": "text", "text": "Look at this: "},
                                                     {"type": "image", "data": image},
                                                     {"type": "text", "text": "What is it?"}]}]
                eng.submit(Run(i, chat, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), False), out)
            texts: dict[int, str] = {}
            while eng.busy:
                step = eng.step()
                assert not step.failed, step.failed
                texts.update({d.rid: d.text for d in step.done})
            return [texts[i] for i in range(len(batch))]

        alone = [run([image])[0] for image in images]
        assert len(set(alone)) > 1
        assert run(images) == alone
    finally:
        eng.close()
    with pytest.raises(EngineError, match=r"model\.mmproj"):
        Engine(EngineConfig(model, mmproj=model, slots=1, ctx_per_slot=256))  # a text GGUF is no projector


def test_mmproj_config_and_hub_refs(tmp_path: Path) -> None:
    """model.mmproj: a relative path resolves against the config's folder; an hf: reference picks the repo's
    mmproj file as llama-server -hf does (the reference's quantisation, else F16, ...); an embedding model
    takes none."""
    from llamapool import hub
    from llamapool.config import ConfigError, from_dict

    model = {"path": "m.gguf", "mmproj": "proj/mmproj.gguf"}
    cfg = from_dict({"models": [model]}, tmp_path)
    assert cfg.models[0].mmproj == str(tmp_path / "proj" / "mmproj.gguf")
    with pytest.raises(ConfigError, match=r"models\[0\]\.mmproj"):
        from_dict({"models": [{**model, "embedding": True}]}, tmp_path)
    ref = "hf:ggml-org/gemma-3-4b-it-GGUF"
    assert from_dict({"models": [{**model, "mmproj": ref}]}, tmp_path).models[0].mmproj == ref  # serve fetches it
    files = ["gemma-3-4b-it-Q4_K_M.gguf", "mmproj-model-Q8_0.gguf", "mmproj-model-f16.gguf", "README.md"]
    assert hub.parse(ref, mmproj=True).pick(files) == ["mmproj-model-f16.gguf"]
    assert hub.parse(ref + ":Q8_0", mmproj=True).pick(files) == ["mmproj-model-Q8_0.gguf"]
    assert hub.parse(ref + ":Q4_K_M").pick(files) == ["gemma-3-4b-it-Q4_K_M.gguf"]  # the model, never the mmproj
    with pytest.raises(hub.HubError, match="no mmproj"):
        hub.parse(ref, mmproj=True).pick(files[:1])


def test_an_image_streams_and_takes_n_choices(oai: openai.OpenAI) -> None:
    image = png(64, 64, 11)
    whole = chat(oai, ask(image)).choices[0].message.content
    stream = oai.chat.completions.create(model="vis", messages=ask(image), stream=True, **GREEDY)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    two = oai.chat.completions.create(model="vis", messages=ask(image), n=2, **GREEDY)  # type: ignore[arg-type]
    assert [c.message.content for c in two.choices] == [whole, whole]  # greedy: both the same reply
