"""A rerank's query-document pair as the tokens llama-server scores (``format_prompt_rerank`` of its
tools/server/server-common.cpp), and the truncation of long documents.

A GGUF with a ``rerank`` chat template (``tokenizer.chat_template.rerank``, as Qwen3-Reranker GGUFs
carry) has ``{query}`` and ``{document}`` replaced in it and the whole tokenized with special tokens
parsed and none added; any other is ``[BOS] query [EOS] [SEP] document [EOS]``, each special token only
where the vocabulary adds it (BERT's WordPiece: ``[CLS] query [SEP] document``; XLM-R's:
``<s> query </s> </s> document </s>``), the texts tokenized without special tokens.

A document longer than ``max_tokens_per_doc`` tokens, or than what a slot's context leaves beside the
query, is cut to its first tokens (Cohere's default: truncate); a query that leaves no room is refused.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as L

from llamapool.worker.vocab import tokenize


class PairError(ValueError):
    """A pair that cannot be scored: ``field`` names the request's part ("query")."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def detokenize(vocab: Any, ids: list[int]) -> str:
    """``ids`` as text, special tokens left out."""
    arr = (L.llama_token * max(1, len(ids)))(*ids)
    size = 16 * len(ids) + 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_detokenize(vocab, arr, len(ids), buf, size, False, False)
        if n >= 0:
            return buf.raw[:n].decode(errors="replace")
        size = -n + 1


class PairFormat:
    """The pair tokens of one model's vocabulary (and its rerank template, if its GGUF has one)."""

    def __init__(self, model: Any, vocab: Any):
        self.vocab = vocab
        raw = L.llama_model_chat_template(model, b"rerank")
        self.template: str | None = raw.decode() if raw else None
        eos = L.llama_vocab_eos(vocab)
        self.eos = eos if eos != L.LLAMA_TOKEN_NULL else L.llama_vocab_sep(vocab)
        self.bos = [L.llama_vocab_bos(vocab)] if L.llama_vocab_get_add_bos(vocab) else []
        self.sep = [L.llama_vocab_sep(vocab)] if L.llama_vocab_get_add_sep(vocab) else []
        self.add_eos = bool(L.llama_vocab_get_add_eos(vocab))

    def _render(self, query: str, doc: str | list[int]) -> list[int]:
        if self.template is not None:
            text = doc if isinstance(doc, str) else detokenize(self.vocab, doc)
            prompt = self.template.replace("{query}", query).replace("{document}", text)
            return tokenize(self.vocab, prompt, False, True)
        q = tokenize(self.vocab, query, False, False)
        d = tokenize(self.vocab, doc, False, False) if isinstance(doc, str) else doc
        eos = [self.eos] if self.add_eos else []
        return self.bos + q + eos + self.sep + d + eos

    def tokens(self, query: str, doc: str, max_doc: int, n_ctx: int) -> list[int]:
        """The pair's tokens, the document cut to ``max_doc`` tokens (0: no limit) and to what fits in
        ``n_ctx`` beside the query; a :class:`PairError` when the query alone leaves no room."""
        whole = self._render(query, doc)
        d = tokenize(self.vocab, doc, False, False)
        room = n_ctx - (len(whole) - len(d))
        if room < 1 and (d or len(whole) > n_ctx):
            raise PairError(f"the query takes {len(whole) - len(d)} tokens of the pair: a slot's context has "
                            f"{n_ctx} (model.ctx_per_slot), which leaves no room for a document", "query")
        limit = min(room, max_doc) if max_doc > 0 else room
        if len(d) <= limit and len(whole) <= n_ctx:
            return whole
        out = self._render(query, d[:limit])
        return out[:n_ctx]
