"""The README as the specification (issue 46 item 4): its examples, run as it says against the daemon of
configs/default.toml (what ``make run`` serves), print what it says, every time.

The examples are read from README.md: the ``llamapool generate`` console line, the python blocks (run in
one namespace, in order: the chat examples use the ``openai`` client made before them) and the curl
command's JSON body. The daemon is configs/default.toml as a real process, with only its HTTP port (a
free one), its runtime dir (``RUNTIME_DIRECTORY``, which is where ``Client()`` and the CLI find the SDK
endpoint), its relative paths (made absolute: the copy lives elsewhere) and ``devices = "cpu"`` (the
README's outputs are CPU workers') changed.

(a) every example prints the same text on its first call (a fresh daemon), on calls after it (twice in
a row: the repeat reaches the worker holding its prompt, as the curl example's ``cached_tokens`` shows),
the curl body once more with ``cache_prompt: false``, and beside sampled requests decoding on every
worker: ``model.deterministic = true`` in the config (whose mark, a reused prefix leaving 2 tokens to
compute, is checked too: on this build the examples' texts happen to hold without the mode).

(b) the texts are the README's, checked only on a machine with the CPU features and llama-cpp-python of
the one the README was written on (another CPU's kernels may round a near-tie otherwise:
docs/http.md#determinism), else skipped naming the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llamapool import default_model

from .conftest import Daemon, free_port
from .neighbours import Neighbours

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIG = ROOT / "configs" / "default.toml"
README_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
# The /proc/cpuinfo flags that choose llama.cpp's CPU kernels (ggml-cpu's x86 variants), and the
# llama-cpp-python whose llama.cpp ran them, on the machine the README's outputs were written on.
KERNEL_FLAGS = ("sse3", "ssse3", "avx", "avx2", "avx_vnni", "f16c", "fma", "avx512f", "avx512bw", "avx512vl",
                "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class CpuFacts:
    flags: tuple[str, ...]  # those of KERNEL_FLAGS the CPU has, sorted
    llama_cpp: str  # llama-cpp-python's version (its llama.cpp)


WRITTEN_ON = CpuFacts(("amx_bf16", "amx_int8", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                       "avx512bw", "avx512f", "avx512vbmi", "avx512vl", "avx_vnni", "f16c", "fma", "ssse3"), "0.3.36")


@dataclass(frozen=True)
class Example:
    """One README example: ``kind`` "cli" (argv), "python" (source) or "curl" (URL and JSON body), and
    the lines the README says it prints."""

    name: str
    kind: str
    code: str
    printed: tuple[str, ...]
    url: str = ""


def _reply(text: str) -> str:
    """A completion's JSON without what differs by call: its id, its time, and the prompt tokens the
    prefix cache held (the first call and later ones differ, docs/http.md#determinism)."""
    body = json.loads(text)
    for key in ("id", "created"):
        body.pop(key, None)
    body.get("usage", {}).pop("prompt_tokens_details", None)
    return json.dumps(body, sort_keys=True)


def examples(markdown: str) -> tuple[Example, ...]:
    """The README's examples, in order, with what it says each prints (the lines after it: a console
    command's next line, a python block's ``# `` comments)."""
    out: list[Example] = []
    for lang, body in BLOCK.findall(markdown):
        lines = body.splitlines()
        if lang == "python" and "print(" in body:
            said = tuple(line[2:] for line in lines if line.startswith("# "))
            out.append(Example(f"python block {sum(e.kind == 'python' for e in out) + 1}", "python", body, said))
        elif lang == "console":
            joined = body.replace("\\\n", " ").splitlines()
            for i, line in enumerate(joined):
                if line.startswith("$ llamapool generate "):
                    out.append(Example("cli", "cli", line[2:], (joined[i + 1],)))
                elif line.startswith("$ curl "):
                    argv = shlex.split(line[2:])
                    url = next(a for a in argv if a.startswith("http"))
                    out.append(Example("curl", "curl", argv[argv.index("-d") + 1], (_reply(joined[i + 1]),), url))
    return tuple(out)


EXAMPLES = examples(README.read_text())


def test_the_readme_has_its_examples() -> None:
    kinds = sorted(e.kind for e in EXAMPLES)
    assert kinds == ["cli", "curl", "python", "python", "python"], [e.name for e in EXAMPLES]
    assert all(e.printed for e in EXAMPLES), "an example without its printed output in README.md"
    # the SDK, the openai completion, chat, a tool call, JSON, Responses: a printed line each
    assert sum(len(e.printed) for e in EXAMPLES if e.kind == "python") == 6


def config_copy(folder: Path, port: int) -> Path:
    """configs/default.toml in ``folder``: its HTTP port ``port``, its relative paths absolute, CPU workers."""
    text = CONFIG.read_text()
    assert 'listen = "127.0.0.1:8000"' in text and 'devices = "auto"' in text
    text = text.replace('listen = "127.0.0.1:8000"', f'listen = "127.0.0.1:{port}"')
    text = text.replace('devices = "auto"', 'devices = "cpu"')
    text = re.sub(r'^((?:path|chat_template) *= *")([^"/][^"]*)"',
                  lambda m: f'{m.group(1)}{(CONFIG.parent / m.group(2)).resolve()}"', text, flags=re.MULTILINE)
    (folder / "default.toml").write_text(text)
    return folder / "default.toml"


@dataclass
class Pool:
    daemon: Daemon
    port: int
    env: dict[str, str]  # the environment in which Client() and the CLI find the daemon
    reused: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # each curl reply's prompt, cached tokens


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Pool]:
    default_model.fetch(ROOT / "models")  # Gemma 3 270M, as make run fetches it
    folder, port = tmp_path_factory.mktemp("readme"), free_port()
    cfg = config_copy(folder, port)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RUNTIME_DIRECTORY": str(folder / "run")}
    log = folder / "daemon.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(cfg)],
                                stdout=fh, stderr=subprocess.STDOUT, env=env)
    d = Daemon(proc, cfg, f"ipc://{folder / 'run' / 'frontend.sock'}", log)
    try:
        d.wait_ready(3, timeout=240)  # two Gemma workers, one SmolLM2
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RUNTIME_DIRECTORY", env["RUNTIME_DIRECTORY"])  # for Client() in this process
            yield Pool(d, port, env)
    finally:
        d.stop()


def run(ex: Example, pool: Pool, namespace: dict[str, Any], **body: Any) -> tuple[str, ...]:
    """What ``ex`` prints, run as the README says (its URL on ``pool``'s port); ``body``: added to the
    curl body."""
    if ex.kind == "cli":
        argv = shlex.split(ex.code)
        out = subprocess.run([sys.executable, "-m", "llamapool.cli", *argv[1:]], env=pool.env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return tuple(out.stdout.splitlines())
    if ex.kind == "curl":
        data = json.dumps({**json.loads(ex.code), **body}).encode()
        req = urllib.request.Request(ex.url.replace(README_URL, f"http://127.0.0.1:{pool.port}"), data,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = r.read().decode()
        usage = json.loads(reply)["usage"]
        pool.reused.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        return (_reply(reply),)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(ex.code.replace(README_URL, f"http://127.0.0.1:{pool.port}"), namespace)
    return tuple(printed.getvalue().splitlines())


def run_all(pool: Pool) -> dict[str, tuple[str, ...]]:
    namespace: dict[str, Any] = {}
    return {ex.name: run(ex, pool, namespace) for ex in EXAMPLES}


def neighbours(pool: Pool) -> Neighbours:
    """Long sampled requests decoding on every worker (two on Gemma's two workers, one on SmolLM2's),
    started before the examples and stopped after them."""
    params = {"temperature": 0.9, "max_tokens": 400, "ignore_eos": True}
    return Neighbours(pool.daemon, [(m, "A recipe for bread:", params)
                                    for m in ("gemma-3-270m", "gemma-3-270m", "smollm2-135m-instruct")])


@pytest.fixture(scope="module")
def printed(pool: Pool) -> dict[str, dict[str, tuple[str, ...]]]:
    """What each example printed: on its first call (the daemon fresh), a second and third (prefix cached
    where the call reached the worker holding it), the curl body with ``cache_prompt: false`` (a
    llama-server parameter llamapool ignores: one more call), and beside neighbours."""
    first = run_all(pool)
    second: dict[str, tuple[str, ...]] = {}
    third: dict[str, tuple[str, ...]] = {}
    namespace: dict[str, Any] = {}
    for ex in EXAMPLES:  # each twice in a row: the second most likely on the worker that cached its prompt
        second[ex.name], third[ex.name] = run(ex, pool, namespace), run(ex, pool, namespace)
    curl = next(e for e in EXAMPLES if e.kind == "curl")
    uncached = {curl.name: run(curl, pool, {}, cache_prompt=False)}
    with neighbours(pool):
        beside = run_all(pool)
    again = [run(curl, pool, {}) for _ in range(2)]  # an idle pool: both to one worker, the second a cache hit
    return {"first call": first, "second call": second, "third call": third, "cache_prompt false": uncached,
            "beside neighbours": beside, "after": {curl.name: again[-1]}}


def test_each_example_prints_the_same_text_every_time(printed: dict[str, dict[str, tuple[str, ...]]]) -> None:
    first = printed["first call"]
    differ = [f"{name}, {when}: {text} (first call: {first[name]})" for when, round_ in printed.items()
              for name, text in round_.items() if text != first[name]]
    assert not differ, "\n".join(differ)


def test_the_examples_run_in_deterministic_mode(pool: Pool, printed: dict[str, dict[str, tuple[str, ...]]]) -> None:
    """The curl example's prefix was reused, and as deterministic mode does (docs/http.md#determinism):
    its last two tokens computed again (without the mode: all but the last). On this build the README's
    examples print the same text without the mode too, so this is the check that the config sets it."""
    prompt = {p for p, _ in pool.reused}
    assert len(prompt) == 1, pool.reused
    assert max(c for _, c in pool.reused) == prompt.pop() - 2, f"(prompt, cached tokens) of each call: {pool.reused}"


def cpu_facts() -> CpuFacts:
    """This machine's CpuFacts (no /proc/cpuinfo, as on macOS: no flags, so never the README's)."""
    import llama_cpp

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return CpuFacts(tuple(sorted(f for f in KERNEL_FLAGS if f in flags)), llama_cpp.__version__)


def test_each_example_prints_what_the_readme_says(printed: dict[str, dict[str, tuple[str, ...]]]) -> None:
    facts = cpu_facts()
    if facts != WRITTEN_ON:
        diff = "; ".join(f"{f.name} {getattr(facts, f.name)} here, {getattr(WRITTEN_ON, f.name)} there"
                         for f in dataclasses.fields(CpuFacts) if getattr(facts, f.name) != getattr(WRITTEN_ON, f.name))
        pytest.skip(f"another machine class than the README's outputs were written on ({diff}): its kernels "
                    f"may round a near-tie otherwise (docs/http.md#determinism)")
    differ = [f"{ex.name}: printed {printed['first call'][ex.name]}, README.md says {ex.printed}"
              for ex in EXAMPLES if printed["first call"][ex.name] != ex.printed]
    assert not differ, "\n".join(differ)
