"""Benchmark workloads: seeded lists of requests (random token-id prompts, fixed output lengths).

Every driver sends exactly these requests, so two services measured with the same name, count,
seed, vocabulary and context budget get the same prompts and the same output lengths. Generation
ignores EOS, so each request must return exactly ``max_tokens`` tokens.

| name | prompt tokens | output tokens |
| --- | --- | --- |
| ``short`` | 128 | 128 |
| ``rag`` | 1,024 | 128 |
| ``long`` | 4,096 | 256 |
| ``mixed`` | log-normal, median 512, sigma 0.8 | log-normal, median 128, sigma 0.6 |
| ``json`` | 128 | 128, each request constrained by :data:`BENCH_SCHEMA` |
| ``logprobs`` | 128 | 128, each token with its logprob and the 5 likeliest (``top_logprobs``: 0 to 20) |
| ``n4`` | 128 | 4 x 128: each request asks for 4 choices (a quarter of the streams, as many sequences) |
| ``image`` | a chat: an image (``image_px`` square, its own per request) and a 64-word question | 64 |

``image`` needs a model with a projector (docs/models.md#images): its prompt is the image's tokens and the
question's (about one a word), each request's image another PNG, so none is in the prefix cache.

``mixed`` draws each request's output length first, then its prompt length, both from log-normal
distributions (``exp(N(ln median, sigma))``, rounded), and clips them so that every request fits the
context budget: output to ``[16, ctx - 16]``, prompt to ``[16, ctx - output]``. With the default
budget (4,352 = 4,096 + 256) about 1 request in 250 has its prompt clipped; the mean prompt is about
700 tokens and the mean output about 154.

:class:`AgentWorkload` is the ``agent`` scenario's (:mod:`llamapool.bench.agent`): sessions whose
prompts grow turn after turn, each turn's prompt a prefix of its session's :meth:`~AgentWorkload.contexts`.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

# (prompt tokens, output tokens) of the fixed-length workloads
FIXED: dict[str, tuple[int, int]] = {"short": (128, 128), "rag": (1024, 128), "long": (4096, 256),
                                     "json": (128, 128), "logprobs": (128, 128), "n4": (128, 128)}
CHOICES = {"n4": 4}  # choices per request of a workload (the others: 1)
# The ``json`` workload's schema: a free string first, then a list of strings, then an integer, so that
# the grammar stays open for the whole reply (a request may still end early when it completes).
BENCH_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "text": {"type": "string"}, "list": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer"}},
    "required": ["text", "list", "n"], "additionalProperties": False}
IMAGE = (64, 64)  # the image workload's question words and output tokens
IMAGE_PX = 64  # its images' side (the generated test projector's; Gemma 3's is 896)
NAMES = (*FIXED, "mixed", "image")
# the mixed workload's log-normal parameters: median and sigma (of the log) for prompt and output
MIXED_PROMPT_MEDIAN = 512
MIXED_PROMPT_SIGMA = 0.8
MIXED_GEN_MEDIAN = 128
MIXED_GEN_SIGMA = 0.6
MIN_TOKENS = 16  # the shortest prompt or output ``mixed`` draws
DEFAULT_CTX = 4096 + 256  # prompt + output budget per request (fits ``long``)
FIRST_ID = 3  # prompt token ids are drawn from [FIRST_ID, n_vocab): above <unk>, <s>, </s>


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    json_schema: dict[str, Any] | None = None  # the output's constraint (the ``json`` workload)
    top_logprobs: int = -1  # the ``logprobs`` workload: logprobs with this many alternatives (-1: none)
    n: int = 1  # choices (each of max_tokens tokens)
    temperature: float = 0.0  # 0: greedy
    model: str = ""  # the pool's model to ask ("": the server's default)
    image: bytes = b""  # the image workload: a PNG, and the question (``text``) after it, as a chat
    text: str = ""

    def messages(self) -> list[dict[str, Any]]:
        """An image request's chat, as the SDK sends it (the file's bytes in a part)."""
        return [{"role": "user", "content": [{"type": "image", "data": self.image},
                                             {"type": "text", "text": self.text}]}]


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    seed: int
    ctx: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def gen_tokens(self) -> int:
        """Tokens the requests ask for (and, EOS being ignored, must get)."""
        return sum(r.max_tokens * r.n for r in self.requests)

    @property
    def prompt_tokens_p50(self) -> float:
        return float(statistics.median(len(r.prompt) for r in self.requests)) if self.requests else 0.0

    @property
    def gen_tokens_p50(self) -> float:
        return float(statistics.median(r.max_tokens for r in self.requests)) if self.requests else 0.0

    @property
    def longest(self) -> int:
        """The most context one request needs: prompt + output."""
        return max((len(r.prompt) + r.max_tokens for r in self.requests), default=0)


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return round(rng.lognormvariate(math.log(median), sigma))


def png(side: int, rng: random.Random) -> bytes:
    """A ``side`` x ``side`` RGB PNG of a pattern ``rng`` picks (smooth: it compresses well)."""
    import struct
    import zlib

    a, b, c = (rng.randrange(1, 9) for _ in range(3))
    off = [rng.randrange(256) for _ in range(3)]
    import numpy as np

    x = np.arange(side, dtype=np.int64)[None, :]
    y = np.arange(side, dtype=np.int64)[:, None]
    rgb = np.stack([np.broadcast_to((x * a + off[0]) % 256, (side, side)),
                    np.broadcast_to((y * b + off[1]) % 256, (side, side)),
                    ((x + y) * c + off[2]) % 256], axis=-1).astype(np.uint8)
    rows = np.concatenate([np.zeros((side, 1), np.uint8), rgb.reshape(side, 3 * side)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + \
        chunk(b"IEND", b"")


def image_workload(n: int, *, seed: int = 0, ctx: int = DEFAULT_CTX, words: int | None = None,
                   gen_tokens: int | None = None, image_px: int = IMAGE_PX, temperature: float = 0.0) -> Workload:
    """``n`` image requests: each its own image of ``image_px`` square and a question of ``words`` words."""
    from llamapool.modelgen import _WORDS

    if not 8 <= image_px <= 4096:
        raise ValueError(f"image: the image side {image_px} must be 8 to 4096 pixels")
    rng = random.Random(f"llamapool-bench/image/{seed}")
    vocab = _WORDS.split()
    reqs = tuple(Request((), gen_tokens or IMAGE[1], temperature=temperature, image=png(image_px, rng),
                         text=" ".join(rng.choice(vocab) for _ in range(words or IMAGE[0])))
                 for _ in range(n))
    return Workload("image", reqs, seed, ctx)


def make_workload(name: str, n: int, n_vocab: int, *, seed: int = 0, ctx: int = DEFAULT_CTX,
                  prompt_tokens: int | None = None, gen_tokens: int | None = None,
                  top_logprobs: int | None = None, temperature: float = 0.0, image_px: int = IMAGE_PX) -> Workload:
    """``n`` requests of workload ``name``; the same arguments always give the same requests.

    ``prompt_tokens``/``gen_tokens`` override the fixed lengths of ``short``/``rag``/``long``, and
    the medians of ``mixed``; ``top_logprobs`` the alternatives of ``logprobs`` (default 5);
    ``temperature`` every request's (default greedy). A
    fixed-length request that does not fit ``ctx`` is an error.
    """
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(NAMES)}")
    if name == "image":
        return image_workload(n, seed=seed, ctx=ctx, words=prompt_tokens, gen_tokens=gen_tokens, image_px=image_px,
                              temperature=temperature)
    if n_vocab <= FIRST_ID:
        raise ValueError(f"n_vocab {n_vocab} leaves no ordinary token ids")
    if n < 0 or ctx < 2 * MIN_TOKENS:
        raise ValueError(f"bad request count {n} or context budget {ctx}")
    rng = random.Random(f"llamapool-bench/{name}/{seed}")  # str seeds are hashed the same way everywhere
    lengths: list[tuple[int, int]] = []
    if name in FIXED:
        p = prompt_tokens or FIXED[name][0]
        g = gen_tokens or FIXED[name][1]
        if p < 1 or g < 1 or p + g > ctx:
            raise ValueError(f"{name}: {p} prompt + {g} output tokens do not fit the context budget {ctx} "
                             "(raise --ctx)")
        lengths = [(p, g)] * n
    else:
        pm = prompt_tokens or MIXED_PROMPT_MEDIAN
        gm = gen_tokens or MIXED_GEN_MEDIAN
        for _ in range(n):
            g = min(max(_lognormal(rng, gm, MIXED_GEN_SIGMA), MIN_TOKENS), ctx - MIN_TOKENS)
            p = min(max(_lognormal(rng, pm, MIXED_PROMPT_SIGMA), MIN_TOKENS), ctx - g)
            lengths.append((p, g))
    schema = BENCH_SCHEMA if name == "json" else None
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise ValueError(f"top_logprobs {top_logprobs}: 0 to 20")
    top = (5 if top_logprobs is None else top_logprobs) if name == "logprobs" else -1
    reqs = tuple(Request(tuple(rng.randrange(FIRST_ID, n_vocab) for _ in range(p)), g, schema, top,
                         CHOICES.get(name, 1), temperature) for p, g in lengths)
    return Workload(name, reqs, seed, ctx)


@dataclass(frozen=True)
class AgentWorkload:
    """The ``agent`` scenario's workload (:mod:`llamapool.bench.agent`): ``sessions`` of ``turns``; turn k's
    prompt is ``shared`` tokens, then ``k + 1`` times ``new`` tokens with ``k`` replies of ``out`` tokens
    between them. The same parameters always give the same prompts."""

    sessions: int = 32
    turns: int = 6
    shared: int = 1024  # tokens every session's first prompt starts with
    new: int = 768  # tokens each turn adds of its own
    out: int = 32  # tokens each turn asks for
    n_vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.shared < 0 or self.new < 1 or self.out < 1:
            raise ValueError(f"agent: sessions {self.sessions} and turns {self.turns} must be >= 1, shared "
                             f"tokens {self.shared} >= 0, new tokens {self.new} and out tokens {self.out} >= 1")
        if self.n_vocab <= FIRST_ID:
            raise ValueError(f"n_vocab {self.n_vocab} leaves no ordinary token ids")

    def prompt_len(self, turn: int) -> int:
        """Turn ``turn``'s (0-based) prompt length."""
        return self.shared + (turn + 1) * self.new + turn * self.out

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens all the turns send."""
        return self.sessions * sum(self.prompt_len(k) for k in range(self.turns))

    @property
    def longest(self) -> int:
        """The most context one turn needs: the last turn's prompt and its reply."""
        return self.prompt_len(self.turns - 1) + self.out

    def contexts(self) -> list[list[int]]:
        """Each session's whole context: turn k's prompt is its first :meth:`prompt_len` (k) tokens."""
        rng = random.Random(f"llamapool-bench/agent/{self.seed}")

        def ids(n: int) -> list[int]:
            return [rng.randrange(FIRST_ID, self.n_vocab) for _ in range(n)]

        shared = ids(self.shared)
        out = []
        for _ in range(self.sessions):
            ctx = list(shared)
            for _ in range(self.turns):
                ctx += ids(self.new) + ids(self.out)  # the turn's new tokens, then its reply's placeholder
            out.append(ctx)
        return out
