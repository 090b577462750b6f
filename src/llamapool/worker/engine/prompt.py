"""A request's prompt as tokens: text, chat messages (the chat template) or token ids, checked against the
context; and the text stream its output goes into."""

from __future__ import annotations

from typing import Any

import llama_cpp as L

from llamapool.protocol.media import MEDIA_MARKER, media_hash
from llamapool.protocol.messages import Prompt, SamplingParams
from llamapool.protocol.params import ParamError
from llamapool.worker.chat import MEDIA_TOKEN, ChatFormatter
from llamapool.worker.engine.media import MediaSpan, Projector, pseudo_ids
from llamapool.worker.engine.sequence import ContextLengthExceeded
from llamapool.worker.text import TextStream
from llamapool.worker.vocab import tokenize


class Prompts:
    """Turns prompts into tokens for a model's vocabulary and chat template, within ``ctx_per_slot``."""

    def __init__(self, vocab: Any, n_vocab: int, chat: ChatFormatter, ctx_per_slot: int,
                 projector: Projector | None = None):
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.chat = chat
        self.ctx_per_slot = ctx_per_slot
        self.projector = projector  # the model's mmproj (None: it takes no images)
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
        """The prompt's tokens (an image's positions as its pseudo ids); ``ValueError``
        (:class:`ContextLengthExceeded` for a long one) when it cannot run."""
        return self.media_tokens(prompt, tools)[0]

    def media_tokens(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None
                     ) -> tuple[list[int], list[MediaSpan]]:
        """The prompt's tokens and its images' spans in them (media.py)."""
        images: list[tuple[bytes, str]] = []
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt, images = _flatten(prompt)  # type: ignore[arg-type]
        if images and self.projector is None:
            raise ParamError(images[0][1], f"'{images[0][1]}' is an image, and this model takes none (its config "
                                           f"sets no mmproj: docs/models.md#images)")
        tokens = self._tokens(prompt, tools, bool(images))
        if not images:
            return tokens, []
        return self._expand(tokens, images)

    def _expand(self, tokens: list[int], images: list[tuple[bytes, str]]) -> tuple[list[int], list[MediaSpan]]:
        """``tokens`` with each :data:`MEDIA_TOKEN` replaced by its image's tokens (libmtmd's)."""
        assert self.projector is not None
        if tokens.count(MEDIA_TOKEN) != len(images):
            raise ParamError("messages", f"the chat template wrote {tokens.count(MEDIA_TOKEN)} of the prompt's "
                                         f"{len(images)} images (a template that drops contents?)")
        out: list[int] = []
        spans: list[MediaSpan] = []
        k = 0
        for t in tokens:
            if t != MEDIA_TOKEN:
                out.append(t)
                continue
            data, field = images[k]
            k += 1
            digest = media_hash(data)
            try:
                segments = self.projector.tokenize(data, digest)
            except ValueError as e:
                raise ParamError(field, f"'{field}' {e}") from None
            for text, owner, chunk in segments:
                if owner is None:
                    out += text
                    continue
                n = self.projector.M.mtmd_input_chunk_get_n_tokens(chunk)
                spans.append(MediaSpan(len(out), n, chunk, owner, digest))
                out += pseudo_ids(digest, n, self.n_vocab).tolist()
        if len(out) >= self.ctx_per_slot:
            raise ContextLengthExceeded(f"prompt has {len(out)} tokens with its images' tokens; the limit is "
                                        f"{self.ctx_per_slot - 1} (model.ctx_per_slot)")
        if spans and spans[-1].end >= len(out):
            raise ParamError(images[-1][1], f"'{images[-1][1]}': the prompt ends with an image; text must follow")
        return out, spans

    def _tokens(self, prompt: Prompt, tools: list[dict[str, Any]] | None, media: bool) -> list[int]:
        """The prompt's tokens, :data:`MEDIA_TOKEN` where an image is (``media``)."""
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
            tokens = self.chat.tokens(prompt, tools, MEDIA_MARKER if media else "")  # type: ignore[arg-type]
        else:
            tokens = list(prompt)  # type: ignore[arg-type]
        if not tokens:
            raise ValueError("prompt tokenizes to nothing")
        bad = next((t for t in tokens if t >= self.n_vocab or (t < 0 and not media)), None)
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


def _flatten(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[bytes, str]]]:
    """The chat with each content of parts (protocol/codec.py) made a string, an image's place in it
    libmtmd's marker; and the images' bytes with the field naming each, in order."""
    out: list[dict[str, Any]] = []
    images: list[tuple[bytes, str]] = []
    texts_at: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        pieces = []
        for j, part in enumerate(content):
            if part.get("type") == "image":
                images.append((part["data"], f"messages[{i}].content[{j}]"))
                pieces.append(MEDIA_MARKER)
            else:
                pieces.append(part["text"])
                texts_at.append((part["text"], f"messages[{i}].content[{j}]"))
        out.append({**m, "content": "".join(pieces)})
    if images:
        for text, field in texts_at:
            if MEDIA_MARKER in text:
                raise ParamError(field, f"'{field}' holds the text {MEDIA_MARKER!r}, which marks an image's place "
                                        f"in a prompt with images")
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str) and MEDIA_MARKER in m["content"]:
                raise ParamError(f"messages[{i}].content", f"'messages[{i}].content' holds the text "
                                                           f"{MEDIA_MARKER!r}, which marks an image's place")
    return out, images
