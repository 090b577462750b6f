"""Text to tokens with llama.cpp's tokenizer (the one wrapper of ``llama_tokenize``; engine thread only)."""

from __future__ import annotations

from typing import Any

import llama_cpp as L


def tokenize(vocab: Any, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """``text``'s tokens: with BOS/EOS as the model adds them (``add_special``), and special-token text
    such as ``<start_of_turn>`` read as those tokens (``parse_special``)."""
    data = text.encode()
    n_max = len(data) + 8
    buf = (L.llama_token * n_max)()
    n = L.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:
        buf = (L.llama_token * -n)()
        n = L.llama_tokenize(vocab, data, len(data), buf, -n, add_special, parse_special)
    return list(buf[:n])
