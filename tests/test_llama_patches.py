"""The llama.cpp patch llamapool carries (patches/llama.cpp/) and the setting that drives it.

- every patch applies cleanly to the pinned llama-cpp-python sdist, by the script ``make install`` builds with,
  and the patched code reads the variable the supervisor sets;
- a patch that does not apply stops the build, naming the patch;
- ``model.prefill_cublas_min_rows`` reaches each worker's environment before it starts, over ``[workers.env]``;
- a build without the patch (here: the CPU build, no CUDA backend) still serves; a GPU worker whose
  llama.cpp lacks the patch says, once, that the setting does nothing;
- ``model.deterministic`` sets 0002's variable in each worker's environment; a GPU worker whose llama.cpp
  lacks 0002 refuses to start, naming the setting and the patch (the mode's promise could not hold).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamapool import llama_patches
from llamapool.config import ConfigError, ModelConfig, from_dict
from llamapool.supervisor.env import worker_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "llama-cpp-build.sh"


def _build(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # the sdist is cached in build/llama-cpp-python (make install fetched it; else pip downloads it once)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON_FETCH": sys.executable, **(env or {})})


def test_the_patches_apply_cleanly_to_the_pinned_sdist_and_read_the_variable_llamapool_sets(tmp_path: Path) -> None:
    sdist = _build("fetch")
    assert sdist.returncode == 0, sdist.stderr
    out = _build("source", env={"LLAMA_SDIST": sdist.stdout.strip(), "LLAMA_CPP_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "applied 0001-cuda-cublas-for-large-quantized-batches.patch" in out.stderr
    assert "applied 0002-cuda-batch-invariant-kernels.patch" in out.stderr
    cuda = Path(out.stdout.strip()) / "vendor/llama.cpp/ggml/src/ggml-cuda"
    assert f'getenv("{llama_patches.CUBLAS_MIN_BATCH_ENV}")' in (cuda / "mmq.cu").read_text()
    assert f'getenv("{llama_patches.DETERMINISTIC_ENV}")' in (cuda / "common.cuh").read_text()
    for where in ("mmvq.cu", "mmq.cu", "mmq.cuh", "fattn.cu", "fattn-common.cuh", "ggml-cuda.cu"):
        assert "ggml_cuda_deterministic()" in (cuda / where).read_text(), where
    assert (ROOT / llama_patches.CUBLAS_PATCH).is_file() and (ROOT / llama_patches.DETERMINISTIC_PATCH).is_file()


def test_a_patch_that_does_not_apply_stops_the_build_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "patches"
    bad.mkdir()
    (bad / "0001-stale.patch").write_text(
        "--- a/ggml/src/ggml-cuda/mmq.cu\n+++ b/ggml/src/ggml-cuda/mmq.cu\n@@ -1,3 +1,3 @@\n"
        " #include \"not-what-is-there.cuh\"\n-#include \"nor-this.cuh\"\n+#include \"x.cuh\"\n #include \"y.cuh\"\n")
    sdist = _build("fetch").stdout.strip()
    out = _build("check", env={"LLAMA_SDIST": sdist, "LLAMA_CPP_PATCHES": str(bad)})
    assert out.returncode != 0
    assert "0001-stale.patch does not apply cleanly to llama-cpp-python" in out.stderr


def test_the_setting_defaults_on_is_checked_and_reaches_the_worker_env_over_workers_env() -> None:
    assert ModelConfig().prefill_cublas_min_rows > 0
    cfg = from_dict({"model": {"path": "m.gguf", "prefill_cublas_min_rows": 0}})
    assert cfg.model.prefill_cublas_min_rows == 0
    with pytest.raises(ConfigError, match=r"model\.prefill_cublas_min_rows: must be >= 0"):
        from_dict({"model": {"path": "m.gguf", "prefill_cublas_min_rows": -1}})
    with pytest.raises(ConfigError, match=r"models\[1\]\.prefill_cublas_min_rows: must be an integer"):
        from_dict({"models": [{"path": "a.gguf"}, {"path": "b.gguf", "prefill_cublas_min_rows": "128"}]})
    env = worker_env({"GGML_CUDA_CUBLAS_MIN_BATCH": "7"}, None, {"GGML_CUDA_CUBLAS_MIN_BATCH": "9"}, 2, 256)
    assert env["GGML_CUDA_CUBLAS_MIN_BATCH"] == "256"
    assert worker_env({}, None, {}, 2, 0)["GGML_CUDA_CUBLAS_MIN_BATCH"] == "0"  # llama.cpp's own choice


def test_the_worker_knows_whether_its_llama_cpp_has_the_patch(tmp_path: Path) -> None:
    import llama_cpp.llama_cpp as raw

    on = {llama_patches.CUBLAS_MIN_BATCH_ENV: "128"}
    loaded = Path(raw._lib._name).parent  # type: ignore[attr-defined]
    if not llama_patches.cuda_libraries(loaded):  # the CPU build (CI): no CUDA backend to patch
        assert "has no CUDA backend" in llama_patches.cublas_rows_ignored(on, loaded)
    assert llama_patches.cublas_rows_ignored({llama_patches.CUBLAS_MIN_BATCH_ENV: "0"}, loaded) == ""
    assert llama_patches.cublas_rows_ignored({}, loaded) == ""
    stock, patched = tmp_path / "stock", tmp_path / "patched"
    for d, body in ((stock, b"\x7fELF ggml_cuda_should_use_mmq GGML_CUDA_FORCE_MMQ"),
                    (patched, b"\x7fELF ggml_cuda_should_use_mmq GGML_CUDA_CUBLAS_MIN_BATCH")):
        d.mkdir()
        (d / "libggml-cuda.so.0.9").write_bytes(body)
        (d / "libggml-cuda.so").symlink_to("libggml-cuda.so.0.9")
    assert llama_patches.cublas_rows_ignored(on, patched) == ""
    note = llama_patches.cublas_rows_ignored(on, stock)
    assert "prefill_cublas_min_rows = 128 does nothing" in note and llama_patches.CUBLAS_PATCH in note


def test_a_build_without_the_patch_serves_with_the_setting_and_each_worker_gets_it(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(model={"prefill_cublas_min_rows": 256}, workers={"env": {"GGML_CUDA_CUBLAS_MIN_BATCH": "1"}})
    for w in d.status()["workers"]:
        env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        assert b"GGML_CUDA_CUBLAS_MIN_BATCH=256" in env
    with d.client() as c:
        r = c.generate("hello", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert r.usage.completion_tokens == 4 and r.finish_reason == "length"
    assert "does nothing" not in d.log_text()  # CPU workers: the setting is for the CUDA backend only


def test_deterministic_reaches_the_worker_env_and_a_gpu_build_without_0002_is_refused(tmp_path: Path) -> None:
    assert worker_env({}, None, {}, 2, 0, deterministic=True)[llama_patches.DETERMINISTIC_ENV] == "1"
    assert worker_env({"GGML_CUDA_DETERMINISTIC": "1"}, None, {}, 2, 0)[llama_patches.DETERMINISTIC_ENV] == "0"
    on = {llama_patches.DETERMINISTIC_ENV: "1"}
    stock, patched = tmp_path / "stock", tmp_path / "patched"
    for d, body in ((stock, b"\x7fELF ggml_cuda_should_use_mmq GGML_CUDA_CUBLAS_MIN_BATCH"),
                    (patched, b"\x7fELF ggml_cuda_should_use_mmq GGML_CUDA_DETERMINISTIC")):
        d.mkdir()
        (d / "libggml-cuda.so.0.9").write_bytes(body)
    assert llama_patches.deterministic_unsupported(on, patched) == ""
    assert llama_patches.deterministic_unsupported({llama_patches.DETERMINISTIC_ENV: "0"}, stock) == ""
    note = llama_patches.deterministic_unsupported(on, stock)
    assert "model.deterministic = true" in note and llama_patches.DETERMINISTIC_PATCH in note
    assert "has no CUDA backend" in llama_patches.deterministic_unsupported(on, tmp_path / "none")


def test_a_deterministic_cpu_worker_gets_the_variable_and_serves(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(model={"deterministic": True})
    for w in d.status()["workers"]:
        assert b"GGML_CUDA_DETERMINISTIC=1" in Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
    with d.client() as c:
        r = c.generate("hello", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert r.usage.completion_tokens == 4
    assert "FATAL" not in d.log_text()  # CPU workers: the CUDA patch is not needed
