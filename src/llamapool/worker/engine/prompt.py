"""A request's prompt as tokens: text, chat messages (the chat template) or token ids, checked against the
context; and the text stream its output goes into."""

from __future__ import annotations

from typing import Any

import llama_cpp as L

from llamapool.protocol.messages import Prompt, SamplingParams
from llamapool.worker.chat import ChatFormatter
from llamapool.worker.engine.sequence import ContextLengthExceeded
from llamapool.worker.text import TextStream
from llamapool.worker.vocab import tokenize


class Prompts:
    """Turns prompts into tokens for a model's vocabulary and chat template, within ``ctx_per_slot``."""

    def __init__(self, vocab: Any, n_vocab: int, chat: ChatFormatter, ctx_per_slot: int):
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.chat = chat
        self.ctx_per_slot = ctx_per_slot
        self.max_piece = self._max_piece_bytes()

    def _max_piece_bytes(self) -> int:
        """An upper bound on the bytes one token stands for (its vocabulary text is at least as long),
        so that a prompt far over the context is refused without tokenizing it (megabytes take
        seconds, on the engine thread)."""
        longest = 1
        for t in range(self.n_vocab):
            text = L.llama_vocab_get_text(self.vocab, t)
            if text and len(text) > longest:
                longest = len(text)
        return longest

    def _surely_too_long(self, n_bytes: int) -> bool:
        """``n_bytes`` of text make at least ``n_bytes / max_piece`` tokens: over the limit?"""
        return n_bytes // self.max_piece >= self.ctx_per_slot

    def tokenize(self, text: str) -> list[int]:
        """A text prompt's tokens: BOS added as the model wants, special-token text read as text."""
        return tokenize(self.vocab, text, add_special=True, parse_special=False)

    def tokens(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's tokens; ``ValueError`` (:class:`ContextLengthExceeded` for a long one) when it cannot run."""
        if not isinstance(prompt, str) and len(prompt) >= self.ctx_per_slot and isinstance(prompt[0], dict):
            # every message renders to a token at least (its role's marker): refused before the template
            # renders them (100,000 one-letter messages held the engine thread 8-14 s)
            raise ContextLengthExceeded(
                f"the chat has {len(prompt)} messages, at least a token each; the limit is {self.ctx_per_slot - 1} "
                f"tokens (model.ctx_per_slot)")
        text_bytes = 0
        for part in [prompt] if isinstance(prompt, str) else prompt:
            content = part.get("content") if isinstance(part, dict) else part
            if isinstance(content, str):
                text_bytes += len(content.encode())
        if self._surely_too_long(text_bytes):
            raise ContextLengthExceeded(
                f"prompt is {text_bytes} bytes of text, at least {text_bytes // self.max_piece} tokens; the limit is "
                f"{self.ctx_per_slot - 1} (model.ctx_per_slot)"
            )
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt)
        elif prompt and isinstance(prompt[0], dict):  # chat messages
            tokens = self.chat.tokens(prompt, tools)  # type: ignore[arg-type]
        else:
            tokens = list(prompt)  # type: ignore[arg-type]
        if not tokens:
            raise ValueError("prompt tokenizes to nothing")
        bad = next((t for t in tokens if t >= self.n_vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range (vocab has {self.n_vocab})")
        if len(tokens) >= self.ctx_per_slot:
            raise ContextLengthExceeded(
                f"prompt has {len(tokens)} tokens; the limit is {self.ctx_per_slot - 1} "
                f"(model.ctx_per_slot)"
            )
        return tokens

    def text_stream(self, p: SamplingParams) -> TextStream:
        """The sequence's text: stop strings held back, and a tool call's opening (``auto``: prose
        streams until it; ``required`` or a named function: the whole reply is calls)."""
        if not p.tools or p.tool_choice == "none":
            return TextStream(p.stop)
        text = TextStream(p.stop, self.chat.tool_format.trigger)
        if p.tool_choice not in (None, "auto"):
            text.mark_here()
        return text
