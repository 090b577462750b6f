"""Chat content tokenized as text: control tokens are read only where the chat template writes them.

A rendered chat prompt is template text (``<start_of_turn>user\\n``) around the messages' contents.
Tokenizing the whole of it with special-token parsing on would make a user's literal
``<end_of_turn>`` Gemma's control token, so that text relayed from end users could forge turns and
roles. Instead (:func:`chat_tokens`):

- when no content holds the text of a control token (the usual case), the rendered prompt is
  tokenized as before, special tokens parsed;
- otherwise the messages are rendered again with a placeholder for each content, which places every
  content in the rendered text (:func:`content_spans`; a template that trims contents is followed),
  and the text is cut at the control tokens of the template's own text only: each stretch between
  them is tokenized with special-token parsing off, the contents within it included. This is what
  llama.cpp does with the whole text when no content holds a control token's text, so the tokens
  differ only where a content does.

A template that reads a content otherwise (compares it, cuts it) cannot be followed: the contents
are then put where the placeholders are, as they were sent.

``parse_special_in_content = true`` (a model's setting) keeps the old behaviour for trusted callers;
``/tokenize`` has its own ``parse_special``. No llama.cpp here: the tokenizer comes as functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a placeholder's number
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class ControlTexts:
    """The texts of a vocabulary's control tokens (those that special-token parsing reads), to find."""

    ids: Mapping[str, int]
    lengths: tuple[int, ...]  # the distinct text lengths, longest first
    starts: re.Pattern[str]  # the first characters of the texts

    @classmethod
    def of(cls, texts: Mapping[str, int]) -> ControlTexts:
        texts = {t: i for t, i in texts.items() if t}
        firsts = sorted({t[0] for t in texts}) or ["\ue002"]  # (no control token: a pattern that never matches)
        return cls(texts, tuple(sorted({len(t) for t in texts}, reverse=True)),
                   re.compile("[" + "".join(re.escape(c) for c in firsts) + "]"))

    def find(self, text: str, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int]]:
        """``(position, length, token)`` of each control token text in ``text[start:end]``, left to right,
        the longest at a position."""
        end = len(text) if end is None else end
        at = start
        while (m := self.starts.search(text, at, end)) is not None:
            at = m.start()
            for n in self.lengths:
                if at + n <= end and (tok := self.ids.get(text[at : at + n])) is not None:
                    yield at, n, tok
                    at += n
                    break
            else:
                at += 1

    def occur_in(self, text: str) -> bool:
        return next(self.find(text), None) is not None


CHUNK_CONTROLS = 64  # control tokens a text is parsed with at most at once (parsed_in_chunks; 64 to 256
# are about as fast on SmolLM2 and Gemma 3, whose 6,000 unused control tokens make larger pieces slower)


def parsed_in_chunks(text: str, controls: ControlTexts, parsed: Tokenize, per: int = CHUNK_CONTROLS) -> list[int]:
    """``parsed(text)`` (special tokens parsed, nothing added) computed a piece at a time: llama.cpp's
    special-token parsing takes time quadratic in a text's special tokens (16,000: 8 s), so that a
    400 kB ``/tokenize`` body held a worker's I/O thread past its heartbeats, and 100,000 chat messages
    its engine thread for minutes. The text is cut only right after a control token's text that
    non-space text follows, every ``per`` of them at most (CHUNK_CONTROLS): llama.cpp cuts a text there too, and no
    whitespace lies across the cut for a token's lstrip or rstrip to take, so the tokens are the same."""
    out: list[int] = []
    start = count = 0
    for at, n, _tok in controls.find(text):
        count += 1
        cut = at + n
        if count >= per and cut < len(text) and not text[cut].isspace():
            out += parsed(text[start:cut])
            start, count = cut, 0
    return out + parsed(text[start:]) if start < len(text) or not out else out


def with_placeholders(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with each non-empty string content replaced by a placeholder, and those contents."""
    contents: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and c:
            out.append({**m, "content": f"{_OPEN}{len(contents)}{_CLOSE}"})
            contents.append(c)
        else:
            out.append(dict(m))
    return out, contents


def content_spans(rendered: str, skeleton: str, contents: Sequence[str]) -> list[tuple[int, int]] | None:
    """Where the contents are in ``rendered``, given ``skeleton``, the same messages rendered with
    placeholders; each content as sent or trimmed, as the template wrote it. None when ``rendered`` is
    not the skeleton with contents in the placeholders (the template read a content otherwise)."""
    parts = _PLACEHOLDER.split(skeleton)  # text, number, text, number, ..., text
    spans = []
    pos = 0
    for k in range(0, len(parts), 2):
        if not rendered.startswith(parts[k], pos):
            return None
        pos += len(parts[k])
        if k + 1 == len(parts):
            break
        i, after = int(parts[k + 1]), parts[k + 2]
        if i >= len(contents):
            return None
        c = contents[i]
        for form in dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip())):
            if rendered.startswith(form, pos) and rendered.startswith(after, pos + len(form)):
                spans.append((pos, pos + len(form)))
                pos += len(form)
                break
        else:
            return None
    return spans if pos == len(rendered) else None


def filled(skeleton: str, contents: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
    """The skeleton with each placeholder replaced by its content as sent, and where they are."""
    text: list[str] = []
    spans = []
    pos = 0
    parts = _PLACEHOLDER.split(skeleton)
    for k, part in enumerate(parts):
        piece = part if k % 2 == 0 else contents[int(part)]
        if k % 2:
            spans.append((pos, pos + len(piece)))
        text.append(piece)
        pos += len(piece)
    return "".join(text), spans


def tokens_outside(text: str, spans: Sequence[tuple[int, int]], controls: ControlTexts, raw: Tokenize) -> list[int]:
    """``text``'s tokens with control tokens read only outside ``spans`` (sorted, disjoint): each stretch
    between two of them tokenized by ``raw`` (special-token parsing off)."""
    out: list[int] = []
    last = 0
    edges = [0] + [e for s in spans for e in s] + [len(text)]
    for a, b in zip(edges[::2], edges[1::2], strict=True):  # the template's own text
        for at, n, tok in controls.find(text, a, b):
            if at > last:
                out += raw(text[last:at])
            out.append(tok)
            last = at + n
    if last < len(text):
        out += raw(text[last:])
    return out


def chat_tokens(messages: Sequence[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
                controls: ControlTexts, parsed: Tokenize, raw: Tokenize) -> list[int]:
    """The tokens of ``messages`` as ``render`` writes them: special tokens parsed (``parsed``) where the
    template writes them, the contents as text (``raw``)."""
    text = render(list(messages))
    skeleton_messages, contents = with_placeholders(messages)
    if not any(controls.occur_in(c) for c in contents):
        return parsed(text)
    skeleton = render(skeleton_messages)
    spans = content_spans(text, skeleton, contents)
    if spans is None:
        text, spans = filled(skeleton, contents)
    return tokens_outside(text, spans, controls, raw)
