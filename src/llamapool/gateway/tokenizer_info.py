"""``GET /tokenizer_info`` as vLLM has it (lm-eval's remote tokenizer reads it): a model's tokenizer
configuration, in the keys of a Hugging Face ``tokenizer_config.json``, read from its GGUF's header.

The header is read directly (its scalar keys, and the offsets of the vocabulary's strings to find the
BOS and EOS tokens' text), skipping the large arrays, so it costs milliseconds rather than the seconds
a full parse of a 49,000-token vocabulary and its merges takes.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from starlette.responses import JSONResponse, Response

from llamapool.gateway.errors import ApiError
from llamapool.gateway.serving import Call, Serving

# GGUF value types: 0-12 (uint8 ... float64); 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token", "tokenizer.ggml.model", "tokenizer.chat_template", "general.architecture",
        "general.name")


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, f.read(size))[0]


def _string(f: BinaryIO) -> bytes:
    return f.read(_read(f, "Q"))


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    """A value (None where not kept); an array's strings are skipped, their offsets returned."""
    if kind == _STRING:
        text = _string(f)
        return text.decode(errors="replace") if keep else None
    if kind == _ARRAY:
        item, n = _read(f, "I"), _read(f, "Q")
        if item == _STRING:
            offsets = []
            for _ in range(n):
                offsets.append(f.tell())
                f.seek(_read(f, "Q"), 1)
            return offsets
        if item in _SCALARS:
            f.seek(n * struct.calcsize("<" + _SCALARS[item]), 1)
            return None
        for _ in range(n):
            _value(f, item, False)
        return None
    return _read(f, _SCALARS[kind])


def gguf_tokenizer(path: str) -> dict[str, Any]:
    """The GGUF's tokenizer keys (``KEYS``), with ``bos_token``/``eos_token`` the tokens' text."""
    out: dict[str, Any] = {}
    with Path(path).open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _read(f, "I")
        _read(f, "Q")
        for _ in range(_read(f, "Q")):
            key = _string(f).decode(errors="replace")
            value = _value(f, _read(f, "I"), key in KEYS)
            if key in KEYS or key == "tokenizer.ggml.tokens":
                out[key] = value
        tokens = out.pop("tokenizer.ggml.tokens", None) or []
        for name in ("bos", "eos"):
            tid = out.get(f"tokenizer.ggml.{name}_token_id")
            if isinstance(tid, int) and 0 <= tid < len(tokens):
                f.seek(tokens[tid])
                out[f"{name}_token"] = _string(f).decode(errors="replace")
        out["vocab_size"] = len(tokens)
    return out


def tokenizer_config(info: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``'s keys, as far as a GGUF has them."""
    template = info.get("tokenizer.chat_template")
    if model.get("chat_template"):  # the config's template file overrides the GGUF's
        template = Path(model["chat_template"]).read_text()
    return {"tokenizer_class": "LlamaCppTokenizer", "model": model["name"],
            "tokenizer_model": info.get("tokenizer.ggml.model"), "model_max_length": model.get("ctx_per_slot"),
            "vocab_size": info.get("vocab_size"), "bos_token": info.get("bos_token"),
            "eos_token": info.get("eos_token"), "add_bos_token": bool(info.get("tokenizer.ggml.add_bos_token")),
            "add_eos_token": bool(info.get("tokenizer.ggml.add_eos_token")), "chat_template": template}


async def handle(s: Serving, call: Call) -> Response:
    """``GET /tokenizer_info[?model=NAME]``: the model's tokenizer configuration (default: the pool's first)."""
    import asyncio

    name = call.request.query_params.get("model")
    model = s.spec.model_info(name)
    if model is None or not model.get("path"):
        known = ", ".join(m["name"] for m in s.spec.models)
        raise ApiError(404, f"no tokenizer for model {name or s.spec.model!r} (the pool's models: {known})",
                       param="model", code="model_not_found")
    try:
        info = await asyncio.to_thread(gguf_tokenizer, model["path"])
        return JSONResponse(tokenizer_config(info, model))
    except (OSError, ValueError, struct.error) as e:
        raise ApiError(500, f"cannot read the tokenizer of {model['name']!r}: {e}", type_="server_error",
                       code="internal_error") from None
