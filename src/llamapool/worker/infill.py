"""Fill-in-the-middle prompts: the one place their tokens are assembled (``/infill`` and ``suffix`` on
``/v1/completions`` both come here), as llama-server's ``format_prompt_infill`` (tools/server/server-common.cpp)
lays them out, so that the same model gets the same tokens::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n text0 ... [FIM_SEP]filename\\n   (repo-level context: input_extra)
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

The FIM tokens are those llama.cpp finds in the model's vocab (``tokenizer.ggml.fim_*_token_id`` in the
GGUF, or their texts: ``<|fim_prefix|>``, CodeLlama's ``▁<PRE>``, DeepSeek's ...). Without a FIM_SEP token each
extra file is its text after a ``--- snippet ---`` line. The prefix keeps its last ``3 * INFILL_BATCH / 4``
tokens, the suffix its first ``INFILL_BATCH / 4 - 2 - len(prompt)``, the extra context its last
``ctx_per_slot - INFILL_BATCH - 2 * n_predict`` (llama-server's ratios, at its default batch of 2048), and
no more than leaves the prompt within the slot's context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp as L

from llamapool.worker.vocab import tokenize

INFILL_BATCH = 2048  # llama-server's default -b, whose quarters share the prefix and suffix
SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of extra files for a model without FIM_SEP
Mixed = str | Sequence[str | int]  # a text, or texts and token ids (llama-server's tokenize_mixed)


class InfillError(ValueError):
    """Infill cannot be done: ``field`` names the part (``model`` for a model without FIM tokens)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def missing(vocab: Any) -> list[str]:
    """The FIM tokens (prefix, suffix, middle) the model lacks: infill needs all three."""
    return [name for name, tid in (("prefix", L.llama_vocab_fim_pre(vocab)), ("suffix", L.llama_vocab_fim_suf(vocab)),
                                   ("middle", L.llama_vocab_fim_mid(vocab))) if tid == L.LLAMA_TOKEN_NULL]


def _mixed(vocab: Any, value: Mixed, n_vocab: int, field: str) -> list[int]:
    """A text's tokens (no BOS, special-token text read as text), or a list of texts and token ids as one."""
    if isinstance(value, str):
        return tokenize(vocab, value, False, False)
    out: list[int] = []
    for part in value:
        if isinstance(part, str):
            out += tokenize(vocab, part, False, False)
        elif not 0 <= part < n_vocab:
            raise InfillError(field, f"'{field}' has token id {part}, out of range (the vocab has {n_vocab})")
        else:
            out.append(part)
    return out


def _extra(vocab: Any, files: Sequence[Sequence[str]]) -> list[int]:
    """The repo-level context: the files of ``input_extra`` (filename, text), then the current file's header."""
    rep, sep = L.llama_vocab_fim_rep(vocab), L.llama_vocab_fim_sep(vocab)
    out: list[int] = []
    if rep != L.LLAMA_TOKEN_NULL:
        out += [rep, *tokenize(vocab, "myproject\n", False, False)]
    for filename, text in files:
        if sep != L.LLAMA_TOKEN_NULL:
            out += [sep, *tokenize(vocab, filename + "\n", False, False)]
        else:
            out += tokenize(vocab, SNIPPET, False, False)
        out += tokenize(vocab, text, False, False)
    if sep != L.LLAMA_TOKEN_NULL:
        out += [sep, *tokenize(vocab, "filename\n", False, False)]
    return out


def infill_tokens(vocab: Any, n_vocab: int, ctx_per_slot: int, parts: dict[str, Any], model: str,
                  special: Callable[[str], list[int]] | None = None) -> list[int]:
    """The prompt of an infill: ``parts`` are the wire's ``input_prefix``, ``input_suffix``, ``input_extra``
    (``[filename, text]`` pairs; absent: no repo-level context at all, as ``suffix`` has it), ``prompt`` (text
    after the prefix, special tokens read: by ``special``, default llama.cpp's own) and ``n_predict``."""
    lacking = missing(vocab)
    if lacking:
        raise InfillError("model", f"model {model!r} cannot infill: its vocab has no FIM {', '.join(lacking)} "
                                   f"token (tokenizer.ggml.fim_pre/suf/mid_token_id in its GGUF); serve a code model "
                                   f"with FIM tokens (Qwen2.5-Coder, CodeLlama, StarCoder2, DeepSeek-Coder)")
    prefix = _mixed(vocab, parts.get("input_prefix", ""), n_vocab, "input_prefix")
    suffix = _mixed(vocab, parts.get("input_suffix", ""), n_vocab, "input_suffix")
    text = parts.get("prompt", "")
    prompt = special(text) if special is not None else tokenize(vocab, text, False, True)
    files = parts.get("input_extra")  # None (``suffix``): no repo-level context; [] (``/infill``): its header
    extra = _extra(vocab, files) if files is not None else []
    n_predict = int(parts.get("n_predict", -1))
    n_prefix = min(len(prefix), 3 * (INFILL_BATCH // 4))
    n_suffix = min(len(suffix), max(0, INFILL_BATCH // 4 - (2 + len(prompt))))
    n_extra = min(max(0, ctx_per_slot - INFILL_BATCH - 2 * n_predict), len(extra))
    head = [L.llama_vocab_fim_pre(vocab), *prefix[len(prefix) - n_prefix:], *prompt]
    if L.llama_vocab_get_add_bos(vocab):
        head.insert(0, L.llama_vocab_bos(vocab))
    tail = [L.llama_vocab_fim_suf(vocab), *suffix[:n_suffix], L.llama_vocab_fim_mid(vocab)]
    # n_predict -1 leaves the extra files 2 tokens more than the context minus a batch, which llama-server
    # then overflows: fewer of them, so the prompt fits the slot (the rest is llama-server's layout)
    n_extra = max(0, min(n_extra, ctx_per_slot - 1 - len(head) - len(tail)))
    return [*extra[len(extra) - n_extra:], *head, *tail]
