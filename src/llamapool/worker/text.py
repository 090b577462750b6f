"""Incremental detokenisation and stop strings: text deltas that never split a character."""

from __future__ import annotations

import codecs


class TextStream:
    """Turns token pieces (bytes) into text deltas, holding back what may start a stop string.

    ``push`` returns the text that is safe to send now; once a stop string appears the text is
    cut before it and :attr:`stopped` is set. ``finish`` flushes what was held back.

    A ``mark`` (the opening of a tool call) is held back like a stop string, but the text goes on:
    from the mark on, nothing more is returned (:attr:`marked` is where it starts; :meth:`mark_here`
    sets it where the text is now, for a mark that is a control token and has no text).
    """

    __slots__ = ("_dec", "_floor", "_hold", "_holds", "_mark", "_stops", "marked", "sent", "stop", "stopped", "text")

    def __init__(self, stops: tuple[str, ...] = (), mark: str = "") -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = stops
        self._mark = mark
        self._holds = (*stops, mark) if mark else stops
        self._hold = max((len(s) for s in self._holds), default=1) - 1
        self.text = ""  # all text so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of ``text`` already returned as deltas
        self.stopped = False
        self.stop = ""  # the stop string that ended the text
        self.marked = -1
        self._floor = 0  # stop strings and the mark are looked for from here on (after a preface)

    def preface(self, text: str) -> None:
        """Start the text with ``text`` (an echoed prompt): returned like generated text, never searched
        for stop strings or the mark."""
        self.text = text + self.text
        self._floor = len(text)

    def mark_here(self) -> None:
        if self.marked < 0:
            self.marked = len(self.text)

    def push(self, piece: bytes) -> str:
        new = self._dec.decode(piece)
        if not new:
            return ""
        start = max(self._floor, len(self.text) - self._hold)
        self.text += new
        if self._mark and self.marked < 0 and (at := self.text.find(self._mark, start)) >= 0:
            self.marked = at
        if self._stops:
            cut, hit = min(((i, s) for s in self._stops if (i := self.text.find(s, start)) >= 0), default=(-1, ""))
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped, self.stop = True, hit
                return self._emit(len(self.text))
        if self._holds:
            return self._emit(len(self.text) - self._partial())
        return self._emit(len(self.text))

    def finish(self) -> str:
        """Flush: the rest of the text (an incomplete UTF-8 tail becomes U+FFFD)."""
        if not self.stopped:
            self.text += self._dec.decode(b"", final=True)
        return self._emit(len(self.text))

    def _partial(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._holds:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, upto: int) -> str:
        if self.marked >= 0:
            upto = min(upto, self.marked)
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out
