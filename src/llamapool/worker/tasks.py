"""The runs a worker answers on its I/O thread, never queued behind generation: tokenize, detokenize,
and a task its model does not do (an embedding or a rerank asked of a generation model, or the reverse:
a 400 naming the model).

llama.cpp's tokenizer only reads the vocabulary, so it may run beside the engine thread's
``llama_decode`` (llama-server tokenizes in its HTTP threads the same way).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import llama_cpp as L

from llamapool.protocol.messages import LIGHT_TASKS, Done, ErrorCode, Failed, Run, Step
from llamapool.worker.content_text import CHUNK_CONTROLS, ControlTexts, parsed_in_chunks
from llamapool.worker.vocab import tokenize

# what a worker's model is (its kind: the task it runs) and what each task does, for the refusals
KINDS = {"": "a generation model", "embed": "an embedding model (embedding = true)",
         "rerank": "a reranker (task = \"rerank\")"}
DOES = {"": "generate", "embed": "compute embeddings", "rerank": "rerank documents"}
HINT = {"": "", "embed": " (list its GGUF again as a model with embedding = true)",
        "rerank": " (rerankers are models with task = \"rerank\": POST /v1/rerank, Client.rerank)"}


def io_answer(run: Run, vocab: Any, n_vocab: int, model: str, kind: str,
              controls: ControlTexts | None = None, prompts: Any = None) -> Step | None:
    """The answer to ``run`` given on the I/O path, or None when the engine thread runs it (``kind``: the
    task the model runs, "" (generate), "embed" or "rerank"; ``controls``: the vocabulary's control
    tokens, for a text holding many; ``prompts``: the engine's ``worker.engine.prompt.Prompts``, which
    renders a prompt as a generation would)."""
    entry: Done | Failed | None = None
    if run.task not in LIGHT_TASKS and run.task != kind:
        entry = Failed(run.rid, ErrorCode.INVALID_REQUEST, f"model {model!r} is {KINDS[kind]}: it does not "
                       f"{DOES.get(run.task, run.task)}{HINT.get(run.task, '') if kind == '' else ''}"
                       + (f"; use it to {DOES[kind]}" if kind else ""), "model")
    elif run.task in LIGHT_TASKS:
        if vocab is None:
            entry = Failed(run.rid, ErrorCode.INVALID_REQUEST, f"model {model!r} has no tokenizer (echo engine)",
                           "model")
        elif run.task == "tokenize" and (run.options or {}).get("infill") is not None:
            entry = _infill(run, vocab, n_vocab, model, prompts, controls)
        elif run.task == "tokenize" and (run.options or {}).get("render"):
            entry = _render(run, prompts)
        elif run.task == "tokenize":
            entry = _tokenize(run, vocab, controls)
        else:
            entry = _detokenize(run, vocab, n_vocab)
    if entry is None:
        return None
    return Step(done=[entry]) if isinstance(entry, Done) else Step(failed=[entry])


def _render(run: Run, prompts: Any) -> Done | Failed:
    """The tokens a generation of the prompt would put in KV (render, issue 53): the engine's own
    ``Prompts.tokens``, BOS and chat template included; a prompt that could not run fails as it would."""
    if prompts is None:
        return Failed(run.rid, ErrorCode.INVALID_REQUEST, "this model's worker does not render prompts", "model")
    chat = isinstance(run.prompt, list) and bool(run.prompt) and isinstance(run.prompt[0], dict)
    try:
        ids = prompts.tokens(run.prompt, (run.options or {}).get("tools"))
    except ValueError as e:
        return Failed(run.rid, getattr(e, "code", ErrorCode.INVALID_REQUEST), str(e), "messages" if chat else "prompt")
    return Done(run.rid, "stop", "", 0, 0, tokens=list(ids))


def _infill(run: Run, vocab: Any, n_vocab: int, model: str, prompts: Any,
            controls: ControlTexts | None) -> Done | Failed:
    """A fill-in-the-middle prompt's tokens (worker/infill.py), for the gateway to generate from."""
    from llamapool.worker.infill import InfillError, infill_tokens

    if prompts is None:
        return Failed(run.rid, ErrorCode.INVALID_REQUEST, "this model's worker does not render prompts", "model")
    try:
        ids = infill_tokens(vocab, n_vocab, prompts.ctx_per_slot, (run.options or {})["infill"], model,
                            lambda text: _parsed(vocab, text, controls))
    except InfillError as e:
        return Failed(run.rid, ErrorCode.INVALID_REQUEST, str(e), e.field)
    return Done(run.rid, "stop", "", 0, 0, tokens=ids)


def _many_controls(text: str, controls: ControlTexts | None) -> bool:
    """Whether ``text`` holds so many control-token texts that llama.cpp's parsing of them takes quadratic time."""
    return controls is not None and len(list(itertools.islice(controls.find(text), CHUNK_CONTROLS))) == CHUNK_CONTROLS


def _parsed(vocab: Any, text: str, controls: ControlTexts | None) -> list[int]:
    """``text``'s tokens, special-token text read as those tokens (no BOS): 64 control tokens at a time."""
    if not _many_controls(text, controls):
        return tokenize(vocab, text, False, True)
    assert controls is not None
    return parsed_in_chunks(text, controls, lambda s: tokenize(vocab, s, False, True))


def _tokenize(run: Run, vocab: Any, controls: ControlTexts | None) -> Done:
    opts = run.options or {}
    text = run.prompt if isinstance(run.prompt, str) else ""
    add, special = bool(opts.get("add_special")), bool(opts.get("parse_special", True))
    if special and _many_controls(text, controls):
        ids = _parsed(vocab, text, controls)
        if add and L.llama_vocab_get_add_bos(vocab):
            ids.insert(0, L.llama_vocab_bos(vocab))
        if add and L.llama_vocab_get_add_eos(vocab):
            ids.append(L.llama_vocab_eos(vocab))
    else:
        ids = tokenize(vocab, text, add, special)
    if not opts.get("with_pieces"):
        return Done(run.rid, "stop", "", 0, 0, tokens=ids)
    buf = ctypes.create_string_buffer(256)
    out: list[Any] = []
    for t in ids:
        n = L.llama_token_to_piece(vocab, t, buf, 256, 0, True)
        raw = buf.raw[: max(n, 0)]
        try:
            piece: Any = raw.decode()
        except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
            piece = list(raw)
        out.append({"id": t, "piece": piece})
    return Done(run.rid, "stop", "", 0, 0, tokens=out)


def _detokenize(run: Run, vocab: Any, n_vocab: int) -> Done | Failed:
    ids = [t for t in run.prompt if isinstance(t, int)] if isinstance(run.prompt, list) else []
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        return Failed(run.rid, ErrorCode.INVALID_REQUEST, f"token id {bad} is out of range (vocab has {n_vocab})",
                      "tokens")
    arr = (L.llama_token * max(1, len(ids)))(*ids)
    size = 16 * len(ids) + 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
        if n >= 0:
            return Done(run.rid, "stop", buf.raw[:n].decode(errors="replace"), 0, 0)
        size = -n + 1
