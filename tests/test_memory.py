"""A worker's memory estimate (supervisor/memory.py): the GGUF header it reads, its formula's parts, and
its total beside what llama.cpp allocates for the same model and context (tests/memory_calibrate.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llamapool.modelgen import make_model
from llamapool.supervisor.memory import (
    CPU_PROCESS,
    CTX_PAD,
    GPU_PROCESS,
    MemoryNeed,
    estimate,
    fmt_bytes,
    read_shape,
    worker_ubatch,
)

ROOT = Path(__file__).resolve().parent.parent
GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"


def _calibrate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("memory_calibrate", ROOT / "tests" / "memory_calibrate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _header_only(path: Path, arch: str = "llama", tensors: int = 0, **fields: Any) -> Path:
    """A GGUF with the given ``arch.KEY`` fields (and ``tensors`` f32 tensors of 1,000 elements)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, arch)
    for key, value in fields.items():
        name = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, list):
            w.add_array(name, value)
        else:
            w.add_uint32(name, value)
    for i in range(tensors):
        w.add_tensor(f"t{i}", np.zeros(1000, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_header_as_gguf_reads_it(tmp_path: Path) -> None:
    """The fast header reader agrees with gguf's own GGUFReader on every number the estimate uses."""
    from gguf import GGUFReader

    path = make_model(tmp_path / "m.gguf", n_embd=96, n_layer=3, n_head=6, n_head_kv=2, n_ff=160, n_vocab=700,
                      qtype="q8_0")
    shape = read_shape(path)
    reader = GGUFReader(path)
    assert shape.weights == sum(int(t.n_bytes) for t in reader.tensors)
    assert (shape.arch, shape.n_layer, shape.n_embd, shape.n_ff, shape.n_head) == ("llama", 3, 96, 160, 6)
    assert shape.n_head_kv == (2, 2, 2) and shape.key_length == shape.value_length == 16
    assert shape.n_vocab == len(reader.fields["tokenizer.ggml.tokens"].data) == 700


def test_the_kv_cache_per_layer_heads_explicit_head_sizes_and_padding(tmp_path: Path) -> None:
    common = {"block_count": 3, "embedding_length": 64, "attention__head_count": 4, "vocab_size": 100}
    # head_count_kv given per layer (a layer without KV heads counts nothing); head sizes default to n_embd/n_head
    per_layer = read_shape(_header_only(tmp_path / "a.gguf", **common, attention__head_count_kv=[2, 0, 4]))
    assert per_layer.n_head_kv == (2, 0, 4) and per_layer.key_length == 16
    need = estimate(tmp_path / "a.gguf", slots=2, ctx_per_slot=1000, n_ubatch=64, gpu=True)
    assert need.kv == (2 + 0 + 4) * (16 + 16) * 2 * 1024 * 2  # 1,000 tokens a slot padded to 1,024
    assert 1024 % CTX_PAD == 0
    # explicit key/value lengths win; no head_count_kv: as many as the query heads
    explicit = _header_only(tmp_path / "b.gguf", **common, attention__key_length=32, attention__value_length=8)
    assert estimate(explicit, 1, 256, 64, gpu=True).kv == 3 * 4 * (32 + 8) * 256 * 2


def test_split_gguf_weights_count_every_part(tmp_path: Path) -> None:
    common = {"block_count": 1, "embedding_length": 8, "attention__head_count": 1, "vocab_size": 10}
    first = _header_only(tmp_path / "m-00001-of-00002.gguf", tensors=2, **common)
    _header_only(tmp_path / "m-00002-of-00002.gguf", tensors=3, **common)
    assert read_shape(first).weights == 5 * 4000


def test_compute_follows_the_logits_and_attention_without_flash_attention(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m.gguf", n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, n_vocab=512)
    gpu = estimate(path, 8, 2048, 512, gpu=True)
    cpu = estimate(path, 8, 2048, 512, gpu=False)
    assert gpu.compute == (512 * 512 + (64 + 128) * 512) * 4  # flash attention: the logits dominate
    assert cpu.compute == ((4 + 2) * 2048 * 512 + (64 + 128) * 512 + 512 * 8) * 4  # KQ and mask, output rows
    assert gpu.process == GPU_PROCESS and cpu.process == CPU_PROCESS
    assert estimate(path, 8, 2048, 512, gpu=True, flash_attn=False).compute > gpu.compute
    assert worker_ubatch(1024, 512, 8) == 520 and worker_ubatch(256, 4096, 64) == 256


def test_text_names_each_part() -> None:
    need = MemoryNeed(weights=253 << 20, kv=36 << 20, compute=70 << 20, slots=8, ctx_per_slot=2048)
    assert need.total == 359 << 20
    assert need.text() == "253 MiB weights + 36 MiB KV (8 x 2048 tokens) + 70 MiB compute = 359 MiB"
    cpu = MemoryNeed(weights=253 << 20, kv=36 << 20, compute=70 << 20, slots=8, ctx_per_slot=2048, process=96 << 20)
    assert cpu.text() == "253 MiB weights + 36 MiB KV (8 x 2048 tokens) + 70 MiB compute + 96 MiB process = 455 MiB"
    assert fmt_bytes(18 << 30) == "18.0 GiB" and fmt_bytes(2048) == "2 KiB" and fmt_bytes(12) == "12 B"


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        estimate(tmp_path / "none.gguf", 8, 2048, 512, gpu=False)
    (tmp_path / "text.gguf").write_text("not a model at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        estimate(tmp_path / "text.gguf", 8, 2048, 512, gpu=False)
    good = make_model(tmp_path / "m.gguf")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:3000])
    with pytest.raises(ValueError, match="truncated"):
        estimate(tmp_path / "cut.gguf", 8, 2048, 512, gpu=False)
    with pytest.raises(ValueError, match=r"no llama\.block_count"):
        estimate(_header_only(tmp_path / "h.gguf", embedding_length=64), 8, 2048, 512, gpu=False)
    for bad in ({"slots": 0}, {"ctx_per_slot": -1}, {"n_ubatch": 1.5}):
        args: dict[str, Any] = {"slots": 8, "ctx_per_slot": 2048, "n_ubatch": 512, **bad}
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive integer"):
            estimate(good, gpu=False, **args)


@pytest.mark.parametrize("case", [(4, 512, 512), (8, 2048, 520), (3, 1000, 256)])
def test_the_estimate_against_llama_cpp_on_the_tiny_model(model_path: str, case: tuple[int, int, int]) -> None:
    """llama.cpp's own buffers (model, KV, compute, output) for the worker's context parameters: the estimate
    of them is never below their total and at most 25 % above (the KV exactly); the whole estimate is more
    than the process's RSS after a micro-batch."""
    slots, ctx, ubatch = case
    got = _calibrate().measure(model_path, slots, ctx, ubatch)
    need = estimate(model_path, slots, ctx, ubatch, gpu=False)
    total = got["model"] + got["KV"] + got["compute"] + got["output"]
    assert need.kv == pytest.approx(got["KV"], rel=0.001)
    assert total <= need.total - need.process <= 1.25 * total, (need.text(), got)
    assert need.total >= got["run"], (need.text(), got)


@pytest.mark.skipif(not GEMMA.exists(), reason="models/gemma-3-270m-q4_k_m.gguf not fetched")
def test_the_estimate_against_llama_cpp_on_gemma() -> None:
    """Gemma 3 270M: an iSWA model (two KV caches, full size) with a 262,144-token vocabulary (the logits
    dominate the compute buffer)."""
    got = _calibrate().measure(str(GEMMA), 4, 1024, 256)
    need = estimate(GEMMA, 4, 1024, 256, gpu=False)
    total = got["model"] + got["KV"] + got["compute"] + got["output"]
    assert need.weights == pytest.approx(got["model"], rel=0.001) and need.kv == pytest.approx(got["KV"], rel=0.001)
    assert total <= need.total - need.process <= 1.1 * total, (need.text(), got)
    assert need.total >= got["run"], (need.text(), got)
