"""Budget-aware closing: a constrained reply that runs out of ``max_tokens`` still ends as its grammar allows.

:class:`Closer` finds, from a matcher's state, a short sequence of tokens that completes the grammar
(a *plan*): the forced bytes llguidance knows (a required key, the rest of a literal), and otherwise
the first of a few closing tokens the state takes. Inside a JSON string: one that ends it (``"}``,
``"``), else a separator a format needs (``@``, ``-``, ``:``, ``.``, each a few times at most: a
hostname takes dots without end), else a letter or a digit. Elsewhere: one that ends the open
object or array (``}}``, ``]``), else the smallest value (``""``, ``0``, ``false``, ``null``), a
comma, a quote. Failing those, the allowed token likeliest to close (one with ``"``, ``}`` or ``]``
in it, then the shortest). Whether the state is inside a string is followed from the bytes of the
tokens taken (:func:`scan`). The plan is greedy, so its length is an upper bound on the shortest
completion; it is found with llguidance's ``try_consume_tokens`` and undone with ``rollback``, a
few microseconds a token.

:class:`Closing` is one sequence's use of it. Far from the end of its budget it consumes the sampled
token, and follows the bytes of the few tokens with a quote, a backslash or a bracket (whether the
text is in a string, how many objects and arrays are open). In its last ``window`` tokens (the
longest plan its grammar's start or a tool call's opening needs, plus ``WINDOW``, plus one for each
object or array open) it checks each sampled token: the state's plan still closes after it (one
``try_consume_tokens``; string content while a few tokens are to spare: nothing), or a new plan fits
in the tokens left; otherwise
the token is replaced by the first token of the plan of the state before it (which fitted), so that
the reply closes by the budget's last token (the engine reports ``length``, not ``stop``); a reply
already whole whose next token would start more than fits (another tool call) ends there, by ``stop``, and so does
one whose later call, started, could then close only with forced values (the call is dropped: the text
holds it unfinished, so it is no call; a reply cut by ``max_tokens`` is the calls the model finished,
never a junk one closed for it). A grammar
whose plan from its start does not fit ``max_tokens`` is refused before the request takes a slot
(:attr:`~llamapool.worker.constraints.Compiled.closing`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

PLAN_LIMIT = 256  # the longest plan looked for (a grammar needing more is not closed: none is refused)
WINDOW = 24  # tokens before the end of a reply's budget (beyond its start's plan) where each token is checked
SEPARATOR_USES = 4  # times one plan may write a format's separator (a.b.c.d)
SLACK = 4  # tokens to spare for string content to be taken without a check (a pattern may lengthen the plan)

_CLOSERS = ["".join(p) for n in (4, 3, 2, 1) for p in itertools.product("}]", repeat=n)]
_IN_STRING = ['"' + c for c in _CLOSERS] + ['"']
_SEPARATORS = ["@", "-", ":", ".", "T", "Z", "+", "/", "P", "D"]
_FILLERS = ["a", "0", "1"]
_OUTSIDE = [*_CLOSERS, '""', "0", "false", "null", "true", "[]", "{}", ",", '"', "{", "["]


OUT, IN, ESCAPE = 0, 1, 2  # where JSON text is: outside strings, inside one, just after a backslash in one


def scan(piece: bytes, where: int, depth: int) -> tuple[int, int]:
    """Where JSON text is after ``piece`` (``OUT``, ``IN`` or ``ESCAPE``) and how many objects and arrays
    are open, if it was at ``where`` with ``depth`` open before it."""
    for c in piece:
        if where == ESCAPE:
            where = IN
        elif where == IN:
            if c == 0x22:  # a quote
                where = OUT
            elif c == 0x5C:  # a backslash
                where = ESCAPE
        elif c == 0x22:
            where = IN
        elif c in (0x7B, 0x5B):  # { [
            depth += 1
        elif c in (0x7D, 0x5D):  # } ]
            depth = max(0, depth - 1)
    return where, depth


class Closer:
    """How to close a grammar from any state, for one vocabulary (built once per worker)."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos: int):
        self.eos = eos
        self.n_vocab = n_vocab
        pieces = [tokenizer.decode_bytes([t]) for t in range(n_vocab)]
        single = {p: t for t, p in enumerate(pieces) if p and t != eos}  # text -> a token that is exactly it
        # the tokens that may move JSON text in or out of a string, or open or close an object or array
        self.structural = {t: p for t, p in enumerate(pieces) if any(c in p for c in b'"\\{}[]')}

        def tokens(texts: list[str]) -> list[int]:
            return [single[s.encode()] for s in texts if s.encode() in single]

        self.in_string = tokens(_IN_STRING)
        self.enders = frozenset(self.in_string)  # tokens that end a string (and maybe more)
        self.separators = tokens(_SEPARATORS)
        self.fillers = tokens(_FILLERS)
        self.closers = tokens(_CLOSERS)
        self.outside = tokens(_OUTSIDE[len(_CLOSERS):])
        # the fallback's order: a token with a closing byte first, then the shortest, then the lowest id
        rank = [(0 if any(c in p for c in b'"}]') else 1 << 20) + len(p) for p in pieces]
        self.rank = np.asarray(rank, dtype=np.int64)
        if 0 <= eos < n_vocab:
            self.rank[eos] = 1 << 40

    def after(self, tok: int, where: int, depth: int = 0) -> tuple[int, int]:
        """Where JSON text is after token ``tok``, and its depth (:func:`scan`), if it was at ``where``."""
        piece = self.structural.get(tok)
        if piece is not None:
            return scan(piece, where, depth)
        return (IN if where == ESCAPE else where), depth

    def plan(self, m: Any, limit: int = PLAN_LIMIT, where: int = OUT) -> list[int] | None:
        """Tokens that complete the grammar from ``m``'s state, at most ``limit`` of them ([]: the text so
        far is complete; None: none found within ``limit``); ``where``: in a JSON string or not
        (:func:`scan`). ``m`` is left as it was."""
        out: list[int] = []
        uses: dict[int, int] = {}
        try:
            while not m.is_accepting():
                if m.is_error() or m.is_stopped() or len(out) >= limit:
                    return None
                took = self._step(m, where != OUT, uses, limit - len(out))
                if not took:
                    return None
                out += took
                for t in took:
                    where = self.after(t, where)[0]
            return out
        finally:
            if out:
                m.rollback(len(out))

    def _step(self, m: Any, inside: bool, uses: dict[int, int], room: int) -> list[int]:
        """The next closing tokens (at most ``room``), consumed ([] when the state takes none): a token
        that ends what is open, else the bytes the grammar forces, else the other candidates."""
        for tok in self.in_string if inside else self.closers:
            if m.try_consume_tokens([tok]) == 1:
                return [tok]
        ff = m.compute_ff_tokens()[:room]
        if ff:
            return ff[: m.try_consume_tokens(ff)]
        if inside:
            for tok in self.separators:
                if uses.get(tok, 0) < SEPARATOR_USES and m.try_consume_tokens([tok]) == 1:
                    uses[tok] = uses.get(tok, 0) + 1
                    return [tok]
        for tok in self.fillers if inside else self.outside:
            if m.try_consume_tokens([tok]) == 1:
                return [tok]
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        ids = np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.n_vocab])
        if not ids.size:
            return []
        tok = int(ids[self.rank[ids].argmin()])
        return [tok] if m.try_consume_tokens([tok]) == 1 else []


@dataclass(eq=False)
class Closing:
    """One constrained sequence's budget: ``left`` tokens it may still take; checked in the last ``window``."""

    matcher: Any
    closer: Closer
    left: int
    window: int
    plan: list[int] | None = None  # the plan of the matcher's state, once in the window (None: not known)
    forced: bool = False  # a token was replaced to close in time
    where: int = OUT  # where the text so far ends: in a JSON string or not (scan)
    depth: int = 0  # the objects and arrays it leaves open: the window grows with them
    # text before or between JSON may be free (a tool call's opening after prose): where the grammar
    # is complete, quotes so far mean nothing. A JSON value alone is complete only at its end, where it
    # is outside strings anyway: no need to ask (llguidance's is_accepting took 0.2 ms a step of 64
    # rows on an H100 host at 1B, twice the token's consume_token: py-spy, job SS)
    free_text: bool = True
    # a reply of calls: it was whole (a call complete) after it had been incomplete. A later call that then
    # cannot close in the tokens left but by forcing its values (``{"city": ""}``) is not closed: the reply
    # ends with the calls already whole (tools with a response_format, or tool_choice required)
    opened: bool = False
    whole: bool = False

    def take(self, tok: int) -> int:
        """Consume ``tok`` (its mask allowed it), or the plan's next token when, after ``tok``, the grammar
        could no longer close in the tokens left; the token consumed."""
        m = self.matcher
        self.left -= 1
        if self.left >= self.window + self.depth:
            self._consume(tok)
            return tok
        before = self.plan if self.plan is not None else self.closer.plan(m, self.left + 1, self.where)
        if before is not None and before[:1] == [tok]:
            self._consume(tok)
            self.plan = before[1:]
            return tok
        was = self.where, self.depth
        self._consume(tok)
        self.plan = before
        if before is not None and len(before) + SLACK <= self.left and was[0] == self.where == IN \
                and before and before[0] in self.closer.enders:  # (no plan: free text, a reply whole)
            return tok  # more of a string the plan ends: the same plan (checked again before it is used)
        if before is not None and len(before) <= self.left and self._closes(before):
            return tok  # the plan still closes it (a digit more, a key's next token): no search
        after = self.closer.plan(m, self.left, self.where)
        if after is not None or before is None:  # it fits (or nothing is known that would)
            self.plan = after
            return tok
        m.rollback(1)
        self.where, self.depth = was
        if before and self.whole:  # a later call that would close with forced values: it is dropped
            self.plan = None
            return self.closer.eos  # (not consumed: the reply ends here, with the calls whole before it)
        if not self._closes(before):  # a plan kept over string content that no longer closes: anew
            before = self.closer.plan(m, self.left + 1, self.where)
            if before is None:  # nothing closes in time any more: the model's token after all
                self._consume(tok)
                self.plan = None
                return tok
        forced = before[0] if before else self.closer.eos
        self._consume(forced)
        self.plan, self.forced = before[1:], bool(before)  # no plan: the reply was whole (ends by stop)
        return forced

    def _consume(self, tok: int) -> None:
        if self.free_text:
            if self.matcher.is_accepting():  # free text (before a tool call's opening): quotes in it mean
                # nothing; or a reply whole after a call
                self.where, self.depth = OUT, 0
                self.whole = self.whole or self.opened
            else:
                self.opened = True
        self.matcher.consume_token(tok)
        self.where, self.depth = self.closer.after(tok, self.where, self.depth)

    def _closes(self, plan: list[int]) -> bool:
        """Whether ``plan`` completes the grammar from the matcher's state (which is left as it was): the
        end of the text (EOS) is allowed after it. llguidance checks that without moving the state, in
        ~1 µs for a plan of a few tokens, where taking the plan and rolling it back took ~30 µs (on this
        VM, Llama 3's vocabulary): a reply's last ``window`` tokens make this check, each of them on
        every constrained row."""
        eos = self.closer.eos
        if plan and eos >= 0:
            valid = self.matcher.validate_tokens([*plan, eos])
            if valid != len(plan):  # all of it and EOS: it closes; not all of the plan: it cannot
                return valid > len(plan)
        n = self.matcher.try_consume_tokens(plan)  # (the plan, but not EOS after it: taken to make sure)
        done = n == len(plan) and self.matcher.is_accepting()
        if n:
            self.matcher.rollback(n)
        return done
